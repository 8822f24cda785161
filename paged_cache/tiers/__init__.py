"""The tiers blocks are kept in, fastest first: what every tier shares (the ``Tier`` interface in
``base``, the stack a config asks for, the eviction order, the block format, the write-behind
queue) and the RAM tier (``hot``); the SSD and remote tiers each have their own folder."""
