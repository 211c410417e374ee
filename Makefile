# Two entry points; each sets up what it needs (tools/setup.sh) first.
VENV ?= .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/fmnist_mlp_pan_compare
PYTEST_ARGS ?=

.PHONY: setup run test test-slow docs bench multiprocess-check clean

EXTRAS ?= test

setup:
	@VENV=$(VENV) EXTRAS=$(EXTRAS) bash tools/setup.sh

run: setup
	$(PY) -m fedjax_pan --config=configs/fmnist_mlp.py:compare --workdir=$(WORKDIR) --overwrite

test: setup
	$(PY) -m pytest -q -n 2 -m "not slow" $(PYTEST_ARGS)

# The tests marked slow: every algorithm against the sequential reference under each
# executor, resume for every kind of client state, the benchmark suite's quick run, the
# documentation site's build (hence the docs extra).
test-slow: EXTRAS = test,docs
test-slow: setup
	$(PY) -m pytest -q -n 2 -m slow $(PYTEST_ARGS)

# The documentation site: Sphinx + MyST, both notebooks executed, warnings as errors.
docs: EXTRAS = test,docs
docs: setup
	rm -rf docs/api/_generated
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html
	@echo "fedjax_pan: open docs/_build/html/index.html"

bench: setup
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 \
	  || echo "fedjax_pan: torch not installed: the benchmark runs without its PyTorch row" >&2
	$(PY) -m benchmarks.run --suite cpu --out runs/bench

# One config on 2 local processes of 2 CPU devices each (JAX's multi-process runtime over
# gloo) and on 1 process: the numbers must agree (`python -m fedjax_pan.run.launch compare`).
MP_DIR ?= runs/multiprocess
MP_CONFIG ?= configs/fmnist_mlp.py:multiprocess
multiprocess-check: setup
	JAX_NUM_CPU_DEVICES=2 $(PY) -m fedjax_pan --config=$(MP_CONFIG) --workdir=$(MP_DIR)/one_process --overwrite --noprogress
	$(PY) -m fedjax_pan.run.launch --processes=2 --devices=2 -- --config=$(MP_CONFIG) --workdir=$(MP_DIR)/two_processes --overwrite --noprogress
	$(PY) -m fedjax_pan.run.launch compare $(MP_DIR)/one_process $(MP_DIR)/two_processes

clean:
	rm -rf $(VENV) runs .pytest_cache docs/_build docs/api/_generated docs/jupyter_execute
