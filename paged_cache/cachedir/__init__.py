"""Offline views of a cache directory for the ``paged-cache`` command: what it holds
(``inventory``), per-model totals and chains (``summary``), and verify / repair / prune
(``maintenance``). The serving path never imports these."""
