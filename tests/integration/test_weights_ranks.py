"""Weight sync from many trainer ranks (``sync([rank_0, ..., rank_M-1], receivers)``) on
real Ray with real NIXL: disjoint names and dim-0 shards, byte-exact over several
versions, ``select`` reading only its rows, typed errors for parts that do not add up,
and a rank killed mid-sync. One node, ``same_node="off"``: every bucket is a NIXL READ.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ray_rdt_pool
from ray_rdt_pool.errors import MissingWeightsError, RankMissingError, RankOverlapError
from ray_rdt_pool.weights import TrainerRankError, WeightReceiver, WeightSender, sync
from tests.support.raycluster import call, env_options, node_class, shared_actors, wait_for

pytestmark = pytest.mark.ray

ENV = {"RAY_RDT_POOL_POOL_BYTES": "16M", "RAY_RDT_POOL_ARENA_BYTES": "16M",
       "RAY_RDT_POOL_METRICS": "0", "RAY_RDT_POOL_SAME_NODE": "off", "RAY_DEDUP_LOGS": "0"}
BUCKET = 64 << 10
VERSION = itertools.count(1)  # receivers outlive senders: versions keep counting up
NAMES = [f"layers.{i}.weight" for i in range(9)]
ROWS, COLS = 48, 96  # fp32: 18 KiB per tensor, several tensors per bucket


@pytest.fixture(scope="module")
def nodes(ray_cluster: str) -> Iterator[dict[str, Any]]:
    ray_rdt_pool.register()
    names = ("t0", "t1", "t2", "e0", "e1")
    with shared_actors(ENV, dict.fromkeys(names, node_class()), setup_hook=True) as n:
        yield n


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(ROWS, COLS, generator=g) for n in NAMES}
    out["norm.bias"] = torch.randn(COLS, generator=g)
    return out


def _rows(world: int) -> list[tuple[int, int]]:
    """Uneven dim-0 shards: FSDP's chunking of ROWS rows over ``world`` ranks."""
    step = -(-ROWS // world)
    return [(min(r * step, ROWS), min((r + 1) * step, ROWS)) for r in range(world)]


def _set_rank(node: Any, seed: int, rank: int, world: int, how: str,
              extra: tuple[str, ...] = (), bucket: int = BUCKET) -> None:
    """Rank ``rank`` of ``world``: ``how`` is "names" (every world-th name, plus the
    names in ``extra``) or "shards" (its rows of every matrix; rank 0 also the bias)."""
    full = _model(seed)
    if how == "names":
        mine = [n for i, n in enumerate(sorted(full)) if i % world == rank] + list(extra)
        node.state = {n: full[n].clone() for n in mine}
        node.weight_sender = WeightSender(node.state, bucket_bytes=bucket)
    else:
        a, b = _rows(world)[rank]
        node.state = {n: full[n][a:b].clone() for n in NAMES}
        if rank == 0:
            node.state["norm.bias"] = full["norm.bias"].clone()
        node.weight_sender = WeightSender(node.state, bucket_bytes=bucket,
                                          shard=(rank, world))


def _step(node: Any) -> None:
    with torch.no_grad():
        for t in node.state.values():
            t.view(torch.int32).add_(1)


def _full(seed: int, steps: int) -> dict[str, torch.Tensor]:
    m = _model(seed)
    for t in m.values():
        t.view(torch.int32).add_(steps)
    return m


def _set_receiver(node: Any, select: Any = None) -> None:
    if select is None:
        node.dest = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    else:
        node.dest = {k: torch.zeros_like(v[select(k, tuple(v.shape))])
                     if select(k, tuple(v.shape)) is not None else torch.zeros_like(v)
                     for k, v in _model(0).items()}
    node.weight_receiver = WeightReceiver(node.dest, select=select)


def _dest(node: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in node.dest.items()}


def _version(node: Any) -> int:
    return int(node.weight_receiver.version)


def _received(node: Any) -> int:
    return int(ray_rdt_pool.stats().bytes_received)


def _drained(node: Any) -> bool:
    s = ray_rdt_pool.stats()
    return bool(s.pool_used == 0 and s.live_objects == 0)


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)), k


@pytest.mark.parametrize("how", ["names", "shards"])
@pytest.mark.parametrize("mode", ["stream", "publish"])
def test_many_ranks_byte_exact_over_versions(nodes: dict[str, Any], how: str,
                                             mode: str) -> None:
    ranks, recs = [nodes["t0"], nodes["t1"], nodes["t2"]], [nodes["e0"], nodes["e1"]]
    for r, t in enumerate(ranks):
        call(t, _set_rank, 7, r, 3, how)
    for e in recs:
        call(e, _set_receiver)
    for step in range(3):
        if step:
            for t in ranks:
                call(t, _step)
        v = next(VERSION)
        rep = sync(ranks, recs, mode=mode, version=v)  # type: ignore[arg-type]
        want = _full(7, step)
        for e in recs:
            _assert_exact(call(e, _dest), want)
            assert call(e, _version) == v
        assert rep.version == v and len(rep.loads) == 2
        assert rep.nbytes == sum(t.nbytes for t in want.values())
        assert all(lr.nbytes == rep.nbytes for lr in rep.loads)
    for t in ranks:
        wait_for(lambda t=t: call(t, _drained), timeout=30)


