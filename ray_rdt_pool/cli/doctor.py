"""``ray-rdt-pool doctor``: is this installation ready for ``tensor_transport="nixl_pool"``?

Checks, in order, each printed as one line (``ok``, ``warn`` or ``FAIL``) with the fix
under each that is not ok:

* ``platform``: Linux (the transport uses memfd and ``process_vm_readv``).
* ``versions``: Ray is the tested minor (``register()`` refuses another), torch and NIXL
  are installed in the ranges the package asks for (else FAIL); a minor release other
  than the tested ones (:data:`TESTED`) is a warning.
* ``nixl``: NIXL's Python API imports, its UCX plugin is present, and an agent can
  create a UCX backend.
* ``memfd``: ``memfd_create`` works (same-node reads map it).
* ``/dev/shm``: big enough for Ray's object store (a warning: Ray then falls back to
  disk).
* ``native helpers``: the two optional compiled helpers are built for this Python and
  torch and load (a warning: without them the package runs memmove and a Python loop).
* ``actors``: two Ray actors move a tensor with ``tensor_transport="nixl_pool"``, byte
  for byte and without a fallback (a local Ray, or ``--address``: on two distinct nodes
  when it has them).
* ``ucx``: the UCX protocols and transports of a NIXL READ between two such actors, read
  from UCX's own report (``UCX_PROTO_INFO``) in the receiving actor; on one node that
  receiver turns the same-node path off, so that a READ happens.

Exit status 1 when a check failed, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["Check", "main", "run_checks"]

#: The ranges pyproject.toml asks for, as (lowest, first excluded) major.minor.
TORCH_RANGE = ((2, 4), (3, 0))
NIXL_RANGE = ((1, 5), (2, 0))
#: The releases the test suite ran on (README's "Tested with" line names the same).
TESTED = {"ray": ("2.60.0",), "torch": ("2.13.0", "2.11.0"), "nixl": ("1.5.1",)}
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

    have = {name: _version(name) for name in ("ray", "torch", "nixl")}
    ray_v, torch_v, nixl_v = have["ray"], have["torch"], have["nixl"]
    detail = (f"ray {ray_v}, torch {torch_v}, nixl {nixl_v}, ray-rdt-pool "
              f"{_version('ray-rdt-pool')}")
    problems, fixes = [], []
    if ray_v is None or ".".join(ray_v.split(".")[:2]) != TESTED_RAY:
        problems.append(f"Ray {ray_v or 'is not installed'}"
                        + ("" if ray_v is None else f" is not the tested {TESTED_RAY}.x"))
        fixes.append(f"pip install 'ray[default]=={TESTED_RAY}.*'")
    for name, version, (low, high) in (("torch", torch_v, TORCH_RANGE),
                                       ("nixl", nixl_v, NIXL_RANGE)):
        if version is None or not low <= _major_minor(version) < high:
            problems.append(f"{name} {version or 'is not installed'}")
            fixes.append(f"pip install '{name}>={low[0]}.{low[1]},<{high[0]}.{high[1]}'")
    if problems:
        return Check("versions", "FAIL", f"{'; '.join(problems)} ({detail})", "; ".join(fixes))
    tested = ", ".join(f"{name} {' or '.join(v)}" for name, v in TESTED.items())
    untested = [name for name, version in have.items() if version is not None
                and _major_minor(version) not in {_major_minor(t) for t in TESTED[name]}]
    if untested:
        return Check("versions", "warn", f"{', '.join(f'{n} {have[n]}' for n in untested)}: "
                     f"in range, but not a release the tests ran on ({tested}); {detail}",
                     "if something fails, try the tested release: pip install "
                     + " ".join(f"'{n}=={TESTED[n][0]}'" for n in untested))
    return Check("versions", "ok", f"{detail} (tested: {tested})")


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
    fix = ("python -m ray_rdt_pool.memory.native build (needs cc and c++; again after a "
           "torch upgrade)")
    try:
        from ray_rdt_pool.memory import native

        missing = [name for name in native.HELPERS
                   if not native.artifact_path(helper=name).exists()]
        unloadable = [] if missing else [
            name for name, load in (("copy", native.load_copy), ("describe", native.load))
            if load() is None]
    except Exception as e:
        return Check("native helpers", "warn", f"cannot tell: {type(e).__name__}: {e}", fix)
    if missing:
        return Check("native helpers", "warn",
                     f"not built for this Python and torch: {', '.join(missing)} (the "
                     "package runs memmove and its Python loop instead: slower puts)", fix)
    if unloadable:
        return Check("native helpers", "warn",
                     f"built but not loadable: {', '.join(unloadable)} (the package runs "
                     "memmove and its Python loop instead)",
                     "python -m ray_rdt_pool.memory.native build --force")
    return Check("native helpers", "ok", f"copy and describe built and loaded from "
                 f"{native.cache_dir()}")


@contextlib.contextmanager
def _captured_fds() -> Iterator[list[str]]:
    """What this process writes to fds 1 and 2 inside the block (UCX prints its protocol
    report there, below Python), appended to the yielded list when the block ends."""
    import ctypes

    text: list[str] = []
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile("w+") as sink:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield text
        finally:
            libc.fflush(None)  # C stdio buffers it while fd 1 is a file
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
            sink.seek(0)
            text.append(sink.read())


def _actor_class() -> Any:
    import ray

    @ray.remote(num_cpus=0, enable_tensor_transport=True)  # type: ignore[call-overload]
    class Peer:
        def __init__(self) -> None:
            import ray_rdt_pool

            ray_rdt_pool.register()

        def put(self, n: int) -> tuple[list[Any], int]:
            import torch

            self.data = torch.arange(n, dtype=torch.int32)
            ref = ray.put(self.data, _tensor_transport="nixl_pool")
            return [ref], int(self.data.sum())

        def get(self, refs: list[Any]) -> dict[str, Any]:
            import ray_rdt_pool

            with _captured_fds() as out:
                got = ray.get(refs[0])
            stats = ray_rdt_pool.stats().as_dict()
            return {"sum": int(got.sum()), "n": int(got.numel()),
                    "node": str(ray.get_runtime_context().get_node_id()),
                    "fallbacks": stats["fallbacks"] + stats.get("receive_fallbacks", 0),
                    "errors": stats["transfer_errors"], "reads": stats["reads_posted"],
                    "mapped": stats["mapped_gets"], "ucx": "".join(out)}

    return Peer


def judge_transfer(got: dict[str, Any], want: int, n: int, where: str) -> Check:
    """The ``actors`` verdict on one receiver's report of a put/get."""
    path = ("mapped from the sender's pool" if got.get("mapped")
            else "one NIXL READ" if got.get("reads") else "an unknown path")
    if got["sum"] != want or got["n"] != n:
        return Check("actors", "FAIL", f"the receiver got other bytes ({where}, {path})",
                     "report it with the `ray-rdt-pool doctor` output and NIXL's log")
    if got["fallbacks"] or got["errors"]:
        return Check("actors", "FAIL", f"the tensor arrived, but through a fallback "
                     f"({got['fallbacks']}) or after an error ({got['errors']})",
                     "read the actor logs for the NIXL or UCX error")
    return Check("actors", "ok", f"put/get of {n * 4 >> 20} MiB with nixl_pool between two "
                 f"actors on {where}: {path}, byte for byte")


