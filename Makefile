# The only two set-up commands a fresh machine needs: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# A CPU build of torch that lies on the development machines' disk; the package
# itself accepts any torch >= 2.4.
TORCH  ?= torch==2.13.0

.PHONY: run test test-fast test-cluster test-faults lint docs install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/posbench up

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m lint.terminal_output
	$(PY) -m lint.fragments

# The generated parts of the docs (the catalogue tables of docs/encodings.md and
# docs/tasks.md).
docs: $(STAMP)
	$(PY) -m cli.render.catalog docs/encodings.md
	$(PY) -m cli.render.tasks docs/tasks.md

test: $(STAMP) lint
	$(PY) -m pytest -n 2 -q

# A contributor's loop (a couple of minutes): no test that starts real processes (servers,
# browsers, workers, the CLI) or trains for long; `make test` and CI still run everything.
test-fast: $(STAMP)
	$(PY) -m pytest -n 2 -q -m "not slow and not cluster and not faults"

# The compose stack for real (docs/cluster.md#how-the-cluster-is-tested): installs and
# starts a Docker engine where none runs (root, apt), builds the images and brings the
# stack up. .ci/run calls it after `make test`.
test-cluster: $(STAMP)
	$(PY) -m pytest -q -m cluster tests/cluster

# Faults across hosts (docs/service.md#faults): network namespaces joined by veth pairs, a
# core host with PostgreSQL and Redis, worker hosts killed, cut off and restarted
# around it. Needs root (ip netns). .ci/run calls it after the cluster.
test-faults: $(STAMP)
	$(PY) -m pytest -q -s -m faults tests/faults

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
