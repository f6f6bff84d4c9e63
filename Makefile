# Two commands do everything on a fresh machine: `make run` and `make test`.
# Each creates .venv (python3 -m venv) and installs the project with its test extra.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PACKAGES := lanehost capabilities machine supervisor api node kubeplugin
# Test workers (pytest-xdist); each gets cgroups of its own (tests/worker_cgroups.py).
PYTEST_WORKERS ?= 2

.PHONY: run test lint typecheck pytest bench contracts protos certify-gpu clean system-run system-test

# Debian packages pip cannot bring: the guest sandbox, the setuid helpers that map a
# normal user's subordinate uids for `dev` guests, and a browser for the page test.
system-run:
	sh scripts/system-packages bwrap:bubblewrap newuidmap:uidmap

system-test:
	sh scripts/system-packages bwrap:bubblewrap newuidmap:uidmap chromium:chromium

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Every confined guest's first exec (supervisor/gate.py); without a C compiler guests
# start through sh and setpriv instead.
GATE := $(BIN)/litegraph-gate
$(GATE): native/litegraph-gate.c $(STAMP)
	sh scripts/build-gate $(GATE)

run: $(STAMP) $(GATE) system-run
	$(BIN)/litegraph-node dev

test: $(STAMP) lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy $(PACKAGES) bench

# The suite starts a few hundred Python processes (daemons, CLIs, lane hosts); compiled
# once here, they read the bytecode even where PYTHONDONTWRITEBYTECODE is set.
pytest: $(STAMP) $(GATE) system-test
	$(BIN)/python -m compileall -q -j 0 $(PACKAGES) tests bench scripts >/dev/null
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS)

bench: $(STAMP) $(GATE)
	$(BIN)/python -m bench.run_all

contracts: $(STAMP)
	$(BIN)/litegraph-node contracts

# kubeplugin's gRPC stubs from its .proto contracts (a test checks them for drift).
protos: $(STAMP)
	PYTHON=$(BIN)/python sh scripts/generate-protos .

# On a machine with an NVIDIA GPU: one PASS/FAIL line per check in certify-results/.
# DEVICES=sim is the dry run; WHEELS=dir installs offline from a folder of wheels.
certify-gpu: $(STAMP) $(GATE) system-run
	sh scripts/certify-gpu

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .hypothesis *.egg-info
