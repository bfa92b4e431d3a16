"""Builds the optional compiled copy helper (ray_rdt_pool/memory/_copy.c); the metadata is in
pyproject.toml. optional=True: where no C compiler is found the install goes on, and
ray_rdt_pool.memory.fastcopy falls back to memmove."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ray_rdt_pool.memory._copy", sources=["ray_rdt_pool/memory/_copy.c"],
                             extra_compile_args=["-O2"], optional=True)])
