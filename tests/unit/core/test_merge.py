"""Descriptor merging must move exactly the same bytes to the same places."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_rdt_pool.core.descriptors import merge_descriptors, merge_segments

# Slow shared CI machines must not turn into deadline failures.
RELAXED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

Desc = tuple[int, int, int]


@st.composite
def walks(draw: st.DrawFn, lengths: list[int]) -> list[Desc]:
    """Descriptors with the given lengths, often adjacent to their predecessor."""
    out: list[Desc] = []
    addr, dev = draw(st.integers(0, 50)), 0
    for n in lengths:
        if draw(st.booleans()):  # jump elsewhere, maybe to another device
            addr, dev = draw(st.integers(0, 200)), draw(st.integers(0, 1))
        out.append((addr, n, dev))
        addr += n
    return out


@st.composite
def paired(draw: st.DrawFn) -> tuple[list[Desc], list[Desc]]:
    lengths = draw(st.lists(st.integers(0, 6), max_size=25))
    return draw(walks(lengths)), draw(walks(lengths))


def per_byte(local: list[Desc], remote: list[Desc]) -> list[tuple[int, int, int, int]]:
    return [
        (la + k, ld, ra + k, rd)
        for (la, n, ld), (ra, _, rd) in zip(local, remote)
        for k in range(n)
    ]


def mergeable(x: Desc, y: Desc) -> bool:
    return x[0] + x[1] == y[0] and x[2] == y[2]


@RELAXED
@given(paired())
def test_merge_descriptors_preserves_the_byte_mapping(case: tuple[list[Desc], list[Desc]]) -> None:
    local, remote = case
    out_l, out_r = merge_descriptors(local, remote)
    assert len(out_l) == len(out_r)
    assert all(x[1] == y[1] > 0 for x, y in zip(out_l, out_r))
    assert per_byte(out_l, out_r) == per_byte(local, remote)
    # Maximal: no two neighbours left that are adjacent on both sides.
    for i in range(1, len(out_l)):
        assert not (mergeable(out_l[i - 1], out_l[i]) and mergeable(out_r[i - 1], out_r[i]))
    # And only pairs adjacent on both sides were fused.
    kept = [(x, y) for x, y in zip(local, remote) if x[1]]
    boundaries = sum(
        not (mergeable(a[0], b[0]) and mergeable(a[1], b[1])) for a, b in itertools.pairwise(kept)
    )
    assert len(out_l) == (boundaries + 1 if kept else 0)


def test_merge_descriptors_examples() -> None:
    local = [(0, 4, 0), (4, 4, 0), (8, 4, 1), (100, 0, 0), (12, 4, 1)]
    remote = [(50, 4, 0), (54, 4, 0), (58, 4, 0), (0, 0, 0), (70, 4, 0)]
    assert merge_descriptors(local, remote) == (
        [(0, 8, 0), (8, 4, 1), (12, 4, 1)],
        [(50, 8, 0), (58, 4, 0), (70, 4, 0)],
    )
    # Adjacent on the local side only: no merge.
    assert merge_descriptors([(0, 4, 0), (4, 4, 0)], [(0, 4, 0), (8, 4, 0)])[0] == [
        (0, 4, 0), (4, 4, 0)]
    assert merge_descriptors([], []) == ([], [])
    assert merge_descriptors([(5, 0, 0)], [(9, 0, 0)]) == ([], [])


def test_merge_descriptors_errors() -> None:
    with pytest.raises(ValueError, match="2 local descriptors but 1 remote"):
        merge_descriptors([(0, 1, 0), (1, 1, 0)], [(0, 1, 0)])
    with pytest.raises(ValueError, match="descriptor 1: local length 8 differs from remote "
                                         "length 4"):
        merge_descriptors([(0, 4, 0), (4, 8, 0)], [(0, 4, 0), (4, 4, 0)])
    with pytest.raises(ValueError, match="descriptor 0: negative length"):
        merge_descriptors([(0, -1, 0)], [(0, -1, 0)])


@st.composite
def segment_lists(draw: st.DrawFn) -> list[Desc]:
    lengths = draw(st.lists(st.integers(0, 6), max_size=25))
    virt = draw(walks(lengths))
    addr = draw(walks(lengths))
    return [(v, a, n) for (v, n, _), (a, _, _) in zip(virt, addr)]


@RELAXED
@given(segment_lists())
def test_merge_segments_preserves_the_byte_mapping(segments: list[Desc]) -> None:
    out = merge_segments(segments)

    def expand(segs: list[Desc]) -> list[tuple[int, int]]:
        return [(v + k, a + k) for v, a, n in segs for k in range(n)]

    assert expand(out) == expand(segments)
    assert all(n > 0 for _, _, n in out)
    for x, y in itertools.pairwise(out):
        assert not (x[0] + x[2] == y[0] and x[1] + x[2] == y[1])


def test_merge_segments_examples() -> None:
    assert merge_segments([(0, 1000, 64), (64, 1064, 64), (128, 5000, 64), (192, 5064, 0)]) == [
        (0, 1000, 128), (128, 5000, 64)]
    # Adjacent in virtual space only.
    assert merge_segments([(0, 0, 8), (8, 16, 8)]) == [(0, 0, 8), (8, 16, 8)]
    with pytest.raises(ValueError, match="segment 1: negative length"):
        merge_segments([(0, 0, 8), (8, 8, -8)])
