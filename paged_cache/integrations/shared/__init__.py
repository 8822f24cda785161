"""What several engines' adapters share: requests waiting for another's prefill of a prefix they
share (``prefills``), tenants' cache salts (``tenants``, ``tenants_asgi``), the stats endpoints
(``stats_http``), prefill-rate samples from an engine's own loop (``prefill_samples``) and the
line a stopping server logs (``shutdown``)."""
