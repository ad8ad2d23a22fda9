# Two commands do all set-up: `make demo` and `make test`. Both create/reuse .venv.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml eval/requirements-lmms.txt | sha1sum | cut -c1-12)

PIP := $(VENV)/bin/python -m pip install -q --no-compile
# uv resolves to the same versions as pip and installs them about twice as fast (parallel downloads). Without uv,
# pip does it all.
UV := $(VENV)/bin/uv pip install -q --python $(VENV)/bin/python
# Bytecode is compiled by the first process that imports a module and written into .venv/pycache, where every later
# process reads it, even where PYTHONDONTWRITEBYTECODE is set (as on CI; the suite starts many processes: its
# workers, caption jobs, lmms-eval runs). The project's sources and the packages' stay free of __pycache__ folders. Compiling every installed package at
# install instead (uv's --compile-bytecode) took 56 of the install's 86 s; the commands import a fraction of them.
BYTECODE := env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache

$(STAMP): pyproject.toml eval/requirements-lmms.txt
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	($(PIP) uv && $(UV) -e ".[dev]" -r eval/requirements-lmms.txt && $(UV) --no-deps lmms-eval==0.7.3) || \
	  ($(PIP) --upgrade pip && $(PIP) -e ".[dev]" && $(PIP) -r eval/requirements-lmms.txt && \
	   $(PIP) --no-deps lmms-eval==0.7.3)
	touch $(STAMP)

.PHONY: install demo test test-slow
install: $(STAMP)

demo: $(STAMP)
	$(BYTECODE) $(VENV)/bin/vlmspec demo

test: $(STAMP)
	$(BYTECODE) $(VENV)/bin/python -m pytest -q -n $(or $(JOBS),2) tests

# the suite plus the tests that train a testbed pair to its quality gates (a few minutes more)
test-slow: export VLMSPEC_SLOW_TESTS = 1
test-slow: test
