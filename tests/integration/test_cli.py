"""The ``ray-rdt-pool`` command against a Ray cluster that was running before it.

The one-node tests run ``bench --address``, ``stats --address`` and ``doctor --address``
as subprocesses that join the test process's shared cluster (the full ``bench
--address`` run is tests/integration/test_bench_cli.py). The two-node tests start a
cluster of their own, because they need two nodes: ``ray start --head`` and ``ray start
--address`` (their own temp dir and ports; stopped by the PIDs of their processes, never
with Ray's host-wide stop command), on which ``bench --nodes 2`` must place the receiver
on the other node and ``doctor`` must READ between the two. ``doctor`` must also fail,
naming the fix, when NIXL cannot import.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

from tests.support.raycluster import subprocess_env

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "ray_rdt_pool.cli"]
#: The smallest bench run that still moves every byte through ours and the object store.
TINY = ["--quick", "--reps", "1", "--warmup", "0", "--variants", "objstore,nixl_pool",
        "--workloads", "big,sync", "--big-mib", "1", "--tf-hidden", "32", "--tf-layers", "2",
        "--tf-vocab", "64", "--sync-iters", "2", "--idle-s", "0.1", "--idle-settle-s", "0",
        "--no-ucx-probe", "--no-floor"]


def _env(**extra: str) -> dict[str, str]:
    """This process's environment (with its Ray token settings, which the shared cluster
    asks for) but its RAY_ADDRESS and this package's settings, and ``extra``."""
    env = subprocess_env(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0",
                         RAY_RDT_POOL_POOL_BYTES="32M", RAY_RDT_POOL_ARENA_BYTES="32M")
    env.update(extra)
    return env


