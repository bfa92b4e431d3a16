"""The small named state the weight-sync tests share (one tensor of each kind a model
holds: float32, bf16, a 0-d int64), and destinations that mismatch it in each way a
receiver's check refuses, with the error each raises."""

from __future__ import annotations

from typing import Any

import torch

from ray_rdt_pool.errors import (
    DtypeMismatchError,
    DuplicateTargetError,
    MissingWeightsError,
    ShapeMismatchError,
    UnexpectedWeightsError,
)

Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]


def make_state(spec: Spec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in spec.items():
        t = torch.randn(shape, generator=g, dtype=torch.float64)
        out[name] = (t > 0) if dtype == torch.bool else (t * 100).to(dtype)
    return out


SMALL: Spec = {
    "embed.weight": ((64, 32), torch.float32),
    "layers.0.w": ((32, 32), torch.float32),
    "layers.0.b": ((32,), torch.float32),
    "layers.1.w": ((32, 32), torch.bfloat16),
    "layers.1.b": ((32,), torch.float32),
    "step": ((), torch.int64),
}


def mismatch(kind: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A destination (and receiver options) that mismatches SMALL in one way."""
    dest = make_state(SMALL, seed=5)
    opts: dict[str, Any] = {}
    if kind == "missing":
        dest["extra.dest.only"] = torch.zeros(3)
    elif kind == "unexpected":
        del dest["layers.1.b"]
    elif kind == "shape":
        dest["layers.0.w"] = torch.zeros(32, 31)
    elif kind == "dtype":
        dest["layers.0.b"] = torch.zeros(32, dtype=torch.bool)  # float -> bool refused
    elif kind == "duplicate":
        opts["name_map"] = {"layers.0.b": "layers.1.b"}
    return dest, opts


KINDS = {"missing": MissingWeightsError, "unexpected": UnexpectedWeightsError,
         "shape": ShapeMismatchError, "dtype": DtypeMismatchError,
         "duplicate": DuplicateTargetError}
