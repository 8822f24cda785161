"""Every figure the README and the docs (QUOTING) quote from a benchmark's JSON in their prose
equals that JSON at the rounding shown (the docs' tables are generated: tests/test_doc_tables.py).

A quoted figure is marked by an HTML comment right after it, naming the family, the figure and
its field: ``17 MiB<!-- bench peers "resident bytes, ..." measured -->``. The number before the
comment (with its unit: x, us, ms, s, KiB, MiB, GiB or none) is compared with
``benchmarks/results/<family>.json``; a marker that names no figure fails, as does a document
whose markers are gone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKED = re.compile(
    r"(?P<number>\d[\d,]*(?:\.\d+)?)\s?(?P<unit>x|us|ms|s|KiB|MiB|GiB)?"
    r"<!-- bench (?P<family>\w+) \"(?P<figure>[^\"]+)\" (?P<field>ratio|measured|baseline) -->")
ANY_MARKER = re.compile(r"<!-- bench ")
# README unit -> (the JSON unit it converts from, factor): the JSON keeps seconds and bytes.
SCALES = {"us": ("s", 1e6), "ms": ("s", 1e3), "s": ("s", 1.0), "KiB": ("B", 2.0 ** -10),
          "MiB": ("B", 2.0 ** -20), "GiB": ("B", 2.0 ** -30)}
# document -> the fewest marked figures it holds (so a lost marker cannot pass unnoticed)
QUOTING = {"README.md": 25, "docs/benchmarks.md": 15, "docs/fetch-plan.md": 7, "docs/guide.md": 4,
           "docs/integration.md": 8}


def figures(family: str) -> dict[str, dict]:
    """The figures of one family's JSON by name."""
    path = RESULTS / f"{family}.json"
    assert path.is_file(), f"README quotes family {family!r}, but {path} does not exist"
    return {f["name"]: f for f in json.loads(path.read_text())["figures"]}


def shown(value: float, number: str) -> bool:
    """Whether ``value`` rounds to ``number`` (as written, commas allowed) at its decimals."""
    text = number.replace(",", "")
    decimals = len(text.partition(".")[2])
    return abs(value - float(text)) <= 0.5 * 10.0 ** -decimals + 1e-9


def marks(text: str) -> list[re.Match]:
    found = list(MARKED.finditer(text))
    assert len(found) == len(ANY_MARKER.findall(text)), (
        "a `<!-- bench` marker is not of the form "
        "NUMBER[unit]<!-- bench FAMILY \"FIGURE\" ratio|measured|baseline -->")
    return found


@pytest.mark.unit
@pytest.mark.parametrize("document", sorted(QUOTING))
def test_every_marked_figure_matches_its_benchmark_json(document: str) -> None:
    found = marks((ROOT / document).read_text())
    assert len(found) >= QUOTING[document], f"only {len(found)} marked figures in {document}"
    wrong = []
    for m in found:
        figure = figures(m["family"]).get(m["figure"])
        assert figure is not None, f"{m['family']}.json has no figure {m['figure']!r}"
        value, unit = figure[m["field"]], m["unit"] or ""
        if unit in SCALES:
            source, factor = SCALES[unit]
            assert figure["unit"] == source, (
                f"{m.group(0)}: quoted in {unit}, but the JSON's unit is {figure['unit']!r}")
            value *= factor
        if not shown(value, m["number"]):
            wrong.append(f"{m['family']} {m['figure']!r} {m['field']}: {document} says "
                         f"{m['number']}{unit}, the JSON {value:.4g}{unit}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.unit
def test_a_figure_that_differs_from_its_json_is_found() -> None:
    name = "TTFT ssd hit vs cold prefill, 16k tokens"
    ratio = figures("ttft")[name]["ratio"]
    good = f'{ratio:.0f}x<!-- bench ttft "{name}" ratio -->'
    bad = f'{ratio * 1.1:.0f}x<!-- bench ttft "{name}" ratio -->'
    assert shown(ratio, marks(good)[0]["number"])
    assert not shown(ratio, marks(bad)[0]["number"])
    with pytest.raises(AssertionError, match="not of the form"):
        marks(f'{ratio:.0f}x <!-- bench ttft {name} ratio -->')
