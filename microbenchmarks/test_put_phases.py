"""The put-phases microbenchmark (``python -m microbenchmarks.put_phases``) measures the
real code: a check of the tool, not of the package, so it lives with the tool (tests/
imports nothing from microbenchmarks/). ``make test`` and ``make test-unit`` run it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ray_rdt_pool.memory.allocations import HostMemory


def test_put_phases_times_every_phase_and_leaves_the_packed_bytes(capsys: Any) -> None:
    """``python -m microbenchmarks.put_phases`` times the put's steps on the real code: the
    phases add up to no more than the put, and the region holds the packed tensors."""
    from microbenchmarks import put_phases as P
    from ray_rdt_pool.bench import workloads as W

    tensors = W.build_tensors(W.make_spec("experience_samples", W.QUICK_SIZES))[0][:50]
    total = sum(t.nbytes for t in tensors)
    region = HostMemory(total + (1 << 20), prefault=True)
    try:
        ph = P.put_phases(tensors, region, reps=2, idle_s=0.0)
        assert set(ph) == {"describe", "group", "offsets", "pack", "wire", "put"}
        parts = sum(v for k, v in ph.items() if k != "put")
        assert all(v > 0 for v in ph.values()) and parts <= ph["put"] * 1.0001
        # The first tensor lands at packed offset 0: its bytes are there.
        first = tensors[0].reshape(-1).view(torch.uint8)
        assert torch.equal(region.tensor[:first.numel()], first)
    finally:
        region.close()
    small = HostMemory(4096)
    try:
        with pytest.raises(ValueError, match="region holds 4,096"):
            P.put_phases(tensors, small, reps=1, idle_s=0.0)
    finally:
        small.close()
    costs = P.read_costs(tensors, reps=1, idle_s=0.0)
    assert set(costs) == set(P.READS) and all(v > 0 for v in costs.values())
    with pytest.raises(SystemExit):
        P.main(["--reps", "0"])
    assert "--reps must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        P.main(["--workloads", "views,sync"])
    assert "sync is not a one-object workload" in capsys.readouterr().err
    # native=False keeps describe on its Python loop: the same phases, the same bytes.
    region = HostMemory(total + (1 << 20), prefault=True)
    try:
        ph = P.put_phases(tensors, region, reps=1, idle_s=0.0, native=False)
        assert set(ph) == {"describe", "group", "offsets", "pack", "wire", "put"}
        assert torch.equal(region.tensor[:first.numel()], first)
    finally:
        region.close()
