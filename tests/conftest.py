"""Shared pytest options: `--long` runs the long soak / crash / fuzz variants."""

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="run the long soak/crash/fuzz versions of the reliability tests")


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
