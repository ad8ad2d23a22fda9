# Two commands do all set-up: `make demo` and `make test`. Both create/reuse .venv.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml eval/requirements-lmms.txt | sha1sum | cut -c1-12)

$(STAMP): pyproject.toml eval/requirements-lmms.txt
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e ".[dev]"
	$(VENV)/bin/python -m pip install -q -r eval/requirements-lmms.txt
	$(VENV)/bin/python -m pip install -q --no-deps lmms-eval==0.7.3
	touch $(STAMP)

.PHONY: install demo test test-slow
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vlmspec demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(or $(JOBS),2) tests

# the suite plus the tests that train a testbed pair to its quality gates (a few minutes more)
test-slow: export VLMSPEC_SLOW_TESTS = 1
test-slow: test
