"""Torch and OS layer: the memory of pools and arenas and the bytes of tensors in it.

dtypes (wire dtypes in torch), extent (where a tensor's bytes lie), describe (the facts
of a put's tensors), regions (host and CUDA memory of pools and arenas), blocks (raw
memory as tensors with their own lifetime), pack and pack_pool (the copy into a pool,
threaded for large objects), rebuild (views and copies out of a received block),
fastcopy and native (the optional compiled helpers, built by ``python -m
ray_rdt_pool.memory.native build``).
"""
