# Set-up is idempotent: the .venv is rebuilt only when pyproject.toml or constraints change.
# CPU by default. On a CUDA machine: make test TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (any index serving torch==$(TORCH_VERSION) for your CUDA), or TORCH_SPEC to pick another build.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?= torch==$(TORCH_VERSION)
TORCH_INDEX ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test workers (pytest-xdist): whole modules per worker, so a module's shared cluster and
# fixtures start once; tests/conftest.py starts the slowest modules first. 0: one process.
PYTEST_WORKERS ?= 2

.PHONY: setup test demo lint bench-kv bench-kernels clean protos gpu-wheels

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
	$(PIP) install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/pagedserve demo

lint: setup
	$(VENV)/bin/ruff check .

protos: setup
	$(PY) protos/generate.py

bench-kv: setup
	$(PY) benchmarks/kvmanager_bench.py

bench-kernels: setup
	$(PY) benchmarks/kernels_bench.py

# Wheels the CUDA machine's image lacks (cp312, manylinux x86_64), for scripts/gpu_check.sh.
gpu-wheels: setup
	$(PY) scripts/gpu_wheels.py --dest .whl

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
