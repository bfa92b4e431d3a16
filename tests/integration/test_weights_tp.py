"""Weight sync into a tensor-parallel inference engine: fused parameters, TP=2 shards,
sharded pulls (``WeightReceiver(select=)``) and bf16 on the wire
(``WeightSender(wire_dtype=)``).

The engine model below stores its parameters the way vLLM does: ``qkv_proj`` (q, k, v
concatenated on dim 0) and ``gate_up_proj`` (gate, up), column-parallel weights split
on dim 0 across the TP ranks, row-parallel ones (``o_proj``, ``down_proj``) on dim 1,
embeddings and the LM head split on the vocabulary, norms replicated. Its
``load_weights`` maps the trainer's (Hugging Face) names and slices each tensor for its
rank with per-parameter weight loaders, as vLLM's loaders do.

The in-process tests are in tests/unit/weights/test_weights_tp_logic.py. This module
shares one cluster whose workers register the transport through the setup hook.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ray import cloudpickle

import ray_rdt_pool
from ray_rdt_pool.errors import SelectError
from ray_rdt_pool.weights import WeightReceiver, WeightSender, WireDtypeError, sync
from tests.support import tp_model
from tests.support.raycluster import call, node_class, shared_actors
from tests.support.tp_model import (
    CFG,
    TP,
    EngineModel,
    assert_equal,
    reference,
    tp_select,
    trainer_state,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(tp_model)


# ---------------------------------------------------------------------------------------
# The trainer's model (Hugging Face names) and the engine's (vLLM layout)
# ---------------------------------------------------------------------------------------




# ---------------------------------------------------------------------------------------
# No Ray
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# Ray
# ---------------------------------------------------------------------------------------

ENV = {"RAY_RDT_POOL_POOL_BYTES": "16M", "RAY_RDT_POOL_ARENA_BYTES": "16M",
       "RAY_RDT_POOL_METRICS": "0"}
BUCKET = 1 << 20
VERSION = itertools.count(1)  # receivers outlive senders: versions keep counting up


@pytest.fixture(scope="module")
def actors(ray_cluster: str) -> Iterator[dict[str, Any]]:
    ray_rdt_pool.register()
    with shared_actors(ENV, dict.fromkeys(("trainer", "r0", "r1"), node_class()),
                       setup_hook=True) as nodes:
        yield nodes


def _stats(node: Any) -> Any:
    return ray_rdt_pool.stats()


def _set_trainer(node: Any, seed: int, wire_dtype: Any = None) -> None:
    node.state = trainer_state(CFG, seed)
    node.weight_sender = WeightSender(node.state, bucket_bytes=BUCKET, wire_dtype=wire_dtype)


def _trainer_state(node: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in node.state.items()}


def _set_engine(node: Any, rank: int, sharded: bool) -> None:
    node.model = EngineModel(CFG, rank, TP)
    node.weight_receiver = WeightReceiver(
        load_weights=functools.partial(node.model.load_weights, presharded=sharded),
        select=tp_select(rank, TP) if sharded else None)


def _set_dest(node: Any, dtype: torch.dtype) -> None:
    node.model = None
    node.dest = {k: torch.zeros(v.shape, dtype=dtype) for k, v in trainer_state(CFG, 0).items()}
    node.weight_receiver = WeightReceiver(node.dest)


def _params(node: Any) -> dict[str, torch.Tensor]:
    src = node.model.params() if node.model is not None else node.dest
    return {k: v.detach().clone() for k, v in src.items()}


def _received(ranks: list[Any]) -> list[int]:
    return [call(r, _stats).bytes_received for r in ranks]


def _drained(trainer: Any) -> None:
    from tests.support.raycluster import wait_for

    wait_for(lambda: (lambda s: s.pool_used == 0 and s.live_objects == 0)(
        call(trainer, _stats)), timeout=30)


@pytest.mark.ray
def test_tp2_engine_full_then_sharded_pulls(actors: dict[str, Any]) -> None:
    tr, ranks = actors["trainer"], [actors["r0"], actors["r1"]]
    call(tr, _set_trainer, 3)
    state = call(tr, _trainer_state)
    refs = [reference(state, r, TP) for r in range(TP)]
    # Full pulls: each rank reads every tensor whole and its loader narrows.
    for r, node in enumerate(ranks):
        call(node, _set_engine, r, False)
    before = _received(ranks)
    rep = sync(tr, ranks, mode="publish", version=next(VERSION))
    full = [a - b for a, b in zip(_received(ranks), before)]
    for r, node in enumerate(ranks):
        assert_equal(call(node, _params), refs[r])
    assert all(f >= rep.nbytes for f in full)
    # Sharded pulls: each rank reads only its part, in both modes.
    for mode in ("stream", "publish"):
        for r, node in enumerate(ranks):
            call(node, _set_engine, r, True)  # fresh, zeroed parameters
        before = _received(ranks)
        rep = sync(tr, ranks, mode=mode, version=next(VERSION))  # type: ignore[arg-type]
        part = [a - b for a, b in zip(_received(ranks), before)]
        for r, node in enumerate(ranks):
            assert_equal(call(node, _params), refs[r])
            assert 0.45 < part[r] / full[r] < 0.55, (part, full)
            assert part[r] == rep.loads[r].nbytes  # the report counts the bytes read
    print(f"TP=2 bytes per rank: full pull {full}, sharded pull {part} "
          f"({part[0] / full[0]:.3f} of full)")
    _drained(tr)


@pytest.mark.ray
def test_bf16_on_the_wire_halves_the_bytes(actors: dict[str, Any]) -> None:
    tr, ranks = actors["trainer"], [actors["r0"], actors["r1"]]
    call(tr, _set_trainer, 4)
    state = call(tr, _trainer_state)
    call(ranks[0], _set_dest, torch.float32)
    call(ranks[1], _set_dest, torch.bfloat16)
    before = _received(ranks)
    fp32 = sync(tr, ranks, version=next(VERSION))
    fp32_bytes = [a - b for a, b in zip(_received(ranks), before)]
    assert fp32.loads[0].direct_buckets == fp32.buckets  # fp32 -> fp32 lands directly
    call(tr, _set_trainer, 4, torch.bfloat16)
    for mode in ("stream", "publish"):
        before = _received(ranks)
        rep = sync(tr, ranks, mode=mode, version=next(VERSION))  # type: ignore[arg-type]
        bf16_bytes = [a - b for a, b in zip(_received(ranks), before)]
        assert all(0.45 < b / f < 0.55 for b, f in zip(bf16_bytes, fp32_bytes)), \
            (bf16_bytes, fp32_bytes)
        assert rep.nbytes * 2 == fp32.nbytes  # every tensor here is floating point
        got32, got16 = call(ranks[0], _params), call(ranks[1], _params)
        for k, v in state.items():
            want = v.to(torch.bfloat16)
            assert torch.equal(got32[k], want.to(torch.float32)), k  # cast back on load
            assert torch.equal(got16[k], want), k
    print(f"bytes per receiver: fp32 wire {fp32_bytes[0]}, bf16 wire {bf16_bytes[0]}")
    _drained(tr)


@pytest.mark.ray
def test_sharded_bf16_and_errors_before_any_byte(actors: dict[str, Any]) -> None:
    import ray

    tr, ranks = actors["trainer"], [actors["r0"], actors["r1"]]
    call(tr, _set_trainer, 5, torch.bfloat16)
    state = call(tr, _trainer_state)
    for r, node in enumerate(ranks):
        call(node, _set_engine, r, True)
    before = _received(ranks)
    rep = sync(tr, ranks, version=next(VERSION))
    got = [a - b for a, b in zip(_received(ranks), before)]
    bf16_state = {k: v.to(torch.bfloat16).float() for k, v in state.items()}
    for r, node in enumerate(ranks):
        assert_equal(call(node, _params), reference(bf16_state, r, TP))
        assert got[r] == rep.loads[r].nbytes and 0.2 < got[r] / (2 * rep.nbytes) < 0.3
    print(f"TP=2 sharded + bf16 wire: {got} bytes per rank (fp32 payload: "
          f"{2 * rep.nbytes})")
    # A select that does not fit: refused before anything is read, on either path.
    def bad_select(node: Any) -> None:
        node.weight_receiver.select = lambda n, s: (slice(0, s[0] + 1),)

    call(ranks[0], bad_select)
    put0 = call(tr, _stats).objects_put
    before = _received(ranks)
    with pytest.raises(SelectError, match=r"does not fit size"):
        sync(tr, ranks[:1], version=next(VERSION))
    assert call(tr, _stats).objects_put == put0  # refused before any bucket was put
    m = call(tr, lambda n, v: n.weight_sender.publish(version=v), next(VERSION))
    put1 = call(tr, _stats).objects_put
    assert put1 == put0 + len(m.layout.buckets)
    with pytest.raises(SelectError):
        ray.get(ranks[0].__ray_call__.remote(lambda n, m: n.weight_receiver.load(m), m),
                timeout=60)
    del m
    assert _received(ranks)[0] == before[0]
    # A wire dtype the tensors cannot take: refused before any bucket is put.
    call(tr, _set_trainer, 5, lambda n, t: torch.int8 if "norm" in n else None)
    with pytest.raises(WireDtypeError, match="norm"):
        sync(tr, ranks[1:], version=next(VERSION))
    assert call(tr, _stats).objects_put == put1
    _drained(tr)
