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
# tests and benchmarks run their own instances from their own config dirs. OpenDKIM's
# service is kept from starting (policy-rc.d while installing; disabled under systemd):
# the DKIM end-to-end test runs its own milter in the foreground.
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
	@# unbound: the validating resolver of the DANE tests, which start their own instance; a
	@# policy-rc.d (only for the install, when none exists) keeps the system service stopped.
	@test -x /usr/sbin/unbound || { \
	  echo "installing unbound (Debian package) for the DANE tests"; \
	  rcd=/usr/sbin/policy-rc.d; made=; \
	  if [ ! -e $$rcd ]; then printf '#!/bin/sh\nexit 101\n' > $$rcd; chmod +x $$rcd; made=1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends unbound >/dev/null; rc=$$?; \
	  if [ -n "$$made" ]; then rm -f $$rcd; fi; exit $$rc; }
	@test -x /usr/sbin/opendkim || { \
	  echo "installing opendkim (Debian package), the DKIM verifier of the end-to-end tests"; \
	  guard=; if [ ! -e /usr/sbin/policy-rc.d ]; then \
	    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; guard=1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq opendkim >/dev/null; \
	  rc=$$?; if [ -n "$$guard" ]; then rm -f /usr/sbin/policy-rc.d; fi; \
	  if [ -d /run/systemd/system ]; then systemctl disable opendkim >/dev/null 2>&1; fi; \
	  exit $$rc; }

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

# End to end with real mail software: swaks -> jsqueue (CLI) -> Postfix MX -> Maildir,
# and with OpenDKIM as the MX's milter verifying jsqueue's DKIM signatures.
# Also part of `make pytest` (tests/test_e2e_postfix.py, tests/test_e2e_dkim.py).
e2e: install tools
	$(BIN)/pytest -q tests/test_e2e_postfix.py tests/test_e2e_dkim.py

# jsqueue side by side with Postfix (same durability, same sink, smtp-source load);
# quick run: make bench BENCH_ARGS="--messages 2000". Results under bench/results/.
bench: install tools
	$(BIN)/python bench/compare.py $(BENCH_ARGS)

bench-ingest: install
	$(BIN)/python bench/ingest.py

clean:
	rm -rf $(VENV) data build *.egg-info
