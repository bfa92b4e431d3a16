"""The floor of a relayed sync on the test bed: a plain pipelined TCP chain, no Ray.

Builds a :class:`ray_rdt_pool.bench.testbed.TestBed` of ``max(--hops) + 1`` namespaces with
``ray=False`` (the same links and ``tc`` limits as ``testbed_sync``) and, for each hop
count N, starts one relay process on nodes 1 to N and a sender on node 0. The sender
writes ``--size-mib`` in ``--bucket-mib`` buckets to node 1; each relay reads a whole
bucket, then forwards it to the next node while it reads the next one (store and
forward per bucket, at most ``--inflight`` buckets queued, as a relayed sync holds
them); the last node answers one byte per round back up the chain. One connection per
link carries every round (as Ray's connections stay up between syncs); the first round
is a warm-up. Reported per N: the median and every round time (sender's clock, first
byte out to the last node's answer back), the chain floor (S + (N - 1) * bucket) / B,
and both against N = 1.

    python -m microbenchmarks.testbed_chain --hops 1,2,4,8 --rate 500mbit
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

MIB = 1 << 20
PORT = 47011


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ray_rdt_pool.bench.testbed_cli import add_bed_args

    ap = argparse.ArgumentParser(prog="python -m microbenchmarks.testbed_chain",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--hops", default="1,2,4,8", help="comma-separated chain lengths")
    ap.add_argument("--size-mib", type=int, default=64, help="bytes per round, MiB")
    ap.add_argument("--bucket-mib", type=float, default=2.0, help="bucket size, MiB")
    ap.add_argument("--inflight", type=int, default=2, help="buckets a relay may queue")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per chain length")
    ap.add_argument("--out", default=None, help="folder for testbed_chain.json")
    add_bed_args(ap, nodes=None)
    args = ap.parse_args(argv)
    args.hop_counts = sorted({int(x) for x in str(args.hops).split(",") if x.strip()})
    if not args.hop_counts or args.hop_counts[0] < 1:
        ap.error(f"--hops must list counts >= 1, got {args.hops!r}")
    return args


# ------------------------------------------------------------ inside the namespaces


def _connect(ip: str, deadline_s: float = 60.0) -> socket.socket:
    end = time.monotonic() + deadline_s
    while True:
        try:
            s = socket.create_connection((ip, PORT), timeout=5.0)
            s.settimeout(None)
            return s
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def _recv_exact(s: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = s.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("the upstream node closed the connection")
        got += k
    return buf


def _buckets(size: int, bucket: int) -> list[int]:
    return [min(bucket, size - off) for off in range(0, size, bucket)]


def relay(nxt: str | None, size: int, bucket: int, rounds: int, inflight: int) -> None:
    """One node of the chain: read each bucket whole, forward it while reading on."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", PORT))
    srv.listen(1)
    down = _connect(nxt) if nxt else None
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


def send(first: str, size: int, bucket: int, rounds: int) -> None:
    """Node 0: send ``rounds`` rounds, time each to the last node's answer."""
    s = _connect(first)
    payload = memoryview(bytearray(os.urandom(bucket)))
    times = []
    for _r in range(rounds):
        t0 = time.perf_counter()
        for n in _buckets(size, bucket):
            s.sendall(payload[:n])
        if s.recv(1) != b"A":
            raise ConnectionError("the chain ended without its answer")
        times.append(time.perf_counter() - t0)
    print(json.dumps(times), flush=True)


# ------------------------------------------------------------------ host side


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in ("--relay-node", "--send-node"):
        role, rest = sys.argv[1], sys.argv[2:]
        size, bucket, rounds, inflight = (int(x) for x in rest[1:5])
        if role == "--relay-node":
            relay(rest[0] or None, size, bucket, rounds, inflight)
        else:
            send(rest[0], size, bucket, rounds)
        return 0
    args = parse_args(argv)

    import logging

    from ray_rdt_pool.bench.testbed import TestBed

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    reason = TestBed.available(ray=False)
    if reason is not None:
        print(f"the test bed cannot run here: {reason}", file=sys.stderr)
        return 2
    size, bucket = args.size_mib * MIB, int(args.bucket_mib * MIB)
    rounds = args.rounds + 1
    rate = None if str(args.rate).lower() in ("none", "0", "") else args.rate
    bed = TestBed(nodes=args.hop_counts[-1] + 1, rate=rate, burst=args.burst,
                  latency=args.latency, ray=False)
    results: list[dict[str, Any]] = []
    load: list[float] = []
    me = os.path.abspath(__file__)
    with bed:
        ips = [n.ip for n in bed.nodes]
        for n in args.hop_counts:
            procs = []
            for i in range(n, 0, -1):
                nxt = ips[i + 1] if i < n else ""
                procs.append(bed.popen(i, [sys.executable, me, "--relay-node", nxt, str(size),
                                           str(bucket), str(rounds), str(args.inflight)]))
            sender = bed.popen(0, [sys.executable, me, "--send-node", ips[1], str(size),
                                   str(bucket), str(rounds), "0"], stdout=subprocess.PIPE,
                               text=True)
            out, _ = sender.communicate(timeout=600)
            for p in procs:
                p.wait(timeout=60)
            if sender.returncode or any(p.returncode for p in procs):
                print(f"hops={n}: a process failed", file=sys.stderr)
                return 1
            load.append(os.getloadavg()[0])
            times = json.loads(out)[1:]
            results.append({"hops": n, "median_s": statistics.median(times), "times_s": times,
                            "floor_s": (size + (n - 1) * bucket) * 8 / bed.rate_bps
                            if bed.rate_bps else None})
            print(f"hops={n} {results[-1]['median_s']:.3f} s", file=sys.stderr, flush=True)
    base, fbase = results[0]["median_s"], results[0]["floor_s"]
    print(f"TCP chain, {args.size_mib} MiB in {args.bucket_mib:g} MiB buckets, "
          f"{bed.rate or 'unlimited'} per node, no Ray")
    print("| hops | median | all times | vs 1 hop | chain floor | floor vs 1 hop |")
    print("|---|---|---|---|---|---|")
    for r in results:
        fl = f"{r['floor_s']:.2f} s | {r['floor_s'] / fbase:.2f}x" if fbase else "- | -"
        print(f"| {r['hops']} | {r['median_s']:.2f} s | "
              f"{', '.join(f'{t:.2f}' for t in r['times_s'])} | "
              f"{r['median_s'] / base:.2f}x | {fl} |")
    print(f"load average (1 min) after each chain length: {load}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "testbed_chain.json"), "w") as f:
            json.dump({"results": results, "load1": load, "rate": bed.rate}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
