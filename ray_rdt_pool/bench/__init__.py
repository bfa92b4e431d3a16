"""The side-by-side benchmark behind ``ray-rdt-pool bench``, and its test bed.

Layered above :mod:`ray_rdt_pool._ray` and :mod:`ray_rdt_pool.weights`; the library never
imports it. :mod:`~ray_rdt_pool.bench.run` is the command (Ray's object store and NIXL
variants against ``nixl_pool``), :mod:`~ray_rdt_pool.bench.floor` and
:mod:`~ray_rdt_pool.bench.pack_threads` measure this machine's floors, and
:mod:`~ray_rdt_pool.bench.testbed` / :mod:`~ray_rdt_pool.bench.testbed_sync` run the
weight sync on Ray nodes in network namespaces with limited links (root only).
"""
