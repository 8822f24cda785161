"""The remote tier: blocks shared by several hosts on a Valkey / Redis server. ``tier`` holds
``RemoteTier``; ``client`` (key names, connection), ``reads`` (pipelined reads, read-ahead),
``writer`` (batched writes, outages) and ``mac`` (sealed values) are its parts."""
