"""``ray-rdt-pool doctor``: is this installation ready for ``tensor_transport="nixl_pool"``?

Checks, in order, each printed as one line (``ok``, ``warn`` or ``FAIL``) with the fix
under each that is not ok:

* ``platform``: Linux (the transport uses memfd and ``process_vm_readv``).
* ``versions``: Ray is the tested minor (``register()`` refuses another), torch and NIXL
  are installed in the ranges the package asks for.
* ``nixl``: NIXL's Python API imports, its UCX plugin is present, and an agent can
  create a UCX backend.
* ``shared memory``: ``memfd_create`` works (same-node reads use it); ``/dev/shm`` is big
  enough for Ray's object store (a warning: Ray then falls back to disk).
* ``native helpers``: the two optional compiled helpers are built for this Python and
  torch (a warning: without them the package runs memmove and a Python loop).
* ``actors``: two Ray actors move a tensor with ``tensor_transport="nixl_pool"``, byte
  for byte and without a fallback (a local Ray, or ``--address``: on two distinct nodes
  when it has them); with what UCX chose for a NIXL READ on this host
  (``UCX_PROTO_INFO``, from :func:`ray_rdt_pool.bench.floor.probe_ucx`).

Exit status 1 when a check failed, else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["Check", "main", "run_checks"]

#: The ranges pyproject.toml asks for, as (lowest, first excluded) major.minor.
TORCH_RANGE = ((2, 4), (3, 0))
NIXL_RANGE = ((1, 5), (2, 0))
#: Below this, Ray's object store does not fit in /dev/shm and spills to disk.
SHM_MIN_BYTES = 1 << 30


@dataclasses.dataclass
class Check:
    """One check's verdict: ``status`` is ``ok``, ``warn`` or ``FAIL``."""

    name: str
    status: str
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _major_minor(version: str) -> tuple[int, int]:
    parts = [*version.split("+")[0].split("."), "0"][:2]
    digits = ["".join(c for c in p if c.isdigit()) or "0" for p in parts]
    return int(digits[0]), int(digits[1])


def check_platform() -> Check:
    if sys.platform.startswith("linux"):
        return Check("platform", "ok", f"Linux, Python {sys.version.split()[0]}")
    return Check("platform", "FAIL", f"{sys.platform}: the transport runs on Linux only",
                 "run it on Linux (memfd_create and process_vm_readv are Linux calls)")


def check_versions() -> Check:
    from ray_rdt_pool._ray.patches import TESTED_RAY

    ray_v, torch_v, nixl_v = _version("ray"), _version("torch"), _version("nixl")
    detail = (f"ray {ray_v} (tested {TESTED_RAY}.x), torch {torch_v}, nixl {nixl_v}, "
              f"ray-rdt-pool {_version('ray-rdt-pool')}")
    problems, fixes = [], []
    if ray_v is None or ".".join(ray_v.split(".")[:2]) != TESTED_RAY:
        problems.append(f"Ray {ray_v or 'is not installed'}"
                        + ("" if ray_v is None else f" is not the tested {TESTED_RAY}.x"))
        fixes.append(f"pip install 'ray[default]=={TESTED_RAY}.*'")
    for name, have, (low, high) in (("torch", torch_v, TORCH_RANGE),
                                    ("nixl", nixl_v, NIXL_RANGE)):
        if have is None or not low <= _major_minor(have) < high:
            problems.append(f"{name} {have or 'is not installed'}")
            fixes.append(f"pip install '{name}>={low[0]}.{low[1]},<{high[0]}.{high[1]}'")
    if problems:
        return Check("versions", "FAIL", f"{'; '.join(problems)} ({detail})", "; ".join(fixes))
    return Check("versions", "ok", detail)


