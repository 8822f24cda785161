"""TurboQuantKVCache chains: restored packed (bytes equal), exact logits, codecs never mixed."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import mlx_vlm.turboquant as tq  # the turboquant extra: missing, this module fails
from mlx_lm.generate import generate_step

from paged_cache.handlers import Span, handler_for
from paged_cache.testing.models import VOCAB

from helpers.prefix import assert_exact, hot_prefix, prefill, prompt, store_prompt
from helpers.turboquant import tiny_vlm_llama

pytestmark = pytest.mark.turboquant
BITS = [dict(bits=4), dict(bits=3.5), dict(bits=3, key_bits=2.5)]  # 2.5: a split codec


def _packed_bytes(layer) -> list[bytes]:
    out: dict = {}
    for side in ("keys", "values"):
        tq_state = tq._slice_state(getattr(layer, side), layer.offset)
        from paged_cache.handlers.turboquant import flatten_state
        flatten_state(tq_state, side, out)
    return [np.asarray(out[k]).tobytes() for k in sorted(out)]


@pytest.mark.parametrize("bits,block,dtype", [(BITS[0], 16, mx.float32), (BITS[1], 64, mx.float16),
                                              (BITS[2], 16, mx.bfloat16)])
def test_turboquant_exact_and_packed(bits: dict, block: int, dtype: mx.Dtype) -> None:
    model = tiny_vlm_llama(dtype)
    make = lambda: [tq.TurboQuantKVCache(**bits) for _ in model.layers]  # noqa: E731
    prefix = hot_prefix(model, block, make_cache=make)
    tokens = prompt(3 * block + 5)
    live = make()
    prefill(model, live, tokens, 0, block)
    prefix.store(tokens, live)
    cache, n = prefix.fetch(tokens + [1])
    assert n == len(tokens)
    for got, ref in zip(cache, live):
        assert isinstance(got, tq.TurboQuantKVCache) and got.offset == ref.offset
        assert _packed_bytes(got) == _packed_bytes(ref)  # never dequantized
        assert got.nbytes == ref.nbytes
    for diverge in (2 * block + 3, 2 * block):
        prefix.store(tokens, live)  # the first fetch handed the unshared chain over
        query = tokens[:diverge] + [(tokens[diverge] + 1) % VOCAB] * 7
        assert assert_exact(model, prefix, query) == diverge


def test_turboquant_generate_step() -> None:
    block = 16
    model = tiny_vlm_llama()
    make = lambda: [tq.TurboQuantKVCache(bits=4) for _ in model.layers]  # noqa: E731
    prefix = hot_prefix(model, block, make_cache=make)
    stored = store_prompt(model, prefix, prompt(40))
    query = stored[:37] + [3, 4]
    cache, n = prefix.fetch(query)
    assert n == 37
    cold = make()
    prefill(model, cold, query[:n], 0, block)
    warm = list(generate_step(mx.array(query[n:]), model, prompt_cache=cache, max_tokens=8))
    ref = list(generate_step(mx.array(query[n:]), model, prompt_cache=cold, max_tokens=8))
    assert [t for t, _ in warm] == [t for t, _ in ref]
    assert max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(warm, ref)) == 0.0


def test_split_codecs_of_different_caches_are_never_mixed() -> None:
    block = 16
    model = tiny_vlm_llama()
    handler_blocks = []
    for seed_tokens in (0, 1):  # two caches quantize different data: different split channels
        layer = tq.TurboQuantKVCache(bits=3, key_bits=2.5)
        prefill(model, [layer, tq.TurboQuantKVCache(bits=3, key_bits=2.5)],
                prompt(block, seed=seed_tokens + 3), 0, block)
        handler = handler_for(layer)
        (arrays, desc), = handler.cut(layer, [(0, block)], {}, block)
        handler_blocks.append(desc)
    a, b = handler_blocks
    assert a["codec"]["keys"][1] is True and a["codec_digest"] != b["codec_digest"]
    fresh = tq.TurboQuantKVCache(bits=3, key_bits=2.5)
    handler = handler_for(fresh)
    assert handler.plan(fresh, [Span(0, 16, a), Span(16, 32, a)], 32) == [0, 1]
    assert handler.plan(fresh, [Span(0, 16, a), Span(16, 32, b)], 32) is None


def test_a_turboquant_loan_gives_back_only_the_rows_the_holder_kept() -> None:
    from helpers.loans import changed_then_asked_again, trim_and_extend

    model = tiny_vlm_llama()
    make = lambda: [tq.TurboQuantKVCache(bits=3, key_bits=2.5) for _ in model.layers]  # noqa: E731
    prefix, n = changed_then_asked_again(trim_and_extend, model, make)
    st = prefix.stats()
    assert n == 48 and (st["loan_blocks_returned"], st["loan_blocks_lost"]) == (3, 1)
    prefix.manager.close()
