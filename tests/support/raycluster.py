"""Shared helpers for tests that run a real Ray cluster with real NIXL.

One cluster per test process (a pytest-xdist worker): :func:`shared_cluster` starts it on
first use and every later module of the process joins it; the session ends it
(tests/conftest.py). A module applies its own settings to its own actors, through
``runtime_env`` env vars (:func:`actor_env`, :func:`env_options`) or ``configure()`` in
the actor, never through a cluster of its own. A module that needs a cluster of its own
(several nodes, a Ray restart, ...) says why at its top and starts it with
:func:`start_ray` or ``ray.cluster_utils.Cluster``: that leaves the shared cluster, which
the next module that needs it starts again.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ray

#: What every worker of the shared cluster sees, whichever job it serves: the raylet passes
#: the environment of the process that started it on to every worker, and a driver that
#: joins (an example, a README block, the bench CLI) brings only its own ``runtime_env``.
#: Small pools keep several actors light on a 24 GiB, 2-core machine.
CLUSTER_ENV = {
    "RAY_RDT_POOL_POOL_BYTES": "64M",
    "RAY_RDT_POOL_ARENA_BYTES": "64M",
    "RAY_RDT_POOL_METRICS": "0",
}

#: What the test process's own actors and the test process itself (a driver that puts and
#: gets too) see: the shared cluster's job ``runtime_env``, merged under each actor's.
DEFAULT_ENV = {
    **CLUSTER_ENV,
    "RAY_DEDUP_LOGS": "0",
    # One node: without this every get would map the sender's pool and the modules that
    # attack NIXL READs (stalls, kills, aborts, timeouts) would test nothing. Modules
    # of the same-node path, and the byte-exactness module, set "map" on their actors.
    "RAY_RDT_POOL_SAME_NODE": "off",
}

#: The variable Ray's workers read their ``worker_process_setup_hook`` from (Ray 2.60's
#: ``ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR``): ``ray.init(runtime_env=
#: {"worker_process_setup_hook": "module.func"})`` only sets it for the job's workers.
#: Set per actor, it gives one module's actors the hook on a cluster shared with others.
SETUP_HOOK_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"


def actor_env(env: Mapping[str, str] | None = None, *, setup_hook: bool = False
              ) -> dict[str, Any]:
    """The ``runtime_env`` that gives an actor ``env`` (over the shared cluster's
    :data:`DEFAULT_ENV`, which Ray merges under it) and, with ``setup_hook``,
    ``ray_rdt_pool.setup_worker`` as its worker set-up hook."""
    env_vars = dict(env or {})
    if setup_hook:
        from ray._private import ray_constants

        assert ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR == SETUP_HOOK_VAR
        env_vars[SETUP_HOOK_VAR] = "ray_rdt_pool.setup_worker"
    return {"env_vars": env_vars}


def env_options(cls: Any, env: Mapping[str, str] | None = None, *, setup_hook: bool = False,
                **options: Any) -> Any:
    """``cls.options(...)`` with :func:`actor_env` as its runtime_env (an actor's
    ``runtime_env`` option replaces the class's whole, so pass every setting it needs)."""
    return cls.options(runtime_env=actor_env(env, setup_hook=setup_hook), **options)


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


def _session() -> object:
    return getattr(getattr(ray._private.worker, "_global_node", None), "session_name", None)


class _Shared:
    """The shared cluster of this process, while this process is connected to it."""

    session: object = None
    address: str = ""
    starts: int = 0
    #: This package's settings in this process's environment before the first start.
    saved_env: dict[str, str] | None = None


def _ours_in_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("RAY_RDT_POOL_")}


def shared_cluster() -> str:
    """Join this process's shared cluster, starting it if it is not running (the first
    module of the process that needs it, or the first after a module that ran a cluster of
    its own); its GCS address, for drivers in subprocesses (``RAY_ADDRESS``)."""
    if ray.is_initialized() and _Shared.session is not None and _session() == _Shared.session:
        os.environ.update(DEFAULT_ENV)  # a module may have changed this process's settings
        return _Shared.address
    if ray.is_initialized():
        ray.shutdown()
    drop_stale_rdt_manager()
    # The raylet, and through it every worker of every job, sees this process's environment:
    # CLUSTER_ENV and nothing else of this package (a setting left by an earlier cluster
    # must not reach the workers of drivers that join).
    if _Shared.saved_env is None:
        _Shared.saved_env = _ours_in_environ()
    for k in _ours_in_environ():
        del os.environ[k]
    os.environ.update(CLUSTER_ENV)
    ray.init(address="local",  # never join a cluster another process runs
             num_cpus=8, include_dashboard=False, object_store_memory=512 << 20,
             runtime_env={"env_vars": dict(DEFAULT_ENV)}, log_to_driver=False,
             logging_level="warning")
    # This process reads the same settings as its actors for its own transport.
    os.environ.update(DEFAULT_ENV)
    import ray_rdt_pool

    ray_rdt_pool.register()
    _Shared.session = _session()
    _Shared.address = ray.get_runtime_context().gcs_address
    _Shared.starts += 1
    return _Shared.address


