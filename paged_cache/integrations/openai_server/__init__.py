"""mlx-openai-server integration: paged-cache as its language models' prompt cache (``adapter``:
``OpenAIServerPromptCache``, the patched handler, ``paged-cache openai-server``) and every private
name of mlx-openai-server used, checked at import (``compat``). See docs/integration.md."""

from paged_cache.integrations.openai_server.adapter import (OpenAIServerPromptCache, ServeError,
                                                            handler_worker, paged_handler_class,
                                                            serve_main)

__all__ = ["OpenAIServerPromptCache", "ServeError", "handler_worker", "paged_handler_class",
           "serve_main"]
