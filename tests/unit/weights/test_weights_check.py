"""Tests of ray_rdt_pool.weights without Ray: layout planning and the checks that run
before anything is written. The real syncs on Ray are in tests/integration/test_weights.py.
"""

from __future__ import annotations

import pytest
import torch

from ray_rdt_pool.errors import DtypeMismatchError, RdtPoolError, UnexpectedWeightsError
from ray_rdt_pool.weights import ManifestMismatchError, WeightReceiver, WeightSender
from ray_rdt_pool.weights.advanced import can_cast, plan_layout
from tests.support.weights_state import KINDS, SMALL, make_state
from tests.support.weights_state import mismatch as _mismatch


def test_plan_layout_buckets_respect_bucket_bytes() -> None:
    state = {f"t{i}": torch.zeros(1000, dtype=torch.float32) for i in range(10)}  # 4000 B
    layout, groups = plan_layout(state, bucket_bytes=10_000)
    assert [len(b.names) for b in layout.buckets] == [2, 2, 2, 2, 2]
    assert all(b.nbytes <= 10_000 for b in layout.buckets)
    assert [e.name for e in layout.entries] == list(state)
    assert [len(g) for g in groups] == [2] * 5
    assert layout.total_bytes == 40_000
    big = {"a": torch.zeros(10), "huge": torch.zeros(10_000), "b": torch.zeros(10)}
    layout, _ = plan_layout(big, bucket_bytes=1024)
    assert [b.names for b in layout.buckets] == [("a",), ("huge",), ("b",)]


def test_plan_layout_sends_tied_tensors_once() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(16, 8)
            self.head = torch.nn.Linear(8, 16, bias=False)
            self.head.weight = self.embed.weight

    layout, groups = plan_layout(Tied())
    assert [e.name for e in layout.entries] == ["embed.weight"]
    assert layout.aliases == (("head.weight", "embed.weight"),)
    assert sum(len(g) for g in groups) == 1


def test_plan_layout_conjugate_and_negative_views_are_not_aliases() -> None:
    """``c.conj()`` shares ``c``'s memory, offset, shape, strides and dtype, yet reads
    other values; so does the negative view ``c.conj().imag`` of ``c.imag``. Each is a
    tensor of its own (``b`` used to be an alias of ``a`` and receive ``a``'s bytes)."""
    c = torch.randn(4, dtype=torch.complex64)
    state = {"a": c, "b": c.conj(), "im": c.imag, "neg": c.conj().imag, "a2": c}
    assert state["neg"].is_neg()
    layout, groups = plan_layout(state)
    assert [e.name for e in layout.entries] == ["a", "b", "im", "neg"]
    assert layout.aliases == (("a2", "a"),)  # the same tensor still is one
    assert [t.is_conj() for t in groups[0]] == [False, True, False, False]


@pytest.mark.parametrize(("src", "dst", "ok"), [
    (torch.float32, torch.bfloat16, True),
    (torch.bfloat16, torch.float32, True),
    (torch.int64, torch.int32, True),
    (torch.int32, torch.float32, True),
    (torch.bool, torch.float16, True),
    (torch.float32, torch.int64, False),
    (torch.float32, torch.bool, False),
    (torch.complex64, torch.float32, False),
])
def test_same_kind_casting_rule(src: torch.dtype, dst: torch.dtype, ok: bool) -> None:
    assert can_cast(src, dst) is ok
    assert can_cast(src, dst, "unsafe") is True
    assert can_cast(src, dst, "no") is (src == dst)




@pytest.mark.parametrize("kind", list(KINDS))
def test_check_raises_typed_error_and_writes_nothing(kind: str) -> None:
    layout, _ = plan_layout(make_state(SMALL, seed=1), bucket_bytes=4096)
    dest, opts = _mismatch(kind)
    before = {k: v.clone() for k, v in dest.items()}
    with pytest.raises(KINDS[kind]) as info:
        WeightReceiver(dest, **opts).check(layout)
    err = info.value
    assert isinstance(err, ManifestMismatchError) and isinstance(err, ValueError)
    assert isinstance(err, RdtPoolError)
    assert err.problems and err.problems[0][0] == kind
    assert "nothing was written" in str(err)
    assert all(torch.equal(before[k], dest[k]) for k in dest)


def test_complex_to_real_is_refused_and_unsafe_allows_it() -> None:
    layout, _ = plan_layout({"z": torch.zeros(4, dtype=torch.complex64)})
    with pytest.raises(DtypeMismatchError):
        WeightReceiver({"z": torch.zeros(4)}).check(layout)
    WeightReceiver({"z": torch.zeros(4)}, casting="unsafe").check(layout)


def test_name_map_skips_and_non_strict() -> None:
    layout, _ = plan_layout(make_state(SMALL, seed=1))
    dest = {k.replace("layers.", "blocks."): v for k, v in make_state(SMALL, seed=2).items()}
    del dest["step"]
    def rename(n: str) -> str | None:
        return None if n == "step" else n.replace("layers.", "blocks.")

    plan = WeightReceiver(dest, name_map=rename).check(layout)
    assert plan.skipped == 1
    with pytest.raises(UnexpectedWeightsError):
        WeightReceiver(dest, name_map=lambda n: n.replace("layers.", "blocks.")).check(layout)
    WeightReceiver(dest, name_map=lambda n: n.replace("layers.", "blocks."),
                   strict=False).check(layout)
    # a dict maps the listed names only
    dest2 = make_state(SMALL, seed=2)
    dest2["first.w"] = dest2.pop("layers.0.w")
    WeightReceiver(dest2, name_map={"layers.0.w": "first.w"}).check(layout)


def test_layout_and_check_of_float4_weights_under_deterministic_algorithms() -> None:
    """A state with float4_e2m1fn_x2 tensors (a wire dtype) is laid out and checked with
    ``torch.use_deterministic_algorithms(True)`` on, as with it off: the element size is
    read off the dtype, not off a tensor ``torch.empty`` would have to fill (it has no
    fill for that dtype, and raised NotImplementedError)."""
    def f4(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)

    sender = WeightSender({"w": f4(8), "b": torch.ones(3)})
    receiver = WeightReceiver({"w": f4(8), "b": torch.zeros(3)})
    want = sender.layout()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = sender.layout()
        receiver.check(got)
    finally:
        torch.use_deterministic_algorithms(was)
    assert got == want
    assert [(e.dtype, e.nbytes) for e in got.entries] == [("float4_e2m1fn_x2", 8),
                                                           ("float32", 12)]
