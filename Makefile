# kvbench — the README's two commands are `make run` and `make test`; both set up a fresh machine first.
PYTHON ?= python3
VENV ?= .venv
# torch 2.13.0 is the CPU build this workplace serves from local disk; on a GPU machine use e.g.
# `make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"`.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
KVBENCH := $(VENV)/bin/kvbench
PYTEST_ARGS ?= -m "not slow"
SCALE ?= paper

.PHONY: setup run test test-all clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The default job: SmolLM2-135M (offline), RULER niah_single_1 at 2k tokens, full cache vs SnapKV@128.
run: setup
	$(KVBENCH) run -m model=smollm2_135m task=ruler task.subtasks=[niah_single_1] task.context_length=2048 \
		task.num_samples=4 policy=full,snapkv budget=128 hydra.sweep.dir=results/default
	$(KVBENCH) table results/default

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest -q -m ""

clean:
	rm -rf $(VENV) results/default results/multirun
