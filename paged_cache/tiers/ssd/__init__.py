"""The SSD tier: block files in a private directory and their SQLite (WAL) manifest, shared by
every server on the host that uses the directory. ``tier`` holds ``SSDTier``; the other modules
are its parts (see docs/architecture.md)."""
