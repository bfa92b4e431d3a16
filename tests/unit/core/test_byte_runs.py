"""``extent.spanned_runs`` and ``extent.runs_meet`` against a byte-by-byte enumeration.

Fast unit tests, no Ray and no NIXL. The weights receiver refuses destinations that share
bytes on these two functions (``weights.validate.Claims``), so a run left out or a meeting missed
would let two weights overwrite each other; a meeting invented would refuse interleaved
views that load correctly.
"""

from __future__ import annotations

import itertools
from typing import Any
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ray_rdt_pool.memory.extent as E

DTYPES = [torch.uint8, torch.int16, torch.float32, torch.float64, torch.complex128]
BUFFER = 512


@st.composite
def views(draw: Any, base: torch.Tensor) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    flat = base.view(dtype)
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    stride = [draw(st.integers(1, 12)) for _ in shape]
    last = sum((k - 1) * s for k, s in zip(shape, stride))
    offset = draw(st.integers(0, max(0, flat.numel() - last - 1)))
    if offset + last >= flat.numel():
        stride = [1] * len(shape)
        shape = [1] * len(shape)
    return flat.as_strided(shape, stride, offset)


def covered(t: torch.Tensor) -> set[int]:
    item = t.element_size()
    out: set[int] = set()
    for idx in itertools.product(*(range(k) for k in t.shape)):
        first = t.data_ptr() + item * sum(i * s for i, s in zip(idx, t.stride()))
        out.update(range(first, first + item))
    return out


def run_bytes(runs: tuple[torch.Tensor, int]) -> set[int]:
    starts, length = runs
    return {b for s in starts.tolist() for b in range(s, s + length)}


BASE = torch.zeros(BUFFER, dtype=torch.uint8)


@settings(max_examples=300, deadline=None)
@given(a=views(BASE), b=views(BASE))
def test_runs_cover_each_byte_and_meet_only_when_bytes_are_shared(a: torch.Tensor,
                                                                  b: torch.Tensor) -> None:
    ra, rb = E.spanned_runs(a), E.spanned_runs(b)
    assert ra is not None and rb is not None
    assert run_bytes(ra) == covered(a)
    assert ra[0].tolist() == sorted(ra[0].tolist())
    shared = bool(covered(a) & covered(b))
    assert E.runs_meet(ra, rb) is shared
    assert E.runs_meet(rb, ra) is shared


def test_dense_layouts_are_one_run_and_the_cap_gives_up() -> None:
    m = torch.zeros(64, 32)
    for t in (m, m.t(), m[3:9], m.view(torch.int8)):
        starts, length = E.spanned_runs(t)  # type: ignore[misc]
        assert starts.tolist() == [t.data_ptr()] and length == t.nbytes
    starts, length = E.spanned_runs(m[:, 4:12])  # type: ignore[misc]
    assert len(starts) == 64 and length == 8 * 4
    with mock.patch.object(E, "MAX_SPANNED_RUNS", 63):
        assert E.spanned_runs(m[:, 4:12]) is None
