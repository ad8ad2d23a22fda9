# Two commands do all set-up: `make demo` and `make test`. Both create/reuse .venv.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml eval/requirements-lmms.txt | sha1sum | cut -c1-12)

PIP := $(VENV)/bin/python -m pip install -q
# uv resolves to the same versions as pip and installs them about twice as fast (parallel downloads); bytecode is
# compiled at install, as pip does, so no process compiles transformers' sources. Without uv, pip does it all.
UV := $(VENV)/bin/uv pip install -q --python $(VENV)/bin/python --compile-bytecode

$(STAMP): pyproject.toml eval/requirements-lmms.txt
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	($(PIP) uv && $(UV) -e ".[dev]" -r eval/requirements-lmms.txt && $(UV) --no-deps lmms-eval==0.7.3) || \
	  ($(PIP) --upgrade pip && $(PIP) -e ".[dev]" && $(PIP) -r eval/requirements-lmms.txt && \
	   $(PIP) --no-deps lmms-eval==0.7.3)
	touch $(STAMP)

# The project's own modules compiled once (an editable install leaves them as sources): every process the tests
# start would otherwise compile them again where PYTHONDONTWRITEBYTECODE is set.
compile: $(STAMP)
	$(VENV)/bin/python -m compileall -q vlmspec eval pipelines > /dev/null

.PHONY: install demo test test-slow compile
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vlmspec demo

test: compile
	$(VENV)/bin/python -m pytest -q -n $(or $(JOBS),2) tests

# the suite plus the tests that train a testbed pair to its quality gates (a few minutes more)
test-slow: export VLMSPEC_SLOW_TESTS = 1
test-slow: test
