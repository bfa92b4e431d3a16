"""Environment facts recorded with every benchmark run (machine, versions, UCX, load).

Only reads: /proc/cpuinfo (psutil has no CPU model), psutil, package metadata and
environment variables. The UCX protocol probe (a tiny NIXL READ in a subprocess) lives in
:mod:`ray_rdt_pool.bench.floor`; the bench starts it in the background while Ray starts
and attaches its result here.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from typing import Any


def loadavg() -> list[float]:
    """1, 5 and 15 minute load averages (other work on a 2-core box skews timings)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mem_total_gib() -> float | None:
    import psutil

    try:
        return round(psutil.virtual_memory().total / (1 << 30), 1)
    except Exception:  # an environment facts call must not fail the run
        return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_env() -> dict[str, Any]:
    """Machine and software facts (cheap; no subprocess, no Ray)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "cores": os.cpu_count(),
        "cores_usable": affinity,
        "cpu_model": cpu_model(),
        "mem_total_gib": mem_total_gib(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "versions": {name: _version(name) for name in
                     ("ray", "torch", "nixl", "nixl-cu12", "nixl-cu13", "numpy",
                      "ray-rdt-pool", "transferqueue", "tensordict")},
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "loadavg_start": loadavg(),
        "native_helper": _native_helper(),
    }


def _native_helper() -> bool | None:
    """Whether the compiled describe helper is built for this torch (the bench's actors
    run on this host with the same torch and load it); None where that cannot be told."""
    try:
        from ray_rdt_pool.memory.native import artifact_path

        return artifact_path().exists()
    except Exception:
        return None


def start_ucx_probe() -> subprocess.Popen[str]:
    """Start the UCX probe (:mod:`~ray_rdt_pool.nixl.ucx`) in the background; finish
    with :func:`finish_ucx_probe`."""
    code = ("import json; from ray_rdt_pool.nixl.ucx import probe_ucx; "
            "print(json.dumps(probe_ucx()))")
    # The folder that holds this copy of the package, so the child imports it too.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.Popen([sys.executable, "-c", code], cwd=root, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def finish_ucx_probe(proc: subprocess.Popen[str] | None, timeout_s: float = 90) -> dict[str, Any]:
    import json

    if proc is None:
        return {"skipped": True}
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return json.loads(out.strip().splitlines()[-1])
    except Exception as exc:
        proc.kill()
        return {"error": f"{type(exc).__name__}: {exc}"}
