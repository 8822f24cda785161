# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
# `make test-lowest` runs the suite against the lowest supported mlx and mlx-lm (.ci/lowest.txt),
# and the tests marked turboquant against the lowest mlx-vlm (.ci/lowest-turboquant.txt).
# pip prints each package it collects (no --quiet): a first install takes minutes and shows it.
# `make test-engines` runs tests/engines against serving engines from the package registry, each
# in its own environment .venv-engine-NAME (.ci/engines/NAME.engine + NAME.txt).
# Pythons (.ci/python finds each, the interpreter's own path): `make demo` / `make test` on the
# newest supported one, 3.13, where the machine has it (else it says so loudly and uses 3.11); the
# lowest and engine lanes on 3.11 (mlx-openai-server needs Python < 3.13). Set PYTHON /
# PYTHON_LOW to choose others; `make clean` first when .venv was made by another Python.
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell sh .ci/python 3.13 3.11)
endif
ifeq ($(origin PYTHON_LOW),undefined)
PYTHON_LOW := $(shell sh .ci/python 3.11)
endif
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
DEMO_STAMP = $(VENV)/.installed-demo
LOWEST  ?= .venv-lowest
LOW_STAMP = $(LOWEST)/.installed
LOWEST_TQ ?= .venv-lowest-turboquant
LOW_TQ_STAMP = $(LOWEST_TQ)/.installed
# mlx-vlm below the turboquant extra's range (.ci/old-mlx-vlm.txt: exo's lock), alone (no
# dependencies): tests/test_optional_versions.py puts it first on sys.path of a paged-cache
# import, which must turn the TurboQuant handler off and nothing else.
OLD_VLM = .venv-old-mlx-vlm
OLD_VLM_STAMP = $(OLD_VLM)/.installed
PIP_INSTALL = pip install --progress-bar on --disable-pip-version-check
# MLX's backend on Linux (the extra of the same name): the demo and the tests run on the CPU.
BACKEND ?= cpu
# The suite runs on every core (pytest-xdist), each test file on one worker (its module-scoped
# servers and models are built once); TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= auto
XDIST = -n $(TEST_WORKERS) --dist loadfile
# `make test-gpu`: a Python that already has MLX with a GPU backend and paged-cache's test tools.
GPU_PYTHON ?= $(PYTHON)
GPU_RESULTS ?= benchmarks/results/gpu
GPU_TESTS = tests/test_prefix_cache.py tests/test_restore_paths.py tests/test_row_path.py \
	tests/test_loans.py tests/test_handlers.py tests/test_prefix_cache_tiers.py \
	tests/test_window_order.py tests/test_reuse_checkpoints.py tests/test_scheduler.py \
	tests/test_prefix_cache_memory.py tests/test_fetch_both.py

ENGINES ?= vllm-mlx openai-server

.PHONY: install server demo test test-long test-lowest test-engines test-gpu bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The demo needs the library and matplotlib (its plot) only: no test tools, no mlx-vlm.
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	@echo "make demo: installing paged-cache, mlx, mlx-lm and matplotlib into $(VENV)"
	$(BIN)/$(PIP_INSTALL) -e ".[plot,$(BACKEND)]"
	touch $(DEMO_STAMP)

# Everything the tests need: the test tools, the turboquant (mlx-vlm) and remote extras, and the
# out-of-range mlx-vlm of the optional-versions test.
$(STAMP): pyproject.toml | $(BIN)/python
	@echo "make test: installing paged-cache with its test tools and every extra into $(VENV)"
	$(BIN)/$(PIP_INSTALL) -e ".[dev,turboquant,remote,$(BACKEND)]"
	touch $(STAMP) $(DEMO_STAMP)

$(OLD_VLM_STAMP): .ci/old-mlx-vlm.txt | $(BIN)/python
	rm -rf $(OLD_VLM)
	$(BIN)/pip install --quiet --no-deps --target $(OLD_VLM) -r .ci/old-mlx-vlm.txt
	touch $(OLD_VLM_STAMP)

# The lowest lane: mlx and mlx-lm of .ci/lowest.txt, every extra the tests need but turboquant
# (its mlx-vlm needs a higher mlx: the tests marked turboquant are left out there, and the module
# that imports mlx-vlm to be collected); those tests in their own environment at that extra's
# floor (.ci/lowest-turboquant.txt).
$(LOW_STAMP): pyproject.toml .ci/lowest.txt
	$(PYTHON_LOW) -m venv $(LOWEST)
	$(LOWEST)/bin/pip install --quiet --upgrade pip
	$(LOWEST)/bin/$(PIP_INSTALL) -c .ci/lowest.txt ".[dev,remote,$(BACKEND)]"
	touch $(LOW_STAMP)

$(LOW_TQ_STAMP): pyproject.toml .ci/lowest-turboquant.txt
	$(PYTHON_LOW) -m venv $(LOWEST_TQ)
	$(LOWEST_TQ)/bin/pip install --quiet --upgrade pip
	$(LOWEST_TQ)/bin/pip install --quiet -c .ci/lowest-turboquant.txt ".[dev,turboquant,remote,$(BACKEND)]"
	touch $(LOW_TQ_STAMP)

