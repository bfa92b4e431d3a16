"""Same-node sharing: the shared pool, its lease table, receivers' mappings, source reads."""
