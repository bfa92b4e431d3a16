"""Properties of the packed layout shared by sender and receiver."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_rdt_pool.core.layout import (
    BLOCK_ALIGN,
    BlockMap,
    Placed,
    align_up,
    group_layout,
    group_offsets,
    group_run_starts,
    lay_runs,
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


# -- repeated groups --

# (numel, align, count) with element sizes, which are powers of two.
GROUP_RUN = st.tuples(st.integers(0, 9), ALIGNS, st.integers(0, 3))
GROUPS = st.lists(st.tuples(st.lists(GROUP_RUN, min_size=1, max_size=4), st.integers(1, 6)),
                  max_size=5)


def _specs(groups: list[tuple[list[tuple[int, int, int]], int]]
           ) -> list[tuple[list[tuple[int, int, int]], int]]:
    return [([(numel * a, a, c) for numel, a, c in runs], repeat) for runs, repeat in groups]


def _expanded(groups: list[tuple[list[tuple[int, int, int]], int]]
              ) -> tuple[list[int], list[int]]:
    nbytes = [n for runs, repeat in groups for _ in range(repeat)
              for n, _a, c in runs for _ in range(c)]
    aligns = [a for runs, repeat in groups for _ in range(repeat)
              for _n, a, c in runs for _ in range(c)]
    return nbytes, aligns


@RELAXED
@given(GROUPS)
def test_group_layout_equals_the_tensor_by_tensor_layout(
    raw: list[tuple[list[tuple[int, int, int]], int]],
) -> None:
    groups = _specs(raw)
    placed, total = group_layout(groups)
    offsets, expected_total = packed_offsets(*_expanded(groups))
    assert total == expected_total
    got = [o for (runs, repeat), p in zip(groups, placed) for o in group_offsets(runs, p, repeat)]
    assert got == offsets
    # Run starts: the first tensor of each run with tensors.
    starts = [s for (runs, repeat), p in zip(groups, placed)
              for s, (_n, _a, c) in zip(group_run_starts(p, repeat), runs * repeat) if c]
    firsts = []
    pos = 0
    for runs, repeat in groups:
        for _ in range(repeat):
            for _n, _a, c in runs:
                if c:
                    firsts.append(offsets[pos])
                pos += c
    assert starts == firsts


@RELAXED
@given(GROUPS)
def test_groups_are_uniform_from_the_second_repetition(
    raw: list[tuple[list[tuple[int, int, int]], int]],
) -> None:
    groups = _specs(raw)
    placed, _ = group_layout(groups)
    offsets, _ = packed_offsets(*_expanded(groups))
    pos = 0
    for (runs, repeat), p in zip(groups, placed):
        per = sum(c for *_, c in runs)
        mine = offsets[pos:pos + per * repeat]
        reps = [mine[k * per:(k + 1) * per] for k in range(repeat)]
        pos += per * repeat
        # The pieces lay out the group exactly, each one uniform.
        pieces = p.pieces(repeat)
        assert sum(r for *_, r in pieces) == repeat
        got: list[int] = []
        for starts, stride, r in pieces:
            got += group_offsets(runs, Placed(starts, starts, stride), r)
        assert got == mine
        if repeat < 2 or not per:
            continue
        widest = max(a for _n, a, c in runs if c)
        assert p.stride % widest == 0  # a field is a strided array of typed elements
        for k in range(1, repeat):
            assert reps[k] == [o + (k - 1) * p.stride for o in reps[1]]
        if p.first == p.origin:
            assert reps[1] == [o + p.stride for o in reps[0]]
        if all(c for *_, c in runs):
            assert (p.first == p.origin) == (reps[1] == [o + p.stride for o in reps[0]])
            if runs[0][1] == widest:  # starting with its widest tensor: on the grid
                assert p.first == p.origin


def test_a_group_off_the_grid_and_its_pieces() -> None:
    # int8, float64, int16 from offset 0: repetitions at 0, 18, 34, 50 (strides 18, 16, 16).
    runs = [(1, 1, 1), (8, 8, 1), (2, 2, 1)]
    (p,), total = group_layout([(runs, 4)])
    assert p == Placed([0, 8, 16], [2, 8, 16], 16) and total == 128
    assert group_offsets(runs, p, 4) == [0, 8, 16, 18, 24, 32, 34, 40, 48, 50, 56, 64]
    assert group_run_starts(p, 4) == [0, 8, 16, 18, 24, 32, 34, 40, 48, 50, 56, 64]
    assert p.pieces(4) == [([0, 8, 16], 0, 1), ([18, 24, 32], 16, 3)]
    assert p.pieces(1) == [([0, 8, 16], 16, 1)]
    # Starting with its widest tensor, the same pattern is uniform from repetition 0.
    (q,), _ = group_layout([([(8, 8, 1), (2, 2, 1), (1, 1, 1)], 3)])
    assert q == Placed([0, 8, 10], [0, 8, 10], 16) and q.pieces(3) == [([0, 8, 10], 16, 3)]


def test_group_layout_examples_and_errors() -> None:
    assert group_layout([]) == ([], 0)
    # From any position; a run without tensors reports where it would start.
    assert lay_runs(10, [(4, 4, 2), (0, 8, 0), (1, 1, 1)]) == ([12, 24, 20], 21)
    # A run of 3 and a group of one tensor repeated 3 times lie alike.
    (a,), ta = group_layout([([(4, 4, 3)], 1)])
    (b,), tb = group_layout([([(4, 4, 1)], 3)])
    assert group_offsets([(4, 4, 3)], a, 1) == group_offsets([(4, 4, 1)], b, 3) == [0, 4, 8]
    assert ta == tb == 64
    # Empty tensors and runs without tensors move nothing but their alignment.
    (c,), tc = group_layout([([(0, 8, 2), (0, 4, 0)], 1000)])
    assert c.stride == 0 and tc == 0 and set(group_offsets([(0, 8, 2), (0, 4, 0)], c, 1000)) == {0}
    # A run with many tensors and few repetitions, and the other way round.
    (d,), _ = group_layout([([(2, 2, 5), (8, 8, 1)], 2)])
    assert group_offsets([(2, 2, 5), (8, 8, 1)], d, 2) == [0, 2, 4, 6, 8, 16, 24, 26, 28, 30,
                                                           32, 40]
    with pytest.raises(ValueError, match="repeat must be at least 1"):
        group_layout([([(4, 4, 1)], 0)])
    with pytest.raises(ValueError, match="not contiguous"):
        group_layout([([(6, 4, 2)], 2)])
    with pytest.raises(ValueError, match="negative"):
        group_layout([([(-4, 4, 1)], 2)])
    # Alignments that are not powers of two may not repeat uniformly: 0, 9, 18 here.
    with pytest.raises(ValueError, match="powers of two"):
        group_layout([([(3, 3, 1), (4, 4, 1)], 3)])


def test_a_million_repetitions_cost_two() -> None:
    runs = [(8192, 8, 2), (4096, 4, 2), (4, 4, 1)]  # an RL sample: 3 runs, 5 tensors
    (p,), total = group_layout([(runs, 1_000_000)])
    assert p.stride == 24_584 and total == align_up(24_584 * 1_000_000 - 4, BLOCK_ALIGN)
