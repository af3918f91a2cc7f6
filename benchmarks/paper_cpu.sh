#!/usr/bin/env bash
# The paper's Figure 2 and a Figure 12-style comparison on this CPU with the embedded SmolLM2-135M:
# ShareGPT-shaped requests scaled down (a tenth, then a twentieth, of their length), 4-token blocks
# and small pools, so that memory binds at a size two shared cores can run.
set -euo pipefail
# Prefix caching off, as in the paper's system and when the committed figures were measured.
PS="${PAGEDSERVE:-.venv/bin/pagedserve}"
OUT=benchmarks/results
NOCACHE=--no-prefix-caching

$PS bench memory $NOCACHE --num-threads 2 --block-size 4 --num-device-blocks 96 --max-model-len 128 \
    --length-scale 0.1 --trace sharegpt --num-requests 16 --no-progress \
    --json $OUT/memory_cpu_sharegpt.json --plot $OUT/memory_cpu_sharegpt.png
$PS bench serve --launch $NOCACHE --num-threads 2 --block-size 4 --num-device-blocks 32 --max-model-len 64 \
    --length-scale 0.05 --trace sharegpt --num-requests 8 --no-progress \
    --kv-policy paged --kv-policy orca-oracle --kv-policy orca-max --rates 0.1,0.3,0.6 \
    --latency-bound 8,4,16 \
    --stop-factor 100 --json $OUT/serve_cpu_sharegpt.json --plot $OUT/serve_cpu_sharegpt.png
