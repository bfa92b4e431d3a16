"""The threaded pack copy leaves exactly the bytes of the one-thread copy.

Fast unit tests, no Ray and no NIXL: ``pack_into`` on one thread and on several, into two
``HostMemory`` s filled with the same pattern, must leave byte-identical regions (so a
threaded pack writes nowhere else either), and both must hold each tensor's logical
bytes where the block map puts them. The unit size is patched down to a few hundred
bytes so small tensors still make many units, cut inside tensors and across blocks.
"""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import pairwise
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_rdt_pool.config import PoolConfig, Tuning, from_env
from ray_rdt_pool.core.layout import BlockMap, packed_offsets
from ray_rdt_pool.errors import ConfigurationError
from ray_rdt_pool.memory import fastcopy, native, pack, pack_pool, rebuild
from ray_rdt_pool.memory.allocations import HostMemory
from ray_rdt_pool.memory.describe import Described, describe
from ray_rdt_pool.memory.dtypes import dtype_name
from ray_rdt_pool.memory.fastcopy import move_batch, stream_copy, stream_kind

RELAXED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60)
FILL = 0xA5

DTYPES = [torch.float32, torch.int8, torch.float64, torch.bfloat16, torch.complex64,
          torch.int16]
KINDS = ["own", "adjacent", "transposed", "strided", "neg", "conj", "zero"]


@contextmanager
def unit_bytes(n: int) -> Iterator[None]:
    with mock.patch.object(pack_pool, "PACK_CHUNK", n):
        yield


def _values(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype.is_complex or dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64 if dtype.is_complex
                           else torch.float32).to(dtype)
    return torch.randint(-100, 100, (n,), generator=g).to(dtype)


def build(specs: Sequence[tuple[str, int, torch.dtype]], seed: int = 0) -> list[torch.Tensor]:
    """Tensors from (kind, numel, dtype) specs. ``adjacent`` ones are consecutive slices
    of one buffer, so the pack merges them into one span."""
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    shared: torch.Tensor | None = None
    pos = 0
    for kind, n, dtype in specs:
        if kind == "conj" and not dtype.is_complex:
            dtype = torch.complex64
        if kind == "zero":
            out.append(torch.empty(0, 3, dtype=dtype))
        elif kind == "adjacent":
            if shared is None or shared.dtype != dtype or pos + n > shared.numel():
                shared, pos = _values(max(4096, n), dtype, g), 0
            out.append(shared[pos:pos + n])
            pos += n
            continue
        elif kind == "transposed":
            out.append(_values(2 * (n + 2), dtype, g).view(2, n + 2).t())
        elif kind == "strided":
            out.append(_values(2 * n + 2, dtype, g)[::2])
        elif kind == "neg":
            out.append(torch._neg_view(_values(n, dtype, g)))
        elif kind == "conj":
            out.append(_values(n, dtype, g).conj())
        else:
            out.append(_values(n, dtype, g))
        shared = None  # anything else breaks the run of adjacent slices
    return out


