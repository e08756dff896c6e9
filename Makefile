# Trainboard. `make demo` runs the main job on the embedded default (SQLite, filesystem broker);
# `make test` sets up and runs the whole suite (PostgreSQL, Redis, Chromium on this machine).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/trainboard
# make test runs the suite in TEST_WORKERS pytest-xdist processes (-n 3 --dist loadgroup: on 2 cores
# a third overlaps the tests that wait on a worker, a cluster or a browser; a fourth was slower), each test file
# (or xdist_group) whole on one worker, each worker with its own test database (pytest-django's
# _gwN suffix) and Redis database (TEST_REDIS_URL's + N: 12-15 for up to 4 workers), see
# tests/xdist_workers.py. TEST_WORKERS=0 runs it serially (about twice as long on 2 cores).
TEST_REDIS_URL ?= redis://127.0.0.1:6379/12
TEST_WORKERS ?= 3
XDIST_ARGS := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup)
PORT ?= 8000

.PHONY: help demo test venv dev-venv static static-dev services system-deps compose-config clean

help:  ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

# requirements-lock.txt (scripts/lock-requirements.sh) pins what requirements.txt pulls in, as the image does.
$(VENV)/.installed: requirements.txt requirements-lock.txt trainer_pkg/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -r requirements.txt -c requirements-lock.txt
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed requirements-dev.txt client/pyproject.toml
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

# PYTHONDONTWRITEBYTECODE is emptied for the suite (an environment may set it): the suite starts hundreds
# of Python processes (Celery workers, launchers, ranks, manage.py), and without the byte-code cache each
# compiles the project's modules again (Django set-up with jobs and trainer_pkg: 3.8-4.9 s against 3.4 s).
test: dev-venv static-dev system-deps  ## Set up and run the whole suite on PostgreSQL and Redis
	PYTHONDONTWRITEBYTECODE= DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m pytest $(XDIST_ARGS) $(PYTEST_ARGS)

clean:  ## Remove the embedded database, broker files, run directories and test artifacts
	rm -rf var test-artifacts
