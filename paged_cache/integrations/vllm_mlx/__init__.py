"""vllm-mlx integration: paged-cache as the prefix cache of vllm-mlx's continuous-batching
Scheduler (``adapter``: ``install``, ``PagedPrefixCache``, ``paged-cache vllm-mlx``), the chats
opening together that share one prefill (``prefills``) and every private name of vllm-mlx used,
checked at import (``compat``). See docs/integration.md."""

from paged_cache.integrations.vllm_mlx.adapter import (PagedPrefixCache, ServeError, engine_argv,
                                                       install, serve_main, uninstall,
                                                       vision_refusal)

__all__ = ["PagedPrefixCache", "ServeError", "engine_argv", "install", "serve_main", "uninstall",
           "vision_refusal"]
