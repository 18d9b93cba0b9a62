# kvbench — the README's two commands are `make run` and `make test`; both set up a fresh machine first.
PYTHON ?= python3
VENV ?= .venv
# torch 2.13.0 is the CPU build this workplace serves from local disk; on a GPU machine use e.g.
# `make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"`.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
KVBENCH := $(VENV)/bin/kvbench
PYTEST_ARGS ?= -m "not slow"
# pytest-xdist workers, each pinned to a CPU of its own (tests/conftest.py); 0 runs the tests in this process
TEST_WORKERS ?= auto
SCALE ?= paper

.PHONY: setup run test test-all lint test-slurm gpu-check clean

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
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=20 $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m ""

# ruff (lint and format) and mypy, as configured in pyproject.toml; CI runs it before the tests
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The sweeps against a real scheduler: a throw-away single-node Slurm (LOCAL_SLURM start|stop|env; the default
# needs root the first time, to install Debian's slurm-wlm and munge), tests/test_slurm.py on it, then stopped.
LOCAL_SLURM ?= scripts/local_slurm.sh
test-slurm: setup
	$(LOCAL_SLURM) start
	eval "$$($(LOCAL_SLURM) env)" && $(PY) -m pytest -q -m slurm tests/test_slurm.py; \
		status=$$?; $(LOCAL_SLURM) stop; exit $$status

# make gpu-check [DRY=1]: what a lent GPU machine runs in under 8 minutes (scripts/gpu_check.sh, docs/gpu.md):
# pytest -m "cuda or kernel" and kvbench bench on llama31_8b_random (prefill at 8k/32k, the grids); DRY=1 only prints it
gpu-check: setup
	DRY=$(DRY) scripts/gpu_check.sh

clean:
	rm -rf $(VENV) results/default results/multirun

# --- Paper reproductions --------------------------------------------------------------------------------------
# make reproduce-<paper> [SCALE=paper|smoke|plan] [LAUNCHER=slurm|local] [LAUNCHER_ARGS="hydra.launcher.KEY=VALUE ..."]: the paper's sweeps
# (conf/experiment/<sweep>.yaml, or <sweep>_smoke.yaml), each with its full-cache baseline, then the benchmark
# tables, the plots and the comparison with each transcribed table of the paper, written to
# results/[smoke/]<paper>/report/. SCALE=smoke runs the same sweeps on SmolLM2-135M with one sample and short
# contexts on a CPU. Finished runs are not submitted again: an interrupted or failed reproduction is resumed by
# running it again. LAUNCHER_ARGS go to every sweep, e.g. the cluster's partition and account for LAUNCHER=slurm
# (conf/hydra/launcher/slurm.yaml lists the keys).
LAUNCHER ?=
LAUNCHER_ARGS ?=
ifeq ($(filter $(SCALE),paper smoke plan),)
$(error SCALE must be paper, smoke or plan, not '$(SCALE)')
endif
SMOKE := $(filter smoke,$(SCALE))
# SCALE=plan: every job of the paper-scale sweeps resolved and validated (kvbench plan), nothing run; fails if any is invalid
PLAN := $(filter plan,$(SCALE))
RESULTS := results$(if $(SMOKE),/smoke)
LAUNCH := $(if $(LAUNCHER),hydra/launcher=$(LAUNCHER)) $(LAUNCHER_ARGS)
# Smoke runs use one torch thread (engine.threads; elsewhere auto: the CPUs the process may use): SmolLM2's small
# matrices gain little from a second one, and the smoke results keep the thread count they were made with.
SMOKE_THREADS ?= 1
RUN := $(KVBENCH) $(if $(PLAN),plan,run) -m $(if $(SMOKE),engine.threads=$(SMOKE_THREADS))
FULL_CACHE := policy=full budget=128k
CAOTE_TABLES := table2 table3 table10 table11 table4 table12 table5 table13
OBCACHE_TABLES := table1 table3 table4 table5
CALIDROP_TABLES := table1 table2 table4 table5 table6 niah_text
SLAKE_TABLES := table1 table2 table4

# $(call sweep,EXPERIMENT): the experiment's multirun, then its full-cache runs (one per model, task and context).
sweep = $(RUN) +experiment=$(1)$(if $(SMOKE),_smoke) $(LAUNCH) && \
	$(RUN) +experiment=$(1)$(if $(SMOKE),_smoke) $(FULL_CACHE) $(LAUNCH)
# $(call extra,EXPERIMENT): a sweep whose table takes its full-cache rows from the main sweep (no full-cache runs).
extra = $(RUN) +experiment=$(1)$(if $(SMOKE),_smoke) $(LAUNCH)
# $(call report,PAPER,TABLES): benchmark tables and plots, then the paper's tables beside ours, all in report/.
report = $(if $(PLAN),true,$(report_tables))
report_tables = $(KVBENCH) table $(RESULTS)/$(1) --output-dir $(RESULTS)/$(1)/report && \
	$(KVBENCH) plot $(RESULTS)/$(1) --output-dir $(RESULTS)/$(1)/report && \
	for table in $(2); do \
		$(KVBENCH) compare-paper $(1):$$table $(RESULTS)/$(1) --output-dir $(RESULTS)/$(1)/report || exit 1; \
	done

.PHONY: reproduce-caote reproduce-obcache reproduce-calidrop reproduce-slake leaderboard shared-context

reproduce-caote: setup
	$(call sweep,caote)
	$(call sweep,caote_niah)
	$(call sweep,caote_booksum)
	$(call report,caote,$(CAOTE_TABLES))

# Table 3's GQA-aware half: obcache_gqa (LongBench) and obcache_niah_gqa (NIAH 8k).
reproduce-obcache: setup
	$(call sweep,obcache)
	$(call sweep,obcache_niah)
	$(call extra,obcache_gqa)
	$(call extra,obcache_niah_gqa)
	$(call sweep,obcache_pg19)
	$(call report,obcache,$(OBCACHE_TABLES))

# Table 2's θ grid: calidrop_theta; the needle figures: calidrop_needle (LLaMA-3, 8k) and calidrop_needle_mistral
# (32k, which the smoke run leaves out).
reproduce-calidrop: setup
	$(call sweep,calidrop)
	$(call extra,calidrop_theta)
	$(call sweep,calidrop_ruler)
	$(call sweep,calidrop_needle)
	$(if $(SMOKE),,$(call sweep,calidrop_needle_mistral))
	$(call report,calidrop,$(CALIDROP_TABLES))

# Table 2's ablation run: slake_ablation. NeedleBench (Table 4) needs its data from the hub, so the offline smoke run
# leaves it out.
reproduce-slake: setup
	$(call sweep,slake)
	$(call extra,slake_ablation)
	$(if $(SMOKE),,$(call sweep,slake_needlebench))
	$(call report,slake,$(SLAKE_TABLES))

# --- Leaderboard ------------------------------------------------------------------------------------------------
# make leaderboard [SCALE=paper|smoke|plan] [MODEL=NAME] [LEADERBOARD_DIR=DIR]: every base alone and with every modifier
# that applies to it, under one protocol on the offline SmolLM2-135M (MODEL: any conf/model name, into
# results/leaderboard-NAME), on RULER, the needle grid and perplexity, and every
# base on RULER query-agnostic, KVzip head-wise among them
# (conf/experiment/leaderboard[_needle|_ppl|_agnostic|_headwise][_smoke].yaml), each a grouped sweep sharing each
# prompt's prefill; then kvbench leaderboard's cells (mean, 95% bootstrap interval, n), the paired modifier-vs-base comparisons and the plot
# in DIR/report/, with provenance.json (the command, versions, commit, this invocation's wall time and the seconds
# summed over every record). Stopped, it resumes where it was when run again. The runs are committed packed
# (DIR/runs.tar.xz, read as the run directories they hold; a sweep into DIR unpacks them to resume them), packed
# again once the report is written.
MODEL ?=
LEADERBOARD_DIR ?= $(RESULTS)/leaderboard$(if $(MODEL),-$(MODEL))
LEADERBOARD_SWEEPS = leaderboard leaderboard_needle leaderboard_ppl leaderboard_agnostic leaderboard_headwise
leaderboard: setup
	start=$$(date +%s); commit=$$(git describe --always --dirty --abbrev=40 2>/dev/null); \
	for sweep in $(LEADERBOARD_SWEEPS); do \
		$(RUN) +experiment=$${sweep}$(if $(SMOKE),_smoke) $(if $(MODEL),model=$(MODEL)) \
			hydra.sweep.dir=$(LEADERBOARD_DIR) $(LAUNCH) || exit 1; \
	done && \
	$(if $(PLAN),true,$(KVBENCH) leaderboard $(LEADERBOARD_DIR) --output-dir $(LEADERBOARD_DIR)/report \
		--provenance "make leaderboard SCALE=$(SCALE)$(if $(MODEL), MODEL=$(MODEL))" --started $$start \
		--commit "$$commit" && \
		$(KVBENCH) pack $(LEADERBOARD_DIR))

# --- Shared context ---------------------------------------------------------------------------------------------
# make shared-context [SCALE=paper|smoke|plan] [SHARED_CONTEXT_DIR=DIR]: every base policy answering RULER
# niah_multikey_1's four questions per haystack with the question seen while evicting (aware) and with each haystack
# compressed once before its questions (agnostic), conf/experiment/shared_context[_smoke].yaml; then the two side by
# side with the paired intervals (kvbench table --layout query_modes) in DIR/report/; its runs packed
# as the leaderboard's.
SHARED_CONTEXT_DIR ?= $(RESULTS)/shared_context
shared-context: setup
	$(RUN) +experiment=shared_context$(if $(SMOKE),_smoke) hydra.sweep.dir=$(SHARED_CONTEXT_DIR) $(LAUNCH) && \
	$(if $(PLAN),true,$(KVBENCH) table $(SHARED_CONTEXT_DIR) --layout query_modes \
		--output-dir $(SHARED_CONTEXT_DIR)/report && $(KVBENCH) pack $(SHARED_CONTEXT_DIR))
