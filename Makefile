# Two commands do everything on a fresh machine (see README):
#   make build   set up .venv and run `andrea-export build` on its embedded default (ANDREA-120M)
#   make test    set up .venv (and .venv-serve, the serving environment) and run the test suite
#   make test-quick   the same without the heavy tier (full-size builds, real servers, peer exports: pyproject's
#                `heavy` marker, tests/conftest.py): under two minutes on 2 cores, to run while working
# Set-up is idempotent: it reinstalls only when pyproject.toml changed.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# `andrea-export serve` runs Triton from its own environment: nvidia-pytriton pins numpy < 2
SERVE_VENV ?= .venv-serve
# torch 2.13.0 CPU lies on these machines' disk (/opt/wheels); elsewhere pip takes it from PyPI.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: build test test-quick setup serve-env bench-env clean docs docs-serve

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(FIND_LINKS) "torch==2.13.0"
	$(BIN)/pip install -q $(FIND_LINKS) -e ".[rtx,triton,serve,genai,hf,peers,gguf,dev]"
	touch $@

setup: $(BIN)/.installed

$(SERVE_VENV)/bin/.installed: requirements-serve.txt pyproject.toml
	$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip install -q --upgrade pip
	$(SERVE_VENV)/bin/pip install -q -r requirements-serve.txt
	$(SERVE_VENV)/bin/pip install -q --no-deps -e .
	touch $@

serve-env: $(SERVE_VENV)/bin/.installed

# `bench --serve` drives the server with NVIDIA's aiperf, from an environment of its own (not needed by the tests)
.venv-aiperf/bin/.installed:
	$(PYTHON) -m venv .venv-aiperf
	.venv-aiperf/bin/pip install -q "aiperf==0.13.0"
	touch $@

bench-env: .venv-aiperf/bin/.installed

build: setup
	$(BIN)/andrea-export build $(ARGS)

test: setup serve-env
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-quick: setup serve-env
	$(BIN)/python -m pytest -m "not heavy" $(PYTEST_ARGS)

# The manual (docs/, mkdocs.yml) into site/; --strict: a broken link or a missing API name fails it
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve

clean:
	rm -rf $(VENV) $(SERVE_VENV) .venv-aiperf out