def check_nixl() -> Check:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as e:
        return Check("nixl", "FAIL", f"NIXL's Python API does not import: "
                     f"{type(e).__name__}: {e}", "pip install 'nixl>=1.5,<2' (Linux x86_64 or "
                     "aarch64 wheels; they bundle UCX)")
    try:
        agent = nixl_agent(f"doctor-{os.getpid()}",
                           nixl_agent_config(enable_prog_thread=False, backends=[]))
        plugins = list(agent.get_plugin_list())
        if "UCX" not in plugins:
            return Check("nixl", "FAIL", f"NIXL has no UCX plugin (it has {plugins})",
                         "reinstall the nixl wheel, or point NIXL_PLUGIN_DIR at a folder "
                         "with libplugin_UCX.so")
        agent.create_backend("UCX")
    except Exception as e:
        return Check("nixl", "FAIL", f"NIXL cannot create a UCX backend: "
                     f"{type(e).__name__}: {e}", "check UCX_* environment variables (unset "
                     "UCX_TLS to let UCX choose), and NIXL's log for the cause")
    return Check("nixl", "ok", f"nixl {_version('nixl')}: UCX backend created (plugins: "
                 f"{', '.join(plugins)})")


def check_shared_memory() -> list[Check]:
    out = []
    try:
        fd = os.memfd_create("ray_rdt_pool-doctor", os.MFD_CLOEXEC)
        os.close(fd)
        out.append(Check("memfd", "ok", "memfd_create works (same-node reads map it)"))
    except (AttributeError, OSError) as e:
        out.append(Check("memfd", "FAIL", f"memfd_create failed: {e}",
                         "run on Linux 3.17 or later, and allow memfd_create in the "
                         "container's seccomp profile"))
    try:
        size = shutil.disk_usage("/dev/shm").total
    except OSError as e:
        out.append(Check("/dev/shm", "warn", f"/dev/shm is not usable: {e}",
                         "mount a tmpfs on /dev/shm (docker run --shm-size=8g), or Ray's "
                         "object store runs from disk"))
        return out
    gib = size / (1 << 30)
    if size < SHM_MIN_BYTES:
        out.append(Check("/dev/shm", "warn", f"/dev/shm holds {gib:.2f} GiB",
                         "give it at least 1 GiB (docker run --shm-size=8g) so Ray's object "
                         "store fits in memory"))
    else:
        out.append(Check("/dev/shm", "ok", f"/dev/shm holds {gib:.1f} GiB"))
    return out


def check_native() -> Check:
    try:
        from ray_rdt_pool.memory.native import HELPERS, artifact_path, cache_dir

        missing = [name for name in HELPERS if not artifact_path(helper=name).exists()]
    except Exception as e:
        return Check("native helpers", "warn", f"cannot tell: {type(e).__name__}: {e}",
                     "python -m ray_rdt_pool.memory.native build")
    if missing:
        return Check("native helpers", "warn",
                     f"not built for this Python and torch: {', '.join(missing)} (the "
                     "package runs memmove and its Python loop instead: slower puts)",
                     "python -m ray_rdt_pool.memory.native build (needs cc and c++)")
    return Check("native helpers", "ok", f"copy and describe built in {cache_dir()}")


def _actor_class() -> Any:
    import ray

    @ray.remote(num_cpus=0, enable_tensor_transport=True)  # type: ignore[call-overload]
    class Peer:
        def __init__(self) -> None:
            import ray_rdt_pool

            ray_rdt_pool.register()

        def where(self) -> str:
            return str(ray.get_runtime_context().get_node_id())

        def put(self, n: int) -> tuple[list[Any], int]:
            import torch

            self.data = torch.arange(n, dtype=torch.int32)
            ref = ray.put(self.data, _tensor_transport="nixl_pool")
            return [ref], int(self.data.sum())

        def get(self, refs: list[Any]) -> dict[str, Any]:
            import ray_rdt_pool

            got = ray.get(refs[0])
            stats = ray_rdt_pool.stats().as_dict()
            return {"sum": int(got.sum()), "n": int(got.numel()),
                    "fallbacks": stats["fallbacks"] + stats.get("receive_fallbacks", 0),
                    "errors": stats["transfer_errors"]}

    return Peer


