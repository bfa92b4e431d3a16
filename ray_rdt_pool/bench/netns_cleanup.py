"""Cleanup of the test bed: the processes in its namespaces, its links, its leftovers.

:func:`cleanup_stale` removes what earlier test beds left behind (a crashed run);
the test bed's own teardown uses the same steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray_rdt_pool.bench.netns import (
    BASE_DIR,
    NAME_RE,
    TAG_LEN,
    link_names,
    netns_list,
    netns_lock,
    own_netns,
    sh,
)

logger = logging.getLogger(__name__)


def ns_pids(ns: str) -> list[int]:
    r = sh(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def _kill_namespaces(namespaces: Sequence[str], tag: str, grace_s: float = 2.0,
                     log: list[str] | None = None) -> list[str]:
    """SIGTERM every process in the namespaces, SIGKILL what is left after ``grace_s``,
    and wait until none is left; returns the problems."""
    assert all(own_netns(ns, tag) for ns in namespaces), namespaces
    me = os.getpid()

    def signal_all(sig: int) -> int:
        n = 0
        for ns in namespaces:
            for pid in ns_pids(ns):
                if pid == me:
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                    n += 1
        return n

    if log is not None and namespaces:
        log.append(f"{time.strftime('%H:%M:%S')} kill -TERM $(ip netns pids ...) "
                   f"in {' '.join(namespaces)}")
    if signal_all(signal.SIGTERM) == 0:
        return []
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(ns_pids(ns) for ns in namespaces):
        time.sleep(0.1)
    if any(ns_pids(ns) for ns in namespaces):
        if log is not None:
            log.append(f"{time.strftime('%H:%M:%S')} kill -KILL $(ip netns pids ...)")
        signal_all(signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(ns_pids(ns) for ns in namespaces):
            time.sleep(0.1)
    left = {ns: ns_pids(ns) for ns in namespaces}
    return [f"processes {pids} still run in namespace {ns}" for ns, pids in left.items()
            if pids]


def delete_tag(tag: str, log: list[str] | None = None) -> list[str]:
    """Remove every namespace of a tag, processes first (deleting a namespace takes its
    veths and bridge with it), and any host link of the tag. A namespace whose processes
    would not end is kept, so that a later cleanup can still find them. Returns the
    problems."""
    namespaces = [ns for ns in netns_list() if own_netns(ns, tag)]
    problems = _kill_namespaces(namespaces, tag, log=log)
    for ns in namespaces:
        if ns_pids(ns):
            continue
        r = sh(["ip", "netns", "del", ns], check=False, log=log)
        if r.returncode != 0:
            problems.append(f"ip netns del {ns}: {r.stderr.strip()}")
    for name in [name for name in link_names() if own_netns(name, tag)]:
        r = sh(["ip", "link", "del", name], check=False, log=log)
        if r.returncode != 0 and name in link_names():
            problems.append(f"ip link del {name}: {r.stderr.strip()}")
    return problems


def cleanup_stale() -> list[str]:
    """Remove what crashed test-bed runs left (processes, namespaces with their veths and
    bridge, directories): only names with the ``rtb`` prefix whose run's lock is no longer held.
    Returns the tags removed."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return []
    BASE_DIR.mkdir(parents=True, exist_ok=True)
    tags = {m.group(1) for name in [*netns_list(), *link_names()]
            if (m := NAME_RE.match(name)) is not None}
    tags |= {p.stem for p in BASE_DIR.glob("*.lock")}
    tags |= {p.name for p in BASE_DIR.iterdir() if p.is_dir()
             and re.fullmatch(f"[a-z0-9]{{{TAG_LEN}}}", p.name)}
    removed = []
    for tag in sorted(tags):
        if not re.fullmatch(f"[a-z0-9]{{{TAG_LEN}}}", tag):
            continue
        fd = netns_lock(tag, create=False)
        if fd is None:
            continue  # a live run holds it
        try:
            d = BASE_DIR / tag
            kept = (d / "KEEP").exists()
            if kept and not any(own_netns(name, tag) for name in [*netns_list(), *link_names()]):
                continue  # the logs of a finished run, kept on purpose
            problems = delete_tag(tag)
            if problems:
                logger.warning("testbed: leftovers of run %s not removed: %s", tag, problems)
                continue
            if d.is_dir() and not kept:
                shutil.rmtree(d, ignore_errors=True)
            if not d.exists():
                with contextlib.suppress(FileNotFoundError):
                    (BASE_DIR / f"{tag}.lock").unlink()
            removed.append(tag)
        finally:
            os.close(fd)
    if removed:
        logger.info("testbed: removed leftovers of earlier runs %s", removed)
    return removed


def default_cluster_file() -> Path:
    """Ray's ``ray_current_cluster`` in its default temp dir (as Ray computes it)."""
    tmp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return Path(tmp) / "ray" / "ray_current_cluster"


def read_text_of(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def kill_group(p: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def restore_cluster_file(before: bytes | None, address: str) -> list[str]:
    """Remove Ray's default ``ray_current_cluster`` if it names ``address`` (put back
    ``before``, what it held before the test bed started, if anything)."""
    path = default_cluster_file()
    now = read_text_of(path)
    if now is None or now == before:
        return []
    if now.decode(errors="replace").strip() != address:
        return []  # someone else's cluster wrote it meanwhile: theirs
    try:
        if before is None:
            path.unlink()
        else:
            path.write_bytes(before)
    except OSError as e:
        return [f"could not restore {path}: {e}"]
    return []
