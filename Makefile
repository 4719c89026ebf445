# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export RAY_USAGE_STATS_ENABLED := 0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export NIXL_LOG_LEVEL := WARN

.PHONY: demo test lint install bench-install clean

$(STAMP): pyproject.toml setup.py $(wildcard kvshare/*.c)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned, so pip takes the CPU wheel on disk instead of a CUDA build
	$(BIN)/python -m pip install --quiet "torch==2.13.0" numpy
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# benchmark-only peers (NVIDIA Dynamo's RadixTree for benchmarks/index.py, ...): not needed by
# make test; ai-dynamo goes in without its dependencies (see the bench extra in pyproject.toml)
bench-install: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[test,bench]"
	$(BIN)/python -m pip install --quiet --no-deps "ai-dynamo==1.6.1"

demo: $(STAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check kvshare actors router tests benchmarks examples
	$(BIN)/mypy kvshare actors router

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info kvshare/*.so
