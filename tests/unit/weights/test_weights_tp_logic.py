"""Weight sync into a tensor-parallel inference engine, without Ray: the engine's loader,
wire dtypes and sharded pulls (``WeightReceiver(select=)``), with ``ray.get`` and
``fetch_selected`` replaced by in-process slicing. The engine model (vLLM's layout) is
in tests/support/tp_model.py; tests/integration/test_weights_tp.py runs the same on a
cluster.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ray import cloudpickle

from ray_rdt_pool.errors import SelectError, ShapeMismatchError
from ray_rdt_pool.weights import (
    Manifest,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WireDtypeError,
)
from ray_rdt_pool.weights.advanced import WeightLayout, plan_layout
from tests.support.tp_model import (
    CFG,
    TP,
    EngineModel,
    assert_equal,
    reference,
    tp_select,
    trainer_state,
)


def test_engine_loader_is_the_vllm_layout() -> None:
    st = trainer_state(CFG, 0)
    full = reference(st, 0, 1)
    ranks = [reference(st, r, TP) for r in range(TP)]
    p = "model.layers.1."
    q, kv, inter = CFG.q // TP, CFG.kv // TP, CFG.inter // TP
    for r, m in enumerate(ranks):
        qkv = m[p + "self_attn.qkv_proj.weight"]
        assert torch.equal(qkv[:q], st[p + "self_attn.q_proj.weight"][r * q:(r + 1) * q])
        assert torch.equal(qkv[q + kv:], st[p + "self_attn.v_proj.weight"][r * kv:(r + 1) * kv])
        gu = m[p + "mlp.gate_up_proj.weight"]
        assert torch.equal(gu[inter:], st[p + "mlp.up_proj.weight"][r * inter:(r + 1) * inter])
    # the two ranks' row-parallel halves put together are the full (TP=1) parameter
    o = torch.cat([m[p + "self_attn.o_proj.weight"] for m in ranks], dim=1)
    assert torch.equal(o, full[p + "self_attn.o_proj.weight"])


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """ray.get is the identity (a bucket's "ref" is its tensor list) and fetch_selected
    slices it; returns the list of selections fetch_selected was called with."""
    import ray

    from ray_rdt_pool._ray import owned

    calls: list[Any] = []

    def fetch_selected(ref: Any, selection: Any, timeout_s: Any = None) -> list[torch.Tensor]:
        calls.append(list(selection))
        return [t.contiguous() if s is None else t[s].contiguous()
                for t, s in zip(ref, selection)]

    monkeypatch.setattr(ray, "get", lambda ref, **kw: ref)
    monkeypatch.setattr(owned, "fetch_selected", fetch_selected)
    return calls


def _manifest(layout: WeightLayout, version: int, groups: list[list[torch.Tensor]]
              ) -> Manifest:
    return Manifest(layout, [[list(g)] for g in groups], version)  # type: ignore[list-item]


def test_wire_dtype_layout_and_errors() -> None:
    st = {"w": torch.randn(64, 64), "ids": torch.arange(10), "b": torch.randn(64),
          "h": torch.randn(8, dtype=torch.float16)}
    fp32 = plan_layout(st, 1 << 20)[0]
    bf16 = plan_layout(st, 1 << 20, torch.bfloat16)[0]
    got = {e.name: (e.dtype, e.nbytes) for e in bf16.entries}
    assert got == {"w": ("bfloat16", 64 * 64 * 2), "ids": ("int64", 80),
                   "b": ("bfloat16", 128), "h": ("bfloat16", 16)}
    assert bf16.total_bytes < 0.52 * fp32.total_bytes
    # per tensor: only the matrices, as fp16
    per = plan_layout(st, 1 << 20, lambda n, t: torch.float16 if t.dim() == 2 else None)[0]
    assert [e.dtype for e in per.entries] == ["float16", "int64", "float32", "float16"]
    # buckets are sized by wire bytes: two fp32 matrices need two 16 KiB buckets, one in bf16
    two = {"a": torch.zeros(64, 64), "c": torch.zeros(64, 64)}
    assert len(plan_layout(two, 16 << 10)[0].buckets) == 2
    assert len(plan_layout(two, 16 << 10, torch.bfloat16)[0].buckets) == 1
    for bad, match in ((lambda n, t: torch.int8, r"'w' \(float32\) as int8.*return None"),
                       (lambda n, t: "bf16", r"returned str 'bf16'.*torch.dtype")):
        with pytest.raises(WireDtypeError, match=match) as info:
            WeightSender(st, wire_dtype=bad).layout()
        assert info.value.name == "w" and isinstance(info.value, WeightSyncError)
    with pytest.raises(WireDtypeError, match="floating-point"):
        WeightSender(st, wire_dtype=torch.int32)  # type: ignore[arg-type]
    e = cloudpickle.loads(cloudpickle.dumps(WireDtypeError("m", "w")))
    assert e.name == "w" and str(e) == "m"


def test_put_converts_in_the_pack(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bucket's ray.put runs inside transport.pack_as with the ids of the tensors
    to convert (the wire dtype is applied by the pack copy, not before)."""
    import contextlib

    import ray

    from ray_rdt_pool._ray import conversions

    seen: list[tuple[list[torch.Tensor], dict[int, torch.dtype] | None]] = []
    active: list[dict[int, torch.dtype]] = []

    @contextlib.contextmanager
    def pack_as(dtypes: dict[int, torch.dtype]) -> Iterator[None]:
        active.append(dict(dtypes))
        try:
            yield
        finally:
            active.pop()

    def put(tensors: list[torch.Tensor], **kw: Any) -> str:
        seen.append((list(tensors), active[-1] if active else None))
        return "ref"

    monkeypatch.setattr(conversions, "pack_as", pack_as)
    monkeypatch.setattr(ray, "put", put)
    monkeypatch.setattr("ray_rdt_pool.weights.weight_sender.pool_stats",
                        lambda: type("S", (), {"fallbacks": 0, "pool_used": 0})())
    st = {"w": torch.randn(4, 4), "ids": torch.arange(3), "b": torch.randn(4)}
    for source in (st, lambda: iter(st.items())):
        seen.clear()
        m = WeightSender(source, wire_dtype=torch.bfloat16).publish()
        ((tensors, conv),) = seen
        assert all(t.dtype != torch.bfloat16 for t in tensors)  # not converted before
        assert conv == {id(tensors[0]): torch.bfloat16, id(tensors[2]): torch.bfloat16}
        assert [e.dtype for e in m.layout.entries] == ["bfloat16", "int64", "bfloat16"]
    seen.clear()
    WeightSender(st).publish()
    assert seen[0][1] is None  # no conversion: no pack_as block


def test_select_reads_parts_and_writes_selected_shapes(in_process: list[Any]) -> None:
    st = trainer_state(CFG, 1)
    layout, groups = plan_layout(st, 1 << 20)
    for r in range(TP):
        # load_weights gets the selected slices; the engine places them as they are
        eng = EngineModel(CFG, r, TP)
        rec = WeightReceiver(load_weights=functools.partial(eng.load_weights, presharded=True),
                             select=tp_select(r, TP))
        rep = rec.load(_manifest(layout, 1, groups))
        assert_equal(eng.params(), reference(st, r, TP))
        assert 0.45 < rep.nbytes / layout.total_bytes < 0.55  # bytes read, about half
        # a dest of the selected shapes (a sharded state dict with the trainer's names)
        sel = tp_select(r, TP)
        dest = {k: torch.zeros_like(v[sel(k, tuple(v.shape)) or ()]) for k, v in st.items()}
        WeightReceiver(dest, select=sel, direct=False).load(_manifest(layout, 1, groups))
        for k, v in st.items():
            assert torch.equal(dest[k], v[sel(k, tuple(v.shape)) or ()].contiguous()), k
    # tensors nobody takes are skipped with an empty dim-0 slice; full selections are None
    in_process.clear()
    dest = {"model.norm.weight": torch.zeros(CFG.hidden)}
    WeightReceiver(dest, strict=False, direct=False, select=lambda n, s: (slice(None),)).load(
        _manifest(layout, 1, groups))
    assert torch.equal(dest["model.norm.weight"], st["model.norm.weight"])
    norm = layout.by_name()["model.norm.weight"]
    flat = [s for call in in_process for s in call]
    # every other tensor is skipped (an empty dim-0 slice); norm's bucket is read through
    # fetch_selected only if it holds other tensors too
    alone = all(e.bucket != norm.bucket for e in layout.entries if e is not norm)
    assert len(flat) == len(layout.entries) - alone
    assert flat.count(None) == (not alone)  # type: ignore[comparison-overlap]
    assert all(s is None or s[0] == slice(0, 0) for s in flat)


def test_select_errors_before_anything_is_read(in_process: list[Any]) -> None:
    st = trainer_state(CFG, 1)
    layout, groups = plan_layout(st, 1 << 20)
    name = "model.layers.0.self_attn.o_proj.weight"
    cases: list[tuple[Any, str]] = [
        ((slice(0, CFG.hidden + 1),), r"dim 0: slice\(0, 257, None\) does not fit size 256"),
        ((slice(None), slice(0, 8, 2)), "step 2"),
        ([0, 1], "not a tuple of slice"),
        ((slice(None),) * 3, "3 slices for a tensor of 2 dimension"),
        (KeyError("no"), "raised KeyError"),
    ]
    for answer, match in cases:
        def select(n: str, shape: tuple[int, ...], answer: Any = answer) -> Any:
            if n != name:
                return None
            if isinstance(answer, Exception):
                raise answer
            return answer

        eng = EngineModel(CFG)
        rec = WeightReceiver(load_weights=eng.load_weights, select=select)
        with pytest.raises(SelectError, match=match) as info:
            rec.load(_manifest(layout, 1, groups))
        assert repr(name) in str(info.value) and "None for the whole tensor" in str(info.value)
        assert info.value.problems[0][:2] == ("select", name)
        assert isinstance(info.value, WeightSyncError) and rec.version == 0
        assert not in_process  # nothing was read
        assert all(not p.any() for p in eng.params().values())  # nothing was written
    # a destination of the full shape does not fit a selection: a typed shape error
    dest = {name: torch.zeros(CFG.hidden, CFG.q)}
    with pytest.raises(ShapeMismatchError, match=r"\(256, 128\) as selected"):
        WeightReceiver(dest, strict=False, select=tp_select(0, TP)).check(layout)


def test_select_in_a_lazy_stream(in_process: list[Any]) -> None:
    """A lazy stream validates each bucket's selections before reading that bucket."""
    from ray_rdt_pool.weights.advanced import BucketLayout

    st = trainer_state(CFG, 2)
    layout, groups = plan_layout(st, 1 << 20)
    eng = EngineModel(CFG, 1, TP)
    rec = WeightReceiver(load_weights=functools.partial(eng.load_weights, presharded=True),
                         select=tp_select(1, TP))
    rec._begin_stream("s", None, 1)
    for k, g in enumerate(groups):
        spec = BucketLayout(layout.buckets[k], tuple(e for e in layout.entries if e.bucket == k))
        rec._load_stream_bucket("s", k, [list(g)], spec)
    rec._finish_stream("s", len(groups))
    assert rec.version == 1
    assert_equal(eng.params(), reference(st, 1, TP))


def test_a_tp_receiver_records_which_part_of_each_tensor_it_holds() -> None:
    """What a catch-up's peer says it holds: per destination name, the manifest name,
    the full shape and the part its select reads, for whole tensors and for names a
    many-rank sync sends as dim-0 pieces (their full shape given)."""
    from ray_rdt_pool.weights.advanced import plan_layout

    def rank1(name: str, shape: tuple[int, ...]) -> Any:
        return (slice(shape[0] // 2, shape[0]),) if name != "norm" else None

    dest = {"model.w": torch.zeros(32, 8), "model.norm": torch.zeros(8),
            "model.big": torch.zeros(4, 8)}
    rec = WeightReceiver(dest, name_map=lambda n: f"model.{n}", select=rank1)
    layout, _groups = plan_layout({"w": torch.ones(64, 8), "norm": torch.ones(8),
                                   "other": torch.ones(2)}, 1 << 20)
    record = rec._shard_of(layout, {"big": (8, 8)})
    assert record is not None
    assert record() == {"model.w": ("w", (64, 8), (slice(32, 64), slice(0, 8))),
                     "model.norm": ("norm", (8,), None),
                     "model.big": ("big", (8, 8), (slice(4, 8), slice(0, 8)))}
    assert WeightReceiver(dest)._shard_of(layout) is None  # whole tensors: no record