def check_actors(address: str | None, timeout_s: float) -> list[Check]:
    import logging

    import ray

    from ray_rdt_pool.bench import env as bench_env

    probe = bench_env.start_ucx_probe()
    out = []
    started = not ray.is_initialized()
    t0 = time.monotonic()
    try:
        if started:
            env = {"RAY_RDT_POOL_POOL_BYTES": "16M", "RAY_RDT_POOL_ARENA_BYTES": "16M"}
            if address:
                ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING,
                         runtime_env={"env_vars": env})
            else:
                ray.init(address="local", num_cpus=2, include_dashboard=False,
                         log_to_driver=False, logging_level=logging.WARNING,
                         runtime_env={"env_vars": env})
        import ray_rdt_pool

        ray_rdt_pool.register()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        here = ray.get_runtime_context().get_node_id()
        nodes.sort(key=lambda n: n != here)
        pair = nodes[:2] if len(nodes) >= 2 else nodes * 2
        Peer = _actor_class()
        a, b = (Peer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
                .remote() for n in pair)
        n = 1 << 18  # 1 MiB of int32
        refs, want = ray.get(a.put.remote(n), timeout=timeout_s)
        got = ray.get(b.get.remote(refs), timeout=timeout_s)
        where = "two nodes" if pair[0] != pair[1] else "one node"
        if got["sum"] != want or got["n"] != n:
            out.append(Check("actors", "FAIL", f"the receiver got other bytes ({where})",
                             "report it with `ray-rdt-pool doctor` output and NIXL's log"))
        elif got["fallbacks"] or got["errors"]:
            out.append(Check("actors", "FAIL", f"the tensor arrived, but through a fallback "
                             f"({got['fallbacks']}) or after an error ({got['errors']})",
                             "read the actor logs for the NIXL or UCX error"))
        else:
            out.append(Check("actors", "ok", f"put/get of 1 MiB with nixl_pool between two "
                             f"actors on {where} in {time.monotonic() - t0:.1f} s"))
        for h in (a, b):
            ray.kill(h)
    except Exception as e:
        out.append(Check("actors", "FAIL", f"put/get with nixl_pool failed: "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                         "fix the checks above first; else see docs/troubleshooting.md and "
                         "the actor logs (RAY_RDT_POOL_LOG_LEVEL=DEBUG)"))
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
    ucx = bench_env.finish_ucx_probe(probe)
    reads = ucx.get("read_protocols") or []
    if ucx.get("error") or not reads:
        out.append(Check("ucx", "warn", "could not tell which UCX transports a READ uses: "
                         f"{ucx.get('error') or 'no UCX_PROTO_INFO output'}",
                         "run with UCX_PROTO_INFO=y to see UCX's choice"))
    else:
        out.append(Check("ucx", "ok", f"UCX {ucx.get('ucx_version')}: a NIXL READ on this "
                         f"host uses {'; '.join(reads[:3])}"
                         f"{'' if not ucx.get('UCX_TLS') else ', UCX_TLS=' + ucx['UCX_TLS']}"))
    return out


def run_checks(address: str | None = None, actors: bool = True,
               timeout_s: float = 120.0) -> list[Check]:
    """Every check (the actor check only when ``actors``), in order."""
    checks: list[Check] = [check_platform(), check_versions(), check_nixl()]
    checks += check_shared_memory()
    checks.append(check_native())
    if actors:
        if any(c.failed for c in checks):
            checks.append(Check("actors", "FAIL", "not run: a check above failed",
                                "fix the checks above, then run ray-rdt-pool doctor again"))
        else:
            checks += check_actors(address, timeout_s)
    return checks


def render(checks: Sequence[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<15} {c.detail}")
        if c.fix and c.status != "ok":
            lines.append(f"{'':<21} fix: {c.fix}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ray-rdt-pool doctor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", metavar="ADDR",
                   help="run the actor check on this running cluster (two distinct nodes "
                        "when it has them) instead of a local Ray")
    p.add_argument("--no-actors", action="store_true",
                   help="skip the actor check (no Ray is started)")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="seconds for each step of the actor check (default 120)")
    a = p.parse_args(argv)
    found = run_checks(address=a.address, actors=not a.no_actors, timeout_s=a.timeout_s)
    print(render(found))
    failed = [c.name for c in found if c.failed]
    print(f"\n{len(failed)} check(s) failed: {', '.join(failed)}" if failed
          else "\nall checks passed")
    return 1 if failed else 0
