"""The benchmark tables of README.md and docs/*.md are what benchmarks/doc_tables.py generates
from benchmarks/results/*.json: a table that drifted from its JSON fails here (rewrite it with
``python -m benchmarks.doc_tables``)."""

from __future__ import annotations

import json

import pytest

from benchmarks import doc_tables

pytestmark = pytest.mark.unit

# document -> the fewest table blocks it holds (so that a lost marker cannot pass unnoticed)
TABLED = {"docs/benchmarks.md": 9}


def test_every_table_equals_its_rendering_from_the_json() -> None:
    differ = doc_tables.rewrite(check=True)
    assert not differ, (f"tables differ from benchmarks/results/*.json in "
                        f"{', '.join(p.name for p in differ)}: run `python -m benchmarks.doc_tables`")
    for document, fewest in TABLED.items():
        blocks = doc_tables.BLOCK.findall((doc_tables.ROOT / document).read_text())
        assert len(blocks) >= fewest, f"only {len(blocks)} bench-table blocks in {document}"


def test_a_table_edited_by_hand_is_regenerated() -> None:
    text = (doc_tables.ROOT / "docs/benchmarks.md").read_text()
    block = next(m for m in doc_tables.BLOCK.finditer(text) if m["spec"] == "policy:tiny")
    assert "| 1 MiB/s |" in block["body"]
    edited = block[0].replace("| 1 MiB/s |", "| 1 MiB/s (edited) |")
    assert doc_tables.refresh(edited) == block[0] != edited


def test_any_family_is_tabled_and_a_bad_marker_names_its_problem(tmp_path) -> None:
    figure = dict(family="exo", name="TTFT ssd hit vs cold prefill, 2 hosts", ratio=12.5,
                  ratio_meaning="cold TTFT / hit TTFT", measured=0.08, baseline=1.0, unit="s",
                  goal=None, goal_op=None, met=None, spread=0.1, details={})
    (tmp_path / "exo.json").write_text(json.dumps(
        {"figures": [figure], "quick": False,
         "machine": {"backend": "metal", "mlx": "0.32.4", "date": "2026-11-28",
                     "cpus": 10, "load_average": [1.5, 1.0, 0.5]}}))
    table = doc_tables.render("exo", tmp_path)
    assert table.startswith("*`benchmarks/results/exo.json`: full run of 2026-11-28, MLX 0.32.4 "
                            "metal backend, 10 CPUs, load average 1.5 at its start.*")
    assert "| exo | TTFT ssd hit vs cold prefill, 2 hosts | 80 ms | 1 s | 12.5 |" in table
    with pytest.raises(ValueError, match="no .*nothing.json"):
        doc_tables.render("nothing", tmp_path)
    with pytest.raises(ValueError, match="draws no table 'rates'.*it draws: tiny, 8b"):
        doc_tables.render("policy:rates")
