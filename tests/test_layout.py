"""Properties of the packed layout shared by sender and receiver."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_rdt_pool.layout import (
    BLOCK_ALIGN,
    BlockMap,
    align_up,
    map_extent,
    packed_offsets,
    run_layout,
)

# Slow shared CI machines must not turn into deadline failures.
RELAXED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

ALIGNS = st.sampled_from([1, 2, 4, 8, 16])
# (numel, align): a tensor's size is always a multiple of its element size.
TENSOR = st.tuples(st.integers(0, 300), ALIGNS)
TENSORS = st.lists(TENSOR, max_size=40)
RUN = st.tuples(st.integers(0, 50), ALIGNS, st.integers(0, 6))  # (numel, align, count)


def _sizes(tensors: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [n * a for n, a in tensors], [a for _, a in tensors]


def test_align_up_examples() -> None:
    assert [align_up(n, 8) for n in (0, 1, 7, 8, 9, 16)] == [0, 8, 8, 8, 16, 16]
    assert align_up(65, BLOCK_ALIGN) == 128
    with pytest.raises(ValueError):
        align_up(3, 0)


def test_block_align_holds_every_dtype() -> None:
    assert BLOCK_ALIGN % 16 == 0 and BLOCK_ALIGN >= 64


def test_empty_and_small_examples() -> None:
    assert packed_offsets([], []) == ([], 0)
    assert run_layout([]) == ([], 0)
    # int8 then float32: the float32 tensor waits for a 4-byte boundary.
    assert packed_offsets([3, 8], [1, 4]) == ([0, 4], 64)
    assert packed_offsets([64, 8], [8, 8]) == ([0, 64], 128)
    with pytest.raises(ValueError):
        packed_offsets([1, 2], [1])


@RELAXED
@given(TENSORS)
def test_packed_offsets_properties(tensors: list[tuple[int, int]]) -> None:
    nbytes, aligns = _sizes(tensors)
    offsets, total = packed_offsets(nbytes, aligns)
    assert len(offsets) == len(nbytes)
    end = 0
    for off, n, a in zip(offsets, nbytes, aligns):
        assert off % a == 0
        # Never overlaps the previous tensor, and pads by less than one alignment.
        assert end <= off < end + a
        end = off + n
    assert total % BLOCK_ALIGN == 0
    assert total >= sum(nbytes) and total >= end
    assert total - end < BLOCK_ALIGN


@RELAXED
@given(TENSORS)
def test_same_dtype_neighbours_have_no_padding(tensors: list[tuple[int, int]]) -> None:
    nbytes, aligns = _sizes(tensors)
    offsets, _ = packed_offsets(nbytes, aligns)
    for i in range(1, len(offsets)):
        if aligns[i] == aligns[i - 1]:
            assert offsets[i] == offsets[i - 1] + nbytes[i - 1]


@RELAXED
@given(st.lists(RUN, max_size=15))
def test_run_layout_equals_packed_offsets_on_expansion(
    runs: list[tuple[int, int, int]],
) -> None:
    specs = [(numel * a, a, count) for numel, a, count in runs]
    starts, total = run_layout(specs)
    nbytes = [n for n, _, c in specs for _ in range(c)]
    aligns = [a for _, a, c in specs for _ in range(c)]
    offsets, expected_total = packed_offsets(nbytes, aligns)
    assert total == expected_total
    expanded = [s + k * n for s, (n, _, c) in zip(starts, specs) for k in range(c)]
    assert expanded == offsets


def test_run_layout_rejects_a_non_contiguous_run() -> None:
    with pytest.raises(ValueError, match="not contiguous"):
        run_layout([(6, 4, 2)])
    assert run_layout([(6, 4, 1)]) == ([0], 64)  # a single tensor is fine
    with pytest.raises(ValueError):
        run_layout([(4, 4, -1)])


def test_run_layout_is_linear_in_runs() -> None:
    # A million equal tensors cost one run, not a million offsets.
    starts, total = run_layout([(1024, 4, 1_000_000), (2, 2, 1)])
    assert starts == [0, 1024 * 1_000_000]
    assert total == align_up(1024 * 1_000_000 + 2, BLOCK_ALIGN)


BLOCKS = st.lists(
    st.tuples(st.integers(0, 10_000).map(lambda x: x * 8), st.integers(0, 40)), max_size=8
)


@st.composite
def blocks_and_range(draw: st.DrawFn) -> tuple[list[tuple[int, int]], int, int]:
    blocks = draw(BLOCKS)
    total = sum(n for _, n in blocks)
    start = draw(st.integers(0, total))
    length = draw(st.integers(0, total - start))
    return blocks, start, length


@RELAXED
@given(blocks_and_range())
def test_map_extent_matches_byte_by_byte(case: tuple[list[tuple[int, int]], int, int]) -> None:
    blocks, start, length = case
    physical = [off + k for off, n in blocks for k in range(n)]
    pieces = map_extent(start, length, blocks)
    assert [p + k for p, n in pieces for k in range(n)] == physical[start : start + length]
    assert all(n > 0 for _, n in pieces)
    # Each piece lies inside one block, and pieces split only at block boundaries:
    # there are exactly as many as the blocks the range touches.
    touched = 0
    pos = 0
    for _, n in blocks:
        if n and length and pos < start + length and pos + n > start:
            touched += 1
        pos += n
    assert len(pieces) == touched
    assert BlockMap(blocks).map(start, length) == pieces


@RELAXED
@given(BLOCKS, st.integers(-5, 5), st.integers(0, 5))
def test_map_extent_rejects_out_of_range(
    blocks: list[tuple[int, int]], delta: int, length: int
) -> None:
    total = sum(n for _, n in blocks)
    start = total - length + delta
    if start < 0 or delta > 0:
        with pytest.raises(ValueError, match="outside"):
            map_extent(start, length, blocks)
    else:
        assert sum(n for _, n in map_extent(start, length, blocks)) == length


def test_map_extent_examples() -> None:
    blocks = [(1000, 64), (0, 128), (500, 64)]
    assert map_extent(0, 0, blocks) == []
    assert map_extent(60, 10, blocks) == [(1060, 4), (0, 6)]
    assert map_extent(0, 256, blocks) == [(1000, 64), (0, 128), (500, 64)]
    assert map_extent(192, 64, blocks) == [(500, 64)]
    with pytest.raises(ValueError):
        map_extent(250, 7, blocks)
    with pytest.raises(ValueError):
        map_extent(-1, 1, blocks)
