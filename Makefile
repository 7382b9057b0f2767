# `make test` and `make demo` work on a fresh clone: they create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-slow demo train-tiny venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not gpu' tests

# only the tests marked `slow` (full-size shapes: minutes, ~14 GB of disk; tests/conftest.py skips them otherwise)
test-slow: $(STAMP)
	STRATAD_SLOW=1 $(BIN)/python -m pytest -q -m 'slow and not gpu' tests

# the trained tiny model that ships in stratad/model/data (no model to make first)
demo: $(STAMP)
	$(BIN)/python -m stratad.demo

# regenerate that model (a few minutes on one core; the same bytes on the same machine)
train-tiny: $(STAMP)
	$(BIN)/python scripts/train_tiny.py

clean:
	rm -rf $(VENV) build *.egg-info
