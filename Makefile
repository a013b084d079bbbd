# jsqueue — two commands do everything on a fresh machine:
#   make run    install, then start the whole queue on an embedded nats-server
#   make test   install, then ruff, mypy (strict) and the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint typecheck pytest deploy-test tools e2e bench bench-ingest nemesis \
  clean cluster

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Debian packages the tests drive as real peers (Postfix, swaks, Chromium, unbound, OpenDKIM),
# given as path:package and installed in one go when their path is missing. Postfix is
# preseeded "No configuration": the system instance gets no main.cf; a policy-rc.d (only
# during the install, when there is none) keeps every service from starting, and unbound and
# OpenDKIM are disabled under systemd. Tests and benchmarks run their own instances.
TOOLS := /usr/bin/swaks:swaks /usr/sbin/postfix:postfix /usr/sbin/smtp-sink:postfix \
  /usr/bin/chromium:chromium /usr/sbin/unbound:unbound /usr/sbin/opendkim:opendkim

tools:
	@missing=$$(for t in $(TOOLS); do test -x "$${t%%:*}" || echo "$${t##*:}"; done | sort -u); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages for the tests and benchmarks:" $$missing; \
	  echo "postfix postfix/main_mailer_type select No configuration" | debconf-set-selections; \
	  rcd=/usr/sbin/policy-rc.d; made=; \
	  if [ ! -e $$rcd ]; then printf '#!/bin/sh\nexit 101\n' > $$rcd; chmod +x $$rcd; made=1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    $$missing >/dev/null; rc=$$?; \
	  if [ -n "$$made" ]; then rm -f $$rcd; fi; \
	  if [ -d /run/systemd/system ]; then systemctl disable unbound opendkim >/dev/null 2>&1; fi; \
	  exit $$rc; fi

run: install
	$(BIN)/jsqueue up

# A local three-node nats-server cluster (client ports 4222-4224, routes 6222-6224, stores
# under data/nats/cluster/); point jsqueue at it with the URLs and replicas it prints.
cluster: install
	$(BIN)/jsqueue nats --cluster

lint: install
	$(BIN)/ruff check jsqueue tests bench deploy
	$(BIN)/ruff format --check jsqueue tests bench deploy
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy

# Most tests wait on real peers (nats-server, MXes, Postfix), so three run at once; those
# marked serial bound a recovery time and run alone afterwards. Both parts always run.
pytest: install tools
	@rc=0; $(BIN)/pytest -q -n 3 -m "not serial" || rc=$$?; \
	$(BIN)/pytest -q -m serial || rc=$$?; exit $$rc

# The image and k8s/ played for real (deploy/kube_play_test.py, root): podman, runc and
# debootstrap installed when missing, a base image made with debootstrap (no registry; cached
# under /var/tmp/jsqueue-deploy), the Dockerfile built, k8s/ played with `podman kube play`
# beside a three-node NATS cluster, kill -9 of a NATS server, a worker and a front end.
deploy-test: install
	$(BIN)/python deploy/kube_play_test.py

# The deployment test and pytest both run (pytest last: its summary closes the output);
# `make test` fails when either fails.
test: lint typecheck
	@rc=0; $(MAKE) --no-print-directory deploy-test || rc=$$?; \
	$(MAKE) --no-print-directory pytest || rc=$$?; exit $$rc

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

# The randomized fault soak on a three-node cluster (bench/README.md, "Fault soak"): NATS
# nodes killed and paused, workers and front ends killed, under load; then the checker.
# E.g. make nemesis NEMESIS_ARGS="--duration 600 --seed 7 --strict". Three minutes of it
# are part of `make pytest` (tests/test_nemesis.py, serial).
nemesis: install
	$(BIN)/python bench/nemesis.py $(NEMESIS_ARGS)

clean:
	rm -rf $(VENV) data build *.egg-info
