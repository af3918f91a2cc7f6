"""What one block-map snapshot costs: built in the scheduler, encoded, turned into JSON.

256 running requests over pools of 1,456 (the embedded model in 1 GiB), 16,384 and 131,072
blocks. The scheduler builds a map only when the gateway asks, at most four times a second.
Writes benchmarks/results/kv_state_cost.json.

    .venv/bin/python benchmarks/kv_state_cost.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from services.gateway.kv_state import kv_state_json
from services.scheduler.kv_state import PreemptionLog, kv_snapshot
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.protocol import ExecutorReady, SampledToken, StepResult
from shared.sampling import SamplingParams
from shared.wire import encode


def busy_scheduler(num_blocks: int, num_requests: int = 256) -> Scheduler:
    ready = ExecutorReady(num_blocks, num_blocks, 16, 4096, 1000, (2,))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=65536), ready)
    for i in range(num_requests):
        scheduler.add_request(f"req-{i}", list(range(3, 83)), SamplingParams(max_tokens=8))
    plan = scheduler.schedule()
    scheduler.update(StepResult(plan.step_id, [SampledToken(s.seq_id, 7) for s in plan.seqs]))
    return scheduler


def timed(repeats: int, fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    return (time.perf_counter() - start) / repeats * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="1456,16384,131072", help="device pool sizes")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default="benchmarks/results/kv_state_cost.json")
    args = parser.parse_args()
    rows = []
    print("| device blocks | snapshot ms | encode ms | wire KiB | JSON ms | JSON KiB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for num_blocks in (int(b) for b in args.blocks.split(",")):
        scheduler = busy_scheduler(num_blocks, args.num_requests)
        snapshot_ms, state = timed(args.repeats, kv_snapshot, scheduler, PreemptionLog())
        encode_ms, wire = timed(args.repeats, encode, state)
        json_ms, body = timed(args.repeats, lambda s: json.dumps(kv_state_json(s)), state)
        row = {
            "num_device_blocks": num_blocks,
            "snapshot_ms": round(snapshot_ms, 2),
            "encode_ms": round(encode_ms, 2),
            "wire_kib": round(len(wire) / 1024),
            "json_ms": round(json_ms, 2),
            "json_kib": round(len(body) / 1024),
        }
        rows.append(row)
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
