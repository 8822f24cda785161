# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: install demo test test-long bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev,turboquant]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/paged-cache demo

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-long: $(STAMP)
	$(BIN)/python -m pytest -q --long $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) build *.egg-info
