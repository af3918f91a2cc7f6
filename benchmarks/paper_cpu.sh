#!/usr/bin/env bash
# The paper's Figure 2 and a Figure 12-style comparison on this CPU with the embedded SmolLM2-135M:
# ShareGPT-shaped requests scaled to a tenth of their length, 4-token blocks and a pool of 384 token
# slots, so memory binds as it does at the paper's scale.
set -euo pipefail
PS=${PAGEDSERVE:-.venv/bin/pagedserve}
OUT=benchmarks/results
CPU="--num-threads 2 --block-size 4 --num-device-blocks 96 --max-model-len 128 --length-scale 0.1"

$PS bench memory $CPU --trace sharegpt --num-requests 16 --no-progress \
    --json $OUT/memory_cpu_sharegpt.json --plot $OUT/memory_cpu_sharegpt.png
$PS bench serve $CPU --launch --trace sharegpt --num-requests 12 --no-progress \
    --kv-policy paged --kv-policy orca-oracle --kv-policy orca-max \
    --rates 0.15,0.3,0.6 --latency-bound 1.0,0.5,2.0 --stop-factor 3 \
    --json $OUT/serve_cpu_sharegpt.json --plot $OUT/serve_cpu_sharegpt.png
