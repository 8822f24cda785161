"""Serving engines paged-cache plugs into, one folder each (``mlx_lm``, ``vllm_mlx``,
``openai_server``), and what several of them share (``shared``)."""
