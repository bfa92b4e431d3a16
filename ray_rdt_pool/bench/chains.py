"""The floors of a relayed sync on the test bed: the same chain with no Ray at all.

Two chains of ``hops`` receivers run on the test bed's namespaces and links, each node a
plain process (no Ray), node 0 the source:

* ``tcp``: a pipelined TCP chain. Node 0 writes ``size`` bytes in ``bucket`` buckets to
  node 1; each node reads a whole bucket, then forwards it while it reads the next one
  (store and forward, at most ``inflight`` buckets queued). What the links allow.
* ``nixl``: the same buckets as one-sided NIXL READs with notifications, as a relayed
  sync moves them: node k READs bucket b from node k-1's registered memory once node
  k-1 signalled it ready, then signals node k+1. What UCX allows, without Ray.

The last node answers each round back to node 0 (TCP: one byte up the chain; NIXL: a
notification), whose clock times the round: first byte out to the answer back. One
connection per link carries every round; the first round is a warm-up.
:func:`run_chain` runs one chain length on a :class:`~ray_rdt_pool.bench.testbed.TestBed`
and returns its round times; ``testbed_sync --floors tcp,nixl`` measures both beside
ours in one run. Each node runs this module as a program (``--tcp-node``,
``--nixl-node``).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from ray_rdt_pool.core.clock import Backoff

TCP_PORT = 47011
NIXL_PORT = 47012


def _connect(ip: str, port: int, deadline_s: float = 60.0) -> socket.socket:
    end = time.monotonic() + deadline_s
    while True:
        try:
            s = socket.create_connection((ip, port), timeout=5.0)
            s.settimeout(None)
            return s
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def _listen(port: int, backlog: int = 1) -> socket.socket:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(backlog)
    return srv


def _recv_exact(s: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = s.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("the other node closed the connection")
        got += k
    return buf


def _buckets(size: int, bucket: int) -> list[int]:
    return [min(bucket, size - off) for off in range(0, size, bucket)]


# -- TCP ---------------------------------------------------------------------------------


def tcp_relay(nxt: str | None, size: int, bucket: int, rounds: int, inflight: int) -> None:
    """A node of the TCP chain: read each bucket whole, forward it while reading on."""
    srv = _listen(TCP_PORT)
    down = _connect(nxt, TCP_PORT) if nxt else None
    up, _addr = srv.accept()
    srv.close()
    q: queue.Queue[bytearray] = queue.Queue(maxsize=inflight)

    def forward() -> None:
        assert down is not None
        while True:
            down.sendall(q.get())

    def answers() -> None:
        assert down is not None
        for _r in range(rounds):
            b = down.recv(1)
            if not b:
                return
            up.sendall(b)

    back = threading.Thread(target=answers, daemon=True)
    if down is not None:
        threading.Thread(target=forward, daemon=True).start()
        back.start()
    for _r in range(rounds):
        for n in _buckets(size, bucket):
            buf = _recv_exact(up, n)
            if down is not None:
                q.put(buf)
        if down is None:
            up.sendall(b"A")
    if down is not None:
        back.join()  # every round's answer went up the chain


def tcp_send(first: str, size: int, bucket: int, rounds: int) -> list[float]:
    """Node 0 of the TCP chain: send ``rounds`` rounds, time each to the answer."""
    s = _connect(first, TCP_PORT)
    payload = memoryview(bytearray(os.urandom(bucket)))
    times = []
    for _r in range(rounds):
        t0 = time.perf_counter()
        for n in _buckets(size, bucket):
            s.sendall(payload[:n])
        if s.recv(1) != b"A":
            raise ConnectionError("the chain ended without its answer")
        times.append(time.perf_counter() - t0)
    return times


# -- NIXL --------------------------------------------------------------------------------


def _send_blob(s: socket.socket, blob: bytes) -> None:
    s.sendall(struct.pack("<Q", len(blob)) + blob)


def _recv_blob(s: socket.socket) -> bytes:
    (n,) = struct.unpack("<Q", _recv_exact(s, 8))
    return bytes(_recv_exact(s, n))


def nixl_node(i: int, hops: int, hub: str, size: int, bucket: int, rounds: int) -> list[float]:
    """Node ``i`` of the NIXL chain (0: the source, which times the rounds)."""
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"chain-{i}", nixl_agent_config(enable_prog_thread=False,
                                                         backends=["UCX"]))
    buf = np.frombuffer(bytearray(os.urandom(size)) if i == 0 else bytearray(size),
                        dtype=np.uint8)
    addr = buf.ctypes.data
    reg = agent.register_memory([(addr, size, 0, "")], "DRAM")
    me = json.dumps({"i": i, "addr": addr}).encode() + b"\n" + agent.get_agent_metadata()
    # Node 0 is the hub of a one-off exchange of every node's metadata and address.
    if i == 0:
        srv = _listen(NIXL_PORT, hops)
        conns = [srv.accept()[0] for _ in range(hops)]
        srv.close()
        blobs = [me] + [_recv_blob(c) for c in conns]
        for c in conns:
            for b in blobs:
                _send_blob(c, b)
    else:
        c = _connect(hub, NIXL_PORT)
        _send_blob(c, me)
        blobs = [_recv_blob(c) for _ in range(hops + 1)]
    peers: dict[int, tuple[str, int]] = {}
    for b in blobs:
        head, md = b.split(b"\n", 1)
        info = json.loads(head)
        if info["i"] in (i - 1, i + 1, 0) and info["i"] != i:
            name = agent.add_remote_agent(md)
            peers[info["i"]] = (name.decode() if isinstance(name, bytes) else name,
                                info["addr"])
    sizes = _buckets(size, bucket)
    inbox: list[tuple[str, bytes]] = []

    def poll() -> None:
        for sender, msgs in agent.get_new_notifs().items():
            s = sender.decode() if isinstance(sender, bytes) else str(sender)
            inbox.extend((s, bytes(m)) for m in msgs)

    def wait_for(sender: str, msg: bytes) -> None:
        backoff = Backoff()  # the pauses of ours, so that the floor polls alike
        while True:
            for j, (s, m) in enumerate(inbox):
                if s == sender and m == msg:
                    del inbox[j]
                    return
            poll()
            time.sleep(backoff.next())

    def send(k: int, msg: bytes) -> None:
        while True:
            try:
                agent.send_notif(peers[k][0], msg)
                return
            except Exception:  # the connection is being made
                poll()
                time.sleep(0.001)

    last = hops
    times: list[float] = []
    for r in range(rounds):
        tag = b"%d/" % r
        if i == 0:
            t0 = time.perf_counter()
            for b in range(len(sizes)):
                send(1, tag + b"R%d" % b)
            wait_for(f"chain-{last}", tag + b"A")  # no need to load it to hear it
            times.append(time.perf_counter() - t0)
            continue
        up_name, up_addr = peers[i - 1]
        for b, n in enumerate(sizes):
            wait_for(up_name, tag + b"R%d" % b)
            off = b * bucket
            local = agent.get_xfer_descs([(addr + off, n, 0)], "DRAM")
            remote = agent.get_xfer_descs([(up_addr + off, n, 0)], "DRAM")
            h = agent.initialize_xfer("READ", local, remote, up_name)
            state = agent.transfer(h)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(h)
            agent.release_xfer_handle(h)
            if state == "ERR":
                raise RuntimeError(f"node {i}: READ of bucket {b} failed")
            if i < last:
                send(i + 1, tag + b"R%d" % b)
        if i == last:
            send(0, tag + b"A")
    # Leave only once the next node read everything from here: its word comes up the
    # chain from the last node.
    if i < last:
        wait_for(f"chain-{i + 1}", b"X")
    if i > 0:
        send(i - 1, b"X")
    time.sleep(0.2)  # let the last notification leave before the agent goes
    agent.deregister_memory(reg)
    return times


# -- host side ---------------------------------------------------------------------------


def run_chain(bed: Any, kind: str, hops: int, size: int, bucket: int, rounds: int,
              inflight: int = 2, timeout_s: float = 600.0) -> list[float]:
    """Run one ``kind`` chain (``"tcp"`` or ``"nixl"``) of ``hops`` receivers on nodes 0 to
    ``hops`` of ``bed`` for ``rounds`` rounds; returns the round times after the first."""
    ips = [n.ip for n in bed.nodes]
    me = [sys.executable, "-m", "ray_rdt_pool.bench.chains"]
    procs = []
    if kind == "tcp":
        for i in range(hops, 0, -1):
            nxt = ips[i + 1] if i < hops else ""
            procs.append(bed.popen(i, [*me, "--tcp-node", nxt, str(size), str(bucket),
                                       str(rounds), str(inflight)]))
        head = bed.popen(0, [*me, "--tcp-send", ips[1], str(size), str(bucket),
                             str(rounds)], stdout=subprocess.PIPE, text=True)
    elif kind == "nixl":
        for i in range(1, hops + 1):
            procs.append(bed.popen(i, [*me, "--nixl-node", str(i), str(hops), ips[0],
                                       str(size), str(bucket), str(rounds)]))
        head = bed.popen(0, [*me, "--nixl-node", "0", str(hops), ips[0], str(size),
                             str(bucket), str(rounds)], stdout=subprocess.PIPE, text=True)
    else:
        raise ValueError(f"no chain of kind {kind!r}: 'tcp' or 'nixl'")
    try:
        out, _ = head.communicate(timeout=timeout_s)
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in [head, *procs]:
            if p.poll() is None:
                p.kill()
    if head.returncode or any(p.returncode for p in procs):
        raise RuntimeError(f"the {kind} chain of {hops} hop(s) failed")
    return [float(t) for t in json.loads(out.strip().splitlines()[-1])][1:]


def main(argv: list[str]) -> int:
    role, rest = argv[0], argv[1:]
    if role == "--tcp-node":
        tcp_relay(rest[0] or None, *(int(x) for x in rest[1:5]))
    elif role == "--tcp-send":
        print(json.dumps(tcp_send(rest[0], *(int(x) for x in rest[1:4]))), flush=True)
    elif role == "--nixl-node":
        i, hops = int(rest[0]), int(rest[1])
        times = nixl_node(i, hops, rest[2], *(int(x) for x in rest[3:6]))
        if i == 0:
            print(json.dumps(times), flush=True)
    else:
        print(f"unknown role {role!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
