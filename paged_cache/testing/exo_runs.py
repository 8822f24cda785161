"""Chats played through exo's real generate path (needs exo importable: Python 3.13 and exo's
checkout, see docs/integration.md): ``mlx_generate`` (exo's sequential runner) or
``ExoBatchGenerator`` (its batching runner), with exo's own ``KVPrefixCache``, paged-cache's
``PagedKVPrefixCache`` or no cache (the cold run). Used by tests/engines/test_exo.py and
benchmarks/exo.py; exo is imported inside the functions only.

The workload: conversations one after another over a shared system prompt, each a first turn,
a second turn (the first, its reply and a new question) and that second turn asked again (a
retry), greedy; ``AGAIN`` adds the first turn asked again last (a prompt that a longer stored
one covers). With ``cancel``, each request is first sent and cancelled as exo's runner cancels
a task (``cancelled``), then sent again. Per request: the reply's tokens, the prompt's tokens,
the cached tokens exo reports (``usage.prompt_tokens_details.cached_tokens``) and MLX's active
memory after it.
"""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

ROUNDS = ("first", "second", "retry")
AGAIN = ROUNDS + ("again",)


@dataclass
class Request:
    conversation: int
    round: str
    prompt_tokens: int
    cached_tokens: int
    reply: list[int]
    active_bytes: int
    cancelled: bool = False   # sent and cancelled once before (``play``'s ``cancel``)


def chat_prompt(system: str, turns: list[tuple[str, str | None]]) -> str:
    """The prompt string of the tiny models' chat template (paged_cache.testing.CHAT_TEMPLATE)
    for a system prompt and (user, assistant reply or None for the turn asked now) pairs."""
    out = f"<|im_start|>system\n{system}<|im_end|>\n"
    for user, reply in turns:
        out += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        if reply is not None:
            out += f"{reply}<|im_end|>\n"
    return out


def filler(seed: int, chars: int) -> str:
    """Deterministic printable text of ``chars`` characters (one token each for the byte
    tokenizer of the tiny models)."""
    words = ("alpha", "bravo", "delta", "gamma", "kilo", "lima", "oscar", "tango", "zulu")
    out, i = [], seed * 7919
    while sum(map(len, out)) < chars:
        out.append(words[(i * 31 + 7) % len(words)] + str(i % 97) + " ")
        i += 1
    return "".join(out)[:chars]


def generate_fn(kind: str, group: Any = None) -> Callable[..., tuple[list[int], int, int]]:
    """``ask(model, tokenizer, cache, task, prompt) -> (reply tokens, prompt tokens, cached
    tokens)`` through exo's ``mlx_generate`` (kind "sequential") or ``ExoBatchGenerator``
    ("batch"), on ``group`` (exo's distributed group of a sharded model; None on one node)."""
    if kind == "sequential":
        from exo.worker.engines.mlx.generator.generate import mlx_generate

        def ask(model: Any, tokenizer: Any, cache: Any, task: Any, prompt: str,
                on_prefill: Callable[[], None] | None = None):
            reply, usage = [], None
            for out in mlx_generate(model=model, tokenizer=tokenizer, task=task, prompt=prompt,
                                    kv_prefix_cache=cache, group=group,
                                    distributed_prompt_progress_callback=on_prefill):
                reply.append(out.token)
                usage = out.usage or usage
            return reply, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens
        return ask
    from exo.worker.engines.mlx.generator.batch_generate import ExoBatchGenerator

    def ask_batch(model: Any, tokenizer: Any, cache: Any, task: Any, prompt: str,
                  on_prefill: Callable[[], None] | None = None):
        gen = ExoBatchGenerator(model=model, tokenizer=tokenizer, group=group,
                                kv_prefix_cache=cache)
        try:
            uid = gen.submit(task, prompt, distributed_prompt_progress_callback=on_prefill)
        except BaseException:
            gen.close()
            raise
        reply, usage = [], None
        while gen.has_work:
            for got, out in gen.step():
                assert got == uid
                reply.append(out.token)
                usage = out.usage or usage
        gen.close()
        return reply, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens
    return ask_batch


