"""Weight sync under races and partial failures, in process (no cluster).

A :class:`WeightSender`'s ``stream()`` and real :class:`WeightReceiver` s run in this
process: a stand-in for Ray (tests/support/fakeray.py) runs each actor's calls on its
own thread, in order, as a plain actor does, and the transport is a ``Runtime`` over the
fake NIXL of ray_rdt_pool.testing (``same_node="off"``: every bucket is READ). Each test
stages one interleaving or failure that real Ray makes hard to hit on demand; the
real-Ray counterparts are in tests/integration/test_weights*.py.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ray_rdt_pool._ray.owned import free_owned, put_owned
from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.errors import (
    DuplicateTargetError,
    InvalidInputError,
    MissingWeightsError,
    PoolExhaustedError,
    UnexpectedWeightsError,
)
from ray_rdt_pool.weights import (
    Manifest,
    StaleVersionError,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WeightSyncTimeoutError,
    sync,
)
from ray_rdt_pool.weights.advanced import BucketLayout, WeightLayout, plan_layout
from tests.support.fakeray import Actor, Handle, _get, make_runtime, receiver_node

# ---------------------------------------------------------------------------------------
# The stand-in for Ray: tests/support/fakeray.py
# ---------------------------------------------------------------------------------------


@pytest.fixture()
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Runtime]]:
    yield from make_runtime(monkeypatch)


def filled(value: float, n: int = 6) -> dict[str, torch.Tensor]:
    """``w0`` .. ``w{n-1}``, 4 KiB each (one bucket each at 4 KiB buckets), all ``value``."""
    return {f"w{i}": torch.full((32, 32), float(value)) for i in range(n)}


def manifest(version: int, state: dict[str, torch.Tensor], mid: str = ""
             ) -> tuple[WeightLayout, list[list[torch.Tensor]], Manifest]:
    """A manifest whose bucket "refs" are the tensor lists themselves (ray.get is the
    identity for them here)."""
    layout, groups = plan_layout(state, 4096)
    refs: list[Any] = [[list(g)] for g in groups]
    return layout, groups, Manifest(layout, refs, version, id=mid or f"m{version}")


def values(dest: dict[str, torch.Tensor]) -> list[float]:
    return [float(t.flatten()[0]) for t in dest.values()]


class FailingReceiver(WeightReceiver):
    """Fails on bucket ``fail_at`` (None: never), as a failed READ or loader would."""

    fail_at: int | None = None

    def _load_bucket(self, plan: Any, ref: Any, *rest: Any) -> Any:
        if plan.index == self.fail_at:
            raise RuntimeError(f"injected failure on bucket {plan.index}")
        return super()._load_bucket(plan, ref, *rest)


# ---------------------------------------------------------------------------------------
# Finding 1: one writer at a time, versions never go down
# ---------------------------------------------------------------------------------------


class _Gate:
    """Stands in for a receiver's writer lock: the thread named ``held`` waits for
    ``release`` before it takes the lock (a load that reserved its version, then lost
    the race for the lock)."""

    def __init__(self, lock: Any, held: str, release: threading.Event) -> None:
        self.lock, self.held, self.release = lock, held, release

    def __enter__(self) -> Any:
        if threading.current_thread().name == self.held:
            assert self.release.wait(10)
        return self.lock.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.lock.__exit__(*exc)


def test_an_older_load_that_lost_the_race_is_refused_before_it_writes() -> None:
    """Loads of v6 and v7 reserve in that order; v7 writes and commits first. v6 then
    raises StaleVersionError without writing: the version stays 7 and every byte is v7's
    (it used to commit 6 over 7)."""
    import ray

    get, ray.get = ray.get, _get
    try:
        dest = filled(0)
        rec = WeightReceiver(dest, direct=False)
        v7_done = threading.Event()
        rec._writing = _Gate(rec._writing, "v6", v7_done)  # type: ignore[assignment]
        out: dict[int, Any] = {}

        def run(v: int) -> None:
            try:
                out[v] = rec.load(manifest(v, filled(v))[2]).version
            except BaseException as e:
                out[v] = e
            if v == 7:
                v7_done.set()

        t6 = threading.Thread(target=run, args=(6,), name="v6")
        t6.start()
        time.sleep(0.1)  # v6 reserved and waits at the gate
        t7 = threading.Thread(target=run, args=(7,), name="v7")
        t7.start()
        t7.join(10)
        t6.join(10)
    finally:
        ray.get = get
    assert out[7] == 7
    assert isinstance(out[6], StaleVersionError) and out[6].current == 7, out[6]
    assert rec.version == 7 and values(dest) == [7.0] * 6


def test_a_newer_load_supersedes_a_stream_in_progress(runtime: Any) -> None:
    """A stream of v5 has loaded buckets 0-2 when a load of v6 (a driver's publish)
    arrives: the load writes everything and commits 6; the stream's later buckets and
    its commit are refused, so the receiver holds v6 only and refuses v6 again (it used
    to end at version 5 holding [v6, v6, v6, v5, v5, v5])."""
    runtime()
    dest = filled(0)
    rec = WeightReceiver(dest, direct=False)
    lay5, g5, _m = manifest(5, filled(5))
    rec._begin_stream("s5", lay5, 5)
    for k in range(3):
        rec._load_stream_bucket("s5", k, [list(g5[k])])
    assert rec.load(manifest(6, filled(6))[2]).version == 6
    with pytest.raises(WeightSyncError, match="not in that stream"):
        rec._load_stream_bucket("s5", 3, [list(g5[3])])
    with pytest.raises(WeightSyncError, match="not in that stream"):
        rec._finish_stream("s5", 6)
    assert rec.version == 6 and values(dest) == [6.0] * 6
    with pytest.raises(StaleVersionError, match="version 6"):
        rec.load(manifest(6, filled(6), "another")[2])


class SlowReceiver(WeightReceiver):
    """Holds bucket ``hold`` of a stream between ``entered`` and ``go``."""

    hold = 0

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.entered, self.go = threading.Event(), threading.Event()

    def _stream_one(self, st: Any, k: int, *rest: Any) -> Any:
        if k == self.hold:
            self.entered.set()
            assert self.go.wait(10)
        return super()._stream_one(st, k, *rest)


def test_a_load_waits_for_the_stream_bucket_being_written(runtime: Any) -> None:
    """A load of v6 arrives while bucket 0 of a v5 stream is being written: it waits for
    that bucket, then supersedes the stream, so no v5 byte lands after a v6 byte."""
    runtime()
    dest = filled(0)
    rec = SlowReceiver(dest, direct=False)
    lay5, g5, _m = manifest(5, filled(5))
    rec._begin_stream("s5", lay5, 5)
    bucket = threading.Thread(target=rec._load_stream_bucket, args=("s5", 0, [list(g5[0])]))
    bucket.start()
    assert rec.entered.wait(10)
    out: list[Any] = []
    load = threading.Thread(target=lambda: out.append(rec.load(manifest(6, filled(6))[2])))
    load.start()
    time.sleep(0.2)  # the load would have written everything by now if it did not wait
    rec.go.set()
    bucket.join(10)
    load.join(10)
    assert out[0].version == 6 and rec.version == 6 and values(dest) == [6.0] * 6
    with pytest.raises(WeightSyncError, match="not in that stream"):
        rec._load_stream_bucket("s5", 1, [list(g5[1])])


def test_an_older_writer_is_refused_while_a_newer_stream_runs(runtime: Any) -> None:
    """While a stream of v8 holds the receiver, a begin or a load of v7 is refused (it
    used to abort the v8 stream and take its place); a begin of v9 supersedes it."""
    runtime()
    dest = filled(0)
    rec = WeightReceiver(dest, direct=False)
    lay, g8, _m = manifest(8, filled(8))
    rec._begin_stream("s8", lay, 8)
    rec._load_stream_bucket("s8", 0, [list(g8[0])])
    with pytest.raises(StaleVersionError, match="loading now") as info:
        rec._begin_stream("s7", lay, 7)
    assert info.value.loading and info.value.current == 8
    with pytest.raises(StaleVersionError, match="loading now"):
        rec.load(manifest(7, filled(7))[2])
    rec._load_stream_bucket("s8", 1, [list(g8[1])])  # s8 still holds the receiver
    _l, g9, _m = manifest(9, filled(9))
    rec._begin_stream("s9", lay, 9)
    with pytest.raises(WeightSyncError, match="not in that stream"):
        rec._load_stream_bucket("s8", 2, [list(g8[2])])
    for k in range(6):
        rec._load_stream_bucket("s9", k, [list(g9[k])])
    assert rec._finish_stream("s9", 6) == 0
    assert rec.version == 9 and values(dest) == [9.0] * 6


# ---------------------------------------------------------------------------------------
# Finding 2: only the sender's finish commits, after every receiver has every bucket
# ---------------------------------------------------------------------------------------


def test_an_aborted_stream_never_commits_even_if_its_last_bucket_finishes() -> None:
    """The sender gave up (timeout) and told the receiver to drop the stream while its
    last bucket was still loading: that bucket finishes, the version does not change
    (it used to be committed at the last bucket), and a late finish is refused."""
    import ray

    get, ray.get = ray.get, _get
    try:
        layout, groups, _m = manifest(9, filled(1, 3))
        loading, go = threading.Event(), threading.Event()

        def loader(batch: Any) -> None:
            for name, _t in batch:
                if name == "w2":
                    loading.set()
                    assert go.wait(10)

        rec = WeightReceiver(load_weights=loader)
        rec._begin_stream("s1", layout, 9)
        rec._load_stream_bucket("s1", 0, [list(groups[0])])
        rec._load_stream_bucket("s1", 1, [list(groups[1])])
        out: list[Any] = []
        t = threading.Thread(
            target=lambda: out.append(rec._load_stream_bucket("s1", 2, [list(groups[2])])))
        t.start()
        assert loading.wait(10)
        rec._abort_stream("s1")
        go.set()
        t.join(10)
        assert [r.bucket for r in out[0]] == [2]
        assert rec.version == 0
        with pytest.raises(WeightSyncError, match="not in that stream"):
            rec._finish_stream("s1", 3)
        assert rec.version == 0
    finally:
        ray.get = get


def test_a_stream_commits_only_once_every_receiver_has_every_bucket(runtime: Any) -> None:
    """r2 fails at the last bucket after r1 loaded every bucket: stream() raises and r1
    does not commit (it used to commit at its last bucket, so one receiver reported the
    new version for a stream the sender reported failed). The pool drains."""
    rt = runtime()
    state = filled(3, 4)
    r1, h1 = receiver_node(filled(0, 4))
    r2, h2 = receiver_node(filled(0, 4), FailingReceiver)
    r2.weight_receiver.fail_at = 3  # type: ignore[attr-defined]
    sender = WeightSender(state, bucket_bytes=4096, source_reads=False)
    with pytest.raises(RuntimeError, match="injected failure on bucket 3"):
        sender.stream([h1, h2], max_inflight=8)
    assert values(r1.weight_receiver.dest) == [3.0] * 4  # type: ignore[arg-type]
    assert r1.weight_receiver.version == 0 and r2.weight_receiver.version == 0
    st = rt.stats()
    assert st.pool_used == 0 and st.live_objects == 0 and st.arena_used == 0


# ---------------------------------------------------------------------------------------
# Finding 3: a pool that holds fewer than max_inflight buckets
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("lazy", [False, True], ids=["mapping", "lazy"])
def test_a_pool_of_one_bucket_streams_without_waiting_for_itself(runtime: Any,
                                                                 lazy: bool) -> None:
    """pool_bytes == bucket_bytes with max_inflight=2: the sender retires the
    acknowledged bucket to make room (it used to wait for timeout_s for a free that
    only it could make, then raise WeightSyncTimeoutError)."""
    rt = runtime(pool_bytes=64 << 10)
    state = {f"w{i}": torch.randn(8 << 10) for i in range(4)}  # 32 KiB each, 2 a bucket
    r1, h1 = receiver_node({k: torch.zeros_like(v) for k, v in state.items()})
    src: Any = (lambda: iter(state.items())) if lazy else state
    sender = WeightSender(src, bucket_bytes=64 << 10, source_reads=False)
    rep = sender.stream([h1], max_inflight=2, timeout_s=5.0)
    assert rep.buckets == 2 and rep.fallbacks == 0 and rep.peak_pool_used == 64 << 10
    assert all(torch.equal(r1.weight_receiver.dest[k], v)  # type: ignore[index]
               for k, v in state.items())
    assert r1.weight_receiver.version == 1
    st = rt.stats()
    assert st.pool_used == 0 and st.live_objects == 0 and st.fallbacks == 0


def test_a_pool_of_two_buckets_shared_with_another_object(runtime: Any) -> None:
    """Another object holds a page of a pool of exactly 2 buckets: the second bucket
    fits once the first is retired (it used to time out)."""
    rt = runtime(pool_bytes=64 << 10)
    put_owned("other", [torch.zeros(1024)])  # 4 KiB held by something else meanwhile
    try:
        state = {f"w{i}": torch.randn(8 << 10) for i in range(4)}
        r1, h1 = receiver_node({k: torch.zeros_like(v) for k, v in state.items()})
        sender = WeightSender(state, bucket_bytes=32 << 10, source_reads=False)
        rep = sender.stream([h1], max_inflight=2, timeout_s=5.0)
        assert rep.buckets == 4 and rep.fallbacks == 0
        assert all(torch.equal(r1.weight_receiver.dest[k], v)  # type: ignore[index]
                   for k, v in state.items())
        assert rt.stats().live_objects == 1  # only "other"
    finally:
        free_owned("other")
    assert rt.stats().pool_used == 0


@pytest.mark.parametrize("lazy", [False, True], ids=["mapping", "lazy"])
def test_a_bucket_larger_than_the_pool_fails_at_once(runtime: Any, lazy: bool) -> None:
    """A bucket the pool can never hold: PoolExhaustedError naming the sizes and the fix
    long before timeout_s, nothing put, nothing held, no receiver committed."""
    rt = runtime(pool_bytes=64 << 10)
    state = {"small": torch.randn(1024), "huge": torch.randn(32 << 10)}  # 128 KiB
    r1, h1 = receiver_node({k: torch.zeros_like(v) for k, v in state.items()})
    src: Any = (lambda: iter(state.items())) if lazy else state
    sender = WeightSender(src, bucket_bytes=4096, source_reads=False)
    t0 = time.monotonic()
    with pytest.raises(PoolExhaustedError, match="lower bucket_bytes or raise pool_bytes"):
        sender.stream([h1], timeout_s=60.0)
    assert time.monotonic() - t0 < 30.0
    st = rt.stats()
    assert st.pool_used == 0 and st.live_objects == 0 and st.fallbacks == 0
    assert r1.weight_receiver.version == 0


def test_a_converting_bucket_waits_for_one_free_block(runtime: Any) -> None:
    """A wire_dtype bucket packs into one contiguous block. With the pool's free bytes
    enough but split in two, the stream waits for a block that holds it (here another
    object is freed 0.3 s later) instead of packing into overflow memory, which costs
    a fallback registration (it used to count free bytes only)."""
    rt = runtime(pool_bytes=64 << 10)
    for i in range(4):
        put_owned(f"o{i}", [torch.zeros(4 << 10)])  # 16 KiB each: the pool is full
    free_owned("o0")
    free_owned("o2")  # 32 KiB free, largest block 16 KiB
    state = {"w": torch.randn(16 << 10)}  # 64 KiB fp32, 32 KiB as bf16
    r1, h1 = receiver_node({"w": torch.zeros(16 << 10, dtype=torch.bfloat16)})
    sender = WeightSender(state, bucket_bytes=32 << 10, wire_dtype=torch.bfloat16,
                          source_reads=False)
    timer = threading.Timer(0.3, free_owned, ("o1",))
    timer.start()
    try:
        rep = sender.stream([h1], timeout_s=10.0)
    finally:
        timer.join()
        free_owned("o3")
    assert rep.fallbacks == 0 and rt.stats().fallbacks == 0
    assert torch.equal(r1.weight_receiver.dest["w"],  # type: ignore[index]
                       state["w"].to(torch.bfloat16))
    assert rt.stats().pool_used == 0


# ---------------------------------------------------------------------------------------
# Finding 5: retries after a partial failure
# ---------------------------------------------------------------------------------------


def test_a_retry_after_a_partial_failure_uses_a_new_version(runtime: Any) -> None:
    """A lazy stream commits on r1 and fails at r2's commit (a destination tensor nobody
    sent). The sender's next default version is past the one r1 committed, so the retry
    succeeds on both (it used to resend that version, which r1 refused forever)."""
    rt = runtime()
    state = filled(4, 4)
    r1, h1 = receiver_node(filled(0, 4))
    r2, h2 = receiver_node({**filled(0, 4), "extra": torch.zeros(3)})
    sender = WeightSender(lambda: iter(state.items()), bucket_bytes=4096, source_reads=False)
    with pytest.raises(MissingWeightsError, match="'extra'"):
        sender.stream([h1, h2])
    assert (r1.weight_receiver.version, r2.weight_receiver.version) == (1, 0)
    assert sender.version == 0  # the last successful one
    r2.weight_receiver.strict = False  # the engine is fixed
    assert sender.stream([h1, h2]).version == 2
    assert (r1.weight_receiver.version, r2.weight_receiver.version) == (2, 2)
    assert rt.stats().pool_used == 0


def test_a_refused_begin_leaves_no_receiver_holding_the_stream(runtime: Any) -> None:
    """r1 refuses the stream (stale); r2, which began, is told to drop it, so it loads
    that version from a publish right after (it used to keep the stream and its
    reservation, and refuse as "loading now")."""
    rt = runtime()
    state = filled(5, 4)
    _r1, h1 = receiver_node(filled(0, 4))
    r2, h2 = receiver_node(filled(0, 4), direct=False)
    sender = WeightSender(state, bucket_bytes=4096, source_reads=False)
    assert sender.stream([h1], version=5).version == 5
    put0 = rt.stats().objects_put
    with pytest.raises(StaleVersionError, match="version 3 is not newer"):
        sender.stream([h1, h2], version=3)
    assert rt.stats().objects_put == put0  # refused before any bucket was put
    assert r2.weight_receiver.load(manifest(3, filled(3, 4))[2]).version == 3
    assert values(r2.weight_receiver.dest) == [3.0] * 4  # type: ignore[arg-type]


def test_a_failed_bucket_aborts_every_receiver(runtime: Any) -> None:
    """r2 fails at bucket 1: every receiver drops the stream, so both take a publish of
    the same version at once, and the next default-versioned stream succeeds."""
    rt = runtime()
    state = filled(6, 4)
    r1, h1 = receiver_node(filled(0, 4), direct=False)
    r2, h2 = receiver_node(filled(0, 4), FailingReceiver, direct=False)
    r2.weight_receiver.fail_at = 1  # type: ignore[attr-defined]
    sender = WeightSender(state, bucket_bytes=4096, source_reads=False)
    with pytest.raises(RuntimeError, match="injected failure on bucket 1"):
        sender.stream([h1, h2])
    r2.weight_receiver.fail_at = None  # type: ignore[attr-defined]
    for r in (r1, r2):
        assert r.weight_receiver.load(manifest(1, filled(1, 4))[2]).version == 1
    assert sender.stream([h1, h2]).version == 2
    assert values(r2.weight_receiver.dest) == [6.0] * 4  # type: ignore[arg-type]
    assert rt.stats().pool_used == 0


# ---------------------------------------------------------------------------------------
# Finding 6: tied destinations
# ---------------------------------------------------------------------------------------


class Tied(torch.nn.Module):
    def __init__(self, seed: int, tied: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(16, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def test_named_parameters_into_a_tied_receiver(runtime: Any) -> None:
    """``named_parameters()`` lists a tied weight once; the receiver's state_dict lists it
    under both names. The alias counts as loaded (it used to raise MissingWeightsError
    after every bucket was written, and never commit)."""
    runtime()
    trainer, engine = Tied(1), Tied(2)
    r1, h1 = receiver_node(engine)
    sender = WeightSender(lambda: trainer.named_parameters(), bucket_bytes=1 << 20,
                          source_reads=False)
    assert sender.stream([h1]).version == 1
    assert r1.weight_receiver.version == 1
    for k, v in trainer.state_dict().items():
        assert torch.equal(engine.state_dict()[k], v), k
    # the same names as a whole layout
    layout, _g = plan_layout(dict(trainer.named_parameters()))
    WeightReceiver(Tied(3)).check(layout)


@pytest.mark.parametrize("how", ["mapping", "lazy"])
def test_an_untied_sender_into_a_tied_receiver_is_refused_up_front(runtime: Any,
                                                                   how: str) -> None:
    """Two different manifest tensors into one destination tensor: only the one written
    last would stay (it used to, silently). DuplicateTargetError naming both, before
    anything is written or, for a whole layout, put."""
    rt = runtime()
    trainer, engine = Tied(1, tied=False), Tied(2)
    before = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    r1, h1 = receiver_node(engine)
    src: Any = trainer if how == "mapping" else (lambda: trainer.state_dict().items())
    sender = WeightSender(src, bucket_bytes=1 << 20, source_reads=False)
    put0 = rt.stats().objects_put
    with pytest.raises(DuplicateTargetError, match=r"'head\.weight' and 'embed\.weight'"):
        sender.stream([h1])
    if how == "mapping":
        assert rt.stats().objects_put == put0
    assert r1.weight_receiver.version == 0
    for k, v in engine.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert rt.stats().pool_used == 0


def _lazy_buckets(state: dict[str, torch.Tensor], bucket_bytes: int
                  ) -> tuple[WeightLayout, list[list[torch.Tensor]], list[BucketLayout]]:
    """The buckets a lazy source makes of ``state`` (a tie across buckets is sent twice)."""
    from ray_rdt_pool.weights.planning import iter_buckets

    specs, groups = [], []
    for p in iter_buckets(iter(state.items()), bucket_bytes):
        specs.append(p.spec)
        groups.append(list(p.tensors))
    entries = tuple(e for s in specs for e in s.entries)
    return WeightLayout(entries, tuple(s.bucket for s in specs)), groups, specs


def test_a_tie_a_lazy_source_sends_twice_is_compared_not_rewritten(runtime: Any) -> None:
    """A lazy tied state_dict whose tie spans buckets sends the tensor twice: equal bytes
    load (nothing is written the second time); other bytes into that one destination
    tensor refuse the later bucket before any of it is written."""
    runtime()
    trainer, engine = Tied(1), Tied(2)
    sd = dict(trainer.state_dict())
    _layout, groups, specs = _lazy_buckets(sd, 600)  # embed, mid, head in 3+ buckets
    heads = [k for k, s in enumerate(specs) if "head.weight" in s.bucket.names]
    assert heads and heads[0] > 0 and "embed.weight" in specs[0].bucket.names
    rec = WeightReceiver(engine, direct=False)
    rec._begin_stream("s", None, 1)
    for k, (g, spec) in enumerate(zip(groups, specs)):
        rec._load_stream_bucket("s", k, [g], spec)
    rec._finish_stream("s", len(groups))
    assert rec.version == 1 and torch.equal(engine.embed.weight, trainer.embed.weight)

    untied = dict(Tied(4, tied=False).state_dict())
    _layout, groups, specs = _lazy_buckets(untied, 600)
    engine = Tied(5)
    rec = WeightReceiver(engine, direct=False)
    rec._begin_stream("s", None, 1)
    h = next(k for k, s in enumerate(specs) if "head.weight" in s.bucket.names)
    for k in range(h):
        rec._load_stream_bucket("s", k, [groups[k]], specs[k])
    with pytest.raises(DuplicateTargetError, match=f"bucket {h} was not written"):
        rec._load_stream_bucket("s", h, [groups[h]], specs[h])
    assert torch.equal(engine.embed.weight, untied["embed.weight"])  # the earlier bucket's
    assert rec.version == 0


def test_a_refused_tie_leaves_its_whole_bucket_unwritten_when_it_could_land(
        runtime: Any) -> None:
    """A bucket whose other tensor could land directly was landed before the tie was
    compared: the refusal said "bucket 1 was not written" while ``mid`` held the new
    bytes. Such a bucket now goes through the arena and a refusal writes none of it."""
    runtime()
    a, b = torch.full((8, 8), 1.0), torch.full((8, 8), 2.0)
    sd = {"embed.weight": a, "mid": b, "head.weight": b}  # head is mid's alias in bucket 1
    e, m = torch.zeros(8, 8), torch.zeros(8, 8)
    r, h = receiver_node({"embed.weight": e, "head.weight": e, "mid": m}, direct=True)
    sender = WeightSender(lambda: iter(sd.items()), bucket_bytes=256, source_reads=False)
    with pytest.raises(DuplicateTargetError, match="bucket 1 was not written"):
        sender.stream([h])
    assert torch.equal(e, a) and torch.equal(m, torch.zeros(8, 8))
    assert r.weight_receiver.version == 0
    # Equal bytes into the tie still load, and the untied tensors of the bucket land.
    sd["head.weight"] = a
    rep = sender.stream([h])
    assert torch.equal(e, a) and torch.equal(m, b) and r.weight_receiver.version == rep.version


# ---------------------------------------------------------------------------------------
# Finding 7: conjugate and negative views are other tensors
# ---------------------------------------------------------------------------------------


def test_conjugate_and_negative_views_are_not_aliases(runtime: Any) -> None:
    """``c.conj()`` shares ``c``'s memory, shape, strides and dtype but reads otherwise;
    so does the negative view ``c.conj().imag`` of ``c.imag``. Each is sent as its own
    tensor (``b`` used to be an alias of ``a`` and receive ``a``'s bytes)."""
    runtime()
    c = torch.randn(4, dtype=torch.complex64)
    state = {"a": c, "b": c.conj(), "im": c.imag, "neg": c.conj().imag}
    assert state["neg"].is_neg()
    layout, _g = plan_layout(state)
    assert layout.aliases == () and [e.name for e in layout.entries] == list(state)
    dest = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in state.items()}
    _r1, h1 = receiver_node(dest)
    WeightSender(state, source_reads=False).stream([h1])
    for k, v in state.items():
        assert torch.equal(dest[k], v.resolve_conj().resolve_neg()), k


