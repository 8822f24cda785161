"""exo integration: paged-cache as the prefix cache of exo's MLX runner. ``prefix`` holds the
logic of exo's four cache members over ``BlockAwarePrefixCache`` (no exo import), ``adapter``
the subclass of exo's ``KVPrefixCache`` built from it, ``compat`` every name of exo used (checked
at import), ``needs`` what exo's environment needs (named when an import of exo fails),
``settings`` the configuration the runner process reads and its manager, ``hook`` the startup
hook that patches exo's runner, ``launcher`` the ``paged-cache exo`` command. Nothing here
imports exo until ``adapter`` / ``compat`` / ``launcher`` is imported. See docs/integration.md."""
