"""Shared helpers for tests that run a real Ray cluster with real NIXL.

Each test module starts one cluster (Ray start-up costs seconds) through
:func:`start_ray` in a module-scoped fixture and shuts it down at the end.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ray

#: Small pools keep several actors light on a 24 GiB, 2-core machine.
DEFAULT_ENV = {
    "RAY_RDT_POOL_POOL_BYTES": "64M",
    "RAY_RDT_POOL_ARENA_BYTES": "64M",
    "RAY_RDT_POOL_METRICS": "0",
    "RAY_DEDUP_LOGS": "0",
    # One node: without this every get would map the sender's pool and the modules that
    # attack NIXL READs (stalls, kills, aborts, timeouts) would test nothing. Modules
    # of the same-node path, and the byte-exactness module, set "map".
    "RAY_RDT_POOL_SAME_NODE": "off",
}


def drop_stale_rdt_manager() -> bool:
    """Forget Ray's RDT manager of an ended session in this process; True if one was.

    Ray 2.60 keeps one RDT manager per process across ``ray.shutdown()``: its queue of
    transfers for the failure monitor survives, and in the next session the monitor
    thread dies on their owners, now unknown ("owner is unknown": an unhandled thread
    exception, and no failure monitoring in that process any more). Every field of the
    manager belongs to one session, and Ray makes a new one on first use. No-op while
    Ray is initialized.
    """
    if ray.is_initialized():
        return False
    worker = ray._private.worker.global_worker
    if getattr(worker, "_rdt_manager", None) is None:
        return False
    worker._rdt_manager = None
    return True


def start_ray(env: dict[str, str] | None = None, **init_kwargs: Any) -> dict[str, str]:
    """Start a fresh local cluster whose workers see ``env`` (merged over DEFAULT_ENV)."""
    env_vars = {**DEFAULT_ENV, **(env or {})}
    for k, v in env_vars.items():
        os.environ[k] = v  # the driver process reads the same settings
    if ray.is_initialized():
        ray.shutdown()
    drop_stale_rdt_manager()
    init_kwargs.setdefault("num_cpus", 8)
    init_kwargs.setdefault("include_dashboard", False)
    init_kwargs.setdefault("object_store_memory", 512 * 1024 * 1024)
    init_kwargs.setdefault("address", "local")  # never join a cluster another process runs
    ray.init(runtime_env={"env_vars": env_vars}, log_to_driver=False, **init_kwargs)
    import ray_rdt_pool

    ray_rdt_pool.register()
    return env_vars


def digest(tensors: Sequence[Any]) -> list[str]:
    """A byte-exact fingerprint of each tensor: dtype, shape and every byte of its values."""
    import torch

    out = []
    for t in tensors:
        t = t.detach().resolve_conj().resolve_neg().cpu()
        # A fresh tensor has standard strides (.contiguous() may keep odd ones for size-1 dims).
        c = torch.empty(t.shape, dtype=t.dtype).copy_(t)
        raw = c.reshape(-1).view(torch.uint8)
        h = hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]
        out.append(f"{c.dtype}|{tuple(c.shape)}|{h}")
    return out


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1) -> Any:
    """Poll until ``predicate()`` is truthy; return it, or raise with the last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value {value!r})")
        time.sleep(interval)
        value = predicate()
    return value


def all_dtype_tensors(seed: int = 0, rows: int = 3, first_cols: int = 5) -> list[Any]:
    """One tensor of every dtype the wire carries (rows x first_cols+i), random bits."""
    import torch

    from ray_rdt_pool.core.runs import DTYPES

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, name in enumerate(DTYPES):
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            continue
        item = torch.empty(0, dtype=dt).element_size()
        shape = (rows, first_cols + i)
        raw = torch.randint(0, 256, (shape[0] * shape[1] * item,), dtype=torch.uint8, generator=g)
        if dt == torch.bool:
            raw = raw % 2
        out.append(raw.view(dt).view(shape))
    return out


def _noop(actor: Any) -> None:
    return None


def call(actor: Any, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Run ``fn(actor_instance, *args, **kw)`` inside ``actor`` and return its value."""
    return ray.get(actor.__ray_call__.remote(fn, *args, **kw), timeout=120)


@contextlib.contextmanager
def actor_cluster(env: dict[str, str], classes: dict[str, Any], *, setup_hook: bool = False,
                  **init_kwargs: Any) -> Iterator[dict[str, Any]]:
    """A fresh local cluster (4 CPUs) whose workers see ``env``; one started actor per
    name in ``classes``. ``setup_hook`` registers the transport in every worker through
    ``ray_rdt_pool.setup_worker``. Kills the actors and shuts the cluster down after."""
    import ray_rdt_pool

    ray_rdt_pool.register()
    runtime_env: dict[str, Any] = {"env_vars": env}
    if setup_hook:
        runtime_env["worker_process_setup_hook"] = "ray_rdt_pool.setup_worker"
    if ray.is_initialized():
        ray.shutdown()
    init_kwargs.setdefault("logging_level", "warning")
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env=runtime_env,
             **init_kwargs)
    try:
        actors = {name: cls.remote() for name, cls in classes.items()}
        ray.get([a.__ray_call__.remote(_noop) for a in actors.values()], timeout=120)
        yield actors
        for a in actors.values():
            ray.kill(a)
    finally:
        ray.shutdown()


def node_class(**options: Any) -> Any:
    """A bare actor class (RDT enabled, one torch thread) for tests that run everything
    inside it through :func:`call`; ``options`` go to ``ray.remote`` (e.g.
    ``max_concurrency``)."""

    @ray.remote(enable_tensor_transport=True, **options)
    class Node:
        def __init__(self) -> None:
            import torch

            torch.set_num_threads(1)

    return Node


def _stats_of(actor: Any) -> Any:
    import ray_rdt_pool

    return ray_rdt_pool.stats()


def wait_drained(actor: Any, timeout: float = 30.0) -> Any:
    """Wait until ``actor``'s sender pool holds no object (frees run after the refs die);
    return its stats."""
    st = wait_for(lambda: (x := call(actor, _stats_of)).pool_used == 0
                  and x.live_objects == 0 and x, timeout=timeout, interval=0.05)
    assert st.pool_used == 0 and st.live_objects == 0, st
    return st


#: Ray's log line (on stderr) when ``ray.init`` starts a cluster rather than joining one.
STARTED_LOCAL = "Started a local Ray instance"


def run_example(*args: str, address: str | None = None, timeout: float = 240.0) -> str:
    """Run a program of ``examples/`` as a user would: a subprocess joined to the cluster
    at ``address`` (as ``RAY_ADDRESS``), or with ``None`` on a local cluster of its own,
    in an environment without this package's settings but 64 MiB pools and arenas (the
    defaults reserve 1 GiB each). It must exit 0, and must have joined ``address`` (not
    started a cluster) when one is given; returns its standard output."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_RDT_POOL_") and k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(root), RAY_RDT_POOL_POOL_BYTES="64M",
               RAY_RDT_POOL_ARENA_BYTES="64M")
    if address is not None:
        env["RAY_ADDRESS"] = address
    proc = subprocess.run([sys.executable, str(root / "examples" / args[0]), *args[1:]],
                          cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (STARTED_LOCAL in proc.stderr) == (address is None), proc.stderr[-3000:]
    return proc.stdout