def test_a_failed_stream_gives_its_reservation_back_once() -> None:
    """A stream of v5 failed here (its reservation given back), then a load of v5 took
    the receiver over: dropping the failed stream gave "its" reservation back a second
    time, the load's. While the load wrote, another v5 stream was accepted, and its
    buckets overwrote the committed bytes of the load."""
    import ray

    get, ray.get = ray.get, _get
    try:
        dest = filled(0)
        rec = FailingReceiver(dest, direct=False)
        assert rec.load(manifest(4, filled(4))[2]).version == 4
        layout, groups, _m = manifest(5, filled(5))
        rec._begin_stream("s5", layout, 5)
        rec.fail_at = 0
        with pytest.raises(RuntimeError, match="injected"):
            rec._load_stream_bucket("s5", 0, [list(groups[0])])
        rec.fail_at = None
        writing, go = threading.Event(), threading.Event()
        real = rec._load_bucket

        def slow(plan: Any, ref: Any, *rest: Any) -> Any:
            if threading.current_thread().name == "load" and plan.index == 0:
                writing.set()
                assert go.wait(10)
            return real(plan, ref, *rest)

        rec._load_bucket = slow  # type: ignore[method-assign]
        out: list[Any] = []
        t = threading.Thread(name="load", target=lambda: out.append(
            rec.load(manifest(5, filled(5.0), "pub")[2]).version))
        t.start()
        try:
            assert writing.wait(10)
            other, _g, _m2 = manifest(5, filled(55.0))
            with pytest.raises(StaleVersionError, match="loading now"):
                rec._begin_stream("s5b", other, 5)
        finally:
            go.set()
            t.join(10)
    finally:
        ray.get = get
    assert out == [5] and rec.version == 5 and values(dest) == [5.0] * 6