def scatter_blocks(total: int, cuts: Sequence[int], gaps: Sequence[int],
                   order: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
    """Split ``[0, total)`` at ``cuts`` into blocks placed out of order, with gaps between,
    as the allocator may hand them out. Returns the blocks and the region size needed."""
    edges = sorted({0, total, *[c for c in cuts if 0 < c < total]})
    lengths = [b - a for a, b in pairwise(edges)] or [total]
    place = sorted(range(len(lengths)), key=lambda i: order[i % len(order)] if order else i)
    phys: dict[int, int] = {}
    at = 0
    for k, i in enumerate(place):
        at += gaps[k % len(gaps)] if gaps else 0
        phys[i] = at
        at += lengths[i]
    return [(phys[i], lengths[i]) for i in range(len(lengths))], at + 64


def logical_bytes(t: torch.Tensor) -> bytes:
    t = t.resolve_conj().resolve_neg()
    # A fresh tensor has standard strides (.contiguous() may keep odd ones for size-1 dims).
    c = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return c.view(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""


def pack_both(tensors: list[torch.Tensor], blocks: list[tuple[int, int]] | None,
              which: Sequence[int] | None, threads: int, chunk: int,
              threshold: int = 0, stream_min: int = 0
              ) -> tuple[bytes, bytes, list[int], list[tuple[int, int]]]:
    """Pack one-thread (memmove) and threaded (streaming stores from ``stream_min``)
    into two regions; return both regions' bytes."""
    d = describe(tensors)
    offsets, total = packed_offsets(d.nbytes, d.aligns)
    if blocks is None:
        blocks, size = [(128, total)], total + 256
    else:
        size = max((o + n for o, n in blocks), default=0) + 64
    regions = [HostMemory(max(size, 64)) for _ in range(2)]
    for r in regions:
        r.tensor.fill_(FILL)
    pack.pack_into(tensors, d, offsets, blocks, regions[0], which)
    with unit_bytes(chunk):
        pack.pack_into(tensors, d, offsets, blocks, regions[1], which, threads=threads,
                       threshold=threshold, stream_min=stream_min)
    out = [r.tensor.numpy().tobytes() for r in regions]
    for r in regions:
        r.close()
    return out[0], out[1], offsets, blocks


def check_placed(region: bytes, tensors: list[torch.Tensor], offsets: list[int],
                 blocks: list[tuple[int, int]], which: Sequence[int] | None) -> None:
    """Every tensor in ``which`` holds its logical bytes at its mapped physical places."""
    bmap = BlockMap(blocks)
    for i in range(len(tensors)) if which is None else which:
        want = logical_bytes(tensors[i])
        got = b"".join(region[p:p + m] for p, m in bmap.map(offsets[i], len(want)))
        assert got == want, f"tensor {i} ({tensors[i].dtype}, {tuple(tensors[i].shape)})"


def assert_same_pack(tensors: list[torch.Tensor], blocks: list[tuple[int, int]] | None = None,
                     which: Sequence[int] | None = None, threads: int = 3,
                     chunk: int = 256, stream_min: int = 0) -> None:
    one, many, offsets, used = pack_both(tensors, blocks, which, threads, chunk,
                                         stream_min=stream_min)
    assert one == many
    check_placed(many, tensors, offsets, used, which)


# --------------------------------------------------------------------------- examples


def test_one_big_tensor_many_units() -> None:
    assert_same_pack([torch.randn(50_000)], chunk=4096)


def test_adjacent_views_make_one_span_cut_into_units() -> None:
    weight = torch.randn(64, 100)
    assert_same_pack(list(weight.unbind(0)), chunk=1000)


def test_adjacent_in_memory_but_padded_in_the_pool() -> None:
    # 3 bytes, then float32 values right after them in memory: the pool puts the floats
    # on a 4-byte boundary, so the two are not one span.
    buf = bytearray(bytes(range(200)))
    head = torch.frombuffer(buf, dtype=torch.uint8, count=3)
    tail = torch.frombuffer(buf, dtype=torch.float32, count=40, offset=3)
    more = torch.frombuffer(buf, dtype=torch.uint8, count=37, offset=163)
    assert tail.data_ptr() == head.data_ptr() + 3
    assert_same_pack([head, tail, more], chunk=128)
    blocks, _ = scatter_blocks(256, [2, 70, 130], [64, 0, 8], [3, 1, 0, 2])
    assert_same_pack([head, tail, more], blocks, chunk=128)


def test_multi_block_placement() -> None:
    tensors = [torch.randn(3000), torch.randn(17).to(torch.bfloat16), torch.randn(5000)]
    d = describe(tensors)
    _, total = packed_offsets(d.nbytes, d.aligns)
    # Five blocks, out of order, with gaps; cuts fall inside tensors on purpose.
    blocks, _ = scatter_blocks(total, [1000, 6001, 12_000, 12_064], [64, 0, 320, 8, 128],
                               [3, 1, 4, 0, 2])
    assert len(blocks) == 5
    assert_same_pack(tensors, blocks, chunk=512)


def test_mixed_plain_and_non_plain() -> None:
    specs = [("own", 900, torch.float32), ("transposed", 300, torch.float32),
             ("adjacent", 200, torch.int16), ("adjacent", 55, torch.int16),
             ("neg", 400, torch.float64), ("conj", 100, torch.complex64),
             ("strided", 333, torch.int8), ("own", 10, torch.bfloat16)]
    tensors = build(specs)
    assert not all(describe(tensors).plain)
    d = describe(tensors)
    _, total = packed_offsets(d.nbytes, d.aligns)
    blocks, _ = scatter_blocks(total, [total // 3, total // 2], [0, 64, 192], [2, 0, 1])
    assert_same_pack(tensors, blocks, chunk=300)


def test_only_non_plain_tensors() -> None:
    assert_same_pack(build([("transposed", 5000, torch.float32), ("neg", 3000, torch.float32)]))


def test_zero_size_tensors_and_empty_object() -> None:
    tensors = [torch.empty(0), torch.randn(2000), torch.empty(0, 5), torch.randn(7),
               torch.empty(0, dtype=torch.int8)]
    assert_same_pack(tensors)
    assert_same_pack([torch.empty(0), torch.empty(0, 4)])
    assert_same_pack([])


def test_which_subsets() -> None:
    tensors = build([("adjacent", 700, torch.float32)] * 6 + [("transposed", 90, torch.int16),
                                                              ("own", 3000, torch.float64)])
    for which in ([], [0], [1, 3, 5], [5, 4, 3, 2, 1, 0], [6, 7], [0, 2, 6], list(range(8))):
        assert_same_pack(tensors, which=which, chunk=500)


def test_more_threads_than_units() -> None:
    assert_same_pack([torch.randn(100)], threads=16, chunk=4 << 20)


# --------------------------------------------------------------------------- threshold


def test_threshold_boundary_picks_the_path() -> None:
    tensors = [torch.randn(1024), torch.randn(3072)]  # 16 KiB to copy
    d = describe(tensors)
    offsets, total = packed_offsets(d.nbytes, d.aligns)
    nbytes = sum(d.nbytes)
    real = pack._pack_threaded
    calls: list[int] = []

    def spy(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        real(*args, **kwargs)

    region = HostMemory(total)
    with mock.patch.object(pack, "_pack_threaded", spy), unit_bytes(1024):
        # At the threshold: threaded. One byte above it: the calling thread alone.
        for threshold, threads, which, threaded in [
                (nbytes, 2, None, True), (nbytes + 1, 2, None, False),
                (nbytes, 1, None, False), (0, 1, None, False),
                (4096, 2, [0], True), (4097, 2, [0], False)]:
            calls.clear()
            region.tensor.fill_(0)
            pack.pack_into(tensors, d, offsets, [(0, total)], region, which,
                           threads=threads, threshold=threshold)
            assert bool(calls) == threaded, (threshold, threads, which)
            check_placed(region.tensor.numpy().tobytes(), tensors, offsets, [(0, total)],
                         which)
    region.close()


def test_default_call_stays_on_the_calling_thread() -> None:
    tensors = [torch.randn(1 << 16)]
    d = describe(tensors)
    offsets, total = packed_offsets(d.nbytes, d.aligns)
    region = HostMemory(total)
    with mock.patch.object(pack, "_pack_threaded", side_effect=AssertionError("threaded")):
        pack.pack_into(tensors, d, offsets, [(0, total)], region)
        pack.pack_into(tensors, d, offsets, [(0, total)], region, [0])
    check_placed(region.tensor.numpy().tobytes(), tensors, offsets, [(0, total)], None)
    region.close()


# --------------------------------------------------------------------------- properties

SPEC = st.tuples(st.sampled_from(KINDS), st.integers(1, 700), st.sampled_from(DTYPES))


@RELAXED
@given(specs=st.lists(SPEC, max_size=12), seed=st.integers(0, 2**16),
       cuts=st.lists(st.integers(0, 20_000), max_size=6),
       gaps=st.lists(st.sampled_from([0, 8, 64, 200]), min_size=1, max_size=4),
       order=st.permutations(range(7)), threads=st.integers(2, 5),
       chunk=st.sampled_from([128, 200, 1000, 4096]), data=st.data())
def test_threaded_pack_is_byte_identical(specs: list[tuple[str, int, torch.dtype]], seed: int,
                                         cuts: list[int], gaps: list[int], order: list[int],
                                         threads: int, chunk: int, data: Any) -> None:
    tensors = build(specs, seed)
    d = describe(tensors)
    _, total = packed_offsets(d.nbytes, d.aligns)
    blocks, _ = scatter_blocks(total, cuts, gaps, order)
    which = data.draw(st.none() | st.lists(st.sampled_from(range(len(tensors))), unique=True)
                      if tensors else st.none())
    assert_same_pack(tensors, blocks, which, threads, chunk)


@RELAXED
@given(moves=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 5000)), max_size=30),
       chunk=st.integers(1, 3000))
def test_units_cover_every_move_once(moves: list[tuple[int, int]], chunk: int) -> None:
    # Destinations laid end to end after a random start; sources far away.
    triples = []
    at = 0
    for start, n in moves:
        triples.append((at + start, 1 << 40 | (at + start), n))
        at += start + n
    units = pack_pool.pack_units(triples, chunk)
    assert all(u for u in units)
    assert all(sum(n for *_, n in u) <= max(chunk, 128) for u in units)
    assert_pieces_in_order(triples, [m for u in units for m in u], None)


def assert_pieces_in_order(moves: Sequence[tuple[int, int, int]],
                           pieces: Sequence[tuple[int, int, int]], most: int | None) -> None:
    """``pieces`` are ``moves`` in order, each piece a prefix of what is left of its move,
    cut only on a cache-line boundary of the destination (and, with ``most``, no cut piece
    longer than that)."""
    it = iter(pieces)
    for dst, src, n in moves:
        while n:
            d2, s2, m = next(it)
            assert (d2, s2) == (dst, src) and 0 < m <= n
            if m < n:
                assert (d2 + m) % 64 == 0
                assert most is None or m <= most
            dst, src, n = dst + m, src + m, n - m
    assert next(it, None) is None


def test_many_tensors_threaded_without_the_helper_pack_the_same() -> None:
    """Without the compiled helper the threaded pack of many tensors copies move by move
    (lists of units), and still leaves the one-thread bytes."""
    with mock.patch.object(fastcopy, "move_batch", lambda: None), \
            mock.patch.object(pack, "array_units", side_effect=AssertionError("arrays")):
        assert_same_pack(_many_small(3), threads=3, chunk=512)


@RELAXED
@given(moves=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 5000)), max_size=40),
       chunk=st.integers(1, 3000), base=st.integers(0, 63))
