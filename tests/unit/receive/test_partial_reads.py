"""Partial READs (``fetch_selected``), with the fake NIXL: only the selected bytes are
read, a bad selection is a typed error that reads nothing, and a selection of an object
this process holds itself is checked too.
"""

from __future__ import annotations

import gc
import re

import pytest
import torch

from ray_rdt_pool.errors import (
    InvalidInputError,
)
from tests.support.fake_world import (
    make,
    ship,
)


def test_selected_reads_only_the_selected_bytes(world):
    s, r = make(world), make(world, arena_bytes=4 << 20)
    w = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    b = torch.arange(10, dtype=torch.int16)
    c = torch.randn(4, 6, 8)
    meta = ship(s.put("a", [w, b, c]))
    sel = [(slice(32, 64),), None, (slice(None), slice(2, 5))]  # dim 0, whole, dim 1
    before = r.stats().bytes_received
    out = r.fetch_selected("a", meta, sel, None)
    assert torch.equal(out[0], w[32:64]) and torch.equal(out[1], b)
    assert torch.equal(out[2], c[:, 2:5]) and out[2].is_contiguous()
    want = 32 * 48 * 4 + 10 * 2 + 4 * 3 * 8 * 4
    assert r.stats().bytes_received - before == want
    last = r.backend().xfers[max(r.backend().xfers)]
    assert sum(n for _a, n, _d in last.remote) == want  # only those bytes were read
    del out
    gc.collect()
    assert r.stats().arena_used == 0


def test_selection_errors_are_typed_and_read_nothing(world):
    s, r = make(world), make(world)
    meta = ship(s.put("a", [torch.zeros(8, 8)]))
    for bad, text in (([(slice(0, 8, 2),)], "step 2"), ([None, None], "2 selections"),
                      ([(slice(0, 1), slice(0, 1), slice(0, 1))], "at most 2 slices"),
                      ([(3,)], "tuple of at most")):
        with pytest.raises(InvalidInputError, match=text):
            r.fetch_selected("a", meta, bad, None)
    st = r.stats()
    assert st.transfers_in_flight == 0 and st.bytes_received == 0 and st.arena_used == 0
    empty = r.fetch_selected("a", meta, [(slice(3, 3),)], None)
    assert empty[0].shape == (0, 8)


def test_fetch_selected_of_an_object_this_process_holds_checks_the_selection(
        world, monkeypatch):
    """owned.fetch_selected() of an object this process holds itself indexed the held
    tensor with the selection as given: a step-2 slice was taken (a READ refuses it),
    three slices on a 2-d tensor raised IndexError, a list was taken. Both paths now
    check the same way. Ray's RDT manager is a stand-in here."""
    import types

    import ray

    from ray_rdt_pool._ray import owned

    x = torch.arange(24.0).reshape(4, 6)
    store = types.SimpleNamespace(has_object=lambda oid: True, get_object=lambda oid: [x])
    mgr = types.SimpleNamespace(get_rdt_metadata=lambda oid: types.SimpleNamespace(),
                                rdt_store=store)
    monkeypatch.setattr(ray._private.worker, "global_worker",
                        types.SimpleNamespace(rdt_manager=mgr))
    ref = types.SimpleNamespace(hex=lambda: "obj")
    for bad, text in (([(slice(0, 4, 2),)], "step 2 on dim 0"),
                      ([(slice(None),) * 3], "at most 2 slices"),
                      ([[slice(0, 2)]], "pass a tuple"), ([None, None], "2 selections")):
        with pytest.raises(InvalidInputError, match=re.escape(text)):
            owned.fetch_selected(ref, bad)  # type: ignore[arg-type]
    out = owned.fetch_selected(ref, [(slice(1, 3), slice(2, 5))])  # type: ignore[arg-type]
    assert torch.equal(out[0], x[1:3, 2:5]) and out[0].is_contiguous()
