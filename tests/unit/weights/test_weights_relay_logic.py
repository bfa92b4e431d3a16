"""A relayed stream's logic, in process (no cluster): the options ``sync()`` refuses
before any actor is called (a relay with many trainer ranks among them), the chain's
order, the error's pickling, and a chain of four receivers over the fake NIXL (each
reads every bucket from the one before it, on three Ray calls whatever the bucket
count, byte-exact). The real-Ray counterparts are in
tests/integration/test_weights_relay.py.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.errors import InvalidInputError, RelayReceiverError
from ray_rdt_pool.weights import WeightSender, sync
from ray_rdt_pool.weights.remote import Began
from ray_rdt_pool.weights.stream import chain_order
from tests.support.fakeray import make_runtime, receiver_node


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


def test_sync_checks_a_relay_of_many_trainer_ranks_before_calling_anyone() -> None:
    ranks, engines = [_Actor(1), _Actor(2)], [_Actor(10), _Actor(11)]
    with pytest.raises(InvalidInputError, match=r"relay_order='placement' takes one "
                                                r"trainer; with 2 trainer ranks"):
        sync(ranks, engines, relay="chain", relay_order="placement")
    with pytest.raises(InvalidInputError, match="max_inflight must be an int >= 1"):
        sync(ranks, engines, relay="chain", max_inflight=0)
    # Relayed ranks go ahead (each rank's part down its own chain), and so does one rank
    # in a list, which is the single trainer.
    with pytest.raises(_Reached):
        sync([_Actor(1, reach=True), _Actor(2, reach=True)], engines, relay="chain")
    with pytest.raises(_Reached):
        sync([_Actor(1, reach=True)], engines, relay="chain")
    with pytest.raises(_Reached):
        sync(_Actor(1, reach=True), engines, relay="chain", relay_order="placement")


def test_each_ranks_chain_starts_at_another_receiver() -> None:
    from ray_rdt_pool.weights.ranks import chains

    assert chains(2, 6) == [[0, 1, 2, 3, 4, 5], [3, 4, 5, 0, 1, 2]]
    assert chains(3, 3) == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    for m, n in ((2, 6), (8, 64), (4, 4), (3, 7)):
        got = chains(m, n)
        assert all(sorted(c) == list(range(n)) for c in got)  # every receiver, once
        heads = [c[0] for c in got]
        assert len(set(heads)) == min(m, n)  # no receiver heads two chains


@pytest.mark.parametrize("kw, match", [
    ({"relay": "ring"}, "relay must be None or one of"),
    ({"relay": "chain", "relay_order": "random"}, "relay_order must be one of"),
    ({"relay": "chain", "mode": "publish"}, "needs mode='stream'"),
])
def test_sync_refuses_bad_relay_options_before_calling_anyone(kw: dict[str, Any],
                                                               match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        sync(_Actor(1), [_Actor(10)], **kw)
    with pytest.raises(InvalidInputError, match=match):
        sync([_Actor(1), _Actor(2)], [_Actor(10)], **kw)


def test_placement_order_groups_receivers_by_node_this_node_first() -> None:
    began = [Began(0, False, node, b"", None, False) for node in "ABAHBH"]
    assert chain_order(began, "caller", "H") == [0, 1, 2, 3, 4, 5]
    assert chain_order(began, "placement", "H") == [3, 5, 0, 2, 1, 4]
    assert chain_order(began, "placement", None) == [0, 2, 1, 4, 3, 5]


def test_relay_receiver_error_pickles_with_its_fields() -> None:
    e = RelayReceiverError("receiver 2 died", 2, "ab" * 16, 5, stalled=True,
                           committed=(0, 1))
    got = pickle.loads(pickle.dumps(e))
    assert (type(got), str(got), got.receiver, got.actor_id, got.bucket, got.stalled,
            got.committed) == (RelayReceiverError, "receiver 2 died", 2, "ab" * 16, 5, True,
                               (0, 1))


@pytest.fixture()
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Runtime]]:
    yield from make_runtime(monkeypatch)


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("direct", [True, False], ids=["in-place", "snapshots"])
@pytest.mark.parametrize("lazy", [False, True], ids=["mapping", "lazy"])
def test_every_receiver_reads_each_bucket_from_the_one_before_it(
        runtime: Any, m: int, direct: bool, lazy: bool) -> None:
    """Four receivers, seven buckets: the trainer signals each bucket to the chain's
    first receiver only, every other receiver reads it from the one before it (which
    publishes it: by reference from its weights, or as a snapshot), each receiver costs
    three Ray calls, and every receiver ends byte-exact with nothing held."""
    rt = runtime()
    state = {f"w{i}": torch.full((32, 32), float(i + 1)) for i in range(7)}
    nodes = [receiver_node({k: torch.zeros_like(v) for k, v in state.items()},
                           direct=direct) for _ in range(4)]
    src: Any = (lambda: iter(state.items())) if lazy else state
    sender = WeightSender(src, bucket_bytes=4096, source_reads=False)
    put0 = rt.stats().objects_put
    rep = sender.stream([h for _a, h in nodes], relay="chain", max_inflight=m,
                        timeout_s=10.0)
    assert rep.buckets == 7 and rep.ray_calls == 3 * 4
    for a, _h in nodes:
        rec = a.weight_receiver
        assert rec.version == rep.version
        assert all(torch.equal(rec.dest[k], v) for k, v in state.items())  # type: ignore[index]
    # The trainer packed 7 buckets; each receiver but the last published 7 for the next.
    assert rt.stats().objects_put - put0 == 7 + 3 * 7
    st = rt.stats()
    assert st.live_objects == 0 and st.pool_used == 0
