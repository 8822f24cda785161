"""The trace replay (benchmarks/trace_replay.py) on the first few hundred requests of the shipped
trace: every restored row is exactly what its tokens give, the real prefix cache over the real
hot tier serves exactly what its documented eviction order serves (simulated apart from the
code), and the bounds sit where they must."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from benchmarks import trace_replay, trace_sim
from benchmarks.trace_stream import load

REQUESTS = 300
CAPACITY = 250_000   # tokens: about 490 blocks, so the replay evicts all along


@pytest.fixture(scope="module")
def requests():
    return load(limit=REQUESTS)


@pytest.fixture(scope="module")
def layout_model():
    return trace_replay.model()


def test_the_replay_matches_the_documented_order_with_every_row_exact(tmp_path, requests,
                                                                     layout_model):
    replay = trace_replay.Replay(trace_replay.config_for("ram", CAPACITY, tmp_path),
                                 layout_model)
    try:
        counts = replay.run(requests)   # a restored row that differs raises Mismatch
        hot = replay.manager.stats()["hot"]
    finally:
        replay.close()
    blocks = trace_sim.Blocks.of(requests)
    assert counts.requests == REQUESTS and counts.blocks_requested == blocks.requested
    assert hot["evictions"] > 1000 and hot["bytes"] <= CAPACITY * trace_replay.TOKEN_BYTES
    assert counts.blocks_served > 200 and counts.tokens_checked > 100_000
    assert counts.by_tier == {"hot": counts.blocks_served}
    expected = trace_sim.documented(blocks, CAPACITY)
    assert counts.hit_ratio == pytest.approx(expected, rel=0.01)
    assert expected <= trace_sim.belady(blocks, CAPACITY) <= trace_sim.infinite(blocks)


def test_the_hot_tier_alone_serves_what_the_simulation_serves(requests):
    blocks = trace_sim.Blocks.of(requests)
    for capacity in (CAPACITY, 1_000_000):
        assert trace_sim.through_hot_tier(blocks, capacity) == \
            trace_sim.documented(blocks, capacity)


def test_a_restored_row_that_differs_is_caught(tmp_path, requests, layout_model):
    replay = trace_replay.Replay(trace_replay.config_for("ram", CAPACITY, tmp_path),
                                 layout_model)
    try:
        first, second = requests[:2]     # the second shares the first's leading block
        replay.request(first)
        tokens = second.tokens(trace_replay.VOCAB)
        cache, n = replay.cache.fetch(tokens)
        assert n == trace_replay.served_blocks(second, n) * 512 > 0
        replay._check(cache, tokens[:n], second)   # as stored: no complaint
        values = np.array(cache[0].values)
        values[0, 0, n - 1, 0] += 1      # one restored value off by one
        cache[0].values = mx.array(values)
        with pytest.raises(trace_replay.Mismatch, match=f"trace request {second.index}"):
            replay._check(cache, tokens[:n], second)
    finally:
        replay.close()


def test_an_id_with_two_parents_is_refused(requests):
    a, b = requests[:2]
    forged = type(b)(b.index, b.timestamp_ms, b.input_length, b.output_length,
                     (b.hash_ids[0] + 10**9, *b.hash_ids[1:]))
    with pytest.raises(ValueError, match=f"trace request {b.index}: block id"):
        trace_sim.Blocks.of([a, b, forged])
