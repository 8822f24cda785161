"""Prefill-rate samples from an engine's own generation loop (prefill_samples.py): mlx-lm's real
BatchGenerator and stream_generate on a tiny model, as vllm-mlx and mlx-openai-server run them."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.generate import BatchGenerator, stream_generate

from paged_cache.integrations.shared import prefill_samples
from paged_cache.integrations.mlx_lm.adapter import PREFILL_SAMPLE_TOKENS
from paged_cache.testing import tiny_model, write_model_dir

pytestmark = pytest.mark.timeout(120)


def test_each_batch_step_that_prefilled_is_one_sample() -> None:
    """Two prompts admitted together: the generator's prefill step is one sample of their
    tokens (all but each one's last, which the first decode step feeds); decode steps give
    none."""
    model = tiny_model("llama")
    got: list[tuple[int, float]] = []
    generator = prefill_samples.metered(BatchGenerator(model, max_tokens=3),
                                        lambda tokens, seconds: got.append((tokens, seconds)))
    generator.insert([list(range(1, 41)), list(range(5, 105))], max_tokens=[3, 3])
    for _ in range(8):
        generator.next()
    assert [tokens for tokens, _ in got] == [39 + 99]
    assert all(seconds > 0 for _, seconds in got)


def test_a_failing_recorder_never_stops_the_generation(caplog) -> None:
    model = tiny_model("llama")

    def broken(tokens: int, seconds: float) -> None:
        raise RuntimeError("no sample today")

    generator = prefill_samples.metered(BatchGenerator(model, max_tokens=2), broken)
    generator.insert([list(range(1, 30))], max_tokens=[2])
    generated = sum(len(generator.next()[1]) for _ in range(6))
    assert generated == 2
    assert "prefill sample of 28 tokens not recorded" in caplog.text


def test_a_stream_gives_the_sample_its_first_response_reports(tmp_path: Path) -> None:
    """stream_generate's prompt tokens over its prompt rate, once per request; none for a prompt
    shorter than PREFILL_SAMPLE_TOKENS; closing the stream closes the engine's."""
    from mlx_lm import load

    model, tokenizer = load(str(write_model_dir(tmp_path / "llama", "llama")))
    got: list[tuple[int, float]] = []
    record = lambda tokens, seconds: got.append((tokens, seconds))  # noqa: E731
    stream = stream_generate(model, tokenizer, list(range(1, 101)), max_tokens=4)
    responses = list(prefill_samples.from_responses(stream, record))
    assert len(responses) == 4 and len(got) == 1
    assert got[0][0] == 100 and got[0][1] == pytest.approx(100 / responses[0].prompt_tps)
    short = stream_generate(model, tokenizer, list(range(1, PREFILL_SAMPLE_TOKENS)),
                            max_tokens=2)
    list(prefill_samples.from_responses(short, record))
    assert len(got) == 1
    inner = stream_generate(model, tokenizer, list(range(1, 101)), max_tokens=50)
    outer = prefill_samples.from_responses(inner, record)
    next(outer)
    outer.close()
    with pytest.raises(StopIteration):
        next(inner)
