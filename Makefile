# Two commands: `make demo` and `make test`. Both set up .venv on first use.
# Override the torch requirement for another build, e.g. `make test TORCH_SPEC="torch==2.5.1"`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?= -n 2

.PHONY: setup demo test check-cuda lint bench-manual clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,bench]" "$(TORCH_SPEC)"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m remat.demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# On a machine with a GPU: every CUDA-marked test, then a short run of every form on CUDA.
check-cuda: setup
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make check-cuda: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine with a CUDA build of torch (TORCH_SPEC)')"
	$(PY) -m pytest $(PYTEST_ARGS) -k cuda -rs
	$(PY) benchmarks/cuda/run.py

lint: setup
	$(PY) -m ruff check remat tests benchmarks
	$(PY) -m ruff format --check remat tests benchmarks
	$(PY) -m mypy

bench-manual: setup
	$(PY) benchmarks/manual/run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
