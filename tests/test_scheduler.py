"""Scheduler without a prefix cache: equals mlx-lm's generate_step; queue, cancel, errors, bounds."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from paged_cache.caches import PreallocatedRotatingKVCache, make_bounded_cache
from paged_cache.scheduler import Scheduler, SnapshotStore
from paged_cache.chunks import next_chunk_end

from helpers.backends import batch_equals_alone

ARCHS = ["llama", "gemma3_text", "qwen3_next", "baichuan_m1"]


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * (7 + salt) + 3 * salt) % 256 for i in range(n)]


def _mlx_greedy(model, prompt, max_tokens, step, cache=None):
    return [t for t, _ in generate_step(mx.array(prompt), model, prompt_cache=cache,
                                        max_tokens=max_tokens, prefill_step_size=step)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [False, None])
def test_generate_equals_mlx_generate_step(models, arch, batch):
    model = models[arch]
    prompt = _prompt(150)
    sched = Scheduler(model, block_size=32, prefill_chunk_size=32, batch_decode=batch)
    assert sched.batch_decode is True if batch is None else not sched.batch_decode
    result = sched.generate(prompt, max_tokens=40)
    assert result.tokens == _mlx_greedy(model, prompt, 40, 32)
    assert (result.finish_reason, result.prompt_tokens, result.cached_tokens) == ("length", 150, 0)
    assert result.ttft_s is not None and result.ttft_s <= result.total_s
    assert sched.stream(prompt, max_tokens=40).__next__() == result.tokens[0]
    assert list(sched.stream(prompt, max_tokens=40)) == result.tokens


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [False, pytest.param(None, marks=batch_equals_alone)])
def test_four_together_equal_one_by_one(models, arch, batch):
    model = models[arch]
    prompts = [_prompt(40 + 23 * k, salt=k) for k in range(4)]
    sched = Scheduler(model, block_size=16, prefill_chunk_size=32, batch_decode=batch)
    one_by_one = [sched.generate(p, max_tokens=30).tokens for p in prompts]
    reqs = [sched.submit(p, max_tokens=30) for p in prompts]
    seen = {r.id: [] for r in reqs}
    while any(not r.done for r in reqs):
        for req, token in sched.step():
            seen[req.id].append(token)
    assert [r.result().tokens for r in reqs] == one_by_one
    assert [seen[r.id] for r in reqs] == one_by_one  # step() reports every token once
    assert sched.stats()["requests_finished"] == 8


def test_stop_tokens_cancel_and_errors(models):
    model = models["qwen3_next"]
    sched = Scheduler(model, block_size=16, prefill_chunk_size=16)
    full = sched.generate(_prompt(50), max_tokens=20).tokens
    stopped = sched.generate(_prompt(50), max_tokens=20, stop_tokens=[full[5]])
    assert stopped.finish_reason == "stop" and stopped.tokens == full[: full.index(full[5]) + 1]

    # cancel while queued, while prefilling and while decoding
    queued_sched = Scheduler(model, block_size=16, prefill_chunk_size=16, max_batch=1)
    a, b = queued_sched.submit(_prompt(100), max_tokens=5), queued_sched.submit(_prompt(60))
    queued_sched.step()
    queued_sched.cancel(b)  # still queued behind a
    queued_sched.cancel(a)  # mid-prefill
    queued_sched.run()
    assert (a.result().finish_reason, b.result().finish_reason) == ("cancelled", "cancelled")
    req = sched.submit(_prompt(20), max_tokens=100)
    while len(req.tokens) < 3:
        sched.step()
    req.cancel()
    sched.step()
    assert req.done and req.result().finish_reason == "cancelled" and req.cache is None

    # closing a stream cancels its request
    stream = sched.stream(_prompt(20), max_tokens=100)
    assert 0 <= next(stream) < 256
    stream.close()
    assert sched.stats()["finished_cancelled"] == 2 and sched.stats()["decoding"] == 0

    # a sampler that fails on its 4th call: the request errors, the other one finishes
    calls = []

    def failing(logprobs: mx.array) -> mx.array:
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("sampler broke")
        return mx.argmax(logprobs, axis=-1)

    bad, good = sched.submit(_prompt(30), sampler=failing), sched.submit(_prompt(50), max_tokens=20)
    sched.run()
    assert bad.result().finish_reason == "error" and "sampler broke" in str(bad.error)
    assert good.result().tokens == full
    with pytest.raises(RuntimeError, match="sampler broke"):
        calls.clear()
        sched.generate(_prompt(30), sampler=failing)
    stats = sched.stats()
    assert stats["finished_error"] == 2 and stats["snapshot_bytes"] == 0 and stats["decoding"] == 0


@pytest.mark.parametrize("batch", [False, True])
def test_bounded_scheduler_matches_mlx_rotating(models, batch):
    """max_kv_size/keep: every KV layer is a window; tokens equal mlx-lm's RotatingKVCache run."""
    model = models["llama"]
    keep = 0 if batch else 4  # BatchRotatingKVCache has no keep rows
    sched = Scheduler(model, block_size=16, prefill_chunk_size=32, max_kv_size=48, keep=keep,
                      preallocate=not batch, batch_decode=batch)
    prompt = _prompt(100)
    ref = _mlx_greedy(model, prompt, 200, 32,
                      cache=make_bounded_cache(model, 48, keep=keep, preallocate=False))
    req = sched.submit(prompt, max_tokens=200)
    while not req.done:
        sched.step()
        if req.cache is not None and not batch:  # the preallocated window, never regrown
            assert all(isinstance(c, PreallocatedRotatingKVCache) and c.keys.shape[2] == 48
                       for c in req.cache)
    assert req.result().tokens == ref


