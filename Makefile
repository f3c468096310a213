# bdstack: `make demo` runs the main job on an embedded default, `make test` runs lint + tests.
# Both create .venv and install into it (torch pinned to 2.13.0, installed first so no other package
# pulls a CUDA build).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bdstack-installed

.PHONY: venv test lint demo bench clean

venv: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -r requirements-dev.txt
	@touch $@

lint: venv
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest

demo: venv
	$(PY) -m benchmark.train_step

bench: demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