def play(model: Any, tokenizer: Any, cache: Any, *, conversations: int, system_chars: int,
         user_chars: int, max_tokens: int, kind: str = "sequential", cold_retry: bool = False,
         rounds: tuple[str, ...] = ROUNDS, cancel: bool = False, group: Any = None,
         on_request: Callable[[Request], None] | None = None) -> list[Request]:
    """Play the workload (module docstring) against ``cache`` (None: no prefix cache).
    ``cold_retry`` (no cache only): a retry is not run again but given its second turn's
    reply (with no cache it is the same computation); ``rounds``: ``ROUNDS`` or ``AGAIN``;
    ``cancel``: every request is cancelled once before it is sent again."""
    from exo.shared.types.common import ModelId
    from exo.shared.types.text_generation import (InputMessage, InputMessageContent,
                                                  TextGenerationTaskParams)

    ask = generate_fn(kind, group)
    task = TextGenerationTaskParams(
        model=ModelId("tiny"), max_output_tokens=max_tokens, temperature=0.0,
        input=[InputMessage(role="user", content=InputMessageContent("-"))])
    system = filler(0, system_chars)
    out: list[Request] = []
    for c in range(conversations):
        history: list[tuple[str, str | None]] = []
        first: list[tuple[str, str | None]] = []
        for round_ in rounds:
            if round_ in ("first", "again"):
                history = first = [(filler(1 + c, user_chars), None)]
            elif round_ == "second":
                history = [history[0], (filler(1000 + c, user_chars // 8), None)]
            prompt = chat_prompt(system, history)
            was_cancelled = cancel and cancelled(ask, model, tokenizer, cache, task, prompt)
            if round_ == "retry" and cold_retry and cache is None:
                reply, n_prompt, cached = out[-1].reply, out[-1].prompt_tokens, 0
            else:
                reply, n_prompt, cached = ask(model, tokenizer, cache, task, prompt)
            if round_ == "first":
                history = [(first[0][0], tokenizer.decode(reply))]
            gc.collect()
            req = Request(c, round_, n_prompt, cached, reply, mx.get_active_memory(),
                          was_cancelled)
            out.append(req)
            if on_request is not None:
                on_request(req)
    return out


def cancelled(ask: Callable[..., Any], model: Any, tokenizer: Any, cache: Any, task: Any,
              prompt: str) -> bool:
    """Send ``prompt`` and cancel it as exo's runner cancels a task: its prefill progress
    callback raises exo's ``PrefillCancelled`` at the first report, after ``get_kv_cache`` and
    before any store. False when no prefill ran to cancel (all but the last token restored):
    the request then ran to its end."""
    from exo.worker.engines.mlx.generator.generate import PrefillCancelled

    def cancel() -> None:
        raise PrefillCancelled()

    try:
        ask(model, tokenizer, cache, task, prompt, on_prefill=cancel)
    except PrefillCancelled:
        return True
    return False


# exo's mlx-lm fork's DeepSeek-V4 (mlx_lm.models.deepseek_v4) at test size: a layer with
# the compressor and indexer (ratio 4) beside one without, a 16-token sliding window, 4 experts
DEEPSEEK_V4 = dict(
    model_type="deepseek_v4", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=1, q_lora_rank=32, o_lora_rank=32, o_groups=2, head_dim=32,
    qk_rope_head_dim=16, sliding_window=16, compress_ratios=[0, 4], index_n_heads=2,
    index_head_dim=16, index_topk=4, moe_intermediate_size=32, n_routed_experts=4,
    n_shared_experts=1, num_experts_per_tok=2, num_hash_layers=0, hc_mult=2,
    hc_sinkhorn_iters=2, num_nextn_predict_layers=0, max_position_embeddings=4096)


def deepseek_v4_dir(path: Path) -> Path:
    """A loadable model directory of ``DEEPSEEK_V4`` (random weights, the tiny models' byte
    tokenizer) at ``path``; needs exo's mlx-lm fork."""
    from mlx.utils import tree_flatten

    from paged_cache.testing import TOKENIZER_VOCAB_SIZE, build_model, write_model_dir

    out = write_model_dir(path, "llama")   # the tokenizer's files; config and weights replaced
    config = dict(DEEPSEEK_V4, vocab_size=TOKENIZER_VOCAB_SIZE)
    weights = dict(tree_flatten(build_model(config).parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in weights}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    eos = json.loads((out / "config.json").read_text())["eos_token_id"]
    (out / "config.json").write_text(json.dumps(dict(config, eos_token_id=eos)))
    return out


def builder_cache_class() -> str:
    """In this process: the class exo's ``MlxBuilder.build`` would make its prefix cache from,
    and, when it is paged-cache's, the hot budget of the manager it opens (what a runner spawned
    under ``paged-cache exo`` reports; tests/engines/test_exo.py)."""
    from exo.worker.engines.mlx import builder

    cls = builder.KVPrefixCache
    name = f"{cls.__module__}.{cls.__qualname__}"
    if hasattr(cls, "setup"):
        name += f" hot={cls(None).manager.config.hot_cache_max_bytes}"
    return name