def test_array_units_cover_every_byte_once_in_order(moves: list[tuple[int, int]], chunk: int,
                                                    base: int) -> None:
    """The array form of the units: every byte of every move once, in order; a move is
    cut only on a 64-byte destination boundary and into pieces of at most the unit
    size; a unit holds at most twice the unit size (and no empty unit)."""
    import numpy as np

    triples = []
    at = base
    for gap, n in moves:
        triples.append((at + gap, (1 << 40) + 3 * (at + gap), n))
        at += gap + n
    arr = np.array(triples, dtype=np.int64).reshape(-1, 3)
    units = pack_pool.array_units(arr, chunk)
    size = max(chunk, 128)
    assert all(len(u) for u in units)
    assert all(int(u[:, 2].sum()) <= 2 * size for u in units)
    assert_pieces_in_order(triples, [tuple(r) for u in units for r in u.tolist()], size)


@RELAXED
@given(items=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 64), st.booleans(),
                                st.integers(0, 2)), max_size=60),
       data=st.data())
def test_vector_spans_equal_the_per_tensor_walk(items: list[tuple[int, int, bool, int]],
                                                 data: Any) -> None:
    """The numpy span finder (objects of many tensors) gives the one-by-one walk's spans
    and leftovers, in order: sizes (0 included), plain or not, and sources/destinations
    that continue the previous tensor or jump (so spans join and break everywhere)."""
    nbytes, ptrs, plain, offsets = [], [], [], []
    src, dst = 1 << 30, 0
    for jump, n, ok, dst_jump in items:
        src += jump * 8  # 0: continues the previous tensor's bytes
        dst += dst_jump * 8
        nbytes.append(n)
        ptrs.append(src)
        plain.append(ok)
        offsets.append(dst)
        src += n
        dst += n
    idx = data.draw(st.none() | st.lists(st.sampled_from(range(len(items))), unique=True)
                    if items else st.none())
    walk_left: list[int] = []
    walk = list(pack._spans(range(len(items)) if idx is None else idx, nbytes, ptrs, plain,
                            offsets, walk_left))
    vec_left: list[int] = []
    vec = list(zip(*pack._span_lists(idx, nbytes, ptrs, plain, offsets, vec_left)))
    assert vec == walk and vec_left == walk_left


