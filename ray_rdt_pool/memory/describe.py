"""The facts of an object's tensors, read and checked in one pass on every put.

Owns :class:`Described` (immutable once made; the sender keeps one per put) and
:func:`describe`, which validates the tensors (a typed InvalidInputError naming the
tensor and the fix) and reads their layout facts, in C++ where the compiled helper of
:mod:`ray_rdt_pool.memory.native` is built for this torch and passed its check here,
else in Python, with the same results. Runs on its caller's thread; the helper is loaded
and checked once per process, under a lock, by whichever thread describes first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ray_rdt_pool.errors import InvalidInputError
from ray_rdt_pool.memory.dtypes import COMPLEX_NAMES, bytes_as, dtype_facts, dtype_name
from ray_rdt_pool.memory.extent import NO_MEMORY, memory_problem, reach, storage_base

__all__ = ["Described", "describe", "native_active"]


@dataclass(frozen=True)
class Described:
    """What the transport needs to know about the tensors of one object.

    ``ptrs[i]`` is the address of tensor i's first byte and ``plain[i]`` says its bytes
    can be copied as they lie (contiguous, no lazy conjugate or negation bit), so the
    pack copy needs no further torch calls.
    """

    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    nbytes: list[int]
    aligns: list[int]
    ptrs: list[int]
    plain: list[bool]
    device: str | None


def describe(tensors: Sequence[Any], *, allow_cuda: bool = False,
             native: bool = True) -> Described:
    """Validate the tensors of one object and return their layout facts, in one pass.

    Raises InvalidInputError for a non-tensor item, mixed device types, sparse or meta
    tensors, an unsupported dtype, a CUDA tensor while the CUDA path is off, or a tensor
    with bytes but no memory (a ZeroTensor, a storage resized to 0).

    With ``native`` (``Tuning.native``) and the compiled helper built for this torch
    (:mod:`ray_rdt_pool.memory.native`), the facts of an object of plain dense CPU tensors are
    read in C++; anything else, and every error, takes the Python loop.
    """
    if native and tensors:
        fn = _native_describe()
        if fn is not None:
            facts = fn(tensors)
            if facts is not None:
                return Described(*facts, device="cpu")
    return _describe_py(tensors, allow_cuda)


def _describe_py(tensors: Sequence[Any], allow_cuda: bool) -> Described:
    """The Python loop of :func:`describe`, and the reference the helper is checked
    against. It runs once per tensor on every put, so it touches each tensor's
    attributes once and only the cheap ones (``t.device.type`` costs more than all of them).
    """
    import torch

    Tensor = torch.Tensor
    if not all(issubclass(tp, Tensor) for tp in set(map(type, tensors))):
        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise InvalidInputError(
                    f"item {i} of the object is a {type(t).__name__}, not a torch.Tensor; "
                    "nixl_pool moves tensors only, so pass other values through the object "
                    "store"
                )
    facts = dtype_facts()
    shapes: list[tuple[int, ...]] = []
    dtypes: list[str] = []
    nbytes: list[int] = []
    aligns: list[int] = []
    ptrs: list[int] = []
    plain: list[bool] = []
    add_shape, add_dtype, add_nbytes = shapes.append, dtypes.append, nbytes.append
    add_align, add_ptr, add_plain = aligns.append, ptrs.append, plain.append
    cpu, neg, short = True, False, False
    seen: dict[int, tuple[int]] = {}  # one tuple per 1-d size: equal shapes compare by identity
    # One Python loop that reads every fact of a tensor while its torch objects are in
    # cache, rather than one C-level map per attribute, each of which misses cache again
    # after an idle spell. No pass reads ``t.layout``: every layout but the dense one
    # makes one of these reads raise (sparse, compressed and mkldnn tensors have no data
    # pointer, a strided nested tensor no sizes) or gives an address under NO_MEMORY (a
    # jagged nested tensor), and both land on the checks below that name the tensor.
    # 0-d and 1-d shapes follow from the size and the dtype (``t.shape`` builds a
    # torch.Size, which costs more than the rest of the reads).
    try:
        for t in tensors:
            cpu = cpu and t.is_cpu
            name, align = facts[t.dtype]
            n = t.nbytes  # numel * element size, also for views
            k = t.dim()
            if k == 1:
                m = n // align
                shape = seen.get(m)
                if shape is None:
                    shape = seen[m] = (m,)
                add_shape(shape)
            else:
                add_shape(t.shape if k else ())
            add_dtype(name)
            add_nbytes(n)
            add_align(align)
            p = t.data_ptr()
            add_ptr(p)
            add_plain(t.is_contiguous())
            if t.is_neg():
                neg = True
            if n and not short and p >= NO_MEMORY:  # lower ones are checked below
                # A view's address is its storage's plus its offset, whatever the
                # storage holds now: FSDP resizes a flat parameter's storage to 0 under
                # views whose addresses are then their offsets (any size), and a shrunk
                # storage leaves a view reaching past it. Either way the pack would read
                # memory that is not the tensor's, or kill the process.
                st = t.untyped_storage()
                base = st.data_ptr()
                short = not base or p < base or p + reach(t, n) > base + st.nbytes()
    except (KeyError, RuntimeError):
        _refuse_invalid(tensors, allow_cuda)
        raise
    if not cpu:
        for i in range(len(tensors)):
            _check_device(tensors, i, allow_cuda)
    if short or min(ptrs, default=NO_MEMORY) < NO_MEMORY:  # empty tensors land here too
        _refuse_layouts(tensors)
        _refuse_no_memory(tensors, ptrs, nbytes)
    if neg:
        plain = [p and not t.is_neg() for p, t in zip(plain, tensors)]
    if not COMPLEX_NAMES.isdisjoint(dtypes):
        plain = [p and not t.is_conj() for p, t in zip(plain, tensors)]
    device = None if not tensors else ("cpu" if cpu else "cuda")
    return Described(shapes, dtypes, nbytes, aligns, ptrs, plain, device)


#: What the helper's describe returns: shapes, dtypes, nbytes, aligns, ptrs, plain.
_Facts = tuple[list[Any], list[Any], list[Any], list[Any], list[Any], list[Any]]
_NATIVE_LOCK = threading.Lock()
#: Empty until the first describe that may use the helper; then [its checked describe
#: function, or None where it is missing or failed its check].
_NATIVE: list[Callable[[Sequence[Any]], _Facts | None] | None] = []


def _native_describe() -> Callable[[Sequence[Any]], _Facts | None] | None:
    """The helper's describe, its tables bound once per process (``init``)."""
    if not _NATIVE:
        with _NATIVE_LOCK:
            if not _NATIVE:
                try:
                    checked = _checked_native()
                except Exception as e:  # a put must never fail for the optional helper
                    import logging

                    logging.getLogger(__name__).warning(
                        "ray_rdt_pool: checking the compiled describe helper failed "
                        "(%s: %s); describe() uses its Python loop", type(e).__name__, e)
                    checked = None
                _NATIVE.append(checked)
    return _NATIVE[0]