def test_a_refused_load_does_not_supersede_the_stream_in_progress() -> None:
    """A load of v6 whose layout does not match the destination writes nothing; it used
    to take the receiver over first, so a healthy stream of v5 lost its later buckets."""
    import ray

    from ray_rdt_pool.weights import ManifestMismatchError

    get, ray.get = ray.get, _get
    try:
        dest = filled(0)
        rec = WeightReceiver(dest, direct=False)
        layout, groups, _m = manifest(5, filled(5))
        rec._begin_stream("s5", layout, 5)
        rec._load_stream_bucket("s5", 0, [list(groups[0])])
        wrong = {f"w{i}": torch.zeros(3) for i in range(6)}
        with pytest.raises(ManifestMismatchError):
            rec.load(manifest(6, wrong)[2])
        for k in range(1, len(groups)):
            rec._load_stream_bucket("s5", k, [list(groups[k])])
        rec._finish_stream("s5", len(groups))
    finally:
        ray.get = get
    assert rec.version == 5 and values(dest) == [5.0] * 6


@pytest.mark.parametrize("bad", [-1, 0, math.inf, math.nan, None, True, "300"])
def test_a_bad_timeout_is_refused_before_anything_is_sent(runtime: Any, bad: Any) -> None:
    """Ray's waits refuse a negative timeout and overflow on an infinite one: the
    stream raised that untyped error half-way, and again in its own clean-up, which
    then never told the receivers to drop the stream nor freed the buckets."""
    rt = runtime()
    r, h = receiver_node(filled(0, 4), direct=False)
    sender = WeightSender(filled(3, 4), bucket_bytes=4096, source_reads=False)
    with pytest.raises(InvalidInputError, match="timeout_s must be a finite number"):
        sender.stream([h], timeout_s=bad)
    with pytest.raises(InvalidInputError, match="timeout_s must be a finite number"):
        sync(None, [h], timeout_s=bad)  # type: ignore[arg-type]
    st = rt.stats()
    assert (st.objects_put, st.live_objects) == (0, 0)
    assert r.weight_receiver._stream is None
    assert sender.stream([h], timeout_s=30).version == 1


