# Thin wrappers around scripts/ (CI calls the scripts directly through .ci/run).
#   make test ARGS="-x -k lease"        extra pytest arguments
#   HOLDFAST_TEST_DBS=sqlite make test  one database only (sqlite | postgres)

SHELL := /bin/bash
VENV := .venv
ARGS ?=

.PHONY: help bootstrap demo demo-sources test lint format bench clean

help:
	@echo "make demo | demo-sources | test [ARGS=...] | lint | format | bench | clean  (see DEVELOPERS.md)"

bootstrap:
	@bash scripts/bootstrap.sh

demo:
	@bash scripts/demo.sh

# The pull side of ingestion on a local fixture site: discovery, fetch, index, search and a
# missing_from_source issue, on a fresh SQLite database under var/demo-sources.
demo-sources: bootstrap
	rm -rf var/demo-sources
	env -u DATABASE_URL HOLDFAST_VAR_DIR=var/demo-sources $(VENV)/bin/python manage.py migrate --noinput -v0
	env -u DATABASE_URL HOLDFAST_VAR_DIR=var/demo-sources LOG_LEVEL=WARNING $(VENV)/bin/python manage.py demo_sources

test:
	@bash scripts/test.sh $(ARGS)

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .
	$(VENV)/bin/python manage.py makemigrations --check --dry-run

format: bootstrap
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: bootstrap
	$(VENV)/bin/python bench/run.py

# Removes the virtualenv, caches and build output; keeps var/ (local database, secret key).
clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache .hypothesis *.egg-info
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
