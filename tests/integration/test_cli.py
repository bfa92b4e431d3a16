"""The ``ray-rdt-pool`` command against a Ray cluster that was running before it.

The module starts one cluster with ``ray start --head`` (its own temp dir and ports; it is
stopped by the PIDs of its processes, never ``ray stop``), then runs ``bench --address``,
``stats --address`` and ``doctor --address`` against it, as subprocesses that join it.
``doctor`` must also fail, naming the fix, when NIXL cannot import or Ray is untested.
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

import psutil
import pytest
import tomllib

from ray_rdt_pool.bench import workloads as W
from ray_rdt_pool.cli import doctor

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "ray_rdt_pool.cli"]
#: The smallest bench run that still moves every byte through ours and the object store.
TINY = ["--quick", "--reps", "1", "--warmup", "0", "--variants", "objstore,nixl_pool",
        "--workloads", "big,sync", "--big-mib", "1", "--tf-hidden", "32", "--tf-layers", "2",
        "--tf-vocab", "64", "--sync-iters", "2", "--idle-s", "0.1", "--idle-settle-s", "0",
        "--no-ucx-probe", "--no-floor"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               RAY_RDT_POOL_POOL_BYTES="32M", RAY_RDT_POOL_ARENA_BYTES="32M")
    env.update(extra)
    return env


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


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    temp_dir = tempfile.mkdtemp(prefix="rcli", dir="/tmp")
    port = _free_port()
    argv = [ray_cli, "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
            "--include-dashboard", "false", "--temp-dir", temp_dir, "--disable-usage-stats",
            "--object-store-memory", str(300 << 20)]
    for flag in ("--ray-client-server-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--metrics-export-port",
                 "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port"):
        argv += [flag, str(_free_port())]
    # A loaded host starts the raylet's agent slowly; Ray's default wait then kills it.
    head = subprocess.Popen(argv, env=_env(RAY_agent_register_timeout_ms="300000"),
                            start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            probe = subprocess.run(
                [sys.executable, "-c", "import ray; ray.init(); "
                 "print(len([n for n in ray.nodes() if n['Alive']]))"],
                env=_env(RAY_ADDRESS=address), capture_output=True, text=True, timeout=120)
            if probe.returncode == 0 and probe.stdout.strip().endswith("1"):
                break
            assert head.poll() is None, "ray start --head exited"
            assert time.monotonic() < deadline, f"the head did not come up: {probe.stderr[-2000:]}"
            time.sleep(1)
        yield address
    finally:
        procs = _ours(temp_dir)
        with_head = [psutil.Process(head.pid)] if head.poll() is None else []
        for p in [*with_head, *procs]:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
        _gone, alive = psutil.wait_procs([*with_head, *procs], timeout=20)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        head.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _run(args: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=ROOT, env=_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def test_console_script_is_declared() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["ray-rdt-pool"] == "ray_rdt_pool.cli:main"
    assert "matplotlib" in " ".join(meta["project"]["optional-dependencies"]["bench"])
    top = _run(["--help"], timeout=60)
    assert top.returncode == 0 and all(c in top.stdout for c in ("bench", "stats", "doctor"))


def test_bench_joins_a_running_cluster(cluster: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _run(["bench", "--address", cluster, *TINY, "--json", str(out)])
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads(out.read_text())
    assert data["ok"] is True and data["config"]["address"] == cluster
    assert data["config"]["placement"]["sender"] == data["config"]["placement"]["receiver"]
    assert set(data["summary"]) == {"big", "sync"}
    for name in ("objstore", "nixl_pool"):
        for workload in ("big", "sync"):
            row = data["summary"][workload]["variants"][name]
            assert row["checksums_ok"] is True, (name, workload, row)
    assert f"of the cluster at {cluster}" in proc.stdout


def test_bench_nodes_2_names_how_many_nodes_it_found(cluster: str) -> None:
    proc = _run(["bench", "--address", cluster, *TINY, "--nodes", "2"], timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "2 distinct Ray nodes" in proc.stderr and "has 1 alive node(s)" in proc.stderr


def test_stats_shows_a_named_actor_of_the_cluster(cluster: str) -> None:
    driver = (
        "import ray, time, torch, ray_rdt_pool\n"
        "ray.init(namespace='clitest')\n"
        "ray_rdt_pool.register()\n"
        "@ray.remote(num_cpus=0, enable_tensor_transport=True)\n"
        "class Holder:\n"
        "    def __init__(self):\n"
        "        ray_rdt_pool.register()\n"
        "        self.t = torch.ones(1 << 18)\n"
        "        self.ref = ray.put([self.t], _tensor_transport='nixl_pool')\n"
        "    def ready(self):\n"
        "        return True\n"
        "h = Holder.options(name='holder', lifetime='detached').remote()\n"
        "ray.get(h.ready.remote())\n"
        "print('up', flush=True)\n")
    up = subprocess.run([sys.executable, "-c", driver], env=_env(RAY_ADDRESS=cluster),
                        capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert up.returncode == 0 and "up" in up.stdout, up.stderr[-2000:]
    try:
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
        subprocess.run([sys.executable, "-c", "import ray; ray.init(namespace='clitest'); "
                        "ray.kill(ray.get_actor('holder'))"], env=_env(RAY_ADDRESS=cluster),
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


def test_doctor_fails_on_an_untested_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    real = doctor._version
    monkeypatch.setattr(doctor, "_version",
                        lambda d: "2.61.0" if d == "ray" else real(d))
    check = doctor.check_versions()
    assert check.failed and "Ray 2.61.0 is not the tested 2.60.x" in check.detail
    assert "pip install 'ray[default]==2.60.*'" in check.fix
    assert doctor.main(["--no-actors"]) == 1


def test_netns_nodes_needs_root_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from ray_rdt_pool.bench import run
    from ray_rdt_pool.bench.testbed import TestBed

    assert run.testbed_engine_counts(9) == [1, 2, 4, 8]
    assert run.testbed_engine_counts(6) == [1, 2, 4, 5]
    assert run.testbed_engine_counts(2) == [1]
    monkeypatch.setattr(TestBed, "available", classmethod(
        lambda cls, ray=True: "needs root (it creates network namespaces, veths and tc qdiscs)"))
    assert run.main(["--netns-nodes", "3", "--rate", "100mbit"]) == 2
    assert "needs root" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run.parse_config(["--netns-nodes", "1"])
    assert W.WORKLOADS  # the bench package imports without Ray