@pytest.mark.parametrize("bad", ["actor", None, 3, "one", "receiver object", "twice"])
def test_receivers_that_are_not_actor_handles_are_refused_up_front(runtime: Any,
                                                                   bad: str) -> None:
    """A stream given one handle, a receiver object or a name failed deep in a Ray
    call with an AttributeError or TypeError; the checks now name what was passed."""
    rt = runtime()
    r, h = receiver_node(filled(0, 4), direct=False)
    arg: Any = {"actor": h, None: None, 3: 3, "one": ["r1"],
                "receiver object": [r.weight_receiver], "twice": [h, h]}[bad]
    want = {"actor": "got one actor handle; pass \\[handle\\]",
            None: "got NoneType", 3: "got int", "one": "receiver 0 is a str",
            "receiver object": "receiver 0 is a WeightReceiver",
            "twice": "same receiver actor twice"}[bad]
    sender = WeightSender(filled(3, 4), bucket_bytes=4096, source_reads=False)
    with pytest.raises(InvalidInputError, match=want):
        sender.stream(arg, timeout_s=30)
    with pytest.raises(InvalidInputError, match=want):
        sync(Handle(Actor()), arg, timeout_s=30)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="trainer's actor handle first, got str"):
        sync("trainer", [h])  # type: ignore[arg-type]
    st = rt.stats()
    assert (st.objects_put, st.live_objects) == (0, 0)
    assert sender.stream([h], timeout_s=30).version == 1


