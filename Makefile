# Two entry points: `make demo` and `make test`. Both create .venv when missing and install
# the pinned CPU torch wheel *before* the package, so pip never resolves `torch>=2.4` to a
# multi-GB CUDA build. Override with e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup demo test clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,plot]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/tiny_p2r/run_demo.sh

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV) demo_out
