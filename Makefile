# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: demo test lint docs venv clean bench convergence aot-tpu

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,experiments]'
	touch $(STAMP)

venv: $(STAMP)

# QSDP W8G8 against fp32 FSDP on Shakespeare, 8 simulated CPU devices (a few minutes).
demo: $(STAMP)
	$(PY) -m experiments.gpt.demo

# The whole suite on 8 simulated CPU devices (tests/conftest.py sets them up).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests

# ruff's bug-finding rules, ruff's format check and mypy (pyproject.toml's [tool.ruff] and [tool.mypy] say which, and why).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The documentation site (Sphinx + MyST, API pages from the docstrings), warnings as errors.
docs: $(STAMP)
	$(VENV)/bin/sphinx-build -q -W --keep-going -b html docs docs/_build/html

# Benchmarks (write JSON under experiments/results/).
bench: $(STAMP)
	$(PY) -m experiments.bench.comm
	$(PY) -m experiments.bench.overhead

# The TPU compiler (libtpu) in the environment, then every Pallas kernel compiled by it for TPU
# v4, v5e, v5p and v6e at every bit width (no TPU needed; results/tpu_kernels.json). With libtpu
# installed, `make test` also runs tests/test_tpu_compile.py (CI does: .ci/run).
aot-tpu: $(STAMP)
	$(PY) -m pip install -q -e '.[aot-tpu]'
	$(PY) -m experiments.bench.tpu_kernels

convergence: $(STAMP)
	$(PY) -m experiments.convergence

clean:
	rm -rf $(VENV) .pytest_cache docs/_build docs/results/generated
