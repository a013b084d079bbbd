# jsqueue — two commands do everything on a fresh machine:
#   make run    install, then start the whole queue on an embedded nats-server
#   make test   install, then ruff, mypy (strict) and the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint typecheck pytest tools bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Debian packages the tests drive as real peers (installed only when missing).
tools:
	@command -v swaks >/dev/null || { \
	  echo "installing swaks (Debian package) for the front-end tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq swaks >/dev/null; }

run: install
	$(BIN)/jsqueue up

lint: install
	$(BIN)/ruff check jsqueue tests bench
	$(BIN)/ruff format --check jsqueue tests bench

typecheck: install
	$(BIN)/mypy

pytest: install tools
	$(BIN)/pytest -q

test: lint typecheck pytest

bench: install
	$(BIN)/python bench/ingest.py

clean:
	rm -rf $(VENV) data build *.egg-info