def native_active() -> bool:
    """Whether :func:`describe` reads facts in C++ in this process (the helper is built
    for this torch and passed its check)."""
    return _native_describe() is not None


def _checked_native() -> Callable[[Sequence[Any]], _Facts | None] | None:
    """Load the helper and accept it only if it answers exactly as the Python loop does
    for every probe tensor (each wire dtype; 0-d to 3-d; views with offsets; transposed,
    negated and conjugated views; a Parameter)."""
    import logging

    import torch

    from ray_rdt_pool.memory import native

    mod = native.load()
    if mod is None:
        return None
    facts = dtype_facts()
    dtypes = list(facts)
    index = mod.scalar_types(dtypes)
    names: list[str | None] = [None] * (max(index) + 1)
    aligns: list[int] = [0] * (max(index) + 1)
    for dt, i in zip(dtypes, index):
        names[i], aligns[i] = facts[dt]
    mod.init(names, aligns, (torch.Tensor, torch.nn.Parameter), NO_MEMORY)
    fn: Callable[[Sequence[Any]], _Facts | None] = mod.describe
    for probe in _probe_objects(dtypes):
        got = fn(probe)
        if got is None or Described(*got, device="cpu") != _describe_py(probe, False):
            logging.getLogger(__name__).warning(
                "ray_rdt_pool: the compiled describe helper disagrees with the Python loop "
                "on %d probe tensors (%s); describe() uses its Python loop. Rebuild it with "
                "`python -m ray_rdt_pool.memory.native build --force`",
                len(probe), sorted({str(t.dtype) for t in probe}))
            return None
    return fn


