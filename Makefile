# `make test` and `make demo` work on a fresh clone: they create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL_DIR ?= $(HOME)/.cache/stratad
TINY := $(MODEL_DIR)/tiny.gguf

.PHONY: test demo venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not gpu' tests

$(TINY): $(STAMP)
	mkdir -p $(MODEL_DIR)
	$(BIN)/stratad make-model --preset tiny --router-skew 1.0 --out $(TINY)

demo: $(STAMP) $(TINY)
	$(BIN)/python -m stratad.demo --model $(TINY)

clean:
	rm -rf $(VENV) build *.egg-info