# An engine's environment: paged-cache (editable) with its test extras and the modules the
# engine's serving path imports, within the engine's own ranges (NAME.txt, which also holds the
# engine's mlx-lm range); then the engine itself, without its dependencies (NAME.engine).
.venv-engine-%/.installed: pyproject.toml .ci/engines/%.txt .ci/engines/%.engine
	$(PYTHON_LOW) -m venv .venv-engine-$*
	.venv-engine-$*/bin/pip install --quiet --upgrade pip
	.venv-engine-$*/bin/pip install --quiet -e ".[dev,remote,$(BACKEND)]" -r .ci/engines/$*.txt
	.venv-engine-$*/bin/pip install --quiet --no-deps -r .ci/engines/$*.engine
	touch $@

install: $(STAMP) $(OLD_VLM_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/paged-cache demo

# The remote tier's tests need valkey-server or redis-server on PATH: installed here when missing
# (apt-get: valkey-server where the distribution has it, else redis-server; macOS: brew). Fails,
# never skips, when neither can be had. These packages are built with TLS, which the TLS tests
# need (tests/test_remote_auth.py fails naming it on a server without).
server:
	@if command -v valkey-server >/dev/null 2>&1 || command -v redis-server >/dev/null 2>&1; then \
		exit 0; \
	elif command -v apt-get >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "make server: installing valkey-server (else redis-server) with apt-get for the remote tier's tests"; \
		$$SUDO apt-get update -qq && \
		{ $$SUDO apt-get install -y -qq valkey-server >/dev/null 2>&1 || \
		  $$SUDO apt-get install -y -qq redis-server >/dev/null; }; \
	elif command -v brew >/dev/null 2>&1; then \
		echo "make server: installing valkey with brew for the remote tier's tests"; \
		brew install valkey; \
	fi; \
	command -v valkey-server >/dev/null 2>&1 || command -v redis-server >/dev/null 2>&1 || \
		{ echo "make server: cannot install valkey-server or redis-server; install one" >&2; exit 1; }
	@# The metrics tests check /metrics with promtool and scrape a server with a real Prometheus
	@# (tests/test_prometheus.py): Debian's prometheus package brings both; macOS: brew.
	@if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then \
		exit 0; \
	elif command -v apt-get >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "make server: installing prometheus (and promtool) with apt-get for the metrics tests"; \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq prometheus >/dev/null; \
	elif command -v brew >/dev/null 2>&1; then \
		echo "make server: installing prometheus with brew for the metrics tests"; \
		brew install prometheus; \
	fi; \
	command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || \
		{ echo "make server: cannot install prometheus and promtool; install them" >&2; exit 1; }

test: $(STAMP) $(OLD_VLM_STAMP) server
	@echo "make test: running the suite on $$($(BIN)/python --version) (pytest prints a dot per test)"
	$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-long: $(STAMP) $(OLD_VLM_STAMP) server
	$(BIN)/python -m pytest -q $(XDIST) --long $(PYTEST_ARGS)

test-lowest: $(LOW_STAMP) $(LOW_TQ_STAMP) $(OLD_VLM_STAMP) server
	$(LOWEST)/bin/python -m pytest -q $(XDIST) -m "not turboquant" \
		--ignore tests/test_prefix_cache_turboquant.py $(PYTEST_ARGS)
	$(LOWEST_TQ)/bin/python -m pytest -q $(XDIST) -m turboquant $(PYTEST_ARGS)

test-engines: $(foreach e,$(ENGINES),.venv-engine-$(e)/.installed) server
	@for e in $(ENGINES); do \
		echo "== engine $$e"; \
		.venv-engine-$$e/bin/python -m pytest -q tests/engines --engine $$e $(PYTEST_ARGS) || exit 1; \
	done

# The GPU lane, on a machine whose MLX runs on a GPU (Metal; CUDA: mlx[cuda13]): the model-level
# tests with the GPU as the default device (so the device row path), then the restore and scale
# families, whose JSON (in $(GPU_RESULTS)) names the backend and the row path.
test-gpu:
	$(GPU_PYTHON) -c "import mlx.core as mx, sys; d = mx.default_device(); \
		sys.exit(None if d.type == mx.DeviceType.gpu else f'make test-gpu: the default device is {d}, not a GPU: install MLX with a GPU backend (pip install \"mlx[cuda13]\" on Linux with an NVIDIA card; a Mac has Metal)')"
	$(GPU_PYTHON) -m pytest -q -p no:cacheprovider $(GPU_TESTS) --junitxml=$(GPU_RESULTS)/tests.xml $(PYTEST_ARGS)
	$(GPU_PYTHON) -m benchmarks.run --only restore --only scale --results $(GPU_RESULTS)

bench: $(STAMP) server
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) $(LOWEST) $(OLD_VLM) .venv-engine-* build *.egg-info
