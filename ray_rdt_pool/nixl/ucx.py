"""Which UCX protocols and transports a NIXL READ uses on this machine (``UCX_PROTO_INFO``).

:func:`probe_ucx` runs one small READ in a child (``python -m ray_rdt_pool.nixl.ucx``)
and parses what UCX prints: ``ray-rdt-pool doctor`` judges it, and the benchmark's floors
(:mod:`ray_rdt_pool.bench.floor`) report it. Also the bare NIXL agent and timed READs
that the probe and the floors share (:func:`make_agent`, :func:`timed_reads`).
Stateless; the probe runs in a child process, so nothing of UCX outlives it here.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

_PROTO_ROW = re.compile(r"\|\s*([0-9.]+\.\.(?:inf|[0-9]+))\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|")


_PROBE_TAG = "UCX_PROBE_JSON "


def make_agent(name: str, prog_thread: bool) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=prog_thread, backends=["UCX"]))


def timed_reads(agent: Any, local: Any, remote: Any, peer: str, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        handle = agent.initialize_xfer("READ", local, remote, peer)
        state = agent.transfer(handle)
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("NIXL READ failed")
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        out.append(time.perf_counter() - t)
    return out


def _probe_target(conn: Connection) -> None:
    import numpy as np

    agent = make_agent(f"ucx-probe-target-{os.getpid()}", False)
    buf = np.ones(1 << 20, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data, buf.nbytes))
    while not conn.poll(0.001):
        agent.get_new_notifs()
    conn.recv()


def ucx_probe_child() -> None:
    """Child of :func:`probe_ucx`: one small READ with UCX_PROTO_INFO set by the parent.

    Forks its peer (cheaper than a second interpreter; nothing UCX exists before the
    fork) and uses numpy buffers.
    """
    import numpy as np

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_probe_target, args=(child,), daemon=True)
    proc.start()
    try:
        agent = make_agent(f"ucx-probe-initiator-{os.getpid()}", False)
        dst = np.zeros(1 << 20, dtype=np.uint8)
        agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
        meta, addr, n = parent.recv()
        peer = agent.add_remote_agent(meta)
        local = agent.get_xfer_descs([(dst.ctypes.data, n, 0)], "DRAM")
        remote = agent.get_xfer_descs([(addr, n, 0)], "DRAM")
        timed_reads(agent, local, remote, peer, 1)
        assert int(dst.sum()) == n, "probe READ returned wrong bytes"
        parent.send("stop")
    finally:
        proc.join(10)
    info = {"ucx_version": ucx_version(), "uct_modules": ucx_modules()}
    print(_PROBE_TAG + json.dumps(info), flush=True)


def parse_proto_info(text: str) -> dict[str, list[str]]:
    """Protocol table rows per operation from UCX_PROTO_INFO output (deduplicated)."""
    out: dict[str, list[str]] = {}
    current = None
    for raw in text.splitlines():
        line = re.sub(r"^\[[^]]*\]\s*\[[^]]*\]\s*", "", raw).strip()
        m = re.match(r"\|\s*((?:remote memory|active message)[^|]*?)\s*\|$", line)
        if m:
            current = m.group(1)
            continue
        row = _PROTO_ROW.match(line)
        if row and current:
            entry = f"{row.group(1)}: {row.group(2)} via {row.group(3)}"
            rows = out.setdefault(current, [])
            if entry not in rows:
                rows.append(entry)
    return out


def ucx_version() -> str | None:
    """Version of the libucp bundled with the NIXL wheel in use (best effort)."""
    import ctypes
    import glob

    try:
        import nixl._api as api

        libdir = os.path.dirname(os.path.realpath(api.__file__)) + ".libs"
        for path in sorted(glob.glob(os.path.join(libdir, "libucp*.so*"))):
            lib = ctypes.CDLL(path)
            lib.ucp_get_version_string.restype = ctypes.c_char_p
            return lib.ucp_get_version_string().decode()
    except Exception:
        return None
    return None


def ucx_modules() -> list[str]:
    """UCT transport modules shipped with the NIXL wheel (e.g. cma, ib, cuda)."""
    try:
        import nixl._api as api

        libdir = os.path.join(os.path.dirname(os.path.realpath(api.__file__)) + ".libs", "ucx")
        names = {m.group(1) for f in os.listdir(libdir)
                 if (m := re.match(r"libuct_([a-z0-9_]+)\.so", f))}
        return sorted(names)
    except Exception:
        return []


def probe_ucx(timeout_s: float = 60) -> dict[str, Any]:
    """Run a tiny NIXL READ with ``UCX_PROTO_INFO=y`` and report the protocols selected."""
    env = dict(os.environ, UCX_PROTO_INFO="y")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ray_rdt_pool.nixl.ucx"],
            env=env, capture_output=True, text=True, timeout=timeout_s,
            preexec_fn=lambda: os.nice(10),  # stay out of the way of what it overlaps
            # The folder that holds this copy of the package, so the child imports it too.
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        text = proc.stdout + proc.stderr
        protocols = parse_proto_info(text)
        error = None if proc.returncode == 0 else f"probe exited {proc.returncode}"
    except Exception as exc:
        text, protocols, error = "", {}, f"{type(exc).__name__}: {exc}"
    info: dict[str, Any] = {"ucx_version": None, "uct_modules": []}
    for line in text.splitlines():
        if line.startswith(_PROBE_TAG):
            info = json.loads(line[len(_PROBE_TAG):])
    reads = [r for k, v in protocols.items() if k.startswith("remote memory read") for r in v]
    ams = [r for k, v in protocols.items() if k.startswith("active message") for r in v]
    return {
        "ucx_version": info["ucx_version"],
        "UCX_TLS": os.environ.get("UCX_TLS"),
        "uct_modules": info["uct_modules"],
        "read_protocols": reads,
        "am_transports": sorted({r.split(" via ")[-1] for r in ams}),
        "protocols": protocols,
        "error": error,
    }


if __name__ == "__main__":  # the child of probe_ucx
    ucx_probe_child()
