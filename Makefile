# The README's two commands: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup train test clean

setup: $(STAMP)

# Reinstall only when the project's dependency list changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

train: setup
	$(VENV)/bin/torchrun --standalone --nproc-per-node 1 train.py

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
