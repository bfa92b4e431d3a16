"""The wire's dtypes in torch terms: names, element sizes, and empty tensors of any of them.

Owns three tables filled once per process, on first use (torch is imported then, never at
import), and read-only afterwards; any thread may read them. A dtype the wire cannot
carry, or a wire name this torch lacks, is an InvalidInputError that names the fix.
:func:`empty_tensor` makes a tensor of every wire dtype, also those torch cannot fill.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.core.runs import DTYPES
from ray_rdt_pool.errors import InvalidInputError

if TYPE_CHECKING:
    import torch

__all__ = ["COMPLEX_NAMES", "bytes_as", "dtype_facts", "dtype_name", "empty_tensor",
           "torch_dtype"]

# Both filled together by _dtype_tables(), then never changed.
_NAME_BY_DTYPE: dict[Any, str] = {}
_DTYPE_BY_NAME: dict[str, Any] = {}


def _dtype_tables() -> tuple[dict[Any, str], dict[str, Any]]:
    if not _NAME_BY_DTYPE:
        import torch

        for name in DTYPES:
            dt = getattr(torch, name, None)
            if isinstance(dt, torch.dtype):
                _NAME_BY_DTYPE[dt] = name
                _DTYPE_BY_NAME[name] = dt
    return _NAME_BY_DTYPE, _DTYPE_BY_NAME


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; InvalidInputError for dtypes the wire cannot carry."""
    try:
        return _dtype_tables()[0][dtype]
    except KeyError:
        raise InvalidInputError(
            f"dtype {dtype} cannot be sent with nixl_pool; supported dtypes are "
            f"{sorted(_dtype_tables()[1])}. Convert the tensor first, e.g. t.to(torch.float32)"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire dtype name (the wire decoder already validated it)."""
    try:
        return _dtype_tables()[1][name]
    except KeyError:
        raise InvalidInputError(
            f"dtype {name!r} is not available in this torch build; upgrade torch on the receiver"
        ) from None


#: Wire dtype name -> element size (what ``t.element_size()`` returns, without the call).
_ITEMSIZE: dict[str, int] = {name: size for name, (_code, size) in DTYPES.items()}
#: Wire names of the complex dtypes (their tensors may carry a lazy conjugate bit).
COMPLEX_NAMES = frozenset(name for name in DTYPES if name.startswith("complex"))
_DTYPE_FACTS: dict[Any, tuple[str, int]] = {}


def dtype_facts() -> dict[Any, tuple[str, int]]:
    """torch dtype -> (wire name, element size), for the dtypes the wire carries."""
    if not _DTYPE_FACTS:
        _DTYPE_FACTS.update((dt, (name, _ITEMSIZE[name]))
                            for dt, name in _dtype_tables()[0].items())
    return _DTYPE_FACTS


def empty_tensor(shape: Sequence[int], dtype: torch.dtype, device: str = "cpu"
                 ) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, also for a dtype torch cannot
    fill: under ``torch.use_deterministic_algorithms(True)`` torch fills what it
    allocates, and has no fill for some wire dtypes (float4_e2m1fn_x2), even for no
    elements. Those are bytes viewed as ``dtype``."""
    import torch

    try:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    except NotImplementedError:
        return bytes_as(shape, dtype, device)


def bytes_as(shape: Sequence[int], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Uninitialized bytes viewed as a ``dtype`` tensor of ``shape``: what ``torch.empty``
    of a uint8 buffer gives under deterministic algorithms too (it fills bytes, which it
    can for every dtype)."""
    import torch

    n = math.prod(shape) * dtype.itemsize
    return torch.empty(n, dtype=torch.uint8, device=device).view(dtype).view(tuple(shape))
