"""Conversion in the pack (``pack_as``), with the fake NIXL: tensors converted as they
are packed, and a dtype torch cannot convert to refused before anything is placed.
"""

from __future__ import annotations

import pytest
import torch

from ray_rdt_pool.errors import (
    InvalidInputError,
)
from tests.support.fake_world import (
    make,
    ship,
)


def test_pack_as_converts_in_the_pack(world):
    from ray_rdt_pool._ray.conversions import pack_as

    s, r = make(world), make(world)
    w = torch.randn(100, 7)
    keep = torch.arange(5)
    with pack_as({id(w): torch.bfloat16}):
        meta = ship(s.put("a", [w, keep]))
    assert [dt for _s, dt in meta.decoded().shapes_dtypes()] == ["bfloat16", "int64"]
    out = r.wait(r.fetch("a", meta, None), -1)
    assert out[0].dtype == torch.bfloat16 and torch.equal(out[0], w.to(torch.bfloat16))
    assert torch.equal(out[1], keep)
    assert s.stats().bytes_packed < 100 * 7 * 4  # half the bytes of fp32
    with pytest.raises(InvalidInputError, match="nest"), pack_as({}), pack_as({}):
        pass


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="this torch has no float4")
def test_pack_as_a_dtype_torch_cannot_convert_to_is_refused_before_placing(world):
    """torch has no copy kernel for float4_e2m1fn_x2: packing into it (or out of it)
    raised torch's untyped NotImplementedError out of put()."""
    from ray_rdt_pool._ray.conversions import pack_as

    s = make(world)
    t = torch.randn(4)
    with pytest.raises(InvalidInputError, match=r"no conversion from torch\.float32"), \
            pack_as({id(t): torch.float4_e2m1fn_x2}):
        s.put("a", [t])
    st = s.stats()
    assert (st.live_objects, st.pool_used) == (0, 0)
