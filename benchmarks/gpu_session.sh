#!/usr/bin/env bash
# Every GPU check and benchmark of docs/benchmarks.md in one run on a CUDA machine, each stage
# under its own time limit (at most 5 minutes; 11.5 minutes for the full set), results and
# logs under $OUT (default /tmp/gpu-out): one JSON per benchmark stage, JUnit XML for the tests.
#
#   benchmarks/gpu_session.sh --prepare                       # here, once: wheels and tokenizer
#   benchmarks/gpu_session.sh --dry-run                       # here (CPU): imports, flags, tests collected
#   STAGES="tests kernels 1b" benchmarks/gpu_session.sh       # on the GPU machine
#   STAGES=sweep benchmarks/gpu_session.sh                    # launch options; commit its file
#   STAGES="syncs 1b-quick" benchmarks/gpu_session.sh         # overlap checks, a shorter 1b
#   STAGES=profile benchmarks/gpu_session.sh                  # where a step's host time goes
#   STAGES=sampling benchmarks/gpu_session.sh                 # the fused sampler against torch's
#
# --prepare downloads the wheels the GPU image lacks (as last seen: Python 3.12 with torch,
# triton, transformers, aiohttp, msgpack, uvloop, pytest; no pyzmq, gguf, pytest-asyncio,
# xgrammar or pydantic)
# for CPython 3.12 into .whl/, and copies the embedded model's tokenizer (the 1b and 8b shapes
# use SmolLM2's vocabulary) into .gpu_carry/tokenizer/. Both are git-ignored: carry them.
# Before any stage the script checks every import the stages need and stops if one fails.
set -u
MODE=run
case ${1:-} in
--prepare) MODE=prepare ;;
--dry-run) MODE=dry-run ;;
"") ;;
*) echo "usage: $0 [--prepare | --dry-run]" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/gpu-out}
STAGES=${STAGES:-"tests kernels 1b 1b-varied 8b"}
PY=${PYTHON:-python3}
TOKENIZER=${TOKENIZER:-.gpu_carry/tokenizer}
# What the GPU image lacks, pinned to the versions the CPU side runs (pyproject.toml).
CARRIED_WHEELS="pyzmq==27.3.0 gguf==0.19.0 pytest-asyncio==1.5.0"
# Structured output's grammar engine and what it needs beyond the image (soft: without it the
# served runs log the grammar worker's ImportError and serve on, as in the first H200 session).
CARRIED_WHEELS="$CARRIED_WHEELS xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4
    pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5"
IMPORTS="torch, triton, transformers, zmq, msgpack, aiohttp, uvloop, gguf, pytest, pytest_asyncio"
export PYTHONUNBUFFERED=1

if [ "$MODE" = prepare ]; then
    mkdir -p .whl "$TOKENIZER"
    $PY -m pip download --quiet --no-deps --only-binary=:all: --dest .whl \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any $CARRIED_WHEELS || exit 1
    model_dir=$($PY -c "from shared.model_source import EMBEDDED_MODEL, resolve_model; print(resolve_model(EMBEDDED_MODEL))") || exit 1
    cp "$model_dir"/tokenizer* "$model_dir"/chat_template.jinja "$TOKENIZER"/ 2>/dev/null
    ls "$TOKENIZER"/tokenizer.json >/dev/null || exit 1
    ls -la .whl "$TOKENIZER"
    exit 0
fi

