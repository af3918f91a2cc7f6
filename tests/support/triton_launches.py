"""Which constexpr values a wrapper launched a Triton kernel with."""

from __future__ import annotations


def record_launches(monkeypatch, module, kernel: str, field: str) -> list:
    """Replace `module.<kernel>` with a stand-in that launches the real kernel and appends each
    launch's `field` keyword argument (a constexpr such as BLOCK_Q) to the returned list."""
    chosen = []
    launch = getattr(module, kernel)

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                chosen.append(kwargs[field])
                return launch[grid](*args, **kwargs)

            return run

    monkeypatch.setattr(module, kernel, Recorder())
    return chosen
