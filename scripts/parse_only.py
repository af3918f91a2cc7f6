"""Run a script up to its argument parsing, then stop: its module-level imports and its
parser's answer to the given arguments, without its work. `benchmarks/gpu_session.sh --dry-run`
checks each GPU stage this way on a CPU, so a renamed flag or a broken import fails in CI
instead of on a lent GPU.

    .venv/bin/python -m scripts.parse_only benchmarks/gpu_throughput.py --shape 1b --json x.json
"""

from __future__ import annotations

import argparse
import runpy
import sys


class Parsed(SystemExit):
    """Raised by parse_args once the arguments parsed: the script goes no further."""


def run_until_parsed(script: str, argv: list[str]) -> None:
    """Raises Parsed after a successful parse; an argparse error exits 2 as usual."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed(0)

    argparse.ArgumentParser.parse_args = parse_then_stop
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        argparse.ArgumentParser.parse_args = original
    raise SystemExit(f"{script} returned without parsing its arguments")


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    script, argv = sys.argv[1], sys.argv[2:]
    try:
        run_until_parsed(script, argv)
    except Parsed:
        print(f"parsed: {script}")
        return 0
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
