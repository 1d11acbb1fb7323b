# The two commands of the README: `make demo` and `make test`. Both set up what they need on a fresh
# Debian/Ubuntu machine (apt packages, a virtualenv with the project) or a Mac (Homebrew packages).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UNAME_S := $(shell uname -s)
# The demo needs the gateway and its MLX backend; the tests add the dev tools and the reference
# implementation (torch + transformers, for the parity tests). `make demo` installs the first set,
# `make test` the rest into the same .venv, so either order installs each package once.
ifeq ($(UNAME_S),Darwin)
  DEMO_EXTRAS := mlx,fast
else
  DEMO_EXTRAS := cpu,fast
endif
TEST_EXTRAS := $(DEMO_EXTRAS),dev,reference
# Debian packages the demo uses as real peers (redis-server, sipp) and for MLX's CPU matmuls; the
# tests add espeak-ng (speech), sox, prometheus (promtool), systemd (systemd-analyze verifies the
# unit file) and the third-party SIP software of the interop tests (baresip, linphone-cli, kamailio,
# sipvicious, sipsak; fail2ban-regex checks the ops/fail2ban filter) and g++ (MLX's CPU JIT: the encoder's fused
# sigmoid and softmax, README). tools/install_system_deps.sh adds python3-venv where python3 is the
# distribution's.
APT_DEMO := redis-server sip-tester libopenblas0-pthread libsndfile1
APT_PACKAGES := $(APT_DEMO) espeak-ng sox prometheus systemd baresip linphone-cli kamailio sipvicious sipsak fail2ban g++
BREW_DEMO := redis
BREW_PACKAGES := redis espeak-ng sox prometheus
PYTEST_ARGS ?=

.PHONY: test demo demo-model deps deps-demo venv venv-demo lint typecheck pytest clean

test: deps venv lint typecheck pytest

deps:
	@PYTHON=$(PYTHON) ./tools/install_system_deps.sh $(if $(filter Darwin,$(UNAME_S)),$(BREW_PACKAGES),$(APT_PACKAGES))

deps-demo:
	@PYTHON=$(PYTHON) ./tools/install_system_deps.sh $(if $(filter Darwin,$(UNAME_S)),$(BREW_DEMO),$(APT_DEMO))

venv: $(VENV)/.installed-test

venv-demo: $(VENV)/.installed-demo

# The stamps live inside .venv: a venv made again (tools/setup_venv.sh replaces a broken one) has none.
$(VENV)/.installed-demo: pyproject.toml tools/setup_venv.sh
	./tools/setup_venv.sh $(VENV) $(PYTHON) $(DEMO_EXTRAS)
	touch $@

$(VENV)/.installed-test: pyproject.toml tools/setup_venv.sh
	./tools/setup_venv.sh $(VENV) $(PYTHON) $(TEST_EXTRAS)
	touch $@ $(VENV)/.installed-demo

lint: venv
	$(VENV)/bin/ruff check asr_core gateway tools tests
	$(VENV)/bin/ruff format --check asr_core gateway tools tests
	$(VENV)/bin/lint-imports

typecheck: venv
	$(VENV)/bin/mypy

pytest: venv
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

demo: deps-demo venv-demo
	$(PY) -m tools.demo

# Rebuild the embedded demo model from nothing (docs/demo-model.md): corpus ~25 min (19 training shards),
# training six stages of 7-9 min each (on a GPU if there is one, else the same minutes on the CPU: fewer
# steps), eval ~4 min; `make demo-model DEMO_MODEL_ARGS="--until data"` builds only the data.
DEMO_MODEL_ARGS ?=
demo-model: deps venv
	$(PY) -m tools.demo_model.recipe $(DEMO_MODEL_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache var
