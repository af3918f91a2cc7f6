#!/usr/bin/env bash
# Start `pagedserve serve`, run Locust headless against it, write CSV and HTML reports, stop.
#   loadtest/run.sh [-u USERS] [-t DURATION] [-o OUTDIR] [-- pagedserve serve flags...]
# Environment: PYTHON (default .venv/bin/python), PORT (8000; 0: a free one the server picks),
# PAGEDSERVE_API_KEY (a fixed test key), and the LOADTEST_* settings of loadtest/locustfile.py.
set -euo pipefail
cd "$(dirname "$0")/.."

users=8
duration=60s
outdir=loadtest/results
while [[ $# -gt 0 ]]; do
  case "$1" in
    -u) users="$2"; shift 2 ;;
    -t) duration="$2"; shift 2 ;;
    -o) outdir="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [-u USERS] [-t DURATION] [-o OUTDIR] [-- serve flags]" >&2; exit 2 ;;
  esac
done

python="${PYTHON:-.venv/bin/python}"
port="${PORT:-8000}"
export PAGEDSERVE_API_KEY="${PAGEDSERVE_API_KEY:-loadtest-key}"
mkdir -p "$outdir"
log="$outdir/serve.log"

"$python" -m services.cli serve --port "$port" --api-key "$PAGEDSERVE_API_KEY" "$@" \
  >"$log" 2>&1 &
serve_pid=$!
stop_stack() {
  if kill -0 "$serve_pid" 2>/dev/null; then
    kill -TERM "$serve_pid"
    wait "$serve_pid" || true
  fi
}
trap stop_stack EXIT

# The launcher prints one "pagedserve: ready" line once /health answers (the first start of the
# embedded model converts it, about a minute).
for _ in $(seq 1800); do
  grep -q '^pagedserve: ready' "$log" && break
  kill -0 "$serve_pid" 2>/dev/null || { echo "pagedserve did not start:" >&2; cat "$log" >&2; exit 1; }
  sleep 0.5
done
grep -q '^pagedserve: ready' "$log" || { echo "pagedserve not ready in time" >&2; exit 1; }
# The port it listens on, from the ready line's url (the kernel's pick when PORT=0).
url=$(grep -m1 '^pagedserve: ready' "$log" | sed -E 's/.*"url": "([^"]*)".*/\1/')
port="${url##*:}"

# Exits non-zero when any request failed. --stop-timeout lets running streams finish at the end.
"$python" -m locust -f loadtest/locustfile.py --headless --only-summary \
  -u "$users" -r "$users" -t "$duration" --stop-timeout 60 \
  --host "http://127.0.0.1:$port" --csv "$outdir/locust" --html "$outdir/report.html"
