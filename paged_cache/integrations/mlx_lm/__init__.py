"""mlx_lm.server integration: the drop-in prompt cache (``adapter``, the requests it serves in
``open_requests``, its inserts kept whole in ``deferred``, the sequences it holds in RAM in
``sequences``), how a server model key becomes a model binding (``binding``) and the patch
point plus ``paged-cache serve`` (``server``). See docs/integration.md."""

from paged_cache.integrations.mlx_lm.adapter import PagedPromptCache
from paged_cache.integrations.mlx_lm.open_requests import MAX_OPEN_REQUESTS
from paged_cache.integrations.mlx_lm.deferred import MAX_DEFERRED
from paged_cache.integrations.mlx_lm.sequences import CACHE_TYPES
from paged_cache.integrations.mlx_lm.binding import (ModelBinding, ModelWithDraft, Resolver,
                                                     model_id_for, provider_binding,
                                                     provider_resolver)
from paged_cache.integrations.mlx_lm.server import (ServeError, check_address, patch_server,
                                                    serve_main)

__all__ = ["CACHE_TYPES", "MAX_DEFERRED", "MAX_OPEN_REQUESTS", "ModelBinding", "ModelWithDraft",
           "PagedPromptCache", "Resolver", "ServeError", "check_address", "model_id_for",
           "patch_server", "provider_binding", "provider_resolver", "serve_main"]
