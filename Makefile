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

# (Re)install when pyproject.toml changes; a fresh clone creates the venv from scratch.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# ui-venv and browser let tests/test_mlflow_ui.py open a trained run in MLflow's UI in headless chromium.
# The tests run on every core (pytest-xdist; work-stealing, since a few tests take minutes): the fast ones
# first, so a broken change shows in a few minutes, then those marked slow. `pytest tests/X.py` runs one file.
PYTEST := $(BIN)/python -m pytest -q -n auto --dist worksteal
test: $(STAMP) ui-venv browser
	$(PYTEST) -m "not slow"
	$(PYTEST) -m slow

demo: $(STAMP)
	$(BIN)/python -m mhar_lit fit --config configs/demo.yaml

ui-venv: $(UI_MLFLOW)

$(UI_MLFLOW):
	test -x $(UI_VENV)/bin/python || $(PYTHON) -m venv $(UI_VENV)
	$(UI_VENV)/bin/python -m pip install --quiet "mlflow==3.17.2"

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
