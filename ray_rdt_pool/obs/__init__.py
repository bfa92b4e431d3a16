"""Observability: counters, the stats snapshot, Ray metrics, debug logs."""
