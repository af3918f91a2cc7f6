"""What one step's messages cost to encode and decode: plan, result, deltas to the gateway.

Decode steps of N sequences (one token each), timed over many repetitions. With --compare-ref,
the same messages also go through `shared/wire.py` as it was at that git revision, side by side.
"deltas" are the step's deltas as records, "columns" the same deltas as the scheduler sends
them since protocol v4 (NextTokens); the gateway's decode of "columns" includes turning them
back into records.

    .venv/bin/python benchmarks/wire_cost.py --compare-ref 751050f \\
        --json benchmarks/results/wire_cost.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared import wire
from shared.protocol import (
    NextTokens,
    RequestDelta,
    SampledToken,
    ScheduledSeq,
    SchedulerStats,
    SeqDelta,
    StepPlan,
    StepResult,
    TokenDeltas,
)

ROOT = Path(__file__).resolve().parents[1]


def messages(num_seqs: int) -> dict:
    plan = StepPlan(
        7,
        [
            # A decode step: one token each; every 16th sequence crosses into a new block.
            ScheduledSeq(i, [5], 300, [1000 + i] if i % 16 == 0 else [], False, True)
            for i in range(num_seqs)
        ],
    )
    result = StepResult(7, [SampledToken(i, 17) for i in range(num_seqs)], {"forward": 0.01})
    deltas = TokenDeltas(
        [RequestDelta(f"req-{i}", [SeqDelta(0, [17])], False) for i in range(num_seqs)],
        SchedulerStats(num_seqs, 0, 0, 4000, 60000, 0, 1234),
    )
    # The same deltas as the scheduler sends them now: plain one-token deltas as columns.
    next_tokens = TokenDeltas(
        [],
        deltas.stats,
        NextTokens([f"req-{i}" for i in range(num_seqs)], [17] * num_seqs, [300] * num_seqs),
    )
    return {"plan": plan, "result": result, "deltas": deltas, "columns": next_tokens}


def _decode_deltas(module, data: bytes):
    """What the gateway does with a TokenDeltas: decode, and records for the columns."""
    message = module.decode(data)
    plain = getattr(message, "next_tokens", None)
    if plain is not None:
        [plain.delta(i) for i in range(len(plain.request_ids))]
    return message


def time_codec(module, message, repeats: int) -> dict:
    data = module.encode(message)
    assert module.decode(data) == message
    decode = module.decode
    if isinstance(message, TokenDeltas):
        decode = functools.partial(_decode_deltas, module)
    t0 = time.perf_counter()
    for _ in range(repeats):
        module.encode(message)
    t1 = time.perf_counter()
    for _ in range(repeats):
        decode(data)
    t2 = time.perf_counter()
    return {
        "encode_ms": 1e3 * (t1 - t0) / repeats,
        "decode_ms": 1e3 * (t2 - t1) / repeats,
        "bytes": len(data),
    }


def load_wire_at(ref: str):
    source = subprocess.run(
        ["git", "show", f"{ref}:shared/wire.py"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "wire_at_ref.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("wire_at_ref", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", default="64,256")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--compare-ref", default=None, help="git revision of an older wire.py")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    codecs = {"current": wire}
    if args.compare_ref:
        codecs[args.compare_ref] = load_wire_at(args.compare_ref)
    report: dict = {"command": " ".join(["benchmarks/wire_cost.py", *sys.argv[1:]]), "by_seqs": {}}
    for n in (int(x) for x in args.seqs.split(",")):
        rows = report["by_seqs"][str(n)] = {}
        for kind, message in messages(n).items():
            rows[kind] = {}
            # Alternate the codecs, best of three, so that drift in the machine's load hits both.
            for _ in range(3):
                for name, module in codecs.items():
                    timing = time_codec(module, message, args.repeats)
                    best = rows[kind].get(name)
                    if best is None or timing["encode_ms"] + timing["decode_ms"] < (
                        best["encode_ms"] + best["decode_ms"]
                    ):
                        rows[kind][name] = timing
            for name, t in rows[kind].items():
                print(
                    f"{n:4d} seqs {kind:7s} {name:8s} encode {t['encode_ms']:6.3f} ms  "
                    f"decode {t['decode_ms']:6.3f} ms  {t['bytes']:6d} bytes"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
