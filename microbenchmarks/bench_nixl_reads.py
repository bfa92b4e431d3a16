"""The floor of ``bench_buckets``: the same bytes READ in 4 or in 64 transfers between two
bare NIXL agents in two processes, with no Ray, no pool and no signals.

A stream of N buckets costs at least N transfers (one per bucket) plus the copies; this
measures what N transfers cost on their own, so that the per-bucket cost that
``bench_buckets`` reports can be split into NIXL's (post, UCX, completion) and ours.

    python -m microbenchmarks.bench_nixl_reads [--mib 64] [--buckets 4,64] [--rounds 9]

Each round READs the whole buffer once per bucket count, one transfer at a time (the
stream reads bucket b+1 only once the sender packed it); the median of the rounds is
printed, and the ratio of the last count to the first.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _source(nbytes: int, conn: Any) -> None:
    """The sender: registers a buffer, hands out its metadata and address, then waits."""
    import torch

    buf = torch.arange(nbytes, dtype=torch.uint8)
    agent = _agent("src")
    reg = agent.register_memory(buf)
    conn.send((bytes(agent.get_agent_metadata()), buf.data_ptr()))
    while not conn.poll(0.0005):  # the reader is done; till then, progress the wire-up
        agent.get_new_notifs()
    conn.recv()
    agent.deregister_memory(reg)


def _read_all(agent: Any, remote: str, local: Any, src_addr: int, nbytes: int,
              count: int) -> float:
    step = nbytes // count
    t0 = time.perf_counter()
    for b in range(count):
        off = b * step
        ldl = agent.get_xfer_descs([(local.data_ptr() + off, step, 0)], "DRAM")
        rdl = agent.get_xfer_descs([(src_addr + off, step, 0)], "DRAM")
        h = agent.initialize_xfer("READ", ldl, rdl, remote, b"")
        state = str(agent.transfer(h))
        while state not in ("DONE", "ERR"):
            state = str(agent.check_xfer_state(h))
        agent.release_xfer_handle(h)
        if state == "ERR":
            raise RuntimeError("a READ failed")
    return time.perf_counter() - t0


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--buckets", default="4,64")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    nbytes = a.mib << 20
    counts = [int(c) for c in a.buckets.split(",")]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_source, args=(nbytes, child))
    proc.start()
    md, src_addr = parent.recv()
    agent = _agent("dst")
    local = torch.empty(nbytes, dtype=torch.uint8)
    reg = agent.register_memory(local)
    remote = agent.add_remote_agent(md)
    try:
        for c in counts:  # warm: connections, page faults
            _read_all(agent, remote, local, src_addr, nbytes, c)
        times: dict[int, list[float]] = {c: [] for c in counts}
        for _ in range(a.rounds):
            for c in counts:
                times[c].append(_read_all(agent, remote, local, src_addr, nbytes, c))
        assert torch.equal(local, torch.arange(nbytes, dtype=torch.uint8))
        print(f"bare NIXL READs of {a.mib} MiB, two processes, medians of {a.rounds}:")
        med = {c: statistics.median(ts) for c, ts in times.items()}
        for c in counts:
            print(f"  {c:4d} transfers: {med[c] * 1e3:7.1f} ms "
                  f"({(med[c] - med[counts[0]]) / max(c - counts[0], 1) * 1e6:.0f} us per "
                  "extra transfer)" if c != counts[0] else
                  f"  {c:4d} transfers: {med[c] * 1e3:7.1f} ms")
        print(f"  {counts[-1]} / {counts[0]}: {med[counts[-1]] / med[counts[0]]:.2f}x")
    finally:
        agent.remove_remote_agent(remote)
        agent.deregister_memory(reg)
        parent.send(None)
        proc.join(30)


if __name__ == "__main__":
    main()
