# The README's two commands: `make demo` and `make test`.
# Both create/use a local virtual environment in $(VENV).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-flower-versions test-deploy test-docker smoke lint format install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e ".[app,dev,tensorboard,wandb,mlflow]"
	touch $(STAMP)

# FedAvg+SGD vs FedAdam vs FedDuA+Δ-SGD on non-IID digits (conf/demo.yaml):
# one Ray cluster for the three runs, as many at once as the cores hold (one
# CPU per simulated client); Flower's logs go to outputs/experiments/demo/.flwr;
# prints the table and the plot's path
demo: $(STAMP)
	$(BIN)/fedadapt-exp run conf/demo.yaml --output outputs/experiments \
		--federation-config "client-resources-num-cpus=1"

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

# The Flower releases the library is tested on: the oldest pyproject's
# `flwr>=` allows and the newest release (the app's pin); tests/test_packaging.py
# keeps the three in step
FLOWER_VERSIONS := 1.41.0 1.42.0
# the tests that need only flwr + numpy: tests/strategies holds only such files
# (tests marked `app` in them are left out)
LIBRARY_TESTS := tests/strategies tests/test_imports.py tests/test_layering.py \
	tests/server/test_object_pull.py tests/tools/deploy/test_flwr_cli.py

# builds wheel + sdist, then per Flower version a clean venv (flwr, numpy,
# pytest; no PyTorch) with the wheel installed without changing flwr, and runs
# LIBRARY_TESTS against the installed wheel (66 s for both versions on a
# 2-core VM with a warm pip cache)
test-flower-versions: $(STAMP)
	scripts/test-flower-versions.sh $(BIN)/python $(PYTHON) "$(FLOWER_VERSIONS)" $(LIBRARY_TESTS)

# real processes: SuperLink + 3 SuperNodes with TLS, SuperNode auth, a refused
# stranger and node loss; a Ray cluster; slow process-failure checks and the
# longest multi-run e2e tests (about 10 minutes; kept out of the default suite,
# which must stay within CI's 20 minutes including install)
test-deploy: $(STAMP)
	$(BIN)/python -m pytest -q -m deploy -rs tests

# real containers: Docker engine, offline base image, compose (docs/deployment.md)
test-docker: $(STAMP)
	$(BIN)/python -m pytest -q -m docker -rs tests/tools/deploy/docker

SMOKE_SUITES := feddua-synthetic-smoke delta-sgd-digits-smoke fed-lamb-digits-smoke

# the papers' qualitative claims at CPU scale (docs/reproduction.md); one CPU
# per simulated client (Flower's default is 2), each suite on one Ray cluster
# with as many cells at once as the cores hold: the same numbers (seeded sampling)
SMOKE_RESOURCES := client-resources-num-cpus=1
smoke: $(STAMP)
	@for suite in $(SMOKE_SUITES); do \
		$(BIN)/fedadapt-exp run conf/$$suite.yaml --output outputs/experiments --check \
			--federation-config "$(SMOKE_RESOURCES)" || exit 1; \
	done

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m fedadapt.config --check
	$(BIN)/python -m fedadapt.tools.baselines --check

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .flwr build
