# The two commands of the README: `make demo` and `make test`. Both set up what they need on a fresh
# Debian/Ubuntu machine (apt packages, a virtualenv with the project) or a Mac (Homebrew packages).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UNAME_S := $(shell uname -s)
ifeq ($(UNAME_S),Darwin)
  EXTRAS := mlx,dev,reference,fast
else
  EXTRAS := cpu,dev,reference,fast
endif
# Debian packages the tests and the demo use as real peers and tools.
APT_PACKAGES := redis-server sip-tester espeak-ng sox prometheus libopenblas0-pthread libsndfile1 baresip kamailio sipvicious sipsak fail2ban
BREW_PACKAGES := redis espeak-ng sox prometheus
PYTEST_ARGS ?=

.PHONY: test demo demo-model deps venv lint typecheck pytest clean

test: deps venv lint typecheck pytest

deps:
	@./tools/install_system_deps.sh $(if $(filter Darwin,$(UNAME_S)),$(BREW_PACKAGES),$(APT_PACKAGES))

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

lint: venv
	$(VENV)/bin/ruff check asr_core gateway tools tests
	$(VENV)/bin/ruff format --check asr_core gateway tools tests
	$(VENV)/bin/lint-imports

typecheck: venv
	$(VENV)/bin/mypy

pytest: venv
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

demo: deps venv
	$(PY) -m tools.demo

# Rebuild the embedded demo model from nothing (docs/demo-model.md): corpus ~25 min (19 training shards),
# training six stages of 7-9 min each (on a GPU if there is one, else the same minutes on the CPU: fewer
# steps), eval ~4 min; `make demo-model DEMO_MODEL_ARGS="--until data"` builds only the data.
DEMO_MODEL_ARGS ?=
demo-model: deps venv
	$(PY) -m tools.demo_model.recipe $(DEMO_MODEL_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache var
