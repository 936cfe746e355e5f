# Two entry points: `make demo` and `make test`. Both create .venv when missing and install
# the pinned CPU torch wheel *before* the package, so pip never resolves `torch>=2.4` to a
# multi-GB CUDA build. Override with e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast clean

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
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_ARGS) tests

# The inner loop: the linter and every test that starts no other process (no gloo ranks, no
# torchrun, no CLI or tool subprocess) and is not marked slow; the conftest marks the spawners.
test-fast: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not spawns and not slow" $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV) demo_out

# The GPU lane (docs/gpu.md): tests/cuda, then the GPU benchmarks, one report in $(GPU_REPORT)
# (and in $OUT when that is set), within a 720 s budget on an H200. The interpreter: GPU_PYTHON when
# given; else $(PYTHON) when its torch is a CUDA build (a cluster image, a lent GPU machine:
# nothing is installed); else $(GPU_VENV), made offline from the wheels in $(GPU_WHEELS) when
# there are any (torch, its dependencies, the package's and setuptools), otherwise from
# $(GPU_TORCH_SPEC) — PyPI's Linux torch 2.13.0 is the CUDA 13.0 build; for an older driver use
# e.g. GPU_TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
# Without a CUDA device the same command is a trial on CPU (CUDA tests skip, or run their CPU parts
# with GPU_CHECK_ARGS=--dry-run-tests; the smallest benchmark shapes): `make test` runs that trial.
GPU_PYTHON ?=
GPU_VENV ?= .venv-gpu
GPU_TORCH_SPEC ?= torch==2.13.0
GPU_WHEELS ?= .whl
GPU_REPORT ?= gpu_report
GPU_CHECK_ARGS ?=

.PHONY: gpu-check

$(GPU_VENV)/.installed: setup.py
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	if ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1; then source="--no-index --find-links $(GPU_WHEELS)"; \
	  $(GPU_VENV)/bin/python -m pip install -q $$source $(GPU_WHEELS)/*.whl; \
	else source=""; $(GPU_VENV)/bin/python -m pip install -q $(GPU_TORCH_SPEC); fi; \
	$(GPU_VENV)/bin/python -m pip install -q $$source -e ".[test,bench]"
	touch $@

gpu-check:
	@py="$(GPU_PYTHON)"; \
	if [ -z "$$py" ] && $(PYTHON) -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then \
	  py="$(PYTHON)"; fi; \
	if [ -z "$$py" ]; then $(MAKE) --no-print-directory $(GPU_VENV)/.installed && py=$(GPU_VENV)/bin/python; fi; \
	echo "gpu-check: $$py"; \
	$$py tools/gpu_check.py --out $(GPU_REPORT) $(GPU_CHECK_ARGS)
