"""The multi-node test bed (ray_rdt_pool/bench/testbed.py) keeps its promises.

Each Ray node in its own network namespace, its link limited both ways by tc, NIXL's
bytes over that link, and nothing left behind: no namespace, veth, bridge, process,
directory or lock, after a clean exit, after an exception in the ``with`` body, after a
node that fails to start, and after a run that was killed (the next run's cleanup). The
host's ``ray_current_cluster`` stays as it was. Needs root and network namespaces;
skipped with the reason elsewhere.

Link limits are checked as lower bounds on time (bytes that crossed a link cannot have
crossed faster than its rate): a limiter that does not hold fails them; nothing here
asserts how fast our code is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from ray_rdt_pool.bench import netns as N
from ray_rdt_pool.bench import netns_cleanup as C
from ray_rdt_pool.bench import testbed as tb
from ray_rdt_pool.bench.netns import TestBedError
from ray_rdt_pool.bench.netns_cleanup import cleanup_stale
from ray_rdt_pool.bench.testbed import TestBed

REASON = TestBed.available()
pytestmark = [pytest.mark.ray, pytest.mark.skipif(REASON is not None, reason=str(REASON)),
              pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
CLUSTER_FILE = C.default_cluster_file()

#: A TCP receiver on port 5201 of its namespace: prints "ready", takes ``n`` connections,
#: drains them all, prints bytes and the seconds from "ready" to the last byte.
RECV = textwrap.dedent("""
    import socket, sys, threading, time
    n = int(sys.argv[1])
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 5201)); s.listen(8)
    t0 = time.monotonic(); print("ready", flush=True)
    got = []
    def drain(c):
        k = 0
        while b := c.recv(1 << 20):
            k += len(b)
        got.append(k)
    ts = [threading.Thread(target=drain, args=(s.accept()[0],)) for _ in range(n)]
    for t in ts: t.start()
    for t in ts: t.join()
    print(sum(got), time.monotonic() - t0, flush=True)
""")
SEND = textwrap.dedent("""
    import socket, sys
    c = socket.create_connection((sys.argv[1], 5201))
    c.sendall(b"x" * int(sys.argv[2]))
    c.close()
