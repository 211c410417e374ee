# Two entry points; each sets up what it needs (tools/setup.sh) first.
VENV ?= .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/fmnist_mlp_pan_compare
PYTEST_ARGS ?=

.PHONY: setup run test test-slow bench clean

setup:
	@VENV=$(VENV) bash tools/setup.sh

run: setup
	$(PY) -m fedjax_pan.main --config=configs/fmnist_mlp.py:compare --workdir=$(WORKDIR) --overwrite

test: setup
	$(PY) -m pytest -q -n 2 -m "not slow" $(PYTEST_ARGS)

# The tests marked slow: every algorithm against the sequential reference under each
# executor, resume for every kind of client state, the benchmark suite's quick run.
test-slow: setup
	$(PY) -m pytest -q -n 2 -m slow $(PYTEST_ARGS)

bench: setup
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 \
	  || echo "fedjax_pan: torch not installed: the benchmark runs without its PyTorch row" >&2
	$(PY) -m benchmarks.run --suite cpu --out runs/bench

clean:
	rm -rf $(VENV) runs .pytest_cache
