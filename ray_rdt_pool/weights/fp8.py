"""FP8 on the wire: the quantizing of a weight into FP8 with scales, and back.

Owns the math and the shapes of scaled FP8 (the ``weight_scale_inv`` convention of
vLLM's block-FP8 layers), so that the sender's pack, the receiver's copy and a select of
a shard agree on it:

* a **scale group** is the whole tensor (``"tensor"``), one row (``"row"``: a 2-D
  tensor's row) or a block of ``(bm, bn)`` elements of a 2-D tensor (the edge blocks
  may be smaller); a tensor that is not 2-D takes one scale whatever was asked;
* per group, ``scale = amax / torch.finfo(fp8).max`` in fp32 (1.0 for a group of
  zeros), ``q = (w.float() / scale).to(fp8)`` and, on the receiver,
  ``q.float() * scale`` cast to the destination's dtype: bit for bit the same as that
  reference, written out plainly;
* a group's scale travels as one fp32 element of a scale tensor of
  ``ceil(dim / group dim)`` elements per dimension, in the same bucket, right after its
  weight, under the weight's name plus :data:`SCALE_SUFFIX`.

Torch, and the compiled helper's quantizing and dequantizing copies where it is built
(the same bits, several times faster on a CPU: :func:`quantize`, :func:`dequantize`);
stateless; runs on the sender's and the
receivers' threads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch

from ray_rdt_pool.errors import InvalidInputError
from ray_rdt_pool.memory.fastcopy import fp8_dequantizer, fp8_quantizer

__all__ = ["FP8", "SCALE_SUFFIX", "WireScale", "block_of", "check_wire_scale",
           "dequantize", "dequantize_torch", "quantize", "quantize_torch", "scale_selection",
           "scale_shape"]

#: The FP8 dtypes a weight may travel as, with scales.
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
#: What a scale's name adds to its weight's (a NUL: no module or mapping name has one).
SCALE_SUFFIX = "\x00scale"

WireScale = Literal["tensor", "row"] | tuple[int, int]


def check_wire_scale(scale: Any) -> WireScale:
    """``wire_scale`` as given, or InvalidInputError naming the choices."""
    if scale in ("tensor", "row"):
        return scale
    if (isinstance(scale, tuple) and len(scale) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in scale)):
        return (int(scale[0]), int(scale[1]))
    raise InvalidInputError(f"wire_scale must be 'tensor', 'row' or a (rows, cols) block of "
                            f"positive ints such as (128, 128), got {scale!r}")


def block_of(shape: Sequence[int], scale: WireScale) -> tuple[int, ...]:
    """The scale group of a tensor of ``shape``, as a size per dimension."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or scale == "tensor":
        return tuple(max(s, 1) for s in shape)
    if scale == "row":
        return (1, max(shape[1], 1))
    bm, bn = scale
    return (bm, bn)


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """The shape of the scale tensor of a tensor of ``shape`` in groups of ``block``."""
    return tuple(max(1, math.ceil(s / b)) for s, b in zip(shape, block))


def _expand(scale: torch.Tensor, shape: Sequence[int], block: Sequence[int]) -> torch.Tensor:
    """Each element's group scale, as a tensor of ``shape``."""
    out = scale
    for dim, (s, b) in enumerate(zip(shape, block)):
        if b != 1:
            out = out.repeat_interleave(b, dim=dim)
        out = out.narrow(dim, 0, s)
    return out


def quantize(w: torch.Tensor, fp8: torch.dtype, block: Sequence[int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of weight ``w`` in groups of ``block`` (see the module): by the
    compiled helper's quantizing copy where it applies (a CPU bf16 or fp32 weight whose
    rows are contiguous, the helper built), else by :func:`quantize_torch`; the two
    agree bit for bit (a test compares them)."""
    out = _quantize_native(w, fp8, block)
    return out if out is not None else quantize_torch(w, fp8, block)


def _quantize_native(w: torch.Tensor, fp8: torch.dtype, block: Sequence[int]
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`quantize` by ``rdt_quantize_fp8``, or None where it does not apply."""
    if w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float32) \
            or fp8 not in FP8 or w.numel() == 0:
        return None
    fn = fp8_quantizer()
    if fn is None:
        return None
    shape = tuple(w.shape)
    if len(shape) == 2 and w.stride(1) == 1 and (w.stride(0) >= shape[1] or shape[0] == 1):
        rows, cols = shape
        ld = max(w.stride(0), cols)
        bm, bn = block
    elif tuple(block) == tuple(max(s, 1) for s in shape) and w.is_contiguous():
        rows, cols, ld, bm, bn = 1, w.numel(), w.numel(), 1, w.numel()  # one scale
    else:
        return None
    q = torch.empty(shape, dtype=fp8)
    scale = torch.empty(scale_shape(shape, block), dtype=torch.float32)
    rc = fn(w.data_ptr(), int(w.dtype == torch.bfloat16), rows, cols, ld, bm, bn,
            int(fp8 == torch.float8_e5m2), q.data_ptr(), scale.data_ptr())
    return (q, scale) if rc == 0 else None


