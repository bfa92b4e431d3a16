"""Torch and OS layer: dtypes, tensor facts, memory regions, pack, rebuild, the compiled helpers."""
