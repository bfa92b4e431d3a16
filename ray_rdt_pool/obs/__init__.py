"""Observability: counters, the stats snapshot, Ray metrics, the pool table, debug logs."""
