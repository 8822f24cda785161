"""The defaults the docs quote are the code's: configuration.md's table of fields and its
`paged-cache config` example against ``CacheConfig`` and the command itself, and each default
docs/guide.md and docs/cli.md state in prose against the constant that sets it. A changed default
fails here until the docs say the new one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from paged_cache import CacheConfig
from paged_cache.cli.demo import DEFAULT_OUTPUT
from paged_cache.cli.main import LOG_LEVEL_DEFAULT
from paged_cache.cli.options import HIDDEN_FIELDS
from paged_cache.cli.stats_cmd import DEFAULT_URL
from paged_cache.config import (HOT_DEFAULT_CAP, HOT_FALLBACK, HOT_RAM_SHARE, QUEUE_DEFAULT,
                                READ_THREADS_DEFAULT, SSD_AUTO_SHARE, default_ssd_dir,
                                format_size, parse_size)
from paged_cache.testing.real_model import default_models_dir
from helpers.cli import run_cli

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parent.parent / "docs"
FRACTIONS = {"half": 0.5, "a quarter": 0.25}
# Defaults no constant states alone: the table describes how they are derived.
DERIVED = {"hot_cache_max_bytes", "ssd_dir"}
# `config` lines that depend on the machine: its home directory and free space.
MACHINE_LINES = {"ssd_dir", "ssd_max_bytes"}


def defaults() -> dict:
    """Every field's default as the code has it (``CacheConfig()`` built from defaults alone)."""
    return CacheConfig().to_dict()


def fields_table() -> dict[str, str]:
    """configuration.md's table of fields: field -> its default column."""
    text = (DOCS / "configuration.md").read_text()
    table = text.split("## Fields", 1)[1].split("\n\n", 2)[1]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    return {row[0].strip("| `"): row[1] for row in rows}


def quoted(cell: str, default: object, field: str) -> object:
    """The value a table cell states, read as the type of the code's default."""
    literal = re.match(r"`([^`]*)`", cell)
    if default is None:
        return None if cell.startswith("none") else cell
    if field.endswith("_bytes") and not literal:
        return parse_size(cell, field)
    assert literal, f"{field}: no `value` in {cell!r}"
    return ast.literal_eval(literal[1])


def test_the_fields_table_lists_every_user_setting_with_its_default() -> None:
    table, code = fields_table(), defaults()
    assert set(table) == set(code) - set(HIDDEN_FIELDS), "configuration.md's table of fields"
    for field, cell in table.items():
        if field not in DERIVED:
            assert quoted(cell, code[field], field) == code[field], (field, cell)
    assert table["hot_cache_max_bytes"].startswith(
        f"1/{round(1 / HOT_RAM_SHARE)} of physical RAM, at most {format_size(HOT_DEFAULT_CAP)} "
        f"({format_size(HOT_FALLBACK)} if RAM cannot be read)")
    assert f"/{default_ssd_dir().name}`" in table["ssd_dir"]


def test_the_config_example_is_what_config_prints(monkeypatch) -> None:
    """configuration.md's example, line by line (spaces aside), but for the home directory and
    the free space of the machine it ran on."""
    text = (DOCS / "configuration.md").read_text()
    block = text.split("## `paged-cache config`", 1)[1].split("```\n", 2)[1]
    command, *shown = block.strip().splitlines()
    env, _, flags = command.removeprefix("$ ").partition(" paged-cache config ")
    monkeypatch.setenv(*env.split("="))
    monkeypatch.delenv("COLUMNS", raising=False)
    status, out, _ = run_cli("config", *flags.split())
    assert status == 0
    printed = {line.split()[0]: line.split() for line in out.splitlines()}
    example = {line.split()[0]: line.split() for line in shown}
    assert list(example) == list(printed)
    for field in set(example) - MACHINE_LINES:
        assert example[field] == printed[field], field


# docs/guide.md and docs/cli.md: (document, what the prose says, the code's value)
PROSE = [
    ("guide.md", r"`--ssd-read-threads`\): (\d+) by default", str(READ_THREADS_DEFAULT)),
    ("guide.md", r"`--write-queue-max-bytes`, ([\d.]+ [KMG]iB)\)", format_size(QUEUE_DEFAULT)),
    ("guide.md", r"`--block-size` tokens \((\d+) by default\)", str(CacheConfig().block_size)),
    ("guide.md", r"`--fetch-policy`, default `([\w-]+)`", CacheConfig().fetch_policy),
    ("guide.md", r"default hot budget \((1/\d+ of RAM, at most \d+ GiB)\)",
     f"1/{round(1 / HOT_RAM_SHARE)} of RAM, at most {format_size(HOT_DEFAULT_CAP)}"),
    ("guide.md", r"`--ssd-max-bytes`, default (\w+) of the disk's free space", SSD_AUTO_SHARE),
    ("guide.md", r"`--ssd-max-bytes`, (\w+) the free space by default", SSD_AUTO_SHARE),
    ("guide.md", r"under `--output`, default `\./([\w-]+)`", str(DEFAULT_OUTPUT)),
    ("guide.md", r"into `--cache-dir`, default\s+`~/\.cache/([\w-]+)`", None),
    ("cli.md", r"paged-cache's loggers, default `(\w+)`", LOG_LEVEL_DEFAULT),
    ("cli.md", r"\(default URL `([^`]+)`", DEFAULT_URL),
]


@pytest.mark.parametrize("document, said, value", PROSE, ids=[p[1][:40] for p in PROSE])
def test_defaults_the_prose_states(document: str, said: str, value: object, monkeypatch) -> None:
    if value is None:  # the models' directory: its name (the home directory is the reader's)
        monkeypatch.delenv("PAGED_CACHE_MODELS_DIR", raising=False)
        value = default_models_dir().name
    found = re.findall(said, (DOCS / document).read_text())
    assert found, f"{document} no longer says {said!r}: update this test with it"
    for quote in found:
        assert FRACTIONS.get(quote, quote) == value, (document, quote, value)