def test_select_reads_only_its_rows_from_the_ranks_that_hold_them(
        nodes: dict[str, Any]) -> None:
    ranks, recs = [nodes["t0"], nodes["t1"]], [nodes["e0"], nodes["e1"]]
    for r, t in enumerate(ranks):
        call(t, _set_rank, 11, r, 2, "shards")

    def first_quarter(name: str, shape: tuple[int, ...]) -> Any:  # all in rank 0's rows
        return (slice(0, ROWS // 4),) if len(shape) == 2 else None

    def columns(name: str, shape: tuple[int, ...]) -> Any:  # row parallel: every rank
        return (slice(None), slice(COLS // 2, COLS)) if len(shape) == 2 else None

    call(recs[0], _set_receiver, first_quarter)
    call(recs[1], _set_receiver, columns)
    before = [call(e, _received) for e in recs]
    rep = sync(ranks, recs, version=next(VERSION))
    got = [call(e, _received) - b for e, b in zip(recs, before)]
    full = _full(11, 0)
    want0 = {k: v[:ROWS // 4] if v.dim() == 2 else v for k, v in full.items()}
    want1 = {k: v[:, COLS // 2:] if v.dim() == 2 else v for k, v in full.items()}
    _assert_exact(call(recs[0], _dest), want0)
    _assert_exact(call(recs[1], _dest), want1)
    bias = COLS * 4
    # Exactly the selected bytes: nothing of rank 1's rows for receiver 0.
    assert got[0] == len(NAMES) * (ROWS // 4) * COLS * 4 + bias, got
    assert got[1] == len(NAMES) * ROWS * (COLS // 2) * 4 + bias, got
    assert [lr.nbytes for lr in rep.loads] == got


def _expect_refused(ranks: list[Any], recs: list[Any], exc: type, match: str) -> Any:
    before = [call(e, _version) for e in recs]
    with pytest.raises(exc, match=match) as info:
        sync(ranks, recs, version=next(VERSION))
    assert [call(e, _version) for e in recs] == before
    for t in ranks:
        wait_for(lambda t=t: call(t, _drained), timeout=30)  # offers were freed
    return info.value


def test_overlap_and_missing_are_typed_errors(nodes: dict[str, Any]) -> None:
    ranks, recs = [nodes["t0"], nodes["t1"], nodes["t2"]], [nodes["e0"], nodes["e1"]]
    for e in recs:
        call(e, _set_receiver)
    # Rank 2 also holds a name rank 0 holds, neither as a shard.
    for r, t in enumerate(ranks):
        call(t, _set_rank, 3, r, 3, "names", ("layers.0.weight",) if r == 2 else ())
    err = _expect_refused(ranks, recs, RankOverlapError, r"layers\.0\.weight.*ranks \[0, 2\]")
    assert err.name == "layers.0.weight" and err.ranks == (0, 2)
    # A name no rank holds: the receivers' strict check names it.
    call(ranks[2], _set_rank, 3, 2, 3, "names")
    call(ranks[1], lambda n: n.state.pop("layers.1.weight"))
    _expect_refused(ranks, recs, MissingWeightsError, r"layers\.1\.weight.*3 trainer ranks")
    # A sharded name that one rank of the world does not hold.
    for r, t in enumerate(ranks):
        call(t, _set_rank, 3, r, 3, "shards")
    call(ranks[1], lambda n: n.state.pop("layers.4.weight"))
    err = _expect_refused(ranks, recs, RankMissingError, r"layers\.4\.weight.*\[1\]")
    assert err.ranks == (1,)
    # Ranks passed out of order.
    call(ranks[1], _set_rank, 3, 1, 3, "shards")
    _expect_refused([ranks[1], ranks[0], ranks[2]], recs, RankMissingError, "rank order")
    # Everything adds up again: the receivers are usable.
    sync(ranks, recs, version=next(VERSION))
    for e in recs:
        _assert_exact(call(e, _dest), _full(3, 0))


class SlowReceiver(WeightReceiver):
    """Sleeps before each bucket, so a rank can be killed while the receivers read."""

    def _load_bucket(self, plan: Any, ref: Any, *rest: Any) -> Any:
        time.sleep(0.4)
        return super()._load_bucket(plan, ref, *rest)


def _set_slow_receiver(node: Any) -> None:
    node.dest = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    node.weight_receiver = SlowReceiver(node.dest)


def test_killed_rank_mid_sync_commits_nothing(nodes: dict[str, Any]) -> None:
    import ray

    ranks, recs = [nodes["t0"], nodes["t1"], nodes["t2"]], [nodes["e0"], nodes["e1"]]
    for r, t in enumerate(ranks):  # one tensor per bucket: rank 1's come all along
        call(t, _set_rank, 5, r, 3, "names", (), ROWS * COLS * 4)
    for e in recs:
        call(e, _set_slow_receiver)
    v0 = next(VERSION)
    sync(ranks, recs, version=v0)
    old = call(recs[0], _dest)
    for t in ranks:
        call(t, _step)
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            sync(ranks, recs, version=next(VERSION), timeout_s=120)
        except BaseException as e:
            box["error"] = e

    th = threading.Thread(target=run)
    th.start()
    time.sleep(1.0)  # the receivers are part-way through (0.4 s per bucket)
    ray.kill(ranks[1])
    t_kill = time.monotonic()
    th.join(180)
    print(f"failed sync ended {time.monotonic() - t_kill:.1f} s after the kill")
    assert not th.is_alive()
    err = box.get("error")
    assert isinstance(err, TrainerRankError), repr(err)
    assert err.rank == 1 and err.died and err.committed == ()
    assert "trainer rank 1 died" in str(err)
    for e in recs:
        assert call(e, _version) == v0  # no partial version committed
    # Buckets before the failure may be written; the version is what counts. The
    # receivers stay usable: a later sync from the live ranks (rank 2 takes over rank
    # 1's names) commits a full new version.
    del old
    # The module's later tests get a live rank 1 again.
    nodes["t1"] = env_options(node_class(), ENV, setup_hook=True).remote()
    call(nodes["t1"], lambda self: None)
    call(ranks[0], _set_rank, 6, 0, 3, "names")
    call(ranks[2], _set_rank, 6, 2, 3, "names",
         tuple(n for i, n in enumerate(sorted(_model(0))) if i % 3 == 1))
    v2 = next(VERSION)
    sync([ranks[0], ranks[2]], recs, version=v2)
    for e in recs:
        assert call(e, _version) == v2
        _assert_exact(call(e, _dest), _full(6, 0))


@pytest.mark.parametrize("how", ["names", "shards"])
def test_relayed_ranks_each_send_their_part_once_down_their_own_chain(
        nodes: dict[str, Any], how: str) -> None:
    """Two trainer ranks, three receivers, ``relay="chain"``: rank r's part goes to the
    receiver its chain starts at, which relays it on; every receiver ends byte-exact
    over versions, having read the whole model once, on a fixed number of Ray calls."""
    ranks, recs = [nodes["t0"], nodes["t1"]], [nodes["e0"], nodes["e1"], nodes["t2"]]
    for r, t in enumerate(ranks):
        call(t, _set_rank, 17, r, 2, how)
    for e in recs:
        call(e, _set_receiver)
    for step in range(2):
        if step:
            for t in ranks:
                call(t, _step)
        before = [call(e, _received) for e in recs]
        v = next(VERSION)
        rep = sync(ranks, recs, relay="chain", version=v, timeout_s=60)
        want = _full(17, step)
        total = sum(t.nbytes for t in want.values())
        for e, b in zip(recs, before):
            _assert_exact(call(e, _dest), want)
            assert call(e, _version) == v
            assert call(e, _received) - b == total  # the whole model, once
        # offers 2, signal endpoints 3, loads 3, serves 2, commits 3
        assert rep.ray_calls == 13, rep.ray_calls
    for t in ranks:
        wait_for(lambda t=t: call(t, _drained), timeout=30)
    for e in recs:
        wait_for(lambda e=e: call(e, _drained), timeout=30)


def _set_fp8_rank(node: Any, seed: int, rank: int, world: int) -> None:
    full = _model(seed)
    a, b = _rows(world)[rank]
    node.state = {n: full[n][a:b].clone().to(torch.bfloat16) for n in NAMES}
    node.weight_sender = WeightSender(node.state, bucket_bytes=BUCKET, shard=(rank, world),
                                      wire_dtype=torch.float8_e4m3fn, wire_scale=(8, 32))


def _set_bf16_receiver(node: Any) -> None:
    node.dest = {n: torch.zeros(ROWS, COLS, dtype=torch.bfloat16) for n in NAMES}
    node.weight_receiver = WeightReceiver(node.dest)


def test_fp8_shards_from_many_ranks_dequantize_into_their_rows(
        nodes: dict[str, Any]) -> None:
    """Each rank quantizes its own rows (its own scale blocks); a receiver dequantizes
    each rank's piece into its rows, bit for bit as quantizing that piece alone."""
    from ray_rdt_pool.weights.fp8 import dequantize, quantize

    ranks, recs = [nodes["t0"], nodes["t1"]], [nodes["e0"]]
    for r, t in enumerate(ranks):
        call(t, _set_fp8_rank, 23, r, 2)
    call(recs[0], _set_bf16_receiver)
    rep = sync(ranks, recs, version=next(VERSION), timeout_s=60)
    got = call(recs[0], _dest)
    full = _model(23)
    for n in NAMES:
        parts = []
        for a, b in _rows(2):
            w = full[n][a:b].to(torch.bfloat16)
            q, s = quantize(w, torch.float8_e4m3fn, (8, 32))
            parts.append(dequantize(q, s, (8, 32), torch.bfloat16))
        assert torch.equal(got[n].view(torch.int16), torch.cat(parts).view(torch.int16)), n
    assert rep.nbytes < len(NAMES) * ROWS * COLS * 2 * 0.6  # FP8 and scales, not bf16
