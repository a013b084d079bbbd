# jsqueue — two commands do everything on a fresh machine:
#   make run    install, then start the whole queue on an embedded nats-server
#   make test   install, then ruff, mypy (strict) and the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint typecheck pytest tools e2e bench bench-ingest clean cluster

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Debian packages the tests drive as real peers (installed only when missing). Postfix is
# preseeded "No configuration": the system instance gets no main.cf and is never started;
# tests and benchmarks run their own instances from their own config dirs.
tools:
	@command -v swaks >/dev/null && test -x /usr/sbin/postfix -a -x /usr/sbin/smtp-sink || { \
	  echo "installing swaks and postfix (Debian packages) for the tests and benchmarks"; \
	  echo "postfix postfix/main_mailer_type select No configuration" | debconf-set-selections; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    swaks postfix >/dev/null; }
	@test -x /usr/bin/chromium || { \
	  echo "installing chromium (Debian package) for the dashboard's browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    chromium >/dev/null; }

run: install
	$(BIN)/jsqueue up

# A local three-node nats-server cluster (client ports 4222-4224, routes 6222-6224, stores
# under data/nats/cluster/); point jsqueue at it with the URLs and replicas it prints.
cluster: install
	$(BIN)/jsqueue nats --cluster

lint: install
	$(BIN)/ruff check jsqueue tests bench
	$(BIN)/ruff format --check jsqueue tests bench
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy

pytest: install tools
	$(BIN)/pytest -q

test: lint typecheck pytest

# End to end with real mail software: swaks -> jsqueue (CLI) -> Postfix MX -> Maildir.
# Also part of `make pytest` (tests/test_e2e_postfix.py).
e2e: install tools
	$(BIN)/pytest -q tests/test_e2e_postfix.py

# jsqueue side by side with Postfix (same durability, same sink, smtp-source load);
# quick run: make bench BENCH_ARGS="--messages 2000". Results under bench/results/.
bench: install tools
	$(BIN)/python bench/compare.py $(BENCH_ARGS)

bench-ingest: install
	$(BIN)/python bench/ingest.py

clean:
	rm -rf $(VENV) data build *.egg-info