#: The two-node cluster's processes and its clients: no token (the shared cluster of the
#: test process has one, which its clients find in this process's environment).
_OWN = {"RAY_AUTH_MODE": "disabled"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ours(temp_dir: str) -> list[psutil.Process]:
    """This cluster's processes: each names its temp dir (or session dir) in its arguments."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in arg for arg in p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _ports(*flags: str) -> list[str]:
    argv: list[str] = []
    for flag in flags:
        argv += [flag, str(_free_port())]
    return argv


#: The ports every node of the cluster takes; each gets a free one, away from a
#: cluster another test or helper runs on this host.
_NODE_PORTS = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
               "--metrics-export-port", "--runtime-env-agent-port", "--node-manager-port",
               "--object-manager-port")


class _Cluster:
    """A cluster of ``ray start`` processes, each node its own process group."""

    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rcli", dir="/tmp")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.starters: list[subprocess.Popen[bytes]] = []
        self.ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"

    def _start(self, argv: list[str]) -> None:
        # A loaded host starts the raylet's agent slowly; Ray's default wait then kills it.
        log = open(os.path.join(self.temp_dir, f"start-{len(self.starters)}.log"), "wb")
        with log:
            self.starters.append(subprocess.Popen(
                [self.ray_cli, "start", "--block", "--num-cpus", "1", "--disable-usage-stats",
                 "--object-store-memory", str(300 << 20), *_ports(*_NODE_PORTS), *argv],
                env=_env(RAY_agent_register_timeout_ms="300000", **_OWN),
                start_new_session=True, stdout=log, stderr=subprocess.STDOUT))

    def _log(self, i: int) -> str:
        path = os.path.join(self.temp_dir, f"start-{i}.log")
        with open(path, "rb") as f:
            return f.read()[-3000:].decode(errors="replace")

    def start_head(self) -> None:
        # Each port was free when chosen, yet another test's cluster starting at the same
        # moment may take one first; a head that exits is started again on new ports.
        for attempt in range(3):
            self._start(["--head", "--port", str(self.port), "--include-dashboard", "false",
                         "--temp-dir", self.temp_dir, *_ports("--ray-client-server-port")])
            try:
                self.wait_for(1)
                return
            except AssertionError:
                if attempt == 2 or self.starters[-1].poll() is None:
                    raise
                why = self._log(len(self.starters) - 1)
                print(f"ray start --head exited, started again:\n{why}")
                self.starters.pop()
                self.port = _free_port()
                self.address = f"127.0.0.1:{self.port}"

    def add_node(self) -> None:
        self._start(["--address", self.address])
        self.wait_for(len(self.starters))

    def wait_for(self, nodes: int) -> None:
        deadline = time.monotonic() + 180
        while True:
            probe = subprocess.run(
                [sys.executable, "-c", "import ray; ray.init(); "
                 "print(len([n for n in ray.nodes() if n['Alive']]))"],
                env=_env(RAY_ADDRESS=self.address, **_OWN), capture_output=True, text=True,
                timeout=120)
            if probe.returncode == 0 and probe.stdout.strip().endswith(str(nodes)):
                return
            exited = [i for i, p in enumerate(self.starters) if p.poll() is not None]
            assert not exited, f"a ray start exited:\n{self._log(exited[0])}"
            assert time.monotonic() < deadline, \
                f"{nodes} node(s) did not come up: {probe.stderr[-2000:]}"
            time.sleep(1)

    def stop(self) -> None:
        """End the ``ray start`` processes and every process that names this cluster's
        temp dir (or its session dir, inside it) in its arguments."""
        starters = [psutil.Process(p.pid) for p in self.starters if p.poll() is None]
        procs = [*starters, *_ours(self.temp_dir)]
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
        _gone, alive = psutil.wait_procs(procs, timeout=5)  # then killed: nothing to keep
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        for p in self.starters:
            p.wait(timeout=30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(ray_cluster: str) -> str:
    """The test process's shared cluster (one node), running before the command."""
    return ray_cluster


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[str]:
    """A cluster of two ``ray start`` nodes of the module's own."""
    c = _Cluster()
    try:
        c.start_head()
        c.add_node()
        yield c.address
    finally:
        c.stop()


def _run(args: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=ROOT, env=_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def test_bench_nodes_2_names_how_many_nodes_it_found(cluster: str) -> None:
    proc = _run(["bench", "--address", cluster, *TINY, "--nodes", "2"], timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "2 distinct Ray nodes" in proc.stderr and "has 1 alive node(s)" in proc.stderr


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Holder:
    """An actor that holds one object of its own (256 Ki floats: 1 MiB)."""

    def __init__(self) -> None:
        import torch

        import ray_rdt_pool

        ray_rdt_pool.register()
        self.t = torch.ones(1 << 18)
        self.ref = ray.put([self.t], _tensor_transport="nixl_pool")

    def ready(self) -> bool:
        return True


def test_stats_shows_a_named_actor_of_the_cluster(cluster: str) -> None:
    """A named actor of the cluster (made by this process, in a namespace of its own), as
    ``stats --address`` lists it from another driver."""
    h = Holder.options(name="holder", namespace="clitest").remote()
    try:
        assert ray.get(h.ready.remote(), timeout=180)
        proc = _run(["stats", "--address", cluster, "--namespace", "clitest", "--json"],
                    timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = json.loads(proc.stdout)
        held = [r for r in rows if r["actor"].startswith("Holder")]
        assert len(held) == 1 and held[0]["live_objects"] == 1, rows
        assert held[0]["pool_used"] >= 1 << 20
        table = _run(["stats", "--address", cluster, "--namespace", "clitest"], timeout=120)
        assert "pool used/capacity" in table.stdout and "Holder" in table.stdout
    finally:
        ray.kill(h)


class _OtherDashboard:
    """An HTTP server that answers Ray's state API as another cluster's dashboard would,
    with no actor alive there (what ``RAY_ADDRESS`` names in a shell that ran Ray's Jobs
    guide)."""

    def __enter__(self) -> str:
        import http.server
        import threading

        body = json.dumps({"result": True, "msg": "", "data": {"result": {
            "result": [], "total": 0, "num_after_truncation": 0, "num_filtered": 0,
            "partial_failure_warning": "", "warnings": None}}}).encode()
        self.asked: list[str] = []
        asked = self.asked

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                asked.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()


def test_stats_reads_the_cluster_it_names_whatever_ray_address_says(cluster: str) -> None:
    """``stats --address B`` with ``RAY_ADDRESS`` naming another cluster's dashboard
    listed that cluster's actors (Ray's state API picks its own target): B's named actor
    was missing. It reads B's own actor table."""
    driver = (
        "import ray, torch, ray_rdt_pool\n"
        "ray.init(namespace='clitest2')\n"
        "ray_rdt_pool.register()\n"
        "@ray.remote(num_cpus=0, enable_tensor_transport=True)\n"
        "class Holder:\n"
        "    def __init__(self):\n"
        "        ray_rdt_pool.register()\n"
        "        self.t = torch.ones(1 << 18)\n"
        "        self.ref = ray.put([self.t], _tensor_transport='nixl_pool')\n"
        "    def ready(self):\n"
        "        return True\n"
        "h = Holder.options(name='holder2', lifetime='detached').remote()\n"
        "ray.get(h.ready.remote())\n")
    up = subprocess.run([sys.executable, "-c", driver], env=_env(RAY_ADDRESS=cluster),
                        capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert up.returncode == 0, up.stderr[-2000:]
    try:
        with _OtherDashboard() as other:
            proc = _run(["stats", "--address", cluster, "--namespace", "clitest2", "--json"],
                        timeout=120, RAY_ADDRESS=other)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = json.loads(proc.stdout)
        assert [r["live_objects"] for r in rows if r["actor"].startswith("Holder")] == [1], \
            rows
    finally:
        subprocess.run([sys.executable, "-c", "import ray; ray.init(namespace='clitest2'); "
                        "ray.kill(ray.get_actor('holder2'))"], env=_env(RAY_ADDRESS=cluster),
                       capture_output=True, timeout=120)


def test_doctor_passes_here(cluster: str) -> None:
    proc = _run(["doctor", "--address", cluster], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    for name in ("versions", "nixl", "memfd", "native helpers", "actors", "ucx"):
        assert any(line.split()[1:2] == name.split()[:1] for line in proc.stdout.splitlines()
                   if line.startswith("ok")), (name, proc.stdout)
    assert "all checks passed" in proc.stdout


def test_doctor_fails_and_says_what_to_fix_when_nixl_is_hidden(tmp_path: Path) -> None:
    fake = tmp_path / "nixl"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    proc = subprocess.run([*CLI, "doctor", "--no-actors"], cwd=tmp_path, text=True,
                          capture_output=True, timeout=120,
                          env=_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}"))
    assert proc.returncode == 1, proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if ln.split()[1:2] == ["nixl"])
    assert line.startswith("FAIL") and "hidden by the test" in line
    assert "fix: pip install 'nixl>=1.5,<2'" in proc.stdout
    assert "1 check(s) failed: nixl" in proc.stdout


def test_bench_nodes_2_puts_the_receiver_on_the_other_node(two_nodes: str,
                                                           tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _run(["bench", "--address", two_nodes, *TINY, "--variants", "nixl_pool",
                 "--workloads", "big", "--nodes", "2", "--json", str(out)], **_OWN)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads(out.read_text())
    placement = data["config"]["placement"]
    assert data["ok"] is True and placement["sender"] != placement["receiver"]
    actors = data["variants"]["nixl_pool"]["actors"]
    assert actors["sender"]["node_id"] == placement["sender"]
    assert actors["receiver"]["node_id"] == placement["receiver"]
    assert data["summary"]["big"]["variants"]["nixl_pool"]["checksums_ok"] is True


def test_doctor_reads_between_two_nodes(two_nodes: str) -> None:
    proc = _run(["doctor", "--address", two_nodes], timeout=300, **_OWN)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    actors = [ln for ln in lines if ln.split()[1:2] == ["actors"]]
    assert len(actors) == 1 and actors[0].startswith("ok"), proc.stdout
    assert "two nodes of one host: one NIXL READ, byte for byte" in actors[0]
    ucx = next(ln for ln in lines if ln.split()[1:2] == ["ucx"])
    # UCX's own report, read in the receiving actor: the READ's protocol and transport.
    assert ucx.startswith("ok") and "a NIXL READ between the actors" in ucx, proc.stdout
    assert " via " in ucx