@pytest.mark.parametrize("lazy", [False, True], ids=["mapping", "lazy"])
def test_stream_report_counts_the_bytes_sent_whatever_a_receiver_selects(
        runtime: Any, lazy: bool) -> None:
    """A lazy stream reported the first receiver's loaded bytes as the bytes sent: with
    a selecting receiver first, half of what a mapping's stream of the same state
    reported."""
    runtime()
    state = filled(2, 4)
    half = {k: torch.zeros(16, 32) for k in state}
    _r1, h1 = receiver_node(half, direct=False, select=lambda name, shape: (slice(0, 16),))
    r2, h2 = receiver_node(filled(0, 4), direct=False)
    src: Any = (lambda: iter(state.items())) if lazy else state
    rep = WeightSender(src, bucket_bytes=4096, source_reads=False).stream([h1, h2])
    full = sum(t.nbytes for t in state.values())
    assert rep.nbytes == full
    assert [ld.nbytes for ld in rep.loads] == [full // 2, full]
    assert values(half) == [2.0] * 4 and values(r2.weight_receiver.dest) == [2.0] * 4


@pytest.mark.parametrize("opt", ["strict", "direct"])
def test_receiver_flags_must_be_bools(opt: str) -> None:
    """``strict="no"`` is truthy: it turned strict checking on, the opposite of what it
    says."""
    with pytest.raises(InvalidInputError, match=f"{opt} must be True or False, got 'no'"):
        WeightReceiver(filled(0, 2), **{opt: "no"})


def test_load_refuses_what_is_not_a_manifest_and_a_non_bool_release() -> None:
    rec = WeightReceiver(filled(0, 2))
    with pytest.raises(InvalidInputError, match=r"takes a Manifest .* got dict"):
        rec.load({"version": 1})  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="release must be True or False"):
        rec.load(manifest(1, filled(1, 2))[2], release="no")  # type: ignore[arg-type]
    assert rec.version == 0 and rec._reserved == []


