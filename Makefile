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
# Each step says what it does; pip shows its own progress. The C++ CPU kernels (about a minute
# and a half on 2 cores), which the first `pagedllm serve` would otherwise build, compile in the
# background while pip installs the rest (they need only torch, ninja and numpy); their log is
# printed when both are done. `make test` also builds the lower instruction-set levels the
# kernel tests run (KERNEL_LEVELS below).
KERNEL_LEVELS ?=
$(STAMP): $(PY) pyproject.toml
	@echo "==> [1/4] upgrading pip"
	$(PY) -m pip install --upgrade pip
	@echo "==> [2/4] installing torch (CPU build), ninja and numpy"
	$(PY) -m pip install --progress-bar on "torch==2.13.0" "ninja>=1.11" "numpy>=1.26,<3"
	@echo "==> [3/4] installing pagedllm, gRPC and OpenTelemetry, and the test dependencies; building the C++ CPU kernels beside it (once per machine)"
	$(PY) -m pagedllm.kernels.cpu $(KERNEL_LEVELS) > $(VENV)/kernel-build.log 2>&1 & build=$$!; \
	$(PY) -m pip install --progress-bar on -e ".[grpc,otel,test]"; installed=$$?; \
	wait $$build; built=$$?; echo "==> C++ CPU kernels:"; cat $(VENV)/kernel-build.log; \
	test $$installed -eq 0 && test $$built -eq 0
	@echo "==> [4/4] generating the gRPC stubs of pagedllm_generation.proto (once per machine)"
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
test: KERNEL_LEVELS = --every-level
test: $(STAMP)
	$(PY) -m pytest tests -n 2 --dist loadfile -m "not serial" --durations=30
	$(PY) -m pytest tests -m serial --durations=10

clean:
	rm -rf $(VENV) build *.egg-info
