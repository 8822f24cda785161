# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
# `make test-lowest` runs the suite against the lowest supported mlx-lm / mlx-vlm (.ci/lowest.txt).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
LOWEST  ?= .venv-lowest
LOW_STAMP = $(LOWEST)/.installed

.PHONY: install server demo test test-long test-lowest bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev,turboquant,remote]"
	touch $(STAMP)

$(LOW_STAMP): pyproject.toml .ci/lowest.txt
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/pip install --quiet --upgrade pip
	$(LOWEST)/bin/pip install --quiet -c .ci/lowest.txt ".[dev,turboquant,remote]"
	touch $(LOW_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/paged-cache demo

# The remote tier's tests need valkey-server or redis-server on PATH: installed here when missing
# (apt-get: valkey-server where the distribution has it, else redis-server; macOS: brew). Fails,
# never skips, when neither can be had.
server:
	@if command -v valkey-server >/dev/null 2>&1 || command -v redis-server >/dev/null 2>&1; then \
		exit 0; \
	elif command -v apt-get >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		{ $$SUDO apt-get install -y -qq valkey-server >/dev/null 2>&1 || \
		  $$SUDO apt-get install -y -qq redis-server >/dev/null; }; \
	elif command -v brew >/dev/null 2>&1; then \
		brew install valkey; \
	fi; \
	command -v valkey-server >/dev/null 2>&1 || command -v redis-server >/dev/null 2>&1 || \
		{ echo "make server: cannot install valkey-server or redis-server; install one" >&2; exit 1; }

test: $(STAMP) server
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-long: $(STAMP) server
	$(BIN)/python -m pytest -q --long $(PYTEST_ARGS)

test-lowest: $(LOW_STAMP) server
	$(LOWEST)/bin/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP) server
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) $(LOWEST) build *.egg-info