def _probe_objects(dtypes: Sequence[Any]) -> list[list[Any]]:
    """Objects whose facts the helper must read exactly as the Python loop does."""
    import warnings

    import torch

    per_dtype = []
    for dt in dtypes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32 is "experimental"
            # Bytes viewed as the dtype (see bytes_as): only the facts matter here.
            base = bytes_as((3, 4, 5), dt)
            per_dtype.append([base, base[1], base[1, 2], base[2, 1:3], base.transpose(0, 2),
                              base[:, 1], bytes_as((), dt), bytes_as((7,), dt)])
    f = torch.arange(12.0).view(3, 4)
    z = torch.zeros(3, 4, dtype=torch.complex64)
    odd = [f._neg_view(), z.conj(), z.conj().resolve_conj(), torch.nn.Parameter(f.clone()),
           f.t(), f[::2], f.expand(2, 3, 4), f.unsqueeze(1)]
    return [*per_dtype, odd, [t for obj in per_dtype for t in obj]]


def _refuse_invalid(tensors: Sequence[Any], allow_cuda: bool) -> None:
    """The slow path of :func:`describe` once a read failed: raise InvalidInputError for
    the first problem in the order the checks promise (device, dtype, layout)."""
    for i in range(len(tensors)):
        _check_device(tensors, i, allow_cuda)
    for t in tensors:
        dtype_name(t.dtype)
    _refuse_layouts(tensors)
    for i, t in enumerate(tensors):
        storage_base(t, i)


def _refuse_layouts(tensors: Sequence[Any]) -> None:
    """Raise InvalidInputError naming the first tensor that is not dense (strided), if
    there is one: a slow path of :func:`describe`, run only once a read failed or an
    address fell under ``NO_MEMORY`` (empty tensors, a jagged nested tensor)."""
    import torch

    _refuse_nested(tensors)  # a jagged nested tensor has a layout of its own
    for i, t in enumerate(tensors):
        if t.layout is not torch.strided:
            raise InvalidInputError(
                f"tensor {i} has layout {t.layout}; only dense (strided) tensors can be "
                "sent, convert with t.to_dense()")


def _refuse_nested(tensors: Sequence[Any]) -> None:
    """Raise InvalidInputError naming the first nested tensor, if there is one."""
    for i, t in enumerate(tensors):
        if t.is_nested:
            raise InvalidInputError(
                f"tensor {i} is a nested tensor ({t.layout} layout, {t.dim()} dims); "
                "nixl_pool sends dense tensors only, so send its components "
                "(list(t.unbind())) or a padded copy (t.to_padded_tensor(0.0))"
            )


def _refuse_no_memory(tensors: Sequence[Any], ptrs: Sequence[int],
                      nbytes: Sequence[int]) -> None:
    """Raise InvalidInputError for the first tensor with bytes to send but no memory
    behind them (see :func:`memory_problem`). The pack would copy from memory that is
    not the tensor's and send wrong bytes or kill the process (torch's own ``clone``
    does)."""
    for i, (p, n) in enumerate(zip(ptrs, nbytes)):
        if not n:
            continue
        t = tensors[i]
        why = memory_problem(t, n, p)
        if why is not None:
            raise InvalidInputError(f"tensor {i} ({tuple(t.shape)} {t.dtype}) {why}")


def _check_device(tensors: Sequence[Any], i: int, allow_cuda: bool) -> None:
    """Slow path of :func:`describe` for anything that is not a CPU tensor."""
    dev = tensors[i].device
    dev0 = tensors[0].device
    if dev.type not in ("cpu", "cuda"):
        raise InvalidInputError(
            f"tensor {i} is on device {dev}; nixl_pool supports cpu and cuda tensors"
        )
    if dev.type != dev0.type:
        raise InvalidInputError(
            f"tensor {i} is on {dev.type} but tensor 0 is on {dev0.type}; one object must "
            "hold tensors of one device type, so send them as separate objects"
        )
    if dev.type == "cuda" and not allow_cuda:
        raise InvalidInputError(
            f"tensor {i} is a CUDA tensor ({dev}); the CUDA path of nixl_pool is not "
            "enabled in this process. Move it to the CPU with t.cpu(), or use "
            "tensor_transport='nixl' for now"
        )
