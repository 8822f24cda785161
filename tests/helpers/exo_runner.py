"""An exo runner process restated for the default suite (no exo): a spawned interpreter that
opens the manager the launcher's environment configures, serves two requests through
``ExoPrefixCache`` as exo's ``mlx_generate`` calls it (tests/helpers/exo_calls.py), and stays
up until told to stop, so its metrics endpoint can be scraped."""

from __future__ import annotations

import os
from typing import Any

PROMPT = [(i * 37 + 11) % 251 + 1 for i in range(80)]


def serve_two_requests(environ: dict[str, str], ready: Any, done: Any,
                       endpoints: Any = None) -> None:
    """Run as a spawned runner under ``environ``: two requests of one prompt (the second a hit),
    then the metrics URLs its stats list go to the queue ``endpoints`` (when given) and
    ``ready`` is set; wait (at most 120 s) for ``done``."""
    os.environ.update(environ)
    from mlx_lm.models.cache import make_prompt_cache

    from helpers import exo_calls
    from paged_cache.integrations.exo.prefix import ExoPrefixCache
    from paged_cache.integrations.exo.settings import process_manager
    from paged_cache.testing.models import tiny_model

    model = tiny_model("llama")
    kv = ExoPrefixCache()
    kv.setup(process_manager(), group=None, make_cache=lambda m: make_prompt_cache(m),
             cache_length=exo_calls.cache_length)
    for _ in range(2):
        exo_calls.mlx_generate(model, kv, lambda: make_prompt_cache(model), PROMPT, 3)
    if endpoints is not None:
        from paged_cache.integrations.shared.stats_http import stats_document
        endpoints.put(stats_document({})["paged_cache"].get("metrics_endpoints"))
    ready.set()
    done.wait(120)