def test_chunk_plan_is_block_aligned():
    # cold: the absolute grid of 64; the last chunk is cut at the last block boundary
    ends, start = [], 0
    while start < 199:
        start = next_chunk_end(start, 199, 16, 64)
        ends.append(start)
    assert ends == [64, 128, 192, 199]
    assert next_chunk_end(80, 199, 16, 64) == 128  # resuming mid-grid ends on the same grid
    assert next_chunk_end(70, 75, 16, 64) == 75    # no boundary left: the rest in one chunk
    assert next_chunk_end(60, 70, 16, 64) == 64
    with pytest.raises(ValueError, match="start"):
        next_chunk_end(10, 10, 16, 64)


class _Snap:
    """A real payload with the two attributes the store reads."""

    def __init__(self, boundary: int, rows: int) -> None:
        self.boundary, self.payload = boundary, mx.zeros((rows, 256), dtype=mx.uint8)

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes


def test_snapshot_store_thins_to_an_even_lattice():
    store = SnapshotStore(max_bytes=4 * 256, unit=16)
    for b in range(1, 9):
        store.add(_Snap(16 * b, 1))
        assert store.nbytes <= store.max_bytes
    assert store.boundaries() == [32, 64, 96, 128]  # every 2nd block boundary (and the newest)
    assert store.dropped == 4 and store.stride == 2
    store.add(_Snap(144, 1))  # the newest is kept even off the lattice: stride doubles
    assert store.boundaries() == [64, 128, 144] and store.stride == 4
    store.add(_Snap(999, 5))  # alone larger than the bound: not kept
    assert 999 not in store.boundaries() and store.nbytes <= store.max_bytes
    taken = store.take()
    assert sorted(taken) == [64, 128, 144] and len(store) == 0 and store.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        SnapshotStore(-1)


@pytest.mark.parametrize("kwargs, name", [
    (dict(prefill_chunk_size=24), "prefill_chunk_size"), (dict(max_batch=0), "max_batch"),
    (dict(max_kv_size=1), "max_kv_size"), (dict(snapshot_max_bytes=-5), "max_bytes"),
    (dict(block_size=0), "block_size"),
])
def test_bad_options_are_named(models, kwargs, name):
    options = dict(block_size=16) | kwargs
    with pytest.raises(ValueError, match=name):
        Scheduler(models["llama"], **options)


def test_bad_requests_are_named(models):
    sched = Scheduler(models["llama"], block_size=16)
    for args, name in [(([],), "prompt_tokens"), ((["a"],), "prompt_tokens"),
                       (([1, -2],), "prompt_tokens"), (([1], 0), "max_tokens"),
                       (([1], 4, None, [1.5]), "stop_tokens"), (([1], 4, "greedy"), "sampler")]:
        with pytest.raises(ValueError, match=name):
            sched.submit(*args)
    assert sched.stats()["requests_submitted"] == 0
    with pytest.raises(ValueError, match="batch_decode"):
        Scheduler(models["llama"], block_size=16, max_kv_size=64, keep=4, batch_decode=True)
    with pytest.raises(ValueError, match="batch_decode"):  # preallocated windows come back plain
        Scheduler(models["llama"], block_size=16, max_kv_size=64, keep=0, batch_decode=True)
