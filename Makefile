# The README's two commands: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# EvalPlus scores HumanEval+/MBPP+ with its own code; without its declared dependencies
# (model-provider SDKs scoring never imports): the extras hold what it does import.
EVALPLUS := evalplus==0.3.1

.PHONY: setup train test clean

setup: $(STAMP)

# Reinstall only when the project's dependency list or this install step changes.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]' --config-settings editable_mode=compat
	$(PY) -m pip install --no-deps $(EVALPLUS)
	touch $(STAMP)

# TRAIN_ARGS: more train.py flags (tests/test_readme_commands.py makes its short run with them).
train: setup
	$(VENV)/bin/torchrun --standalone --nproc-per-node 1 train.py $(TRAIN_ARGS)

# Two pytest-xdist workers, each running whole test files: one worker's single-process tests fill
# the core the other's leave idle (12:21 to 13:48 on 2 idle cores after issue 37's cuts, from 17:47; 18:31 to 19:52 before them with round 5's README-wide and DPO tests; 16:21 with round 4's; 11:13 to 14:47
# before them, as this machine's speed drifts). A file stays on one worker, so its module fixtures are made once and the SLURM
# tests never share the two emulated nodes. Not loadgroup: it stops grouping on pytest 9.2
# (pytest-dev/pytest-xdist#1386). Files go out in collection order, so the multi-process ones
# (e2e, launch) do not all come last and leave one worker idle at the end.
# First the type check of train/ and models/ ([tool.mypy] in pyproject.toml), then the tests; pytest ends with its
# 25 slowest tests (setup and call apart), so a CI log says where the time went. The README's commands run as
# five files of tests/readme/, one group each, so that both workers share them.
test: setup
	$(VENV)/bin/ruff check -q .
	$(PY) -m mypy
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

clean:
	rm -rf $(VENV)
