"""Helpers of the test suite (no tests here): blocks and keys (``blocks``), managers
(``managers``), the prefix cache driven by hand (``prefix``), the ``paged-cache`` command
in-process (``cli``), a ``paged-cache serve`` subprocess (``serve``) and the tenant checks of
every server (``tenants``)."""
