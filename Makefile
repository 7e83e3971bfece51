# reasoning-ledger: everything runs with a bare python3; pytest is installed only for the tests.
PYTHON ?= python3
LEDGER ?= runs.jsonl
RUNS   ?= runs
DRILL_REPEAT ?= 5
# The scripts live beside this Makefile; ledgers are read and written in the current directory,
# so `make -f /opt/reasoning-ledger/Makefile audit` works from wherever your ledgers are.
HERE := $(dir $(abspath $(lastword $(MAKEFILE_LIST))))
VENV ?= $(HERE).venv
PROMPTS ?= $(HERE)prompts

.PHONY: test verify audit drill bench clean help

help:
	@echo "make test    install pytest into .venv if python3 lacks it, then run the tests"
	@echo "make verify  verify $(LEDGER) and every run under $(RUNS)/"
	@echo "make audit   what each model string did, day by day"
	@echo "make drill   the same prompts $(DRILL_REPEAT)x each through ask.py, then the audit"
	@echo "make bench   speed ratios against baselines measured in the same run"

# Uses the python's own pytest when it has one; otherwise a local venv with pytest in it.
test:
	@if $(PYTHON) -c "import pytest" 2>/dev/null; then py="$(PYTHON)"; else \
	  [ -x "$(VENV)/bin/python" ] || $(PYTHON) -m venv "$(VENV)" || exit 2; \
	  "$(VENV)/bin/python" -c "import pytest" 2>/dev/null || "$(VENV)/bin/python" -m pip install -q pytest || exit 2; \
	  py="$(VENV)/bin/python"; fi; \
	cd "$(HERE)" && "$$py" -m pytest -q tests $(PYTEST_ARGS)

verify:
	@set -- ; [ -f "$(LEDGER)" ] && set -- "$$@" "$(LEDGER)"; [ -d "$(RUNS)" ] && set -- "$$@" --all "$(RUNS)"; \
	if [ $$# -eq 0 ]; then echo "nothing to verify: no $(LEDGER) and no $(RUNS)/"; exit 0; fi; \
	$(PYTHON) $(HERE)reasoning_ledger.py verify "$$@"

audit:
	$(PYTHON) $(HERE)audit.py --by day $(AUDIT_ARGS)

drill:
	@set -e; ls $(PROMPTS)/*.txt >/dev/null; \
	for prompt in $(PROMPTS)/*.txt; do \
	  expect="$${prompt%.txt}.expect"; \
	  for i in $$(seq $(DRILL_REPEAT)); do \
	    if [ -f "$$expect" ]; then set -- --expect "$$(cat "$$expect")"; else set --; fi; \
	    $(PYTHON) $(HERE)ask.py --ledger "$(LEDGER)" --temperature 0 "$$@" < "$$prompt" > /dev/null || \
	      echo "drill: $$prompt run $$i exited $$?" >&2; \
	  done; \
	done
	$(PYTHON) $(HERE)audit.py --by day "$(LEDGER)"

bench:
	$(PYTHON) $(HERE)tests/bench.py

clean:
	cd "$(HERE)" && rm -rf .bench .pytest_cache tests/__pycache__ __pycache__