""")


def _names(tag: str) -> list[str]:
    """Every namespace and link of the host that carries the tag."""
    return [n for n in N.netns_list() + N.link_names() if tag in n]


def _running(pids: list[int]) -> list[int]:
    """The pids that still name a live (not zombie) process."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            out.append(pid)
    return out


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (the Ray processes of a test
    bed name its temp dir)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if text in p.joinpath("cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(p.name))
            except OSError:
                pass
    return _running(out)


def _assert_gone(bed: TestBed, pids: Sequence[int] = ()) -> None:
    assert bed.tag
    assert _names(bed.tag) == []
    assert not bed.dir.exists() and not (N.BASE_DIR / f"{bed.tag}.lock").exists()
    deadline = time.monotonic() + 10  # an exiting process may linger a moment as a zombie
    while (_running(list(pids)) or _processes_naming(str(bed.dir))) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(list(pids)) == []
    assert _processes_naming(str(bed.dir) + "/") == []


def _cluster_file() -> bytes | None:
    try:
        return CLUSTER_FILE.read_bytes()
    except OSError:
        return None


def _transfer(bed: TestBed, to: int, senders: list[int], nbytes: int) -> float:
    """Send ``nbytes`` from each sender node to node ``to`` at once; the receiver's seconds."""
    recv = bed.popen(to, [PY, "-c", RECV, str(len(senders))], stdout=subprocess.PIPE, text=True)
    assert recv.stdout is not None and recv.stdout.readline().strip() == "ready"
    procs = [bed.popen(i, [PY, "-c", SEND, bed.nodes[to].ip, str(nbytes)]) for i in senders]
    for p in procs:
        assert p.wait(timeout=60) == 0
    out, _ = recv.communicate(timeout=60)
    got, seconds = out.split()
    assert int(got) == nbytes * len(senders)
    return float(seconds)


def test_each_link_is_limited_both_ways_as_a_full_duplex_nic() -> None:
    rate, burst = "80mbit", "32kb"
    nbytes = 4 << 20
    host_links = N.link_names()
    with TestBed(nodes=3, rate=rate, burst=burst, ray=False) as bed:
        assert N.link_names() == host_links  # the bridge and veths are in namespaces
        # Every node's egress (in its namespace) and ingress (host end) carry the bucket.
        for node in bed.nodes:
            inner = subprocess.run(["ip", "netns", "exec", node.namespace, "tc", "qdisc",
                                    "show", "dev", N.INNER_DEV], capture_output=True,
                                   text=True, check=True).stdout
            outer = subprocess.run(["ip", "netns", "exec", bed.switch, "tc", "qdisc", "show",
                                    "dev", node.veth], capture_output=True, text=True,
                                   check=True).stdout
            assert "tbf" in inner and "rate 80Mbit" in inner, inner
            assert "tbf" in outer and "rate 80Mbit" in outer, outer
        # Two bursts' worth of slack: the receiver's and a sender's bucket start full.
        slack = 2 * N.parse_size(burst)
        floor_two = (2 * nbytes - slack) * 8 / N.parse_rate(rate)
        # Ingress: two senders, each under its own egress limit, into one node; without
        # the host-side qdisc this takes about half the time.
        assert _transfer(bed, 0, [1, 2], nbytes) >= floor_two
        # Egress: one node to two receivers at once.
        t1 = bed.popen(1, [PY, "-c", RECV, "1"], stdout=subprocess.PIPE, text=True)
        t2 = bed.popen(2, [PY, "-c", RECV, "1"], stdout=subprocess.PIPE, text=True)
        for r in (t1, t2):
            assert r.stdout is not None and r.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        procs = [bed.popen(0, [PY, "-c", SEND, bed.nodes[i].ip, str(nbytes)]) for i in (1, 2)]
        for p in procs:
            assert p.wait(timeout=60) == 0
        for r in (t1, t2):
            r.communicate(timeout=60)
        assert time.monotonic() - t0 >= floor_two
        pids = [p for ps in bed.pids().values() for p in ps]
    _assert_gone(bed, pids)


def test_no_rate_means_no_qdisc() -> None:
    with TestBed(nodes=2, rate=None, ray=False) as bed:
        for node in bed.nodes:
            out = subprocess.run(["ip", "netns", "exec", bed.switch, "tc", "qdisc", "show",
                                  "dev", node.veth], capture_output=True, text=True,
                                 check=True).stdout
            assert "tbf" not in out
        assert _transfer(bed, 1, [0], 1 << 20) > 0  # the nodes reach each other
    _assert_gone(bed)


DRIVER = textwrap.dedent("""
    import json, os, ray, torch
    import ray_rdt_pool
    ray.init()
    ray_rdt_pool.register()

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class Where:
        def __init__(self):
            ray_rdt_pool.register()
        def where(self):
            return [ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(),
                    os.environ.get("TESTBED_PROBE"), os.environ.get("UCX_TLS")]
        def put(self, nbytes):
            t = torch.arange(nbytes // 4, dtype=torch.int32)
            return [ray.put([t], _tensor_transport="nixl_pool")]
        def take(self, box):
            (t,) = ray.get(box[0])
            return bool(torch.equal(t, torch.arange(t.numel(), dtype=torch.int32)))

    n = len([x for x in ray.nodes() if x["Alive"]])
    actors = [Where.options(resources={f"node{i}": 0.01}).remote() for i in range(n)]
    print(json.dumps(ray.get([a.where.remote() for a in actors])), flush=True)
    input()  # the test reads the veth counters here
    box = ray.get(actors[0].put.remote(8 << 20))
    print(json.dumps(ray.get(actors[1].take.remote(box))), flush=True)
""")


def test_ray_nodes_each_in_a_namespace_and_cleanup_after_an_exception() -> None:
    before = _cluster_file()
    bed = TestBed(nodes=2, rate="1gbit", env={"TESTBED_PROBE": "passed",
                                               "PYTHONPATH": str(REPO),
                                               "RAY_RDT_POOL_METRICS": "0"})
    pids: list[int] = []
    with pytest.raises(KeyError, match="from the body"), bed:
        assert bed.address == f"{bed.nodes[0].ip}:{tb.HEAD_PORT}"
        assert len({n.ip for n in bed.nodes}) == 2
        assert _cluster_file() == before
        path = bed.dir / "where.py"
        path.write_text(DRIVER)
        p = bed.popen(0, [PY, str(path)], env={"RAY_ADDRESS": bed.address},
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdin is not None and p.stdout is not None
        where = json.loads(p.stdout.readline())
        # Actor i sits on node i (its IP), on distinct Ray nodes, with the env.
        assert [w[0] for w in where] == [n.ip for n in bed.nodes]
        assert len({w[1] for w in where}) == 2
        assert {(w[2], w[3]) for w in where} == {("passed", "tcp,self")}
        # A nixl_pool object from node 0 to node 1 crosses their links (UCX over TCP on
        # the limited veths, not cma or loopback), byte-exact.
        c0, c1 = bed.link_bytes(0), bed.link_bytes(1)
        p.stdin.write("\n")
        p.stdin.flush()
        assert json.loads(p.stdout.readline()) is True
        assert p.wait(timeout=60) == 0
        d0, d1 = bed.link_bytes(0), bed.link_bytes(1)
        assert d0[1] - c0[1] >= 8 << 20  # out of node 0
        assert d1[0] - c1[0] >= 8 << 20  # into node 1
        pids = [p for ps in bed.pids().values() for p in ps]
        assert len(pids) >= 5  # a raylet and its helpers per node, the GCS on the head
        raise KeyError("from the body")
    assert bed.timings["teardown"] > 0
    _assert_gone(bed, pids)
    assert _cluster_file() == before


def test_a_node_that_fails_to_start_is_named_and_everything_is_undone() -> None:
    before = _cluster_file()
    # Ray refuses an object store under 75 MiB: node 1's ray start fails, the head runs.
    bed = TestBed(nodes=2, rate="500mbit", node_args={1: ["--object-store-memory", "1000"]})
    with pytest.raises(TestBedError) as info:
        with bed:
            pytest.fail("the body ran although node 1 did not start")
    msg = str(info.value)
    assert "ray start failed on node(s) [1]" in msg
    assert "node 1" in msg and "minimum allowed" in msg  # the tail of its ray start output
    _assert_gone(bed)
    assert _cluster_file() == before
    assert "ray start --head" in "\n".join(bed.commands)


CRASH = textwrap.dedent("""
    import os, signal, subprocess, sys
    from ray_rdt_pool.bench.testbed import TestBed
    with TestBed(nodes=2, rate="100mbit", ray=False) as bed:
        bed.popen(1, ["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(bed.tag, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup runs
""")


def test_leftovers_of_a_killed_run_are_removed_and_a_live_run_is_not() -> None:
    with TestBed(nodes=2, rate=None, ray=False) as live:
        mine = _names(live.tag)
        crashed = subprocess.run([PY, "-c", CRASH], capture_output=True, text=True,
                                 timeout=60, cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr
        tag = crashed.stdout.split()[0]
        left = _names(tag)
        assert len(left) == 3, left  # 2 nodes and the switch
        sleeper = _running(C.ns_pids(N.ns_name(tag, 1)))
        assert sleeper
        removed = cleanup_stale()
        assert tag in removed and live.tag not in removed
        assert _names(live.tag) == mine  # a live run's lock is held: untouched
        assert _names(tag) == [] and not (N.BASE_DIR / tag).exists()
        assert not (N.BASE_DIR / f"{tag}.lock").exists()
        deadline = time.monotonic() + 10
        while _running(sleeper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running(sleeper) == []
    _assert_gone(live)


def test_ray_current_cluster_is_removed_only_when_it_names_the_bed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    path = C.default_cluster_file()
    assert path == tmp_path / "ray" / "ray_current_cluster"
    path.parent.mkdir()
    bed = TestBed(nodes=1)
    bed.nodes = [tb.Node(0, "rtbxxxxn0", "198.18.7.1", "rtbxxxxv0", tmp_path / "n0")]
    bed._ray_cluster_file_before = None
    path.write_text(bed.address)
    assert bed._restore_cluster_file() == [] and not path.exists()
    path.write_text("10.1.2.3:6379")  # another cluster's, written meanwhile
    assert bed._restore_cluster_file() == [] and path.read_text() == "10.1.2.3:6379"
    bed._ray_cluster_file_before = b"10.9.9.9:6379"
    path.write_text(bed.address)  # ours over someone's: theirs comes back
    assert bed._restore_cluster_file() == [] and path.read_bytes() == b"10.9.9.9:6379"


def test_bad_arguments_and_reasons() -> None:
    with pytest.raises(ValueError, match="tc rate"):
        TestBed(nodes=2, rate="fast")
    with pytest.raises(ValueError, match="nodes"):
        TestBed(nodes=0)
    assert N.parse_rate("500mbit") == 5e8 and N.parse_size("512kb") == 512 * 1024
    bed = TestBed(nodes=2, ray=False)
    with pytest.raises(TestBedError, match="not running"):
        bed.run_driver("print(1)")
    bed.close()  # never started: nothing to do


def test_without_root_the_reason_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in str(TestBed._probe())