def judge_ucx(text: str, ucx_version: str | None, where: str) -> Check:
    """The ``ucx`` verdict from what UCX printed in the receiver during its READ."""
    from ray_rdt_pool.nixl.ucx import parse_proto_info

    protocols = parse_proto_info(text)
    reads = [r for k, v in protocols.items() if k.startswith("remote memory read") for r in v]
    tls = os.environ.get("UCX_TLS")
    if not reads:
        return Check("ucx", "warn", f"could not tell which UCX transports the READ between "
                     f"the actors used ({where}): UCX printed no protocol table",
                     "set UCX_PROTO_INFO=y in the receiving actor's environment and read "
                     "its log")
    over = sorted({r.split(" via ")[-1] for r in reads})
    note = ""
    if where == "two hosts" and all(t.split("/")[0] in ("tcp", "cma", "posix", "sysv")
                                    for t in over):
        note = " (no RDMA transport between the nodes: check that UCX sees the HCAs)"
    return Check("ucx", "ok" if not note else "warn",
                 f"UCX {ucx_version or '?'}: a NIXL READ between the actors ({where}) uses "
                 f"{'; '.join(reads[:3])}{', UCX_TLS=' + tls if tls else ''}{note}",
                 "ucx_info -d lists the devices UCX sees; UCX_TLS must not leave out rc or dc"
                 if note else "")


