"""Which constexpr values a wrapper launched a Triton kernel with."""

from __future__ import annotations


def record_launches(monkeypatch, module, kernel: str, *fields: str) -> list:
    """Replace `module.<kernel>` with a stand-in that launches the real kernel and appends each
    launch's `fields` keyword arguments (constexprs such as BLOCK_Q) to the returned list: the
    value for one field, a tuple of them for several."""
    chosen = []
    launch = getattr(module, kernel)

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                values = tuple(kwargs[f] for f in fields)
                chosen.append(values if len(fields) > 1 else values[0])
                return launch[grid](*args, **kwargs)

            return run

    monkeypatch.setattr(module, kernel, Recorder())
    return chosen