def _many_small(seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for i in range(3 * fastcopy.MANY_MOVES):  # alternating shapes and dtypes, some views
        if i % 3 == 0:
            tensors.append(torch.randn(17, generator=g))
        elif i % 3 == 1:
            tensors.append(torch.randint(0, 9, (5,), generator=g))
        else:
            tensors.append(torch.randn(8, 4, generator=g).t())  # not plain: a leftover
    return tensors


@pytest.mark.parametrize("helper", [True, False], ids=["one-call", "no-helper"])
def test_many_tensors_take_the_vector_path_and_pack_the_same(helper: bool) -> None:
    """Thousands of small tensors: the spans come from numpy, and the moves run in one
    call of the compiled helper (or, without it, one memmove each); same bytes."""
    if helper and move_batch() is None:
        pytest.skip("the compiled copy helper is not built here")
    tensors = _many_small()
    d = describe(tensors)
    offsets, total = packed_offsets(d.nbytes, d.aligns)
    region = HostMemory(total + 128)
    region.tensor.fill_(FILL)
    with mock.patch.object(pack, "_span_arrays", wraps=pack._span_arrays) as vec, \
            mock.patch.object(fastcopy, "move_batch",
                              wraps=fastcopy.move_batch if helper else lambda: None), \
            mock.patch.object(fastcopy, "_memmove", wraps=ctypes.memmove) as memmove:
        pack.pack_into(tensors, d, offsets, [(64, total)], region)
    assert vec.call_count == 1
    plain = sum(d.plain)
    # with the helper only the leftovers (not plain) are memmoved, one each
    assert memmove.call_count == (len(tensors) - plain if helper else len(tensors))
    got = region.tensor.numpy().tobytes()
    region.close()
    assert got[:64] == bytes([FILL]) * 64 and got[64 + total:] == bytes([FILL]) * 64
    check_placed(got[64:], tensors, offsets, [(0, total)], None)


@pytest.mark.parametrize("stream_min", [0, 1])
def test_many_tensors_threaded_batches_pack_the_same(stream_min: int) -> None:
    """The threaded pack of many tensors into one block finds its moves and units as
    arrays and hands each unit to the helper in one call."""
    tensors = _many_small(5)
    with mock.patch.object(fastcopy, "run_batch", wraps=fastcopy.run_batch) as batched, \
            mock.patch.object(pack, "array_units", wraps=pack_pool.array_units) as units:
        assert_same_pack(tensors, threads=3, chunk=512, stream_min=stream_min)
    if move_batch() is not None:
        assert units.call_count == 1
        assert batched.call_count > 1  # several units, one call each
    d = describe(tensors)
    _, total = packed_offsets(d.nbytes, d.aligns)
    blocks, _ = scatter_blocks(total, [total // 3, total // 2 + 5], [64, 0], [2, 0, 1])
    assert_same_pack(tensors, blocks, threads=3, chunk=512, stream_min=stream_min)


@RELAXED
@given(lengths=st.lists(st.integers(0, 300_000) | st.integers(0, 300), min_size=0,
                        max_size=40),
       gaps=st.lists(st.integers(0, 70), min_size=40, max_size=40),
       stream=st.booleans(), seed=st.integers(0, 2**16))
def test_move_batch_writes_exactly_the_bytes_of_memmove(
        lengths: list[int], gaps: list[int], stream: bool, seed: int) -> None:
    fn = move_batch()
    if fn is None:
        pytest.skip("the compiled copy helper is not built here")
    import numpy as np

    g = torch.Generator().manual_seed(seed)
    total = sum(lengths) + sum(gaps) + 64
    src = torch.randint(0, 256, (total,), generator=g, dtype=torch.uint8)
    got = torch.full((total,), FILL, dtype=torch.uint8)
    want = got.clone()
    moves, at = [], 0
    for n, gap in zip(lengths, gaps):
        at += gap
        s = (at * 7919) % max(1, total - n)  # sources anywhere, in another buffer
        moves.append((got.data_ptr() + at, src.data_ptr() + s, n))
        ctypes.memmove(want.data_ptr() + at, src.data_ptr() + s, n)
        at += n
    arr = np.array(moves, dtype=np.int64).reshape(-1, 3)
    fn(arr.ctypes.data, len(arr), 1 if stream else 0)
    assert torch.equal(got, want)


@RELAXED
@given(specs=st.lists(SPEC, min_size=1, max_size=10), seed=st.integers(0, 2**16),
       to=st.sampled_from([torch.bfloat16, torch.float16, torch.float64]),
       threads=st.integers(2, 4))
def test_threaded_converting_pack_is_byte_identical(
        specs: list[tuple[str, int, torch.dtype]], seed: int, to: torch.dtype,
        threads: int) -> None:
    """``pack_torch`` cut into pieces on several threads (dtype conversions, strided
    sources, row groups) leaves the block of the one-call copy, byte for byte."""
    tensors = [t for t in build(specs, seed) if not t.is_complex()]
    d = describe(tensors)
    for i, t in enumerate(tensors):
        if t.is_floating_point():
            d.dtypes[i] = dtype_name(to)
            d.nbytes[i] = t.numel() * to.itemsize
            d.aligns[i] = to.itemsize
    offsets, total = packed_offsets(d.nbytes, d.aligns)
    one = torch.full((total,), FILL, dtype=torch.uint8)
    many = one.clone()
    pack.pack_torch(tensors, d, offsets, one)
    with unit_bytes(256):  # pieces of a few rows each
        pack.pack_torch(tensors, d, offsets, many, threads=threads, threshold=0)
    assert torch.equal(one, many)


# --------------------------------------------------------------------------- failures


def _threaded_setup(n: int = 20_000) -> tuple[list[torch.Tensor], Described, list[int], int,
                                              HostMemory]:
    tensors = [torch.randn(n)]
    d = describe(tensors)
    offsets, total = packed_offsets(d.nbytes, d.aligns)
    return tensors, d, offsets, total, HostMemory(total)


def test_helper_error_propagates_to_the_caller() -> None:
    tensors, d, offsets, total, region = _threaded_setup()
    real = ctypes.memmove
    caller = threading.get_ident()
    helper_entered = threading.Event()

    class Boom(RuntimeError):
        pass

    def memmove(dst: int, src: int, n: int) -> Any:
        if threading.get_ident() != caller:
            helper_entered.set()
            raise Boom("helper failed")
        # Hold the caller back until a helper has taken a unit, so one surely fails.
        helper_entered.wait(30)
        return real(dst, src, n)

    with mock.patch.object(fastcopy, "_memmove", memmove), unit_bytes(1024):
        with pytest.raises(Boom, match="helper failed"):
            pack.pack_into(tensors, d, offsets, [(0, total)], region, threads=2, threshold=0)
    # The helpers survive a failure: the next threaded pack works.
    region.tensor.fill_(0)
    with unit_bytes(1024):
        pack.pack_into(tensors, d, offsets, [(0, total)], region, threads=2, threshold=0)
    check_placed(region.tensor.numpy().tobytes(), tensors, offsets, [(0, total)], None)
    region.close()


def test_caller_error_waits_for_helpers_before_raising() -> None:
    tensors, d, offsets, total, region = _threaded_setup()
    real = ctypes.memmove
    caller = threading.get_ident()
    helper_in, caller_failing = threading.Event(), threading.Event()
    lock = threading.Lock()
    inside = [0]

    def memmove(dst: int, src: int, n: int) -> Any:
        if threading.get_ident() == caller:
            helper_in.wait(30)
            caller_failing.set()
            raise KeyError("caller failed")
        with lock:
            inside[0] += 1
        try:
            helper_in.set()
            caller_failing.wait(30)
            threading.Event().wait(0.05)  # still writing when the caller fails
            return real(dst, src, n)
        finally:
            with lock:
                inside[0] -= 1

    with mock.patch.object(fastcopy, "_memmove", memmove), unit_bytes(1024):
        with pytest.raises(KeyError, match="caller failed"):
            pack.pack_into(tensors, d, offsets, [(0, total)], region, threads=2, threshold=0)
        # pack_into returned only after the helper left the pool alone.
        assert inside[0] == 0
    region.close()


def test_non_plain_tensor_error_propagates() -> None:
    tensors = [torch.randn(20_000), torch.randn(30, 40).t()]
    d = describe(tensors)
    offsets, total = packed_offsets(d.nbytes, d.aligns)
    region = HostMemory(total)

    class Odd(torch.Tensor):
        def contiguous(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            raise ValueError("cannot materialise")

    tensors[1] = tensors[1].as_subclass(Odd)
    with unit_bytes(1024), pytest.raises(ValueError, match="cannot materialise"):
        pack.pack_into(tensors, d, offsets, [(0, total)], region, threads=2, threshold=0)
    region.close()


# --------------------------------------------------------------------------- the pool


def test_concurrent_callers_share_the_pool() -> None:
    inputs = [build([("own", 5000, torch.float32), ("transposed", 300, torch.float64),
                     ("adjacent", 900, torch.int16), ("adjacent", 900, torch.int16)], seed)
              for seed in range(6)]
    errors: list[BaseException] = []

    def run(tensors: list[torch.Tensor]) -> None:
        try:
            for _ in range(5):
                assert_same_pack(tensors, threads=3, chunk=512)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(t,)) for t in inputs]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not any(w.is_alive() for w in workers)
    assert errors == []


def test_helpers_are_daemons_reused_and_renewed_after_fork() -> None:
    assert_same_pack([torch.randn(10_000)], threads=4, chunk=1024)
    pool = pack_pool._pack_pool
    assert pool is not None
    started = pool.helpers
    assert started >= 3
    assert_same_pack([torch.randn(10_000)], threads=4, chunk=1024)
    assert pack_pool._pack_pool is pool and pool.helpers == started  # reused, none added
    helpers = [t for t in threading.enumerate() if t.name.startswith("ray_rdt_pool-pack-")]
    assert len(helpers) == started and all(t.daemon for t in helpers)
    # A forked child inherits the pool object but none of its threads: a new pool.
    with mock.patch.object(pool, "pid", -1):
        assert_same_pack([torch.randn(10_000)], threads=2, chunk=1024)
        assert pack_pool._pack_pool is not pool
    pool.stop(5.0)  # the stand-in "parent's" helpers, which a real child would not have
    assert not any(t.is_alive() for t in helpers)


def test_import_starts_no_thread() -> None:
    code = ("import threading, ray_rdt_pool.memory.pack, ray_rdt_pool.memory.rebuild, "
            "ray_rdt_pool.memory.describe, ray_rdt_pool.memory.pack_pool as p; "
            "assert p._pack_pool is None, 'pool at import'; "
            "print(threading.active_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


# ------------------------------------------------------- pack_torch: strided group copies


def _torch_pack(tensors: list[torch.Tensor], which: Sequence[int] | None = None,
                grouped: bool = True) -> tuple[bytes, list[int]]:
    """pack_torch into a filled block; with ``grouped=False`` every group is one tensor
    (the per-tensor reference the grouped copy must match byte for byte)."""
    d = describe(tensors)
    offsets, total = packed_offsets(d.nbytes, d.aligns)
    block = torch.full((total + 128,), FILL, dtype=torch.uint8)
    if grouped:
        pack.pack_torch(tensors, d, offsets, block, which)
    else:
        with mock.patch.object(pack, "_strided_groups",
                               lambda ts, d, offs, idx: ((i, 1, 0, 0) for i in idx)):
            pack.pack_torch(tensors, d, offsets, block, which)
    return block.numpy().tobytes(), offsets


def _row_views(kind: str, rows: int, cols: int, dtype: torch.dtype, seed: int
               ) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = _values(rows * cols * 2 + 7, dtype, g)
    m = base[3:3 + rows * cols].view(rows, cols)
    if kind == "rows":
        return list(m.unbind(0))
    if kind == "cols":  # strided rows of the transpose
        return list(m.t().unbind(0))
    if kind == "every_other":
        return [m[i] for i in range(0, rows, 2)]
    if kind == "blocks":  # 2-d views stepping through a 3-d tensor
        return list(base[:rows * cols * 2].view(rows, 2, cols).unbind(0))
    if kind == "overlapping":  # windows sharing bytes: reading them twice is fine
        return [base[i:i + cols] for i in range(rows)]
    if kind == "conj" and dtype.is_complex:
        return [r.conj() for r in m.unbind(0)]
    return [m[i].clone() for i in range(rows)]  # separate storages: no group


def test_row_views_are_one_group_and_land_like_single_copies() -> None:
    ts = _row_views("rows", 1000, 16, torch.float32, 0)
    d = describe(ts)
    offsets, _total = packed_offsets(d.nbytes, d.aligns)
    groups = list(pack._strided_groups(ts, d, offsets, range(len(ts))))
    assert [(g[0], g[1]) for g in groups] == [(0, 1000)]
    got, offs = _torch_pack(ts)
    assert got == _torch_pack(ts, grouped=False)[0]
    check_placed(got, ts, offs, [(0, len(got))], None)


def test_groups_break_at_another_storage_shape_or_step() -> None:
    a = _row_views("rows", 4, 8, torch.float32, 1)
    b = _row_views("clones", 3, 8, torch.float32, 2)  # 3 storages
    c = _row_views("rows", 5, 4, torch.float32, 3)  # another shape
    e = _row_views("every_other", 6, 8, torch.float32, 4)  # another step
    ts = a + b + c + e
    d = describe(ts)
    offsets, _total = packed_offsets(d.nbytes, d.aligns)
    sizes = [g[1] for g in pack._strided_groups(ts, d, offsets, range(len(ts)))]
    assert sizes == [4, 1, 1, 1, 5, 3]
    assert _torch_pack(ts)[0] == _torch_pack(ts, grouped=False)[0]


def test_storages_at_one_address_but_of_other_sizes_are_not_one_group() -> None:
    """``a`` and ``b`` are tensors of two storage objects with one base address: a's
    storage is 16 bytes, b's the whole array. Compared by address alone they made one
    group, and the strided view over a's storage reached past it (RuntimeError
    "setStorage ... out of bounds"). Storages of one extent still group."""
    import numpy as np

    arr = np.arange(16, dtype=np.float32)
    a = torch.from_numpy(arr[:4])
    b = torch.from_numpy(arr)[4:8]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    ts = [a, b]
    d = describe(ts)
    offsets, _total = packed_offsets(d.nbytes, d.aligns)
    assert [g[1] for g in pack._strided_groups(ts, d, offsets, range(2))] == [1, 1]
    got, offs = _torch_pack(ts)
    assert got == _torch_pack(ts, grouped=False)[0]
    check_placed(got, ts, offs, [(0, len(got))], None)
    whole = [torch.from_numpy(arr)[:4], torch.from_numpy(arr)[4:8]]  # one extent, two objects
    assert [g[1] for g in pack._strided_groups(whole, d, offsets, range(2))] == [2]
    assert _torch_pack(whole)[0] == got


def test_describe_refuses_tensors_without_memory_and_keeps_empty_ones() -> None:
    """A ZeroTensor (address 0) and a view of a storage resized to 0 (address = its
    offset) have bytes but no memory: the pack copied from there and the process died
    with SIGSEGV. Empty tensors have address 0 too and are fine."""
    from ray_rdt_pool.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"tensor 1 \(\(4,\) torch.float32\) is a "
                                                r"ZeroTensor.*16 bytes.*t\.clone\(\)"):
        describe([torch.ones(2), torch._efficientzerotensor(4)])
    base = torch.ones(1100)
    view = base[100:]
    base.untyped_storage().resize_(0)
    with pytest.raises(InvalidInputError, match=r"tensor 0 .* has 4,000 bytes but its storage "
                                                r"holds 0 .*resized to 0"):
        describe([view])
    d = describe([torch.empty(0), torch.empty(0, 3), torch._efficientzerotensor(0),
                    torch.ones(2)])
    assert d.nbytes == [0, 0, 0, 8]


@pytest.mark.parametrize("native", [False, True])
def test_describe_refuses_views_the_storage_no_longer_holds(native: bool) -> None:
    """FSDP's case: every parameter view of a flat parameter but the first starts far
    into the storage. Once the storage is resized to 0, such a view's address is its
    offset, above 64 KiB, and both describe paths took it for memory: the pack copied
    from there and the sender died with SIGSEGV. A storage shrunk under a view that
    reaches past it read past the allocation. Both are now refused by name."""
    from ray_rdt_pool.errors import InvalidInputError

    flat = torch.ones(200_000)
    params = [flat[:100_000], flat[100_000:]]
    flat.untyped_storage().resize_(0)
    assert params[1].data_ptr() >= 1 << 16
    with pytest.raises(InvalidInputError, match=r"tensor 1 \(\(100000,\) torch.float32\) has "
                                                r"400,000 bytes but its storage holds 0"):
        describe([torch.ones(2), params[1]], native=native)
    shrunk = torch.ones(200_000)
    tail = shrunk[1000:]
    cols = torch.ones(100, 100).t()[:, 10:]  # strided: reaches element 9,999
    shrunk.untyped_storage().resize_(4096)
    with pytest.raises(InvalidInputError, match=r"tensor 0 .* reaches byte 800,000 of its "
                                                r"storage, which holds only 4,096"):
        describe([tail], native=native)
    cols.untyped_storage().resize_(39_996)
    with pytest.raises(InvalidInputError, match=r"reaches byte 40,000 .* holds only 39,996"):
        describe([cols], native=native)
    cols.untyped_storage().resize_(40_000)  # exactly enough again
    assert describe([cols], native=native).nbytes == [36_000]


class _NoStorage(torch.Tensor):
    """A wrapper subclass with no storage of its own, as a DTensor or a FakeTensor is."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...]) -> Any:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        raise NotImplementedError(str(func))


@pytest.mark.parametrize("native", [False, True])
def test_describe_refuses_a_tensor_with_no_storage_of_its_own(native: bool) -> None:
    """A DTensor (FSDP2, tensor parallel) or any wrapper subclass: reading its storage
    raised torch's untyped RuntimeError out of put()."""
    from ray_rdt_pool.errors import InvalidInputError

    for tensors, i in (([torch.ones(3), _NoStorage((4,))], 1), ([_NoStorage((2, 2))], 0)):
        with pytest.raises(InvalidInputError, match=rf"tensor {i} .*is a _NoStorage with no "
                                                    r"memory of its own.*to_local"):
            describe(tensors, native=native)


@RELAXED
@given(parts=st.lists(st.tuples(
    st.sampled_from(["rows", "cols", "every_other", "blocks", "overlapping", "conj",
                     "clones"]),
    st.integers(1, 40), st.integers(1, 33), st.sampled_from(DTYPES)), min_size=1, max_size=6),
    seed=st.integers(0, 2**16), subset=st.booleans())
def test_grouped_pack_torch_matches_per_tensor_copies(
        parts: list[tuple[str, int, int, torch.dtype]], seed: int, subset: bool) -> None:
    ts: list[torch.Tensor] = []
    for k, (kind, rows, cols, dtype) in enumerate(parts):
        ts += _row_views(kind, rows, cols, dtype, seed + k)
    which = list(range(0, len(ts), 2)) if subset else None
    got, offs = _torch_pack(ts, which)
    assert got == _torch_pack(ts, which, grouped=False)[0]
    check_placed(got, ts, offs, [(0, len(got))], which)


def test_stop_pack_helpers_ends_every_helper_and_a_later_pack_starts_new_ones() -> None:
    assert_same_pack([torch.randn(10_000)], threads=4, chunk=1024)
    pool = pack_pool._pack_pool
    assert pool is not None
    threads = list(pool.threads)
    assert len(threads) == pool.helpers >= 3 and all(t.is_alive() for t in threads)
    pack_pool.stop_pack_helpers()
    assert not [t for t in threads if t.is_alive()]
    assert pack_pool._pack_pool is None
    assert_same_pack([torch.randn(10_000)], threads=3, chunk=1024)  # new helpers
    assert pack_pool._pack_pool is not None and pack_pool._pack_pool.helpers >= 2


# ----------------------------------------------------------- streaming-store copies

needs_helper = pytest.mark.skipif(
    stream_copy() is None, reason="the compiled copy helper (native/_copy.c) is not built "
    "here (`python -m ray_rdt_pool.memory.native build`), or this CPU has no streaming stores")


def test_a_built_copy_helper_loads_and_streams() -> None:
    """A built helper that fails to load would only show as slower packs, so on x86-64 a
    helper built for this source must load and stream (tests/unit/memory/test_native.py builds one
    in a fresh folder)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("not x86-64: the helper copies with memmove")
    if not native.artifact_path(helper="copy").exists():
        pytest.skip("the copy helper is not built; run `python -m ray_rdt_pool.memory.native "
                    "build` (make venv does)")
    assert stream_kind() == "sse2-stream"
    assert fastcopy.copy_for(8 << 20, 4 << 20) is stream_copy()
    assert fastcopy.copy_for(1 << 20, 4 << 20) is ctypes.memmove  # small copies: plain stores
    assert fastcopy.copy_for(8 << 20, 0) is ctypes.memmove  # 0 turns streaming off


@needs_helper
@RELAXED
@given(n=st.integers(0, 400_000) | st.integers(131_000, 131_200),
       src_off=st.integers(0, 127), dst_off=st.integers(0, 127), seed=st.integers(0, 2**16))
def test_stream_copy_writes_exactly_the_bytes_of_memmove(n: int, src_off: int, dst_off: int,
                                                         seed: int) -> None:
    fn = stream_copy()
    assert fn is not None
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (n + 256,), generator=g, dtype=torch.uint8)
    dst = torch.full((n + 256,), FILL, dtype=torch.uint8)
    fn(dst.data_ptr() + dst_off, src.data_ptr() + src_off, n)
    want = torch.full((n + 256,), FILL, dtype=torch.uint8)
    want[dst_off:dst_off + n] = src[src_off:src_off + n]
    assert torch.equal(dst, want)  # every byte copied, none written outside


@needs_helper
@pytest.mark.parametrize("shift", [-4096 * 5 - 3, -64, -1, 1, 64, 4096 * 5 + 7])
def test_stream_copy_of_overlapping_ranges_is_a_memmove(shift: int) -> None:
    fn = stream_copy()
    assert fn is not None
    n = 300_000
    buf = torch.randint(0, 256, (n + 2 * 40_000,), dtype=torch.uint8)
    want = buf.clone()
    src, dst = 40_000, 40_000 + shift
    ctypes.memmove(want.data_ptr() + dst, want.data_ptr() + src, n)
    fn(buf.data_ptr() + dst, buf.data_ptr() + src, n)
    assert torch.equal(buf, want)


@needs_helper
@pytest.mark.parametrize("threads", [1, 3])
def test_streaming_pack_is_byte_identical(threads: int) -> None:
    """Tensors large enough for the streaming body, with views and scattered blocks."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300_000, generator=g)
    tensors = [big[:70_001], big[70_001:150_000], torch.randn(33_333, generator=g),
               torch.randn(400, 300, generator=g).t(), torch.randn(20_000, generator=g)]
    d = describe(tensors)
    _, total = packed_offsets(d.nbytes, d.aligns)
    blocks, _ = scatter_blocks(total, [total // 3, total // 2 + 5], [64, 0], [2, 0, 1])
    one, many, offsets, used = pack_both(tensors, blocks, None, threads, 512 << 10,
                                         stream_min=1)
    assert one == many
    check_placed(many, tensors, offsets, used, None)


def test_config_stream_copy_bytes() -> None:
    assert PoolConfig().tuning.stream_copy_bytes == 16 << 20
    assert Tuning(stream_copy_bytes=0).stream_copy_bytes == 0  # off
    for bad in (-1, 1.5, True, "4M"):
        with pytest.raises(ConfigurationError, match="stream_copy_bytes=16 << 20"):
            Tuning(stream_copy_bytes=bad)
    env = "RAY_RDT_POOL_STREAM_COPY_BYTES"
    assert from_env({env: "16M"}).tuning.stream_copy_bytes == 16 << 20
    assert from_env({env: "0"}).tuning.stream_copy_bytes == 0


@pytest.mark.parametrize("count", [3, 2 * fastcopy.MANY_MOVES])
@pytest.mark.parametrize("helper", [True, False], ids=["helper", "no-helper"])
@pytest.mark.parametrize("stream_min", [0, 1])
def test_unpack_into_and_copy_bytes_land_every_byte(count: int, helper: bool,
                                                    stream_min: int) -> None:
    """The receiver's host copies (out of a block into target buffers, and range moves)
    put each tensor's bytes in its target and nowhere else, one call or one per move."""
    if helper and move_batch() is None:
        pytest.skip("the compiled copy helper is not built here")
    g = torch.Generator().manual_seed(count)
    sizes = [(i * 37) % 3000 for i in range(count)]  # some empty, some over 1 KiB
    offsets, total = packed_offsets([4 * n for n in sizes], [4] * count)
    block = torch.randint(0, 256, (total,), generator=g, dtype=torch.uint8)
    with mock.patch.object(fastcopy, "move_batch",
                           wraps=fastcopy.move_batch if helper else lambda: None):
        targets = [torch.full((n,), -1.0) for n in sizes]
        rebuild.unpack_into(targets, offsets, block.data_ptr(), total, "cpu", 0, stream_min)
        for t, off, n in zip(targets, offsets, sizes):
            assert torch.equal(t.view(torch.uint8), block[off:off + 4 * n])
        again = torch.full((total + 64,), FILL, dtype=torch.uint8)
        moves = [(again.data_ptr() + off, block.data_ptr() + off, 4 * n)
                 for off, n in zip(offsets, sizes)]
        rebuild.copy_bytes(moves, "cpu", 0, stream_min)
    want = torch.full((total + 64,), FILL, dtype=torch.uint8)
    for off, n in zip(offsets, sizes):
        want[off:off + 4 * n] = block[off:off + 4 * n]
    assert torch.equal(again, want)
