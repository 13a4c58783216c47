# Two commands: `make demo` and `make test`. Both create .venv on first use (pinned versions from
# requirements.lock) and reuse it afterwards.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint typecheck bench clean-venv

$(STAMP): requirements.lock requirements-zoo.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-zoo.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tfmem.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# `make test` keeps to 15 minutes on 2 cores: the end-to-end runs marked `slow` (each 15 s or more: planning
# ResNets, Keras fits, experiments' --tiny runs) are left to `make test-all`.
test: $(STAMP) lint typecheck
	$(PY) -m pytest -q -p no:cacheprovider --durations=30 -m "not slow"

test-all: $(STAMP) lint typecheck
	$(PY) -m pytest -q -p no:cacheprovider --durations=30

bench: $(STAMP)
	$(PY) -m experiments.run_all

clean-venv:
	rm -rf $(VENV)
