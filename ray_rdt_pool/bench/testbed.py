"""A multi-node Ray cluster on one Linux host, one network namespace per node, with real
link limits.

Each of the N nodes lives in its own network namespace and reaches the others through a
veth on a private bridge. The bridge sits in a namespace of its own (the "switch"), so the
host gets no new interface, address or route, and the host's firewall (bridge netfilter,
a FORWARD policy of DROP as Docker sets it) never sees the traffic. Each node has its
egress AND its ingress limited by ``tc`` (a token bucket on each end of its veth: inside
the node, and on the switch's end, as a full-duplex NIC would be), so a transfer between
two nodes is bounded by the link rate, not by memory bandwidth; :meth:`TestBed.link_bytes`
counts what crossed a node's link. Node 0 is the Ray head; every node ``i`` carries a
custom resource ``node<i>`` (1 unit), so a caller places an actor on node ``i`` with
``.options(resources={"node<i>": 0.01})``. UCX is held to TCP on the veth
(``UCX_TLS=tcp,self``, ``UCX_NET_DEVICES=eth0``), so NIXL's bytes cross the limited link
instead of going through cma or shared memory (the namespaces share one host).

    from ray_rdt_pool.bench.testbed import TestBed
    if (why := TestBed.available()) is not None: raise SystemExit(why)
    with TestBed(nodes=3, rate="500mbit", env={"PYTHONPATH": repo}) as bed:
        out = bed.run_driver("driver.py", ["--engines", "2"], timeout=300)

or from the shell (the driver runs on the head, in namespace 0, with ``RAY_ADDRESS`` set)::

    python -m ray_rdt_pool.bench.testbed_cli --nodes 3 --rate 500mbit -- driver.py ARGS
    python -m ray_rdt_pool.bench.testbed_cli --check | --cleanup

Rules it keeps (the host is shared):

* It needs root, ``ip`` and ``tc`` (iproute2), network namespaces, veths, bridges and the
  ``tbf`` qdisc; :meth:`TestBed.available` returns why not (probed inside a throwaway
  namespace, never on the host's links), so tests skip with that reason.
* Every namespace it makes starts with ``rtb`` and a 4-character tag unique to the run
  (the bridge and the veths live inside them); it deletes only namespaces with its own
  tag, or, for leftovers of a crashed run, those whose tag's lock file
  (``/tmp/rtb/<tag>.lock``, held with ``flock`` for the run's lifetime) is no longer held.
* Traffic stays between the namespaces. The subnet is a /24 of 198.18.0.0/15 (reserved
  for benchmarks) that no host address or route overlaps.
* Processes end by PID: those in its namespaces (``ip netns pids``), SIGTERM then
  SIGKILL. Never Ray's host-wide stop command: it ends every Ray process on the host.
* Each node has its own Ray temp dir under ``/tmp/rtb/<tag>/``, so ``ray start --head``
  does not overwrite ``ray_current_cluster`` in Ray's default temp dir (a later plain
  ``ray.init()`` on the host would join the test bed); should that file name the test
  bed's address anyway, it is removed at close.
* Everything is undone at close, after a failed bring-up, and after an exception in the
  ``with`` body; the Ray logs go too unless ``keep_logs=True`` (a failed bring-up puts
  the tail of the failing node's logs in its exception).

Only the standard library and the ``ray`` CLI (plus a short ``ray.init``/``ray.nodes()``
script run inside namespace 0 to wait for the nodes) are used here, so the module can
move into the package unchanged. The network (names, namespaces, veths, tc) is in
:mod:`~ray_rdt_pool.bench.netns`, the teardown steps and ``cleanup_stale`` in
:mod:`~ray_rdt_pool.bench.netns_cleanup`, the command line in
:mod:`~ray_rdt_pool.bench.testbed_cli`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from ray_rdt_pool.bench.netns import (
    BASE_DIR,
    BRIDGE,
    INNER_DEV,
    MAX_NODES,
    TestBedError,
    new_tag,
    ns_name,
    parse_rate,
    parse_size,
    pick_subnet,
    probe_namespaces,
    sh,
    switch_name,
)
from ray_rdt_pool.bench.netns_cleanup import (
    cleanup_stale,
    default_cluster_file,
    delete_tag,
    kill_group,
    ns_pids,
    read_text_of,
    restore_cluster_file,
)

logger = logging.getLogger(__name__)

__all__ = ["Node", "TestBed"]

HEAD_PORT = 6379
#: The Ray log files whose tails go into a bring-up error.
_LOG_FILES = ("raylet.err", "raylet.out", "gcs_server.err", "gcs_server.out",
              "runtime_env_agent.err", "dashboard_agent.err")

_WAIT_NODES = r"""
import json, sys, time
import ray
want, timeout = int(sys.argv[1]), float(sys.argv[2])
ray.init(logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + timeout
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(json.dumps([{"ip": n["NodeManagerAddress"], "resources": n["Resources"]}
                  for n in alive]))
"""


def _tail(path: Path, lines: int = 15, max_chars: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16 * max_chars))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])[-max_chars:]


#: Ray log lines at error or fatal severity, failed checks, crash banners, exceptions.
_BAD_LINE = re.compile(r"^\[\S+ \S+ [EC] |Check failed|^\*\*\* |^\w*(Error|Exception)\b")


def _excerpt(path: Path, tail: int = 4, bad: int = 4) -> str:
    """The last ``bad`` error lines of a log, then its last ``tail`` lines (a fatal
    line's stack trace would otherwise fill the tail)."""
    text = _tail(path, lines=400, max_chars=200_000)
    lines = text.splitlines()
    worst = [ln[:600] for ln in lines if _BAD_LINE.search(ln)][-bad:]
    last = [ln[:300] for ln in lines[-tail:]] if tail else []
    return "\n".join([*worst, *(["..."] if worst and last else []), *last])


def _ray_cli() -> str | None:
    here = Path(sys.executable).with_name("ray")
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("ray")


@dataclass(frozen=True)
class Node:
    """One Ray node of the test bed."""

    index: int
    namespace: str
    ip: str
    veth: str  # its end in the switch namespace; the node's end is INNER_DEV
    temp_dir: Path

    @property
    def resource(self) -> str:
        """The custom resource that places an actor on this node."""
        return f"node{self.index}"


class TestBed:
    """A Ray cluster of ``nodes`` nodes, one network namespace each, links limited to ``rate``.

    Use as a context manager (or :meth:`start` / :meth:`close`). ``rate`` is a tc rate
    (``"500mbit"``, ``"1gbit"``) applied to each node's egress and ingress; None means no
    limit. ``burst`` and ``latency`` are the token bucket's (tc tbf). ``env`` is added to
    the environment of every Ray process and of drivers (e.g. ``PYTHONPATH`` and
    ``RAY_RDT_POOL_*`` settings). ``num_cpus`` and ``object_store_bytes`` are each node's.
    ``node_args`` adds ``ray start`` arguments for some nodes (by index). Worker nodes
    start ``start_parallel`` at a time (a raylet dies when its agent starts slowly, and
    many at once on few cores are slow). ``ray=False`` builds the network only (for tests
    of the links themselves).
    """

    __test__ = False  # not a pytest test class

    _available: str | None = None
    _probed = False

    def __init__(self, nodes: int = 2, rate: str | None = "500mbit", *,
                 burst: str = "512kb", latency: str = "100ms",
                 env: Mapping[str, str] | None = None, num_cpus: int = 1,
                 object_store_bytes: int = 100 << 20,
                 node_args: Mapping[int, Sequence[str]] | None = None,
                 ray: bool = True, start_timeout_s: float = 300.0, start_parallel: int = 2,
                 keep_logs: bool = False, python: str | None = None) -> None:
        if not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be an int in [1, {MAX_NODES}], got {nodes!r}")
        if rate is not None:
            parse_rate(rate)
            parse_size(burst)
            if not re.fullmatch(r"\d+(?:\.\d+)?(?:ms|us|s)", latency):
                raise ValueError(f"latency {latency!r} is not a tc time: give e.g. '100ms'")
        if object_store_bytes < 78 << 20:
            raise ValueError(f"object_store_bytes must be at least 78 MiB for Ray, got "
                             f"{object_store_bytes}")
        self.n = nodes
        self.rate = rate
        self.burst = burst
        self.latency = latency
        self.extra_env = {k: str(v) for k, v in (env or {}).items()}
        self.num_cpus = num_cpus
        self.object_store_bytes = object_store_bytes
        self.node_args = {int(k): list(v) for k, v in (node_args or {}).items()}
        self.with_ray = ray
        self.start_timeout_s = start_timeout_s
        self.start_parallel = max(1, start_parallel)
        self.keep_logs = keep_logs
        self.python = python or sys.executable
        #: Every command run, with its time, in order.
        self.commands: list[str] = []
        #: Seconds of "bring_up" (network plus Ray) and "teardown".
        self.timings: dict[str, float] = {}
        self.nodes: list[Node] = []
        self.tag = ""
        self.dir = BASE_DIR
        self.subnet: ipaddress.IPv4Network | None = None
        #: The namespace that holds the bridge and the switch ends of the veths.
        self.switch = ""
        self._lock_fd: int | None = None
        self._started = False
        self._closed = False
        self._drivers = 0
        self._ray_cluster_file_before: bytes | None = None

    # ---------------------------------------------------------------- availability

    @classmethod
    def available(cls, ray: bool = True) -> str | None:
        """None when a test bed can run here, else the reason it cannot (for a skip)."""
        if not cls._probed:
            cls._available = cls._probe()
            cls._probed = True
        if cls._available is None and ray and _ray_cli() is None:
            return "the `ray` command is not installed next to this Python or on PATH"
        return cls._available

    _probe = staticmethod(probe_namespaces)

    # ---------------------------------------------------------------- properties

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def address(self) -> str:
        """The Ray head's GCS address (``RAY_ADDRESS`` of a driver)."""
        return f"{self.head.ip}:{HEAD_PORT}"

    @property
    def rate_bps(self) -> float | None:
        """The per-node link rate in bits per second (None: unlimited)."""
        return None if self.rate is None else parse_rate(self.rate)

    def env(self) -> dict[str, str]:
        """The environment of every process the test bed starts in a namespace."""
        base = {k: v for k, v in os.environ.items()
                if k not in ("RAY_ADDRESS", "RAY_TMPDIR") and not k.startswith("UCX_")}
        base.update({
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            # NIXL's bytes over the veth: TCP only, on the namespace's one NIC.
            "UCX_TLS": "tcp,self",
            "UCX_NET_DEVICES": INNER_DEV,
        })
        base.update(self.extra_env)
        return base

    # ---------------------------------------------------------------- bring-up

    def __enter__(self) -> TestBed:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(raise_errors=exc is None)

    def start(self) -> TestBed:
        """Build the network and start Ray on every node; on any failure undo it all."""
        if self._started:
            raise TestBedError("this TestBed was started already; make a new one")
        self._started = True
        reason = self.available(ray=self.with_ray)
        if reason is not None:
            raise TestBedError(f"the test bed cannot run here: {reason}")
        t0 = time.monotonic()
        cleanup_stale()
        self.tag, self._lock_fd = new_tag()
        self.dir = BASE_DIR / self.tag
        self._ray_cluster_file_before = read_text_of(default_cluster_file())
        try:
            self.dir.mkdir(parents=True)
            self._build_network()
            if self.with_ray:
                self._start_ray()
        except BaseException:
            problems = self._teardown()
            if problems:
                logger.error("testbed %s: cleanup after the failed bring-up left: %s",
                             self.tag, "; ".join(problems))
            raise
        self.timings["bring_up"] = time.monotonic() - t0
        logger.info("testbed %s: %d nodes up in %.1f s (%s)", self.tag, self.n,
                    self.timings["bring_up"], self.address if self.with_ray else "no Ray")
        return self

    def _run(self, argv: Sequence[str], check: bool = True, timeout: float = 30.0
             ) -> subprocess.CompletedProcess[str]:
        return sh(argv, check=check, timeout=timeout, log=self.commands)

    def _ns(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[i].namespace]

    def _tbf(self) -> list[str]:
        assert self.rate is not None
        return ["root", "tbf", "rate", self.rate, "burst", self.burst, "latency",
                self.latency]

    def _build_network(self) -> None:
        self.subnet = pick_subnet()
        hosts = list(self.subnet.hosts())
        sw = self.switch = switch_name(self.tag)
        self._run(["ip", "netns", "add", sw])
        self._run(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"])
        self._run(["ip", "-n", sw, "link", "set", BRIDGE, "up"])
        for i in range(self.n):
            node = Node(i, ns_name(self.tag, i), str(hosts[i]), f"v{i}", self.dir / f"n{i}")
            self.nodes.append(node)
            ns, veth = node.namespace, node.veth
            self._run(["ip", "netns", "add", ns])
            self._run(["ip", "-n", sw, "link", "add", veth, "type", "veth", "peer", "name",
                       INNER_DEV, "netns", ns])
            self._run(["ip", "-n", sw, "link", "set", veth, "master", BRIDGE])
            self._run(["ip", "-n", sw, "link", "set", veth, "up"])
            self._run(["ip", "-n", ns, "addr", "add", f"{node.ip}/{self.subnet.prefixlen}",
                       "dev", INNER_DEV])
            self._run(["ip", "-n", ns, "link", "set", INNER_DEV, "up"])
            self._run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.rate is not None:
                # Egress inside the node; the switch end's egress is the node's ingress.
                self._run([*self._ns(i), "tc", "qdisc", "add", "dev", INNER_DEV, *self._tbf()])
                self._run(["ip", "netns", "exec", sw, "tc", "qdisc", "add", "dev", veth,
                           *self._tbf()])
            node.temp_dir.mkdir(parents=True)

    def link_bytes(self, i: int) -> tuple[int, int]:
        """(bytes into node ``i``, bytes out of it) so far, counted on its link."""
        self._check_up()
        r = self._run(["ip", "-n", self.switch, "-s", "-j", "link", "show", "dev",
                       self.nodes[i].veth])
        stats = json.loads(r.stdout)[0]["stats64"]
        # The switch end transmits what goes into the node and receives what leaves it.
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def _ray_start(self, i: int) -> subprocess.Popen[bytes]:
        node = self.nodes[i]
        argv = [*self._ns(i), _ray_cli() or "ray", "start"]
        if i == 0:
            argv += ["--head", "--port", str(HEAD_PORT), "--include-dashboard", "false"]
        else:
            argv += ["--address", self.address]
        argv += ["--node-ip-address", node.ip, "--num-cpus", str(self.num_cpus),
                 "--object-store-memory", str(self.object_store_bytes),
                 "--resources", json.dumps({node.resource: 1}),
                 "--temp-dir", str(node.temp_dir), "--disable-usage-stats",
                 *self.node_args.get(i, [])]
        self.commands.append(f"{time.strftime('%H:%M:%S')} {shlex.join(argv)}")
        logger.debug("testbed: %s", shlex.join(argv))
        out = open(self.dir / f"ray-start-n{i}.log", "wb")
        try:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env())
        finally:
            out.close()

    def _start_nodes(self, indices: Sequence[int], deadline: float) -> None:
        """Run ``ray start`` on the nodes, at most ``start_parallel`` at a time; after a
        failure start no more, let those under way finish, and raise naming the failed."""
        pending = list(indices)
        running: dict[int, subprocess.Popen[bytes]] = {}
        failed: list[int] = []
        while pending or running:
            while pending and not failed and len(running) < self.start_parallel:
                i = pending.pop(0)
                running[i] = self._ray_start(i)
            if not running:
                break
            time.sleep(0.1)
            for i, p in list(running.items()):
                rc = p.poll()
                if rc is None and time.monotonic() > deadline:
                    p.kill()
                    rc = p.wait()
                if rc is not None:
                    del running[i]
                    if rc != 0:
                        failed.append(i)
        if failed:
            failed.sort()
            first = "".join(self.node_report(i) for i in failed[:2])
            rest = "".join(f"\n--- node {i}: {self.node_report(i, short=True)}"
                           for i in failed[2:])
            raise TestBedError(f"ray start failed on node(s) {failed} of test bed "
                               f"{self.tag}{first}{rest}")

    def node_report(self, i: int, short: bool = False) -> str:
        """The `ray start` output and the telling lines of node ``i``'s Ray logs (errors,
        then the tail), for an error message; ``short``: the last line of each only."""
        return _node_report(self.nodes[i], self.dir, short)

    def _start_ray(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        self._start_nodes([0], deadline)
        self._start_nodes(range(1, self.n), deadline)
        out = self.run_driver(_WAIT_NODES, [str(self.n), str(max(5.0, deadline -
                                                                  time.monotonic()))],
                              timeout=max(30.0, deadline - time.monotonic() + 30.0))
        try:
            alive = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError) as e:
            raise TestBedError(f"waiting for the nodes printed no node list: {out!r}") from e
        by_ip = {a["ip"]: a for a in alive}
        missing = [node.index for node in self.nodes
                   if node.resource not in by_ip.get(node.ip, {}).get("resources", {})]
        if missing or len(alive) != self.n:
            raise TestBedError(
                f"after {self.start_timeout_s:.0f} s the cluster has {len(alive)} alive "
                f"node(s) {sorted(by_ip)}, want {self.n}; missing node(s) {missing}"
                + "".join(self.node_report(i) for i in missing))

    # ---------------------------------------------------------------- use

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in node ``i``'s namespace (ended at close, like the rest)."""
        self._check_up()
        full = [*self._ns(i), *argv]
        self.commands.append(f"{time.strftime('%H:%M:%S')} {shlex.join(full)}")
        return subprocess.Popen(full, env={**self.env(), **(env or {})}, **kw)

    def run_driver(self, script: str | os.PathLike[str], args: Sequence[str] = (), *,
                   timeout: float = 600.0, env: Mapping[str, str] | None = None,
                   node: int = 0, echo: bool = False, echo_stderr: bool = False) -> str:
        """Run a Python driver on node ``node`` (the head by default) and return its stdout.

        ``script`` is a path to a ``.py`` file or Python source. ``RAY_ADDRESS`` is the
        head's, so a plain ``ray.init()`` joins the test bed. ``echo`` copies the
        driver's stdout and stderr to this process's as they come, ``echo_stderr`` only
        its stderr (progress, logs). Raises TestBedError
        (with the tail of its output) when it exits non-zero or outlives ``timeout``.
        """
        self._check_up()
        path = Path(os.fspath(script))
        if not (path.suffix == ".py" and path.is_file()):
            self._drivers += 1
            path = self.dir / f"driver-{self._drivers}.py"
            path.write_text(os.fspath(script))
        drv_env = {"RAY_ADDRESS": self.address, **(env or {})}
        p = self.popen(node, [self.python, str(path), *map(str, args)], env=drv_env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       stdin=subprocess.DEVNULL, start_new_session=True)
        chunks: dict[str, list[bytes]] = {"out": [], "err": []}

        def pump(src: IO[bytes], key: str, dst: IO[str]) -> None:
            show = echo or (echo_stderr and key == "err")
            for line in iter(src.readline, b""):
                chunks[key].append(line)
                if show:
                    dst.write(line.decode(errors="replace"))
                    dst.flush()

        assert p.stdout is not None and p.stderr is not None
        pumps = [threading.Thread(target=pump, args=(p.stdout, "out", sys.stdout), daemon=True),
                 threading.Thread(target=pump, args=(p.stderr, "err", sys.stderr), daemon=True)]
        for t in pumps:
            t.start()
        timed_out = False
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:
            kill_group(p)
            raise
        if timed_out:
            kill_group(p)
        for t in pumps:
            t.join(timeout=10)
        out = b"".join(chunks["out"]).decode(errors="replace")
        err = b"".join(chunks["err"]).decode(errors="replace")
        if timed_out or p.returncode != 0:
            what = (f"timed out after {timeout:.0f} s" if timed_out
                    else f"exited with status {p.returncode}")
            raise TestBedError(f"driver {path} on node {node} {what}\n--- stdout tail ---\n"
                               f"{out[-3000:]}\n--- stderr tail ---\n{err[-5000:]}")
        return out

    def pids(self) -> dict[int, list[int]]:
        """The PIDs in each node's namespace."""
        return {node.index: ns_pids(node.namespace) for node in self.nodes}

    def _check_up(self) -> None:
        if not self._started or self._closed or not self.nodes:
            raise TestBedError("the test bed is not running (use it inside its `with`)")

    # ---------------------------------------------------------------- teardown

    def close(self, raise_errors: bool = True) -> None:
        """End every process in the namespaces, delete them and the links, and the logs
        unless ``keep_logs``. Raises TestBedError when something is left (with
        ``raise_errors``; else only logs it)."""
        if self._closed or not self._started:
            return
        t0 = time.monotonic()
        problems = self._teardown()
        self.timings["teardown"] = time.monotonic() - t0
        logger.info("testbed %s: torn down in %.1f s", self.tag, self.timings["teardown"])
        if problems:
            msg = f"test bed {self.tag} cleanup left: " + "; ".join(problems)
            if raise_errors:
                raise TestBedError(msg)
            logger.error("%s", msg)

    def _teardown(self) -> list[str]:
        self._closed = True
        if not self.tag:
            return []
        problems = delete_tag(self.tag, log=self.commands)
        problems += self._restore_cluster_file()
        with contextlib.suppress(OSError):
            (self.dir / "commands.log").write_text("\n".join(self.commands) + "\n")
        if self.keep_logs:
            with contextlib.suppress(OSError):
                (self.dir / "KEEP").touch()
            logger.warning("testbed %s: logs kept in %s", self.tag, self.dir)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        if not problems and (not self.dir.exists() or self.keep_logs):
            with contextlib.suppress(FileNotFoundError):
                (BASE_DIR / f"{self.tag}.lock").unlink()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        return problems

    def _restore_cluster_file(self) -> list[str]:
        """Remove Ray's default ``ray_current_cluster`` if it names this test bed (a plain
        ``ray.init()`` on the host would try to join the dead address)."""
        if not self.nodes:
            return []
        return restore_cluster_file(self._ray_cluster_file_before, self.address)


def _node_report(node: Node, bed_dir: Path, short: bool) -> str:
    i = node.index
    start = _excerpt(bed_dir / f"ray-start-n{i}.log", tail=12)
    logs = node.temp_dir / "session_latest" / "logs"
    if short:
        last = [t.strip().splitlines()[-1] for t in
                [start, *(_excerpt(logs / n, tail=0) for n in _LOG_FILES)] if t.strip()]
        return " | ".join(x[-300:] for x in last)
    parts = [f"\n--- node {i} ({node.namespace}, {node.ip}): ray start output ---\n"
             + start]
    for name in _LOG_FILES:
        text = _excerpt(logs / name)
        if text.strip():
            parts.append(f"\n--- node {i}: {name} ---\n{text}")
    return "".join(parts)
