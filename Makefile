# The two commands of the README: `make demo` (a short CPU training run tracked in MLflow) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# MLflow's web UI needs the full `mlflow` package, kept out of the training venv (see docs/training.md); the
# same release as the training venv's mlflow-skinny, since a newer one would upgrade the store's schema.
UI_VENV   := .venv-ui
UI_MLFLOW := $(UI_VENV)/bin/mlflow
# The browser test drives Debian's chromium through its chromedriver; apt needs root.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: test demo install ui ui-venv browser clean
# Two jobs: the training venv and the UI venv install side by side (a fresh clone's `make test` spends minutes
# in pip); recipes of one target still run in order.
MAKEFLAGS += --jobs=2

install: $(STAMP)

# --no-compile: pip byte-compiles every module of every package one file after the other (~50 s of the ~100 s install
# of the test extra on 2 cores, ~35 s of the UI venv's ~60 s). Each venv is compiled afterwards by COMPILE: the
# training venv on every core (workers 0), the UI venv on one, beside the longer training install. Left out, to be
# compiled on first import: trees the tests barely import (tests folders, sklearn, nltk, setuptools, boto3/botocore:
# 21% of the training venv's modules, of which a run of the suite imported 102). A file that does not compile (a
# template) is passed over, as pip passes it over.
PIP_INSTALL = python -m pip install --quiet --no-compile
COMPILE = python -c "import compileall, re, sys; compileall.compile_dir(sys.argv[1], quiet=2, workers=int(sys.argv[2]), \
  rx=re.compile('/(tests?|sklearn|nltk|setuptools|botocore|boto3)/'))"
# Bytecode is written where an environment turns it off: otherwise every process would compile what the installs
# left uncompiled again (the tests start many).
export PYTHONDONTWRITEBYTECODE =

# (Re)install when pyproject.toml changes; a fresh clone creates the venv from scratch.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/$(PIP_INSTALL) -e '.[test]'
	$(BIN)/$(COMPILE) $(VENV)/lib 0
	touch $(STAMP)

# ui-venv and browser let tests/test_mlflow_ui.py open a trained run in MLflow's UI in headless chromium.
# The tests run on every core (pytest-xdist, work-stealing) in one run: the longest start first, each on the least
# loaded worker (tests/start_order.py), and the short ones fill in around them. Two runs (the fast tests, then those
# marked slow) took ~25 s longer on 2 cores: a second start of the workers, and a second run's end on one busy
# worker. `pytest -m "not slow"` leaves the long ones out; `pytest tests/X.py` runs one file.
PYTEST := $(BIN)/python -m pytest -q -n auto --dist worksteal
test: $(STAMP) ui-venv browser
	$(PYTEST)

demo: $(STAMP)
	$(BIN)/python -m mhar_lit fit --config configs/demo.yaml

ui-venv: $(UI_MLFLOW)

$(UI_MLFLOW):
	test -x $(UI_VENV)/bin/python || $(PYTHON) -m venv $(UI_VENV)
	$(UI_VENV)/bin/$(PIP_INSTALL) "mlflow==3.17.2"
	$(UI_VENV)/bin/$(COMPILE) $(UI_VENV)/lib 1

# chromium and chromedriver from Debian (only when missing); Selenium comes with the test extra.
# Where apt cannot install them (no root, no sudo, no mirror) the suite still runs: the browser test skips,
# naming what is missing, except under CI (CI set), where it fails.
browser: $(STAMP)
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || \
	  ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends chromium chromium-driver) || \
	  echo "browser: chromium/chromedriver not installed; tests/test_mlflow_ui.py will skip"

ui: ui-venv
	@echo "MLflow UI: http://127.0.0.1:5000 (click 'Model training' at the top left once: experiments then open on their runs)"
	$(UI_MLFLOW) ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf $(VENV) .pytest_cache
