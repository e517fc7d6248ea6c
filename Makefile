# Set-up and entry points. `make serve` and `make test` work on a fresh machine with Python 3.10+.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is installed first and pinned: 2.13.0 is the CPU build available on this machine's disk,
# and installing it explicitly keeps other packages from pulling a multi-GB CUDA build.
# Each step says what it does; pip shows its own progress. The last step builds the C++ CPU
# kernels (about a minute and a half on 2 cores), which the first `pagedllm serve` would otherwise do.
$(STAMP): $(PY) pyproject.toml
	@echo "==> [1/5] upgrading pip"
	$(PY) -m pip install --upgrade pip
	@echo "==> [2/5] installing torch (CPU build)"
	$(PY) -m pip install --progress-bar on "torch==2.13.0"
	@echo "==> [3/5] installing pagedllm, gRPC and OpenTelemetry, and the test dependencies"
	$(PY) -m pip install --progress-bar on -e ".[grpc,otel,test]"
	@echo "==> [4/5] building the C++ CPU kernels (once per machine)"
	$(PY) -m pagedllm.kernels.cpu
	@echo "==> [5/5] generating the gRPC stubs of pagedllm_generation.proto (once per machine)"
	$(PY) -m pagedllm.entrypoints.grpc
	touch $(STAMP)

install: $(STAMP)

# Extra `pagedllm serve` flags: make serve ARGS="--port 8001 --api-key secret"
serve: $(STAMP)
	$(VENV)/bin/pagedllm serve $(ARGS)

# Two pytest workers (pytest-xdist; a test file stays on one worker, so a module's server
# starts once), then the tests marked `serial` (latency bounds that another worker's load would
# break) alone. --durations=30 prints the slowest tests, to see where CI's time goes (the limit
# is 20 minutes).
test: $(STAMP)
	$(PY) -m pytest tests -n 2 --dist loadfile -m "not serial" --durations=30
	$(PY) -m pytest tests -m serial --durations=10

clean:
	rm -rf $(VENV) build *.egg-info