def quantize_torch(w: torch.Tensor, fp8: torch.dtype, block: Sequence[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` in plain torch: any dtype, layout or device."""
    with torch.no_grad():
        x = w.detach().float()
        shape = tuple(x.shape)
        groups = scale_shape(shape, block)
        fmax = torch.finfo(fp8).max
        if len(shape) == 2 and tuple(block) != shape:
            # Blocks as a 4-D view of the weight padded to whole blocks, each divided by
            # its own scale through broadcasting (no per-element copy of the scales).
            bm, bn = block
            rows, cols = groups[0] * bm, groups[1] * bn
            if (rows, cols) != shape:
                x = torch.nn.functional.pad(x, (0, cols - shape[1], 0, rows - shape[0]))
            blocks = x.view(groups[0], bm, groups[1], bn)
            amax = blocks.abs().amax(dim=(1, 3))
            scale = torch.where(amax == 0, 1.0, amax / fmax)
            q = (blocks / scale[:, None, :, None]).to(fp8).view(rows, cols)
            if (rows, cols) != shape:
                q = q[:shape[0], :shape[1]].contiguous()
            return q, scale.contiguous()
        amax = x.abs().amax().reshape((1,) * len(shape)) if x.numel() else \
            torch.zeros((1,) * len(shape))
        scale = torch.where(amax == 0, 1.0, amax / fmax)
        return (x / scale).to(fp8), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: Sequence[int],
               dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q.float() * scale`` per group, as ``dtype`` (into ``out`` if given, a tensor of
    ``q``'s shape and of ``dtype``). ``q`` may be a block-aligned part of the weight and
    ``scale`` that part's scales. The compiled helper's dequantizing copy writes it where
    it applies (CPU tensors, bf16 or fp32, rows contiguous), the same bits as torch."""
    dst = out
    if dst is None and q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
        dst = torch.empty(q.shape, dtype=dtype)
    if dst is not None and _dequantize_native(q, scale, block, dtype, dst):
        return dst
    x = dequantize_torch(q, scale, block, dtype)
    if out is None:
        return x
    out.copy_(x)
    return out


def _dequantize_native(q: torch.Tensor, scale: torch.Tensor, block: Sequence[int],
                       dtype: torch.dtype, out: torch.Tensor) -> bool:
    """:func:`dequantize` into ``out`` by ``rdt_dequantize_fp8``; False where it does not
    apply (a layout or device it does not take, or no helper)."""
    if dtype not in (torch.bfloat16, torch.float32) or out.dtype != dtype \
            or q.dtype not in FP8 or out.device.type != "cpu" or q.device.type != "cpu" \
            or scale.device.type != "cpu" or scale.dtype != torch.float32 \
            or tuple(out.shape) != tuple(q.shape) or q.numel() == 0 \
            or not q.is_contiguous() or not scale.is_contiguous():
        return False
    shape = tuple(q.shape)
    if len(shape) == 2 and tuple(scale.shape) == scale_shape(shape, block) \
            and out.stride(1) == 1 and (out.stride(0) >= shape[1] or shape[0] == 1):
        rows, cols = shape
        bm, bn = block
        ld = max(out.stride(0), cols)
    elif scale.numel() == 1 and out.is_contiguous():
        rows, cols, ld, bm, bn = 1, q.numel(), q.numel(), 1, q.numel()
    else:
        return False
    fn = fp8_dequantizer()
    if fn is None:
        return False
    return fn(q.data_ptr(), int(q.dtype == torch.float8_e5m2), rows, cols, bm, bn,
              scale.data_ptr(), out.data_ptr(), int(dtype == torch.bfloat16), ld) == 0


def dequantize_torch(q: torch.Tensor, scale: torch.Tensor, block: Sequence[int],
                     dtype: torch.dtype) -> torch.Tensor:
    """:func:`dequantize` in plain torch, into a new tensor: any layout or device."""
    with torch.no_grad():
        shape = tuple(q.shape)
        if len(shape) == 2 and scale.dim() == 2 and scale.numel() > 1:
            bm, bn = block
            rows, cols = scale.shape[0] * bm, scale.shape[1] * bn
            x = q.float()
            if (rows, cols) != shape:
                x = torch.nn.functional.pad(x, (0, cols - shape[1], 0, rows - shape[0]))
            x = (x.view(scale.shape[0], bm, scale.shape[1], bn)
                 * scale.float()[:, None, :, None]).view(rows, cols)
            return x[:shape[0], :shape[1]].to(dtype)
        return (q.float() * scale.float().reshape(-1)[0]).to(dtype) if scale.numel() == 1 \
            else (q.float() * _expand(scale.float(), shape, block)).to(dtype)


def scale_selection(sel: Sequence[slice] | None, shape: Sequence[int],
                    block: Sequence[int], name: str) -> tuple[slice, ...] | None:
    """The part of the scale tensor that selection ``sel`` (normalized: step-1 slices
    of the leading dimensions) of a weight of ``shape`` needs; ValueError when ``sel``
    cuts a scale group (the selection must fall on group boundaries)."""
    if sel is None:
        return None
    out = []
    for dim, s in enumerate(sel):
        b, n = block[dim], shape[dim]
        start, stop = s.start or 0, n if s.stop is None else s.stop
        if start % b or (stop % b and stop != n):
            raise ValueError(
                f"select({name!r}, {tuple(shape)}) asks for [{start}:{stop}] of dim {dim}, "
                f"which cuts the FP8 scale groups of {b} elements there (wire_scale of "
                f"{tuple(block)}); select on multiples of {b}, or send {name!r} with a "
                "finer wire_scale")
        out.append(slice(start // b, math.ceil(stop / b)))
    return tuple(out)
