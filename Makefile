# reasoning-ledger: everything runs with a bare python3; pytest is installed only for the tests.
# The scripts live beside this Makefile; ledgers are read and written in the current directory, so
# `make -f /opt/reasoning-ledger/Makefile audit` works from wherever your ledgers are.
SHELL := /bin/sh
export PATH ?= /usr/local/bin:/usr/bin:/bin
PYTHON ?= python3
LEDGER ?= calls.jsonl
RUNS   ?= runs
DRILL_REPEAT ?= 5
BENCH_LINES ?= 100000
# pytest processes `make test` runs at once, each a shard of the suite (tests/shards.py)
TEST_JOBS ?= 2
HERE := $(dir $(abspath $(lastword $(MAKEFILE_LIST))))
PROMPTS ?= $(HERE)prompts
# One venv per interpreter, so `make test PYTHON=python3.9` never reuses another Python's .venv.
PY_TAG := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
VENV ?= $(HERE).venv/py$(PY_TAG)

.PHONY: help test verify audit drill demo bench house clean

help:
	@echo "make test    run the tests with PYTHON's pytest, or a venv per Python with pytest in it (PYTHON=python3.9)"
	@echo "make demo    the whole agent loop against a local stand-in model, in a temp dir, in seconds"
	@echo "             REPO=DIR [PATCH=FILE]: on your repository; the stand-in proposes your patch"
	@echo "make verify  verify $(LEDGER), the daemon's $(RUNS)/daemon.jsonl and every run under $(RUNS)/"
	@echo "make audit   what each model string did, day by day (AUDIT_ARGS=... for more)"
	@echo "make drill   the endpoint's /models list, each prompts/*.txt $(DRILL_REPEAT)x through ask.py, then the audit; a failed call or a check not passed: make's exit 2 (sh drill.sh: 1)"
	@echo "make bench   speed ratios against baselines measured in the same run (BENCH_LINES=1000000 for the full figures; PEERS=1: LiteLLM beside the proxy)"
	@echo "make house   each script's code tokens and lines against its budgets (asserts nothing)"
	@echo "make clean   remove venvs, caches and bench files"
	@echo "make help    this list"

test:
	@[ -n "$(PY_TAG)" ] || { echo "make test: $(PYTHON) does not run" >&2; exit 2; }; \
	if $(PYTHON) -c "import pytest" 2>/dev/null; then py="$(PYTHON)"; else \
	  [ -x "$(VENV)/bin/python" ] && "$(VENV)/bin/python" -c "" 2>/dev/null || { rm -rf "$(VENV)"; $(PYTHON) -m venv "$(VENV)"; } || exit 2; \
	  "$(VENV)/bin/python" -c "import pytest" 2>/dev/null || "$(VENV)/bin/python" -m pip install -q pytest || exit 2; \
	  py="$(VENV)/bin/python"; fi; \
	echo "make test: $$("$$py" --version 2>&1) ($$py)"; \
	cd "$(HERE)" && "$$py" tests/shards.py $(TEST_JOBS) --no-header -rs tests $(PYTEST_ARGS)

verify:
	@set -- ; [ -f "$(LEDGER)" ] && set -- "$$@" "$(LEDGER)"; [ -f "$(RUNS)/daemon.jsonl" ] && set -- "$$@" "$(RUNS)/daemon.jsonl"; \
	[ -d "$(RUNS)" ] && set -- "$$@" --all "$(RUNS)"; \
	if [ $$# -eq 0 ]; then echo "nothing to verify: no $(LEDGER) and no $(RUNS)/"; exit 0; fi; \
	$(PYTHON) $(HERE)reasoning_ledger.py verify "$$@"

audit:
	$(PYTHON) $(HERE)audit.py --by day $(AUDIT_ARGS)

# The drill's loop lives in drill.sh, whose exit codes mean what README's table says (0, 1, 2); make
# reports any non-zero exit of a recipe as its own 2, so cron runs drill.sh itself (docs/cron.md).
drill:
	@LEDGER="$(LEDGER)" PROMPTS="$(PROMPTS)" DRILL_REPEAT="$(DRILL_REPEAT)" PYTHON="$(PYTHON)" sh $(HERE)drill.sh

demo:
	@$(PYTHON) $(HERE)tests/demo.py $(if $(REPO),--repo "$(REPO)") $(if $(PATCH),--patch "$(PATCH)") $(if $(TOOLS),--tools "$(TOOLS)")

bench:
	PEERS=$(PEERS) BENCH_LINES=$(BENCH_LINES) $(PYTHON) $(HERE)tests/bench.py $(BENCH)

house:
	@$(PYTHON) $(HERE)tests/house.py

clean:
	cd "$(HERE)" && rm -rf .venv .bench .pytest_cache tests/__pycache__ __pycache__