def pick_pair(nodes: Sequence[dict[str, Any]], here: str) -> tuple[list[str], str]:
    """The sender's and the receiver's node ids (the driver's node, then another one
    when the cluster has it, preferring another host), and how they sit."""
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        raise RuntimeError("the cluster has no alive node")
    alive.sort(key=lambda n: n["NodeID"] != here)
    first = alive[0]
    others = sorted(alive[1:], key=lambda n: n.get("NodeManagerAddress")
                    == first.get("NodeManagerAddress"))
    if not others:
        return [first["NodeID"]] * 2, "one node"
    other = others[0]
    same_host = other.get("NodeManagerAddress") == first.get("NodeManagerAddress")
    return ([first["NodeID"], other["NodeID"]],
            "two nodes of one host" if same_host else "two hosts")


def check_actors(address: str | None, timeout_s: float) -> list[Check]:
    import logging

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_rdt_pool.nixl.ucx import ucx_version

    out = []
    started = not ray.is_initialized()
    env = {"RAY_RDT_POOL_POOL_BYTES": "16M", "RAY_RDT_POOL_ARENA_BYTES": "16M"}
    try:
        if started:
            common: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING,
                                      "runtime_env": {"env_vars": env}}
            if address:
                ray.init(address=address, **common)
            else:
                ray.init(address="local", num_cpus=2, include_dashboard=False, **common)
        import ray_rdt_pool

        ray_rdt_pool.register()
        pair, where = pick_pair(ray.nodes(), ray.get_runtime_context().get_node_id())
        Peer = _actor_class()

        def on(node: str, **extra: str) -> Any:
            return Peer.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                runtime_env={"env_vars": {**env, **extra}}).remote()

        # A receiver has UCX print its protocol choices, which the ucx check reads.
        peers = [on(pair[0]), on(pair[1], UCX_PROTO_INFO="y")]
        try:
            n = 1 << 18  # 1 MiB of int32
            refs, want = ray.get(peers[0].put.remote(n), timeout=timeout_s)
            reports = [ray.get(peers[1].get.remote(refs), timeout=timeout_s)]
            if not reports[0]["reads"]:
                # It mapped the sender's pool; a receiver with that path off makes UCX
                # carry a READ between the two processes.
                peers.append(on(pair[1], UCX_PROTO_INFO="y", RAY_RDT_POOL_SAME_NODE="off"))
                reports.append(ray.get(peers[2].get.remote(refs), timeout=timeout_s))
        finally:
            for h in peers:
                ray.kill(h)
        out.append(judge_transfer(reports[0], want, n, where))
        read = next((r for r in reports if r["reads"]), None)
        if read is None:
            out.append(Check("ucx", "FAIL", "no receiver posted a NIXL READ",
                             "report it with the `ray-rdt-pool doctor` output"))
        else:
            if read is not reports[0]:
                out.append(judge_transfer(read, want, n, where + ", same-node path off"))
            out.append(judge_ucx(read["ucx"], ucx_version(), where))
    except Exception as e:
        out.append(Check("actors", "FAIL", f"put/get with nixl_pool failed: "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                         "fix the checks above first; else see docs/troubleshooting.md and "
                         "the actor logs (RAY_RDT_POOL_DEBUG_TRANSFERS=1 logs every put "
                         "and fetch)"))
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
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


def plain(doc: str) -> str:
    """A docstring as help text: reST roles and literals without their markup."""
    import re

    doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)
    return doc.replace("``", "")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ray-rdt-pool doctor", description=plain(__doc__ or ""),
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
