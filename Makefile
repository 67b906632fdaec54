# The two commands of the README: `make serve` and `make test`. Everything else is plumbing.
VENV ?= .venv
PY := $(VENV)/bin/python
# Compiled numba kernels survive between runs here (start-up takes seconds instead of a minute).
export NUMBA_CACHE_DIR ?= $(HOME)/.cache/reame/numba

.PHONY: install serve test bench

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/reame serve

test: install
	$(VENV)/bin/pytest

bench: install
	$(PY) bench/engine.py
