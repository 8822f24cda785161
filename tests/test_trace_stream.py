"""The trace loader: prompts share exactly the tokens of their shared leading trace blocks, and a
malformed line names its file and line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import trace_stream

pytestmark = pytest.mark.unit


def test_shared_ids_share_tokens_and_others_do_not():
    first, second = trace_stream.load(limit=2)
    assert first.hash_ids[0] == second.hash_ids[0] and first.hash_ids[1] != second.hash_ids[1]
    a, b = first.tokens(32000), second.tokens(32000)
    assert len(a) == first.input_length and len(b) == second.input_length
    block = trace_stream.TRACE_BLOCK
    assert np.array_equal(a[:block], b[:block])
    assert not np.array_equal(a[block:2 * block], b[block:2 * block])
    assert a.max() < 32000 and a.min() >= 0


def test_the_shipped_trace_is_whole():
    rows = trace_stream.load()
    assert len(rows) == 12031
    assert len({h for r in rows for h in r.hash_ids}) == 182790


def test_another_file_replaces_the_shipped_one(tmp_path, monkeypatch):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"timestamp": 5, "input_length": 600, "output_length": 3,
                                "hash_ids": [7, 9]}) + "\n")
    monkeypatch.setenv(trace_stream.ENV, str(path))
    (only,) = trace_stream.load()
    assert only.timestamp_ms == 5 and only.hash_ids == (7, 9)
    assert np.array_equal(only.tokens(100)[:512], trace_stream.block_tokens(7, 100))


@pytest.mark.parametrize("row, why", [
    ({"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}, "does not fit"),
    ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}, "negative"),
    ({"timestamp": 0, "output_length": 1, "hash_ids": [1]}, "input_length"),
])
def test_a_malformed_line_names_its_place(tmp_path, row, why):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1,
                                "hash_ids": [1]}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{why}"):
        trace_stream.load(path)
