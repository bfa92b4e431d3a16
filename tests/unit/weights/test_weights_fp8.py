"""FP8 on the wire, in process over the fake NIXL (tests/support/fakeray.py): a bf16 or
fp32 weight sent as FP8 with tensor, row or block scales arrives dequantized bit for bit
as the plain-torch reference below computes it; a loader or an FP8 destination keeps
the FP8 weight and its scales; a TP select reads a block-aligned part and its scales,
and one that cuts a block is a typed error; the report counts the bytes on the wire.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.errors import InvalidInputError, SelectError
from ray_rdt_pool.weights import WeightReceiver, WeightSender
from tests.support.fakeray import make_runtime, receiver_node

FP8 = torch.float8_e4m3fn


@pytest.fixture()
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Runtime]]:
    yield from make_runtime(monkeypatch)


def reference(w: torch.Tensor, fp8: torch.dtype, groups: tuple[int, int],
              dtype: torch.dtype) -> torch.Tensor:
    """The issue's reference, plainly: per scale group, scale = amax / finfo(fp8).max in
    fp32 (1.0 for a group of zeros), q = (w.float() / scale).to(fp8), and the receiver's
    q.float() * scale cast to its dtype. ``groups``: (rows, cols) of one group."""
    out = torch.empty(w.shape, dtype=dtype)
    bm, bn = groups
    for i in range(0, w.shape[0], bm):
        for j in range(0, w.shape[1], bn):
            g = w[i:i + bm, j:j + bn].float()
            amax = g.abs().max()
            scale = amax / torch.finfo(fp8).max if amax != 0 else torch.tensor(1.0)
            q = (g / scale).to(fp8)
            out[i:i + bm, j:j + bn] = (q.float() * scale).to(dtype)
    return out


def model(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {
        "a.weight": torch.randn(300, 200, generator=g) * 0.02,  # edge blocks
        "b.weight": torch.randn(256, 128, generator=g) * 3.0,
        "c.weight": torch.zeros(128, 64),  # a group of zeros
        "norm.weight": torch.ones(200) + torch.randn(200, generator=g) * 0.1,
    }
    state["b.weight"][0, 0] = 1000.0  # above FP8's range once unscaled
    return {k: v.to(dtype) for k, v in state.items()}


def groups_of(shape: tuple[int, ...], scale: Any) -> tuple[int, int]:
    if scale == "tensor":
        return shape  # type: ignore[return-value]
    if scale == "row":
        return (1, shape[1])
    return scale  # type: ignore[no-any-return]


def fp8_but_norms(name: str, t: torch.Tensor) -> torch.dtype | None:
    return None if "norm" in name else FP8


@pytest.mark.parametrize("scale", ["tensor", "row", (128, 128), (64, 32)])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lazy", [False, True], ids=["mapping", "lazy"])
def test_dequantized_weights_match_the_reference_bit_for_bit(
        runtime: Any, scale: Any, src: torch.dtype, lazy: bool) -> None:
    rt = runtime(pool_bytes=4 << 20, arena_bytes=4 << 20)
    state = model(src)
    dest = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in state.items()}
    _a, h = receiver_node(dest)
    source: Any = (lambda: iter(state.items())) if lazy else state
    sender = WeightSender(source, bucket_bytes=256 << 10, wire_dtype=fp8_but_norms,
                          wire_scale=scale)
    rep = sender.stream([h], timeout_s=10)
    for name, w in state.items():
        if "norm" in name:
            assert torch.equal(dest[name], w.to(torch.bfloat16)), name  # excluded: as is
        else:
            want = reference(w, FP8, groups_of(tuple(w.shape), scale), torch.bfloat16)
            assert torch.equal(dest[name].view(torch.int16), want.view(torch.int16)), name
    # On the wire: one byte per FP8 element, four per scale, the norm in its dtype.
    scales = sum(math.prod(-(-s // g) for s, g in zip(w.shape, groups_of(tuple(w.shape),
                                                                         scale)))
                 for n, w in state.items() if "norm" not in n)
    fp8 = sum(w.numel() for n, w in state.items() if "norm" not in n)
    assert rep.nbytes == fp8 + 4 * scales + state["norm.weight"].nbytes
    assert rt.stats().pool_used == 0


def test_a_loader_and_an_fp8_destination_keep_the_weight_and_its_scales(
        runtime: Any) -> None:
    runtime(pool_bytes=4 << 20, arena_bytes=4 << 20)
    state = model()
    got: dict[str, torch.Tensor] = {}

    def load_weights(pairs: Any) -> None:
        for name, t in pairs:
            got[name] = t.clone()

    _a, loader = receiver_node(None, load_weights=load_weights, keep_fp8=True)
    dest = {"a.weight": torch.zeros(300, 200, dtype=FP8),
            "a.weight_scale_inv": torch.zeros(3, 2),
            **{k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in state.items()
               if k != "a.weight"}}
    _b, fp8_engine = receiver_node(dest)
    sender = WeightSender(state, bucket_bytes=256 << 10, wire_dtype=fp8_but_norms)
    sender.stream([loader, fp8_engine], timeout_s=10)
    w = state["a.weight"]
    # The reference's q and scales, per 128 x 128 block.
    for name in ("a.weight", "b.weight", "c.weight"):
        assert got[name].dtype == FP8 and got[name + "_scale_inv"].dtype == torch.float32
        deq = (got[name].float() * got[name + "_scale_inv"].repeat_interleave(128, 0)
               .repeat_interleave(128, 1)[:got[name].shape[0], :got[name].shape[1]])
        want = reference(state[name], FP8, (128, 128), torch.float32)
        assert torch.equal(deq, want), name
    assert torch.equal(dest["a.weight"].view(torch.uint8), got["a.weight"].view(torch.uint8))
    assert torch.equal(dest["a.weight_scale_inv"], got["a.weight_scale_inv"])
    assert torch.equal(dest["b.weight"], reference(state["b.weight"], FP8, (128, 128),
                                                   torch.bfloat16))
    assert torch.equal(got["norm.weight"], state["norm.weight"])  # excluded: as sent
    del w


@pytest.mark.parametrize("wire", [None, FP8])
def test_weights_that_are_fp8_already_travel_as_they_are(runtime: Any, wire: Any) -> None:
    """An engine that keeps FP8 (weight and ``_scale_inv``) is a sender too, e.g. the peer
    of a catch-up: its FP8 tensors go byte for byte beside their own scale tensors,
    not quantized again (which would add a second scale under the same name)."""
    runtime(pool_bytes=4 << 20, arena_bytes=4 << 20)
    g = torch.Generator().manual_seed(5)
    state = {"w": (torch.randn(300, 200, generator=g) * 40).to(FP8),
             "w_scale_inv": torch.rand(3, 2, generator=g),
             "norm": torch.randn(200, generator=g).to(torch.bfloat16)}
    dest = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    _a, engine = receiver_node(dest)
    rep = WeightSender(state, wire_dtype=wire).stream([engine], timeout_s=10)
    assert torch.equal(dest["w"].view(torch.uint8), state["w"].view(torch.uint8))
    if wire is None:  # (with wire_dtype=FP8 the fp32 and bf16 tensors are quantized)
        assert rep.nbytes == sum(t.numel() * t.element_size() for t in state.values())
        assert torch.equal(dest["w_scale_inv"], state["w_scale_inv"])
        assert torch.equal(dest["norm"], state["norm"])


def test_a_tp_select_reads_its_rows_and_their_scales_or_names_the_block(
        runtime: Any) -> None:
    runtime(pool_bytes=4 << 20, arena_bytes=4 << 20)
    state = {"w": (torch.randn(256, 128) * 0.1).to(torch.bfloat16)}

    def rank1(name: str, shape: tuple[int, ...]) -> Any:
        return (slice(128, 256),)  # block-aligned: rows 128-255

    dest = {"w": torch.zeros(128, 128, dtype=torch.bfloat16)}
    _a, h = receiver_node(dest, select=rank1)
    WeightSender(state, bucket_bytes=1 << 20, wire_dtype=FP8).stream([h], timeout_s=10)
    want = reference(state["w"], FP8, (128, 128), torch.bfloat16)[128:]
    assert torch.equal(dest["w"].view(torch.int16), want.view(torch.int16))

    def cuts(name: str, shape: tuple[int, ...]) -> Any:
        return (slice(0, 100),)

    _b, h2 = receiver_node({"w": torch.zeros(100, 128, dtype=torch.bfloat16)}, select=cuts)
    with pytest.raises(SelectError, match=r"cuts the FP8 scale groups of 128"):
        WeightSender(state, bucket_bytes=1 << 20, wire_dtype=FP8).stream([h2], timeout_s=10)


def test_bad_fp8_options_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="wire_scale must be"):
        WeightSender({"w": torch.zeros(4)}, wire_dtype=FP8, wire_scale=(0, 128))
    with pytest.raises(InvalidInputError, match="wire_scale must be"):
        WeightSender({"w": torch.zeros(4)}, wire_dtype=FP8, wire_scale="block")
    with pytest.raises(InvalidInputError, match="keep_fp8 must be True or False"):
        WeightReceiver({"w": torch.zeros(4)}, keep_fp8="yes")  # type: ignore[arg-type]


def _edge_weight(shape: tuple[int, ...], dtype: torch.dtype, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(shape, generator=g) * scale
    flat = w.view(-1)
    flat[:3] = 0.0
    flat[3] = -0.0
    flat[4] = 1e-40  # a subnormal fp32 (bf16 keeps some)
    flat[5] = -scale * 1e-6  # rounds into FP8's subnormals
    return w.to(dtype)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32])
def test_the_compiled_quantizer_is_torchs_arithmetic_bit_for_bit(
        fp8: torch.dtype, src: torch.dtype) -> None:
    """``quantize`` takes the helper's quantizing copy where it is built; its FP8 bytes
    and scales must equal the plain-torch path's, bit for bit, on edge blocks, groups of
    zeros, subnormals, values beyond FP8's range, NaN and inf, rows with padding (a
    column slice) and every scale granularity."""
    from ray_rdt_pool.memory.fastcopy import fp8_quantizer
    from ray_rdt_pool.weights.fp8 import _quantize_native, block_of, quantize_torch

    if fp8_quantizer() is None:
        pytest.skip("the compiled copy helper is not built here "
                    "(python -m ray_rdt_pool.memory.native build)")
    cases: list[tuple[torch.Tensor, Any]] = []
    for mag in (1e-3, 0.02, 1.0, 1e4):
        for shape, scale in (((300, 257), (128, 128)), ((64, 40), "row"),
                             ((100, 30), "tensor"), ((7, 9), (2, 3)), ((1, 33), (1, 16))):
            cases.append((_edge_weight(shape, src, mag), scale))
    big = _edge_weight((256, 256), src, 1.0)
    big[0, 0], big[200, 200], big[130, 3] = float("nan"), float("inf"), -1e30
    big[140:256, 140:256] = 0.0  # a block of zeros
    cases += [(big, (128, 128)), (big[:, 3:200], (128, 128)),  # padded rows
              (_edge_weight((4, 5, 6), src, 0.5), "tensor")]  # not 2-D: one scale
    for w, scale in cases:
        block = block_of(w.shape, scale)
        got = _quantize_native(w, fp8, block)
        assert got is not None, (tuple(w.shape), scale)
        q, s = got
        q0, s0 = quantize_torch(w, fp8, block)
        assert torch.equal(s.view(torch.int32), s0.view(torch.int32)), (tuple(w.shape), scale)
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)), (tuple(w.shape), scale)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float32])
def test_the_compiled_dequantizer_is_torchs_arithmetic_bit_for_bit(
        fp8: torch.dtype, dst: torch.dtype) -> None:
    """``dequantize`` takes the helper's dequantizing copy where it is built; what it
    writes must equal the plain-torch path bit for bit (NaN as NaN): every one of the 256
    FP8 values, scales that round in bf16, overflow to inf and fall to subnormals, edge
    blocks, every granularity, a destination with padded rows, one of more than 2-D."""
    from ray_rdt_pool.memory.fastcopy import fp8_dequantizer
    from ray_rdt_pool.weights.fp8 import _dequantize_native, dequantize_torch, scale_shape

    if fp8_dequantizer() is None:
        pytest.skip("the compiled copy helper is not built here "
                    "(python -m ray_rdt_pool.memory.native build)")
    g = torch.Generator().manual_seed(3)
    every = torch.arange(256, dtype=torch.uint8)

    def fp8_bytes(shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        b[:min(n, 256)] = every[:min(n, 256)]
        return b.view(fp8).view(shape)

    def scales(shape: tuple[int, ...]) -> torch.Tensor:
        s = torch.exp2(torch.randint(-140, 120, shape, generator=g).float()) \
            * (1 + torch.rand(shape, generator=g))
        s.view(-1)[0] = 1.0
        return s

    cases = [((300, 257), (128, 128)), ((64, 40), (1, 40)), ((100, 30), (100, 30)),
             ((7, 9), (2, 3)), ((1, 33), (1, 16)), ((16, 16), (128, 128))]
    for shape, block in cases:
        q = fp8_bytes(shape)
        s = scales(scale_shape(shape, block))
        want = dequantize_torch(q, s, block, dst)
        for out in (torch.full(shape, 7.0, dtype=dst),
                    torch.full((shape[0], shape[1] + 5), 7.0, dtype=dst)[:, 2:2 + shape[1]]):
            assert _dequantize_native(q, s, block, dst, out), (shape, block)
            assert torch.equal(out.isnan(), want.isnan()), (shape, block)
            ok = ~want.isnan()
            assert torch.equal(out[ok].view(torch.int16 if dst == torch.bfloat16
                                            else torch.int32),
                               want[ok].view(torch.int16 if dst == torch.bfloat16
                                             else torch.int32)), (shape, block)
            if out.stride(0) != shape[1]:  # the padding around the rows is untouched
                assert out.as_strided((shape[0], 2), (out.stride(0), 1),
                                      out.storage_offset() - 2).eq(7.0).all()
    q = fp8_bytes((4, 5, 6))  # not 2-D: one scale
    s = torch.tensor([[[0.37]]])
    out = torch.empty((4, 5, 6), dtype=dst)
    assert _dequantize_native(q, s, (4, 5, 6), dst, out)
    want = dequantize_torch(q, s, (4, 5, 6), dst)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~want.isnan()], want[~want.isnan()])
