#!/usr/bin/env bash
# Every GPU check and benchmark of docs/benchmarks.md in one run on a CUDA machine, each stage
# under its own time limit, results and logs under $OUT (default /tmp/gpu-out).
#
#   STAGES="tests kernels 1b" benchmarks/gpu_session.sh        # about 9 minutes
#   STAGES="1b-varied 8b" benchmarks/gpu_session.sh            # about 5 minutes
#
# A machine without pyzmq or pytest-asyncio gets them from wheels in .whl/ (pip download'ed for
# its Python), and the 1b shape's tokenizer (SmolLM2's vocabulary) from .gpu_carry/tokenizer/:
#   mkdir -p .gpu_carry/tokenizer && cp MODEL_DIR/tokenizer* .gpu_carry/tokenizer/
# where MODEL_DIR is the embedded model's converted directory (~/.cache/pagedserve/models/...).
set -u
OUT=${OUT:-/tmp/gpu-out}
STAGES=${STAGES:-"tests kernels 1b 1b-varied 8b"}
PY=${PYTHON:-python3}
TOKENIZER=${TOKENIZER:-.gpu_carry/tokenizer}
mkdir -p "$OUT"
LOG="$OUT/session.log"
export PYTHONUNBUFFERED=1

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || { echo "wheel install failed" >>"$LOG"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, triton, transformers, zmq; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'zmq', zmq.__version__)"
} >>"$LOG" 2>&1

stage() {  # name, seconds, command...: one stage, its own limit, its exit code logged
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" >>"$LOG"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    echo "== $name: exit $? after $((SECONDS - start))s" >>"$LOG"
}

for s in $STAGES; do
    case $s in
    tests)  # only the files with GPU tests: others import packages this machine may lack
        stage tests 240 $PY -m pytest -q -m gpu -p no:cacheprovider \
            tests/triton/test_triton_decode.py tests/triton/test_triton_cache.py tests/triton/test_triton_prefill.py \
            tests/unit/executor/test_phase_timer.py tests/triton/test_cuda_graphs.py ;;
    kernels)
        stage kernels 150 $PY benchmarks/attention_kernels.py --dtype bfloat16 --output "$OUT/kernels.json" ;;
    1b)  # in-process (overlapped, one step after another, eager), served (async and sync),
        # transformers generate
        stage 1b 270 $PY benchmarks/gpu_throughput.py --shape 1b --tokenizer "$TOKENIZER" \
            --workloads fixed --compare-eager --compare-sync --served-sync \
            --json "$OUT/gpu_throughput_1b.json" ;;
    1b-varied)
        stage 1b-varied 150 $PY benchmarks/gpu_throughput.py --shape 1b --tokenizer "$TOKENIZER" \
            --workloads varied --skip-hf --json "$OUT/gpu_throughput_1b_varied.json" ;;
    8b)
        stage 8b 210 $PY benchmarks/gpu_throughput.py --shape 8b --tokenizer "$TOKENIZER" \
            --workloads fixed --skip-hf --skip-served --json "$OUT/gpu_throughput_8b.json" ;;
    *) echo "unknown stage $s" >>"$LOG" ;;
    esac
done
date -u >>"$LOG"
