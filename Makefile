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
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Extra `pagedllm serve` flags: make serve ARGS="--port 8001 --api-key secret"
serve: $(STAMP)
	$(VENV)/bin/pagedllm serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info
