"""A relayed stream's logic, in process (no cluster): the options ``sync()`` refuses
before any actor is called (a relay with many trainer ranks among them), the chain's
order, the error's pickling, and the calls :class:`RelaySession` submits down the chain
(each receiver reads bucket ``b`` from the one before it, and a receiver holding
snapshots frees bucket ``b - max_inflight`` only after its successor read it). The
real-Ray counterparts are in tests/integration/test_weights_relay.py.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from ray_rdt_pool.errors import InvalidInputError, RelayReceiverError
from ray_rdt_pool.weights import sync
from ray_rdt_pool.weights.relay import RelaySession, _Began, _chain


class _Reached(Exception):
    """Raised by a fake actor's first call: ``sync()`` got past its checks."""


class _Id:
    def __init__(self, n: int) -> None:
        self.n = n

    def hex(self) -> str:
        return f"{self.n:032x}"


class _Actor:
    """Stands in for an actor handle; records each ``__ray_call__`` and returns a token."""

    def __init__(self, n: int, log: list[tuple[int, tuple[Any, ...]]] | None = None,
                 reach: bool = False) -> None:
        self._actor_id = _Id(n)
        self.n, self.log, self.reach = n, log, reach
        self.__ray_call__ = self

    def remote(self, fn: Any, *args: Any) -> object:
        if self.reach:
            raise _Reached
        assert self.log is not None, f"actor {self.n} was called: {fn.__name__}"
        self.log.append((self.n, args))
        return object()


def test_sync_refuses_a_relay_with_many_trainer_ranks_before_calling_anyone() -> None:
    ranks, engines = [_Actor(1), _Actor(2)], [_Actor(10), _Actor(11)]
    with pytest.raises(InvalidInputError, match=r"relay='chain' takes one trainer, got 2 "
                                                r"trainer ranks: drop relay="):
        sync(ranks, engines, relay="chain")
    # One rank in a list is the single trainer: a relay goes ahead.
    with pytest.raises(_Reached):
        sync([_Actor(1, reach=True)], engines, relay="chain")
    with pytest.raises(_Reached):
        sync(_Actor(1, reach=True), engines, relay="chain", relay_order="placement")


@pytest.mark.parametrize("kw, match", [
    ({"relay": "ring"}, "relay must be None or one of"),
    ({"relay": "chain", "relay_order": "random"}, "relay_order must be one of"),
    ({"relay": "chain", "mode": "publish"}, "needs mode='stream'"),
])
def test_sync_refuses_bad_relay_options_before_calling_anyone(kw: dict[str, Any],
                                                               match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        sync(_Actor(1), [_Actor(10)], **kw)
    with pytest.raises(InvalidInputError, match=f"{match}|takes one trainer"):
        sync([_Actor(1), _Actor(2)], [_Actor(10)], **kw)


def test_placement_order_groups_receivers_by_node_this_node_first() -> None:
    began = [_Began(0, False, node, None, False) for node in "ABAHBH"]
    assert _chain(began, "caller", "H") == [0, 1, 2, 3, 4, 5]
    assert _chain(began, "placement", "H") == [3, 5, 0, 2, 1, 4]
    assert _chain(began, "placement", None) == [0, 2, 1, 4, 3, 5]


def test_relay_receiver_error_pickles_with_its_fields() -> None:
    e = RelayReceiverError("receiver 2 died", 2, "ab" * 16, 5, stalled=True)
    got = pickle.loads(pickle.dumps(e))
    assert (type(got), str(got), got.receiver, got.actor_id, got.bucket, got.stalled) == \
        (RelayReceiverError, "receiver 2 died", 2, "ab" * 16, 5, True)


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("places", [None, (False,) * 7, (True, False) * 3 + (True,)])
def test_every_receiver_reads_each_bucket_from_the_one_before_it(
        m: int, places: tuple[bool, ...] | None) -> None:
    """Four receivers, seven buckets; receiver 2 lands buckets per ``places`` (None: a
    lazy stream, whose buckets are snapshots)."""
    log: list[tuple[int, tuple[Any, ...]]] = []
    rs = [_Actor(i, log) for i in range(4)]
    s = RelaySession(rs, 1, receiver_attr="r", max_inflight=m, timeout_s=5.0,
                     bucket_bytes=1, wire_dtype=None, source_reads=False,
                     by_reference=False)
    s.chain = [2, 0, 3, 1]  # receiver indices, in chain order
    s.in_place = [places, places, places, places]
    k = 7
    for b in range(k):
        acks: list[Any] = []
        s._send(acks, [b], [[f"box{b}"]])
        assert acks == [s.rows[b][0]]
        # Every receiver's call for the bucket goes at once, each waiting for its
        # predecessor's ack on the receiver: no round trip through this process.
        assert all(a is not None for a in s.rows[b]), (b, s.rows[b])
    s._advance()
    assert all(all(a is not None for a in row) for row in s.rows)  # every call was made
    assert len(s.unchecked) == 4 * k
    calls: dict[int, list[tuple[Any, ...]]] = {}
    for n, args in log:
        calls.setdefault(n, []).append(args)
    for pos, i in enumerate(s.chain):
        got = calls[i]
        assert [a[2] for a in got] == list(range(k)), "each receiver's calls in order"
        for j, (attr, _session, _j, box, prev, _spec, relays, free_upto, after,
                _t) in enumerate(got):
            assert attr == "r" and relays == (pos < 3)
            if pos == 0:
                assert box == [f"box{j}"] and prev == []
            else:
                assert box == [] and prev == [s.rows[j][pos - 1]]
            snapshot = places is None or not places[j - m] if j >= m else False
            if pos < 3 and snapshot:
                # Freed only once the successor read it: at most m snapshots held.
                assert (free_upto, after) == (j - m, [s.rows[j - m][pos + 1]])
            else:
                assert (free_upto, after) == (-1, [])
    assert all(args[-1] == 5.0 for _n, args in log)
