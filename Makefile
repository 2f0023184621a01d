# The two commands of the README: `make demo` (a short CPU training run tracked in MLflow) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: test demo install ui clean

install: $(STAMP)

# (Re)install when pyproject.toml changes; a fresh clone creates the venv from scratch.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/python -m mhar_lit fit --config configs/demo.yaml

# MLflow's web UI needs the full `mlflow` package, kept out of the training venv (see README).
ui:
	test -x .venv-ui/bin/mlflow || ($(PYTHON) -m venv .venv-ui && .venv-ui/bin/pip install --quiet "mlflow==3.17.2")
	.venv-ui/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf $(VENV) .pytest_cache