def test_a_failed_stream_cleans_up_even_if_its_waits_raise(
        runtime: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The clean-up of a failed stream waits for the receivers; a wait that raised ended
    the clean-up before the aborts and the frees: the trainer held its buckets for good
    and the receiver kept the stream (and its version's reservation)."""
    import ray

    rt = runtime()
    r, h = receiver_node(filled(0, 4), FailingReceiver, direct=False)
    r.weight_receiver.fail_at = 1  # type: ignore[attr-defined]

    def broken_wait(refs: Any, num_returns: int = 1, timeout: Any = None) -> Any:
        if timeout == 0:  # asking which calls ended works; waiting for them does not
            return refs, []
        raise ValueError("wait refused")

    monkeypatch.setattr(ray, "wait", broken_wait)
    sender = WeightSender(filled(6, 4), bucket_bytes=4096, source_reads=False)
    with pytest.raises(ValueError, match="wait refused"):
        sender.stream([h], max_inflight=2)
    st = rt.stats()
    assert (st.live_objects, st.pool_used) == (0, 0)
    deadline = time.monotonic() + 10  # the actor's thread runs the abort it was sent
    while r.weight_receiver._stream is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.weight_receiver._stream is None  # told to drop it
    r.weight_receiver.fail_at = None  # type: ignore[attr-defined]
    assert r.weight_receiver.load(manifest(1, filled(1, 4))[2]).version == 1


def test_the_default_version_is_past_every_version_published(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """publish() did not count its version as used: after an explicit lower version the
    next default one repeated a version receivers had already loaded (and refused)."""
    import ray_rdt_pool.weights.weight_sender as S

    monkeypatch.setattr(S, "_put_bucket", lambda tensors, entries: [tensors])
    monkeypatch.setattr(S, "pool_stats", lambda: type("S", (), {"fallbacks": 0, "pool_used": 0}))
    sender = WeightSender({"w": torch.zeros(4)})
    assert [sender.publish().version for _ in range(2)] == [1, 2]
    assert sender.publish(version=1).version == 1
    assert sender.publish().version == 3


class GatedReceiver(WeightReceiver):
    """Holds bucket 0 on ``entered`` until ``go``: a read the sender gives up on."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.entered, self.go = threading.Event(), threading.Event()

    def _load_bucket(self, plan: Any, *rest: Any) -> Any:
        if plan.index == 0:
            self.entered.set()
            assert self.go.wait(10)
        return super()._load_bucket(plan, *rest)


def _late_freed(rt: Runtime, live: int) -> None:
    import ray_rdt_pool.weights.late as L

    deadline = time.monotonic() + 10
    while L.LATE.held() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert L.LATE.held() == 0 and rt.stats().live_objects == live


def test_a_bucket_a_receiver_still_reads_after_a_timeout_is_not_freed_under_it(
        runtime: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender gives up (timeout_s) while a receiver reads bucket 0: freed then, the
    bucket's block would go to another object, whose bytes the read would load into the
    receiver's weights. It is freed only once the receiver's call ends."""
    import ray

    import ray_rdt_pool.weights as W
    import ray_rdt_pool.weights.late as L

    rt = runtime()
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # no ray.shutdown() here
    monkeypatch.setattr(L._LateBuckets, "POLL_S", 0.05)
    r, h = receiver_node(filled(0, 4), GatedReceiver, direct=False)
    rec = r.weight_receiver
    sender = WeightSender(filled(6, 4), bucket_bytes=4096, source_reads=False)
    with pytest.raises(W.WeightSyncTimeoutError, match="receiver 0"):
        sender.stream([h], max_inflight=1, timeout_s=0.2)
    assert rec.entered.is_set()  # type: ignore[attr-defined]
    assert rt.stats().live_objects == 1  # bucket 0: the receiver reads it still
    other = rt.put("other", [torch.full((32, 32), 99.0)])  # would take its block
    assert other is not None
    rec.go.set()  # type: ignore[attr-defined]
    _late_freed(rt, 1)  # "other" alone: the late bucket went once its reader ended
    assert values(rec.dest)[0] == 6.0 and rec.version == 0  # type: ignore[arg-type]


def test_a_receive_call_that_starts_after_the_sender_gave_up_reads_nothing(
        runtime: Any) -> None:
    """A receiver that began, then was busy (a long generate) when the buckets came:
    the sender gives up, and frees at once what no receiver was signalled. When the
    receiver gets to its queued call, the ABORT waits for it: it reads nothing, and
    its version and weights stay."""
    rt = runtime()
    r, h = receiver_node(filled(0, 4), direct=False)
    h.busy(lambda name: name == "remote_receive")
    sender = WeightSender(filled(6, 4), bucket_bytes=4096, source_reads=False)
    with pytest.raises(WeightSyncTimeoutError, match="never started"):
        sender.stream([h], max_inflight=1, timeout_s=0.2)
    assert rt.stats().live_objects == 0  # bucket 0 was signalled to nobody
    h.free()
    deadline = time.monotonic() + 10
    while r.weight_receiver._stream is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.weight_receiver._stream is None
    assert values(r.weight_receiver.dest) == [0.0] * 4  # type: ignore[arg-type]
    assert r.weight_receiver.version == 0


def test_a_receive_call_that_cannot_be_made_leaves_nothing_behind(runtime: Any) -> None:
    """The receive calls go out one per receiver: when a later receiver's ``.remote()``
    raises (Ray going down, an argument it cannot serialize), the receivers whose calls
    went out are told to stop, nothing is put, and every receiver keeps its version."""
    rt = runtime()
    r1, h1 = receiver_node(filled(0, 4), direct=False)
    r2, h2 = receiver_node(filled(0, 4), direct=False)
    real = h2.__ray_call__

    class Refusing:
        @staticmethod
        def remote(fn: Callable[..., Any], *args: Any) -> Any:
            if fn.__name__ == "remote_receive":
                raise RuntimeError("the call cannot be submitted")
            return real.remote(fn, *args)

    h2.__ray_call__ = Refusing  # type: ignore[assignment]
    sender = WeightSender(filled(6, 4), bucket_bytes=4096, source_reads=False)
    with pytest.raises(RuntimeError, match="cannot be submitted"):
        sender.stream([h1, h2], max_inflight=1, timeout_s=2.0)
    st = rt.stats()
    assert st.live_objects == 0 and st.pool_used == 0
    for r in (r1, r2):
        assert r.weight_receiver.version == 0
        assert values(r.weight_receiver.dest) == [0.0] * 4  # type: ignore[arg-type]


def test_late_buckets_go_once_ray_is_shut_down(runtime: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """After ray.shutdown() no receiver call ends any more: the late buckets of a failed
    stream are freed then, instead of being polled for the life of the process."""
    import ray

    import ray_rdt_pool.weights.late as L

    rt = runtime()
    monkeypatch.setattr(L._LateBuckets, "POLL_S", 0.05)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(L, "calls_ended", lambda refs: False)  # the calls never end
    rt.put("late", [torch.ones(10)])
    L.LATE.add([L.InFlight([object()], None, ["late"])], "s")
    deadline = time.monotonic() + 10
    while L.LATE.held() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert L.LATE.held() == 0 and rt.stats().live_objects == 0


# ---------------------------------------------------------------------------------------
# Fourth review: destinations and weights with no memory, overlapping destinations
# ---------------------------------------------------------------------------------------


def _resized(n: int) -> torch.Tensor:
    t = torch.zeros(32, 32)
    t.untyped_storage().resize_(n)
    return t


_NO_MEMORY_DESTS = {
    "resized to 0 (FSDP)": (lambda: _resized(0), "its storage holds 0 .resized to 0"),
    "shrunk under it": (lambda: _resized(256), "which holds only 256"),
    "meta device": (lambda: torch.zeros(32, 32, device="meta"), "on the meta device"),
    "expanded (stride 0)": (lambda: torch.zeros(32).expand(32, 32), "share memory"),
    "sparse": (lambda: torch.zeros(32, 32).to_sparse(), "layout torch.sparse_coo"),
}


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "arena"])
@pytest.mark.parametrize("kind", list(_NO_MEMORY_DESTS))
def test_a_destination_without_memory_of_its_own_is_refused_before_anything_is_written(
        runtime: Any, kind: str, direct: bool) -> None:
    """A destination whose storage was resized to 0 or shrunk crashed the receiver
    (SIGSEGV, heap corruption: the copy wrote past the storage) or failed after the
    earlier buckets were written; one on the meta device committed a version with no
    byte stored; an expanded one failed half-way with torch's untyped RuntimeError."""
    rt = runtime()
    make, match = _NO_MEMORY_DESTS[kind]
    with pytest.raises(InvalidInputError, match=f"destination tensor 'w1' .*{match}"):
        WeightReceiver({"w1": make()})
    dest = {"w0": torch.zeros(32, 32), "w1": torch.zeros(32, 32)}
    r, h = receiver_node(dest, direct=direct)
    dest["w1"] = make()  # after the receiver was made (FSDP frees a parameter so)
    with pytest.raises(InvalidInputError, match=f"destination tensor 'w1' .*{match}"):
        WeightSender(filled(7, 2), bucket_bytes=4096, source_reads=False).stream([h])
    assert float(dest["w0"][0, 0]) == 0.0 and r.weight_receiver.version == 0
    st = rt.stats()
    assert (st.live_objects, st.pool_used, st.arena_used) == (0, 0, 0)


@pytest.mark.parametrize("lazy", [False, True], ids=["mapping", "lazy"])
@pytest.mark.parametrize("kind", ["resized to 0 (FSDP)", "shrunk under it", "meta device",
                                  "zero tensor"])
def test_a_weight_without_memory_is_refused_before_anything_is_sent(
        runtime: Any, kind: str, lazy: bool) -> None:
    """A ZeroTensor weight raised torch's untyped RuntimeError from the layout; a shrunk
    weight read in place by a same-node receiver sent the bytes past its storage."""
    rt = runtime()
    bad = (torch._efficientzerotensor(32, 32) if kind == "zero tensor"
           else _NO_MEMORY_DESTS[kind][0]())
    state = {"w0": torch.ones(32, 32), "w1": bad}
    r, h = receiver_node(filled(0, 2), direct=False)
    src: Any = (lambda: iter(state.items())) if lazy else state
    with pytest.raises(InvalidInputError, match="weight 'w1'"):
        WeightSender(src, bucket_bytes=4096, source_reads=False).stream([h])
    assert r.weight_receiver.version == 0
    st = rt.stats()
    assert (st.live_objects, st.pool_used) == (0, 0)


@pytest.mark.parametrize("lazy", [False, True], ids=["mapping", "lazy"])
@pytest.mark.parametrize("kind", ["slice", "dtype view", "conjugate", "transpose"])
def test_destinations_that_share_memory_without_being_one_tensor_are_refused(
        runtime: Any, kind: str, lazy: bool) -> None:
    """A destination that is a slice, a dtype view, a conjugate or a transpose of another
    was not seen as a tie: both were written, the later won, and the version committed
    with wrong bytes and no error."""
    runtime()
    base = torch.zeros(8, 8, dtype=torch.complex64 if kind == "conjugate" else torch.float32)
    other = {"slice": lambda: base[2:6], "dtype view": lambda: base.view(torch.int32),
             "conjugate": lambda: base.conj(), "transpose": lambda: base.t()}[kind]()
    dest = {"big": base, "part": other}
    state = {"big": torch.ones_like(base), "part": torch.full_like(other, 2)}
    r, h = receiver_node(dest, direct=False)
    src: Any = (lambda: iter(state.items())) if lazy else state
    with pytest.raises(DuplicateTargetError, match=r"'part' .* shares memory with "
                                                   "destination 'big'"):
        WeightSender(src, bucket_bytes=256, source_reads=False).stream([h])
    assert r.weight_receiver.version == 0
    if not lazy:  # a lazy stream refuses at the bucket of 'part': 'big' is loaded
        assert not base.abs().any()


@pytest.mark.parametrize("kind", ["row, then the transpose", "transpose, then a row",
                                  "column slices that cross", "a column and a row"])
def test_strided_destinations_that_share_bytes_are_refused(runtime: Any, kind: str) -> None:
    """A strided destination was compared only by its first and last byte, and a strided
    one claimed first was not recorded at all: a row of a matrix and the matrix's
    transpose, or two column slices that cross, were both written and committed."""
    runtime()
    base = torch.zeros(8, 8)
    dest = {"row, then the transpose": {"a": base[1], "b": base.t()},
            "transpose, then a row": {"a": base.t(), "b": base[1]},
            "column slices that cross": {"a": base[:, 0:4], "b": base[:, 2:6]},
            "a column and a row": {"a": base[:, 3], "b": base[5, 2:6]}}[kind]
    state = {"a": torch.ones_like(dest["a"]), "b": torch.full_like(dest["b"], 2)}
    r, h = receiver_node(dest, direct=False)
    with pytest.raises(DuplicateTargetError, match=r"'b' .* shares memory with "
                                                   "destination 'a'"):
        WeightSender(state, bucket_bytes=256, source_reads=False).stream([h])
    assert r.weight_receiver.version == 0
    assert not base.any()


def test_disjoint_slices_of_one_buffer_and_ties_still_load(runtime: Any) -> None:
    """What the overlap check must let through: weights that are disjoint parts of one
    flat buffer (row slices, column slices of a fused matrix), and tied weights."""
    runtime()
    flat = torch.zeros(4, 16)
    fused = torch.zeros(8, 8)
    dest = {"a": flat[:2], "b": flat[2:], "q": fused[:, :4], "k": fused[:, 4:],
            "emb": fused, "head": fused}
    dest.pop("emb"), dest.pop("head")
    tied = torch.zeros(4, 4)
    dest.update({"emb": tied, "head": tied})
    woven = torch.zeros(6, 8)  # interleaved columns, and a column beside a row's remainder
    dest.update({"even": woven[:4, 0::2], "odd": woven[:4, 1::2], "col": woven[4:, 0],
                 "rest": woven[4:, 1:]})
    state = {k: torch.full_like(v, float(i + 1)) for i, (k, v) in enumerate(dest.items())}
    state["head"] = state["emb"]
    r, h = receiver_node(dest, direct=False)
    WeightSender(state, bucket_bytes=256, source_reads=False).stream([h])
    assert r.weight_receiver.version == 1
    for k, v in dest.items():
        assert torch.equal(v, state[k]), k


def test_destinations_made_in_inference_mode_load_through_the_arena(runtime: Any) -> None:
    """An engine's weights made under torch.inference_mode() land directly, but a bucket
    copied through the arena (a cast, a strided destination) failed with torch's "Inplace
    update to inference tensor outside InferenceMode" after earlier buckets were written."""
    runtime()
    with torch.inference_mode():
        w0, w1 = torch.zeros(32, 32, dtype=torch.float64), torch.zeros(32, 32)
    dest = {"w0": w0, "w1": w1.t()}
    r, h = receiver_node(dest, direct=True)
    WeightSender(filled(7, 2), bucket_bytes=4096, source_reads=False).stream([h])
    assert r.weight_receiver.version == 1
    assert torch.equal(w0, torch.full((32, 32), 7.0, dtype=torch.float64))
    assert torch.equal(w1, torch.full((32, 32), 7.0))


@pytest.mark.parametrize("lazy", [False, True], ids=["mapping", "lazy"])
def test_a_name_map_that_raises_or_returns_a_non_name_is_a_mismatch(runtime: Any,
                                                                     lazy: bool) -> None:
    """A name_map callable's KeyError reached the caller raw, in a lazy stream after the
    earlier buckets were written; one returning an int was taken for a missing name."""
    runtime()
    state = filled(3, 3)
    for bad, text in (({"w0": "w0", "w1": "w1"}.__getitem__, "KeyError"),
                      (lambda n: 5 if n == "w2" else n, "returned a int")):
        dest = filled(0, 3)
        r, h = receiver_node(dest, direct=False, name_map=bad)
        src: Any = (lambda: iter(state.items())) if lazy else state
        with pytest.raises((MissingWeightsError, UnexpectedWeightsError),
                           match=f"name_map\\(.w2.\\) failed .*{text}"):
            WeightSender(src, bucket_bytes=4096, source_reads=False).stream([h])
        assert r.weight_receiver.version == 0
        if not lazy:
            assert values(dest) == [0.0] * 3


def _stream_direct(layout: WeightLayout | None, objects: list[list[torch.Tensor]],
                   dest: dict[str, torch.Tensor], specs: list[BucketLayout] | None = None,
                   **opts: Any) -> WeightReceiver:
    """Stream ``objects`` (bucket k's tensors) to a receiver of ``dest`` under
    ``layout`` (or the lazy ``specs``), as a sender whose layout disagrees would."""
    from ray_rdt_pool.weights.advanced import PoolBucket

    recv = WeightReceiver(dest, **opts)
    recv._begin_stream("s", layout, 1)
    try:
        for k, tensors in enumerate(objects):
            wire, dev = put_owned(f"b{k}", tensors)
            try:
                recv._load_stream_bucket("s", k, [PoolBucket(f"b{k}", wire, dev)],
                                        specs[k] if specs is not None else None)
            finally:
                free_owned(f"b{k}")
        recv._finish_stream("s", len(objects))
    finally:
        recv._abort_stream("s")
    return recv


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "arena"])
@pytest.mark.parametrize("sent", ["a row", "one value", "int8", "fewer tensors"])
def test_a_bucket_unlike_its_layout_is_refused_before_it_is_written(
        runtime: Any, sent: str, direct: bool) -> None:
    """The receiver compared the layout with its destinations, never the bucket that
    came with the layout: one copied through the arena was broadcast or cast into the
    destination (a (4,) row into every row of a (4, 4) weight, one value into all of
    them) and the version committed; fewer tensors than listed raised a raw IndexError.
    Landed directly, the error blamed the destination."""
    from ray_rdt_pool.weights.advanced import Bucket, TensorEntry

    runtime()
    layout = WeightLayout((TensorEntry("w", (4, 4), "float32", 0, 0, 64),
                           TensorEntry("v", (4,), "float32", 0, 1, 16)),
                          (Bucket(0, ("w", "v"), 128),))
    tensors = {"a row": [torch.arange(4.0), torch.ones(4)],
               "one value": [torch.tensor([9.0]), torch.ones(4)],
               "int8": [torch.ones(4, 4, dtype=torch.int8), torch.ones(4)],
               "fewer tensors": [torch.ones(4, 4)]}[sent]
    dest = {"w": torch.zeros(4, 4), "v": torch.zeros(4)}
    with pytest.raises(WeightSyncError, match=r"bucket 0 arrived as .* its layout lists "
                                              r".* same ray_rdt_pool version"):
        _stream_direct(layout, [tensors], dest, direct=direct)
    assert not dest["w"].any() and not dest["v"].any()


