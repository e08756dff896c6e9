# Trainboard. `make demo` runs the main job on the embedded default (SQLite, filesystem broker);
# `make test` sets up and runs the whole suite (PostgreSQL, Redis, Chromium on this machine).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/trainboard
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15
PORT ?= 8000

.PHONY: help demo test venv dev-venv static static-dev services system-deps compose-config clean

help:  ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

$(VENV)/.installed: requirements.txt trainer_pkg/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -r requirements.txt
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed requirements-dev.txt
	$(PIP) install --quiet -r requirements-dev.txt
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --omit=dev --no-audit --no-fund --loglevel=error
	touch $@

node_modules/.dev-installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch node_modules/.installed $@

venv: $(VENV)/.installed  ## Create .venv with the pinned runtime dependencies
dev-venv: $(VENV)/.dev-installed  ## .venv plus the test tools
static: node_modules/.installed  ## Chart.js from the npm registry, served by whitenoise
static-dev: node_modules/.dev-installed  ## static plus the npm test stand-ins (Azurite)

demo: venv static  ## Set up and run the demo: web on 127.0.0.1:8000 (another port: make demo PORT=8100), worker, beat, one DDP job
	$(PY) manage.py demo --port $(PORT)

system-deps:  ## Debian packages the tests need (Chromium, docker-compose) and the services
	bash scripts/system-deps.sh

test: dev-venv static-dev system-deps  ## Set up and run the whole suite on PostgreSQL and Redis
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m pytest $(PYTEST_ARGS)

clean:  ## Remove the embedded database, broker files, run directories and test artifacts
	rm -rf var test-artifacts
