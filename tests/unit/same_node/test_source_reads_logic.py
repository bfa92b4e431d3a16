"""Source reads without Ray: the reader against a forked child process, and the receiver
runtime (with the fake NIXL of ray_rdt_pool.testing, which this path never calls) reading
this process. What is promised, and the streams on a cluster, are in
tests/integration/test_source_reads.py.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
from collections.abc import Iterator

import pytest
import torch

from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.config import PoolConfig, Tuning
from ray_rdt_pool.errors import InvalidInputError, TransferError
from ray_rdt_pool.memory.pack_pool import copy_moves
from ray_rdt_pool.same_node.peer_memory import (
    SourceProcess,
    peer_batch_reader,
    peer_reader,
    probe_source,
    this_process,
)
from ray_rdt_pool.testing import World
from ray_rdt_pool.weights import WeightReceiver, WeightSender, WeightSyncError
from ray_rdt_pool.weights.advanced import SourceBucket, plan_layout


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _spec(*ts: torch.Tensor) -> list[tuple[int, tuple[int, ...], str]]:
    return [(t.data_ptr(), tuple(t.shape), _dt(t)) for t in ts]


def test_peer_reader_reads_another_process_and_fails_cleanly() -> None:
    data = os.urandom(1 << 20)
    r, w = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: hold the bytes until told to exit
        try:
            buf = ctypes.create_string_buffer(data, len(data))
            os.write(w, ctypes.addressof(buf).to_bytes(8, "little"))
            os.read(r2, 1)
        finally:
            os._exit(0)
    try:
        addr = int.from_bytes(os.read(r, 8), "little")
        out = ctypes.create_string_buffer(len(data))
        read = peer_reader(pid)
        copy_moves([(ctypes.addressof(out), addr, len(data))], 1, read)
        assert out.raw == data
        # a range not mapped in the child: an OSError, no crash
        with pytest.raises(OSError):
            read(ctypes.addressof(out), 8, 4096)
        # vectored: 3,000 short runs every 300 bytes (three system calls), then the same
        # with one bad run in the middle, which raises
        batch = peer_batch_reader(pid)
        runs = [(ctypes.addressof(out) + 100 * i, addr + 300 * i, 100) for i in range(3000)]
        ctypes.memset(out, 0, len(data))
        batch(runs)
        want = b"".join(data[300 * i:300 * i + 100] for i in range(3000))
        assert out.raw[:300_000] == want
        with pytest.raises(OSError):
            batch([*runs[:1500], (ctypes.addressof(out), 8, 100), *runs[1500:]])
    finally:
        os.write(w2, b"x")
        os.waitpid(pid, 0)
    with pytest.raises(OSError):  # the child is gone
        peer_reader(pid)(ctypes.addressof(out), addr, 16)


def test_probe_accepts_only_the_published_bytes() -> None:
    me = this_process("node-a")
    assert me is not None and me.alive() and probe_source(me)
    assert not probe_source(SourceProcess("node-a", me.pid, me.start, me.probe_addr,
                                          bytes(16)))  # other bytes at that address
    assert not probe_source(SourceProcess("node-a", me.pid, me.start + 1, me.probe_addr,
                                          me.probe))  # the pid of another process
    assert not probe_source(SourceProcess("node-a", me.pid, me.start, me.probe_addr, b""))


def test_copy_moves_on_threads_copies_everything_and_reraises() -> None:
    src = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    seen: set[str] = set()

    def copy(d: int, s: int, n: int) -> None:
        seen.add(threading.current_thread().name)
        ctypes.memmove(d, s, n)

    step = 3 << 20  # moves of odd sizes, cut into units by copy_moves
    moves = [(dst.data_ptr() + o, src.data_ptr() + o, min(step, src.numel() - o))
             for o in range(0, src.numel(), step)]
    copy_moves(moves, 2, copy)
    assert torch.equal(dst, src)
    assert len(seen) == 2  # the caller and one helper

    calls = 0

    def failing(d: int, s: int, n: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError(14, "bad address")
        ctypes.memmove(d, s, n)

    with pytest.raises(OSError, match="bad address"):
        copy_moves(moves, 2, failing)


@pytest.fixture()
def receiver() -> Iterator[Runtime]:
    rt = Runtime(PoolConfig(pool_bytes=1 << 20, arena_bytes=4 << 20, metrics=False,
                            tuning=Tuning(read_split_bytes=1 << 20)),
                 backend_factory=World().factory, directory=World(), node_id=lambda: "n1")
    yield rt
    rt.shutdown()


def test_receiver_reads_whole_selected_and_into_targets(receiver: Runtime) -> None:
    rt = receiver
    me = this_process("n1")
    assert me is not None and rt.receiver.sources.can_read(me)
    a, b, c = torch.randn(300, 40), torch.arange(1000), torch.tensor(3.5)
    big = torch.randn(1 << 19)  # 2 MiB: split over two threads (read_split_bytes 1 MiB)
    out = rt.receiver.sources.read(me, _spec(a, b, c, big))
    assert all(torch.equal(x, y) for x, y in zip(out, (a, b, c, big)))
    assert rt.stats().arena_used > 0 and rt.stats().source_reads == 1
    assert rt.stats().bytes_received == a.nbytes + b.nbytes + c.nbytes + big.nbytes
    del out
    gc.collect()
    rt.receiver.drain.run_locked()
    assert rt.stats().arena_used == 0  # the block returned with its views

    sel = [(slice(10, 20), slice(5, 9)), (slice(100, 200),), None, (slice(0, 0),)]
    out = rt.receiver.sources.read(me, _spec(a, b, c, big), sel)
    assert torch.equal(out[0], a[10:20, 5:9]) and torch.equal(out[1], b[100:200])
    assert torch.equal(out[2], c) and out[3].numel() == 0
    assert rt.stats().bytes_received - (a.nbytes + b.nbytes + c.nbytes + big.nbytes) == (
        10 * 4 * 4 + 100 * 8 + 4)
    del out

    targets = [torch.empty_like(a), torch.empty_like(b), torch.empty_like(c)]
    got = rt.receiver.sources.read(me, _spec(a, b, c), targets=targets)
    assert all(g is t for g, t in zip(got, targets))
    assert all(torch.equal(x, y) for x, y in zip(targets, (a, b, c)))


def test_receiver_refuses_bad_targets_and_dead_sources(receiver: Runtime) -> None:
    rt = receiver
    me = this_process("n1")
    assert me is not None
    a = torch.randn(64, 64)
    with pytest.raises(InvalidInputError, match="cannot hold"):
        rt.receiver.sources.read(me, _spec(a), targets=[torch.empty(64, 63)])
    with pytest.raises(InvalidInputError, match="cannot hold"):
        rt.receiver.sources.read(me, _spec(a), targets=[torch.empty(64, 64).t()])
    gone = SourceProcess("n1", me.pid, me.start + 1, me.probe_addr, me.probe)
    errors = rt.stats().transfer_errors
    with pytest.raises(TransferError, match="has probably exited"):
        rt.receiver.sources.read(gone, _spec(a))
    assert rt.stats().transfer_errors == errors + 1
    rt.receiver.drain.run_locked()
    assert rt.stats().arena_used == 0 and rt.stats().source_reads == 0  # nothing leaked
    # a bad address inside a live source: the kernel refuses, still a typed error
    with pytest.raises(TransferError):
        rt.receiver.sources.read(me, [(8, (1024,), "float32")])
    rt.receiver.drain.run_locked()
    assert rt.stats().arena_used == 0


def test_who_may_read_a_source() -> None:
    me = this_process("n1")
    assert me is not None
    for node, same_node, ok in (("n1", "map", True), ("n1", "copy", True),
                                ("n1", "off", False), ("n2", "map", False)):
        rt = Runtime(PoolConfig(pool_bytes=1 << 20, arena_bytes=1 << 20, metrics=False,
                                same_node=same_node),
                     backend_factory=World().factory, directory=World(),
                     node_id=lambda n=node: n)  # type: ignore[misc]
        assert rt.receiver.sources.can_read(me) is ok, (node, same_node)
        rt.shutdown()


def test_receiver_reads_only_the_source_it_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SourceBucket is loaded only within a stream whose receiver accepted that very
    process at its start; any other process named in a bucket fails the stream before a
    byte is read."""
    me = this_process("n1")
    assert me is not None
    src = {"a": torch.randn(10, 10), "b": torch.arange(7)}
    dest = {k: torch.zeros_like(v) for k, v in src.items()}
    rec = WeightReceiver(dest)
    layout, _groups = plan_layout(src, 1 << 20)
    sb = SourceBucket(me, tuple(src[e.name].data_ptr() for e in layout.entries))

    rec._begin_stream("s1", layout, 1)  # nobody accepted a source for s1
    with pytest.raises(WeightSyncError, match="did not accept"):
        rec._load_stream_bucket("s1", 0, [sb])
    assert all(not d.any() for d in dest.values())

    monkeypatch.setattr(WeightReceiver, "_can_read_source", lambda self, s: True)
    rec._begin_stream("s2", layout, 1)
    assert not rec._accept_source("s1", me)  # not the stream in progress
    assert rec._accept_source("s2", me)
    other = SourceProcess(me.node, me.pid, me.start, me.probe_addr + 1, me.probe)
    with pytest.raises(WeightSyncError, match="did not accept"):
        rec._load_stream_bucket("s2", 0, [SourceBucket(other, sb.addrs)])
    assert all(not d.any() for d in dest.values())

    rec._begin_stream("s3", layout, 1)
    assert rec._accept_source("s3", me)
    reports = rec._load_stream_bucket("s3", 0, [sb])
    assert [r.direct for r in reports] == [True] and rec.version == 0
    rec._finish_stream("s3", 1)
    assert rec.version == 1
    assert all(torch.equal(dest[k], v) for k, v in src.items())


def test_sender_option_is_checked() -> None:
    with pytest.raises(InvalidInputError, match="source_reads"):
        WeightSender({}, source_reads=1)  # type: ignore[arg-type]