@pytest.mark.parametrize("case", ["a bucket it does not list", "two at one position",
                                  "a position past the object", "buckets out of order",
                                  "bytes that do not add up", "a name twice"])
def test_a_layout_that_contradicts_itself_is_refused(runtime: Any, case: str) -> None:
    """Nothing checked that a layout agreed with itself: an entry in a bucket the layout
    does not list was never written (strict or not) and the version committed; two
    entries at one position gave one the other's bytes when copied, and buckets listed
    out of order swapped two weights in a stream."""
    from ray_rdt_pool.weights.advanced import Bucket, TensorEntry

    runtime()

    def e(name: str, bucket: int, index: int, nbytes: int = 16) -> TensorEntry:
        return TensorEntry(name, (4,), "float32", bucket, index, nbytes)

    one = (Bucket(0, ("a", "b"), 64),)
    two = (Bucket(0, ("a",), 64), Bucket(1, ("b",), 64))
    layout = {"a bucket it does not list": WeightLayout((e("a", 0, 0), e("b", 7, 0)),
                                                        (Bucket(0, ("a",), 64),)),
              "two at one position": WeightLayout((e("a", 0, 0), e("b", 0, 0)), one),
              "a position past the object": WeightLayout((e("a", 0, 0), e("b", 0, 5)), one),
              "buckets out of order": WeightLayout((e("a", 0, 0), e("b", 1, 0)),
                                                   (two[1], two[0])),
              "bytes that do not add up": WeightLayout((e("a", 0, 0), e("b", 0, 1, 8)), one),
              "a name twice": WeightLayout((e("a", 0, 0), e("a", 0, 1)), one)}[case]
    objects = [[torch.ones(4), torch.full((4,), 2.0)]] if len(layout.buckets) == 1 else \
        [[torch.ones(4)], [torch.full((4,), 2.0)]]
    for direct in (True, False):
        dest = {"a": torch.zeros(4), "b": torch.zeros(4)}
        with pytest.raises(WeightSyncError, match="the weight layout contradicts itself"):
            _stream_direct(layout, objects, dest, direct=direct, strict=False)
        assert not dest["a"].any() and not dest["b"].any()
    # A lazy stream's bucket layouts are checked the same way.
    spec = BucketLayout(Bucket(0, ("a", "b"), 64), (e("a", 0, 0), e("b", 0, 0)))
    dest = {"a": torch.zeros(4), "b": torch.zeros(4)}
    with pytest.raises(WeightSyncError, match="the weight layout contradicts itself"):
        _stream_direct(None, [[torch.ones(4), torch.full((4,), 2.0)]], dest, [spec])
    assert not dest["a"].any()