def end_shared_cluster() -> None:
    """Shut the shared cluster down if this process runs it, and give this process back the
    environment it had before (the end of the session, or tests that need a process
    without Ray: tests/unit/conftest.py). The next module that needs it starts it again."""
    if ray.is_initialized() and _Shared.session is not None and _session() == _Shared.session:
        ray.shutdown()
        drop_stale_rdt_manager()
    _Shared.session = None
    if _Shared.saved_env is not None:
        for k in _ours_in_environ():
            del os.environ[k]
        os.environ.update(_Shared.saved_env)


def _alive_actors() -> dict[str, dict[str, Any]]:
    """This job's live actors, by actor ID."""
    job = ray.get_runtime_context().get_job_id()
    out = {}
    for aid, info in ray._private.state.actors().items():
        if info["JobID"] == job and info["State"] not in ("DEAD",):
            out[aid] = info
    return out


@contextlib.contextmanager
def module_actors_end(grace_s: float = 10.0) -> Iterator[None]:
    """Around a module on the shared cluster: at its end, every actor the module made goes.

    Ray ends an actor once its last handle dies, but this process keeps handles of its own
    for good: Ray's RDT manager never drops the metadata of an object the driver borrowed
    (a ref an actor put and returned; Ray 2.60, "TODO(#57962)"), and that metadata holds
    the handle of the actor that made it. So an actor of which a handle is still alive
    here is killed (``ray.kill``); one of which none is, Ray is ending, and it gets
    ``grace_s`` before it is killed by its PID, and named on stderr. Either way no actor of
    a module burns the next module's CPU or memory.
    """
    from ray.actor import ActorHandle

    before = set(_alive_actors())
    yield
    if not ray.is_initialized() or _session() != _Shared.session:
        return  # the module left the shared cluster: its own cluster took its actors
    gc.collect()
    left = {a: i for a, i in _alive_actors().items() if a not in before}
    if not left:
        return
    held = {}
    for o in gc.get_objects():
        if type(o) is ActorHandle and o._actor_id.hex() in left:
            held[o._actor_id.hex()] = o
    for handle in held.values():
        with contextlib.suppress(Exception):
            ray.kill(handle)
    waiting = {a: i for a, i in left.items() if a not in held}
    deadline = time.monotonic() + grace_s
    while waiting and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = _alive_actors()
        waiting = {a: i for a, i in waiting.items() if a in alive}
    for info in waiting.values():
        print(f"an actor outlived its module: {info['ActorClassName']} (pid {info['Pid']}); "
              "killed", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if info["Pid"]:
                os.kill(info["Pid"], signal.SIGKILL)


@contextlib.contextmanager
def driver_rdt_fetch_timeout(seconds: float) -> Iterator[None]:
    """This process's ``RAY_rdt_fetch_fail_timeout_milliseconds`` for a while: Ray reads
    it once, at import (``ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS``), and the caller of
    a task bounds the transfers of the task's RDT arguments by it. A module gives its
    actors the same through their runtime_env."""
    from ray._private import ray_constants

    before = ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS
    ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS = seconds
    try:
        yield
    finally:
        ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS = before


def start_ray(env: dict[str, str] | None = None, **init_kwargs: Any) -> dict[str, str]:
    """Start a cluster of this module's own whose workers see ``env`` (merged over
    DEFAULT_ENV): for a module that cannot share the cluster, which it leaves (the next
    module that needs the shared cluster starts it again)."""
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
def shared_actors(env: Mapping[str, str], classes: dict[str, Any], *, setup_hook: bool = False,
                  ) -> Iterator[dict[str, Any]]:
    """One started actor per name in ``classes``, on the shared cluster, each seeing ``env``
    over :data:`DEFAULT_ENV` (same_node "map", the package's default, unless ``env`` says
    otherwise); ``setup_hook`` registers the transport in them through
    ``ray_rdt_pool.setup_worker``. A value of ``classes`` may be ``(cls, more_env)``, for an
    actor that sees ``more_env`` over ``env``. Kills the actors after."""
    import ray_rdt_pool

    shared_cluster()
    ray_rdt_pool.register()
    env = {"RAY_RDT_POOL_SAME_NODE": "map", **env}
    actors = {}
    for name, spec in classes.items():
        cls, more = spec if isinstance(spec, tuple) else (spec, {})
        actors[name] = env_options(cls, {**env, **more}, setup_hook=setup_hook).remote()
    try:
        ray.get([a.__ray_call__.remote(_noop) for a in actors.values()], timeout=120)
        yield actors
    finally:
        for a in actors.values():
            ray.kill(a)


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


def held(actor: Any) -> tuple[int, int]:
    """Inside an actor: (pool objects, pool bytes) its transport holds, counting a signal
    session still open or a signal waiting for a session as one object; (0, 0) after
    every sync has ended."""
    import ray_rdt_pool

    st = ray_rdt_pool.stats()
    return int(st.live_objects + st.signal_sessions + st.signals_waiting), int(st.pool_used)


def _reset(actor: Any) -> tuple[int, int]:
    """Inside an actor: drop everything a test set on it; what it still holds then."""
    for k in list(vars(actor)):
        delattr(actor, k)
    gc.collect()
    return held(actor)


class NodePool:
    """The bare actors (:func:`node_class`) of one module, all seeing ``env``, handed out
    again from one test to the next.

    A fresh actor costs about 2.4 CPU-seconds on this 2-core machine (a worker process,
    torch, a NIXL agent), and most tests attack a sync, not an actor's birth. An actor a
    test gives back serves a later test only if it is alive, was made without options, and
    holds nothing of this package once every attribute the test set on it is dropped; any
    other is killed. A test about a new process (a restarted engine) asks for ``fresh``.
    """

    def __init__(self, env: Mapping[str, str], **options: Any) -> None:
        self.env = dict(env)
        #: What every actor of the pool is made with (``ray.remote`` options).
        self.options = options
        self._free: list[Any] = []
        self._plain: set[str] = set()

    def take(self, n: int, *, fresh: bool = False, **options: Any) -> list[Any]:
        """``n`` started actors, free ones first (unless ``fresh``, or with ``options``
        for ``ray.remote`` beyond the pool's, which only a new actor takes)."""
        reuse = 0 if fresh or options else min(n, len(self._free))
        nodes = [self._free.pop() for _ in range(reuse)]
        # No CPU each: a test's actors fit the shared cluster beside other modules'.
        Node = node_class(num_cpus=0, runtime_env=actor_env(self.env),
                          **{**self.options, **options})
        new = [Node.remote() for _ in range(n - reuse)]
        ray.get([a.__ray_call__.remote(_noop) for a in new], timeout=120)
        if not options:
            self._plain.update(a._actor_id.hex() for a in new)
        return nodes + new

    def give_back(self, *actors: Any) -> None:
        """A test is done with ``actors``: the clean ones go back to the pool."""
        for a in actors:
            try:
                if a._actor_id.hex() in self._plain and \
                        ray.get(a.__ray_call__.remote(_reset), timeout=30) == (0, 0):
                    self._free.append(a)
                    continue
            except Exception:  # dead, or stuck: a fresh one takes its place
                pass
            with contextlib.suppress(Exception):
                ray.kill(a)

    def close(self) -> None:
        """Kill the free actors (the module's end)."""
        for a in self._free:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self._free.clear()


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


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a driver or a command run in a subprocess: this process's, but
    none of this package's settings (the test process's own, or those the shared cluster
    gave it, depend on which modules ran before in this process) and no ``RAY_ADDRESS``;
    then ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_RDT_POOL_") and k != "RAY_ADDRESS"}
    env.update(extra)
    return env


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
    env = subprocess_env(PYTHONPATH=str(root), RAY_RDT_POOL_POOL_BYTES="64M",
                         RAY_RDT_POOL_ARENA_BYTES="64M")
    if address is not None:
        env["RAY_ADDRESS"] = address
    proc = subprocess.run([sys.executable, str(root / "examples" / args[0]), *args[1:]],
                          cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (STARTED_LOCAL in proc.stderr) == (address is None), proc.stderr[-3000:]
    return proc.stdout