mkdir -p "$OUT"
LOG="$OUT/session.log"
if [ "$MODE" = run ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || { echo "wheel install failed" >>"$LOG"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
{
    date -u
    [ "$MODE" = run ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import $IMPORTS; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'zmq', zmq.__version__)"
} >>"$LOG" 2>&1 || { echo "an import the stages need failed: see $LOG" | tee -a "$LOG"; exit 1; }
$PY -c "import xgrammar" >>"$LOG" 2>&1 || echo "no xgrammar here: grammar requests fail" >>"$LOG"

FAILED=0
stage() {  # name, seconds, command...: one stage under its own limit, its exit code logged
    local name=$1 limit=$2
    shift 2
    if [ "$MODE" = dry-run ]; then
        if [ "$1" = pytest ]; then  # collected, not run: the GPU tests skip on a CPU anyway
            set -- "$PY" -m pytest --collect-only -q "${@:2}"
        else  # the script's imports and its parser's answer to these flags
            set -- "$PY" -m scripts.parse_only "$@"
        fi
        limit=120
    elif [ "$1" = pytest ]; then
        set -- "$PY" -m pytest "${@:2}"
    else
        set -- "$PY" "$@"
    fi
    echo "== $name (limit ${limit}s): $*" >>"$LOG"
    local start=$SECONDS code
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    code=$?
    echo "== $name: exit $code after $((SECONDS - start))s" >>"$LOG"
    [ "$code" = 0 ] || FAILED=1
}

for s in $STAGES; do
    case $s in
    tests)  # only the files with GPU tests: others import packages this machine may lack
        stage tests 150 pytest -q -m gpu -p no:cacheprovider --junitxml "$OUT/tests.xml" \
            tests/triton/test_triton_decode.py tests/triton/test_triton_cache.py \
            tests/triton/test_triton_prefill.py tests/unit/executor/test_phase_timer.py \
            tests/triton/test_cuda_graphs.py tests/triton/test_triton_sampling.py \
            tests/triton/test_triton_warmup.py ;;
    kernels)
        stage kernels 90 benchmarks/attention_kernels.py --dtype bfloat16 --output "$OUT/kernels.json" ;;
    sampling)  # the sampler's draw: torch's sort path against the fused kernel, 256 rows
        stage sampling 90 benchmarks/sampling_kernel.py --vocabs 49152,128256 \
            --json "$OUT/sampling_kernel.json" ;;
    1b)  # in-process (overlapped, one step after another, eager), served (async and sync),
        # transformers generate
        stage 1b 210 benchmarks/gpu_throughput.py --shape 1b --tokenizer "$TOKENIZER" \
            --workloads fixed --compare-eager --compare-sync --served-sync \
            --json "$OUT/gpu_throughput_1b.json" ;;
    1b-quick)  # in-process overlapped and one step after another, served async: no eager, no
        # served sync, no transformers
        stage 1b-quick 150 benchmarks/gpu_throughput.py --shape 1b --tokenizer "$TOKENIZER" \
            --workloads fixed --compare-sync --skip-hf --json "$OUT/gpu_throughput_1b_quick.json" ;;
    profile)  # the host's Python by function and the ops it launches, 1.1B at batch 256
        stage profile 150 benchmarks/gpu_step_profile.py --shape 1b --tokenizer "$TOKENIZER" \
            --json "$OUT/gpu_step_profile.json" ;;
    profile-8b)  # the same at 8B, where an overlapped launch() took as long as a step
        stage profile-8b 180 benchmarks/gpu_step_profile.py --shape 8b --tokenizer "$TOKENIZER" \
            --json "$OUT/gpu_step_profile_8b.json" ;;
    syncs)  # synchronising CUDA calls while an overlapped step is launched (should be none)
        stage syncs 120 benchmarks/gpu_sync_points.py --tokenizer "$TOKENIZER" \
            --json "$OUT/gpu_sync_points.json" ;;
    1b-varied)
        stage 1b-varied 90 benchmarks/gpu_throughput.py --shape 1b --tokenizer "$TOKENIZER" \
            --workloads varied --skip-hf --json "$OUT/gpu_throughput_1b_varied.json" ;;
    8b)
        stage 8b 150 benchmarks/gpu_throughput.py --shape 8b --tokenizer "$TOKENIZER" \
            --workloads fixed --skip-hf --skip-served --json "$OUT/gpu_throughput_8b.json" ;;
    sweep)  # not in the default set: num_warps/num_stages per kernel, written to kernels/configs
        stage sweep 240 benchmarks/triton_config_sweep.py --warps 2,4,8 --stages 2,3 \
            --json "$OUT/triton_config_sweep.json"
        cp kernels/configs/*.json "$OUT"/ 2>/dev/null ;;
    *) echo "unknown stage $s" >>"$LOG"; FAILED=1 ;;
    esac
done
date -u >>"$LOG"
[ "$MODE" = dry-run ] && cat "$LOG"
exit $FAILED
