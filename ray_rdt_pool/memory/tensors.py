"""The torch layer: host memory regions, tensor validation, the pack copy and the view rebuild.

Depends on torch and the pure modules, never on Ray or NIXL. The transport calls these
functions on both sides, so the byte layout of an object is decided in one place
(:mod:`ray_rdt_pool.core.layout`) and applied here.

Threads: every function runs on its caller's thread. The one exception is a large
``pack_into`` with ``threads`` > 1, which shares its memmoves with daemon helper threads
of this module, started by the first such call (none at import), idle, blocked on a
queue, in between, and stopped by :func:`stop_pack_helpers` (the transport's shutdown).

Blocks over raw memory (:func:`device_block`): their DLPack records live in this module
until torch frees the storage and calls the deleter, from whatever thread drops the last
view. At interpreter exit, :func:`freeze_blocks_at_exit` turns the deleters of blocks still
alive into a C no-op, so nothing calls back into Python while the interpreter tears down.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import operator
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.core.layout import BlockMap
from ray_rdt_pool.core.wire import DTYPES, RunGroup, Runs, TensorRun
from ray_rdt_pool.errors import InvalidInputError
from ray_rdt_pool.memory.fastcopy import move_batch, stream_copy

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "CudaRegion",
    "Described",
    "HostRegion",
    "describe",
    "device_block",
    "dtype_name",
    "pack_into",
    "pack_torch",
    "rebuild",
    "torch_dtype",
    "unpack_into",
]

_memmove = ctypes.memmove
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _copy_for(total: int, stream_min: int) -> Callable[[int, int, int], Any]:
    """The copy for the moves of one host copy of ``total`` bytes: streaming stores from
    ``stream_min`` bytes (0: never) where the compiled helper exists, else memmove."""
    fn = stream_copy() if 0 < stream_min <= total else None
    return _memmove if fn is None else fn


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
    attributes once and only the cheap ones (``t.device.type`` alone costs microseconds).
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
    facts = _dtype_facts()
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
    # cache, rather than one C-level map per attribute: after an idle spell (a sender
    # between steps) each map pass over 5,000 tensors misses cache again, and the loop
    # measured 1 to 1.5 ms faster for 5,120 tensors, warm or cold. No pass reads
    # ``t.layout``: every layout but the dense one makes one of these reads raise
    # (sparse, compressed and mkldnn tensors have no data pointer, a strided nested
    # tensor no sizes) or gives an address under _NO_MEMORY (a jagged nested tensor),
    # and both land on the checks below that name the tensor. 0-d and 1-d shapes follow
    # from the size and the dtype (``t.shape`` builds a torch.Size, about 1.2 us).
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
            if n and not short and p >= _NO_MEMORY:  # lower ones are checked below
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
    if short or min(ptrs, default=_NO_MEMORY) < _NO_MEMORY:  # empty tensors land here too
        _refuse_layouts(tensors)
        _refuse_no_memory(tensors, ptrs, nbytes)
    if neg:
        plain = [p and not t.is_neg() for p, t in zip(plain, tensors)]
    if not _COMPLEX.isdisjoint(dtypes):
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
    facts = _dtype_facts()
    dtypes = list(facts)
    index = mod.scalar_types(dtypes)
    names: list[str | None] = [None] * (max(index) + 1)
    aligns: list[int] = [0] * (max(index) + 1)
    for dt, i in zip(dtypes, index):
        names[i], aligns[i] = facts[dt]
    mod.init(names, aligns, (torch.Tensor, torch.nn.Parameter), _NO_MEMORY)
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
            # Bytes viewed as the dtype (see _bytes_as): only the facts matter here.
            base = _bytes_as((3, 4, 5), dt)
            per_dtype.append([base, base[1], base[1, 2], base[2, 1:3], base.transpose(0, 2),
                              base[:, 1], _bytes_as((), dt), _bytes_as((7,), dt)])
    f = torch.arange(12.0).view(3, 4)
    z = torch.zeros(3, 4, dtype=torch.complex64)
    odd = [f._neg_view(), z.conj(), z.conj().resolve_conj(), torch.nn.Parameter(f.clone()),
           f.t(), f[::2], f.expand(2, 3, 4), f.unsqueeze(1)]
    return [*per_dtype, odd, [t for obj in per_dtype for t in obj]]


#: Wire dtype name -> element size (what ``t.element_size()`` returns, without the call).
_ITEMSIZE: dict[str, int] = {name: size for name, (_code, size) in DTYPES.items()}


_IS_CPU = operator.attrgetter("is_cpu")
_NBYTES = operator.attrgetter("nbytes")
#: Wire names of the complex dtypes (their tensors may carry a lazy conjugate bit).
_COMPLEX = frozenset(name for name in DTYPES if name.startswith("complex"))
_DTYPE_FACTS: dict[Any, tuple[str, int]] = {}


def _dtype_facts() -> dict[Any, tuple[str, int]]:
    """torch dtype -> (wire name, element size), for the dtypes the wire carries."""
    if not _DTYPE_FACTS:
        _DTYPE_FACTS.update((dt, (name, _ITEMSIZE[name]))
                            for dt, name in _dtype_tables()[0].items())
    return _DTYPE_FACTS


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


def storage_base(t: Any, i: int) -> tuple[Any, int]:
    """Tensor ``i``'s storage and its address, or InvalidInputError for a tensor subclass
    with no storage of its own (a DTensor of FSDP2 or tensor parallelism, a wrapper
    subclass), whose reads raise torch's untyped RuntimeError."""
    try:
        t.data_ptr()
        storage = t.untyped_storage()
        return storage, storage.data_ptr()
    except RuntimeError as e:
        raise InvalidInputError(
            f"tensor {i} (a {type(t).__name__}) has no memory of its own to send ({e}); "
            "send plain tensors: for a DTensor its local shard (t.to_local()) or the "
            "whole tensor (t.full_tensor())") from e


def _refuse_layouts(tensors: Sequence[Any]) -> None:
    """Raise InvalidInputError naming the first tensor that is not dense (strided), if
    there is one: a slow path of :func:`describe`, run only once a read failed or an
    address fell under ``_NO_MEMORY`` (empty tensors, a jagged nested tensor)."""
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


#: Addresses below this are never memory (Linux maps nothing under ``vm.mmap_min_addr``,
#: 64 KiB by default): a tensor whose bytes start there has no storage behind them, and
#: its address is just its storage offset.
_NO_MEMORY = 1 << 16


def reach(t: Any, n: int) -> int:
    """Bytes from ``t``'s first element to the end of its last one (``n`` is its
    ``nbytes``, not 0): what of its storage a copy of ``t`` reads."""
    if t.is_contiguous():
        return n
    last = sum((k - 1) * s for k, s in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


#: The most runs :func:`byte_runs` lists for one tensor (32 MiB of run starts).
MAX_BYTE_RUNS = 1 << 22


def byte_runs(t: Any) -> tuple[Any, int] | None:
    """The bytes dense tensor ``t`` covers, as ``(starts, length)``: a sorted int64 tensor
    of run start addresses, each run ``length`` bytes long; None when that takes more
    than :data:`MAX_BYTE_RUNS` runs. Dimensions that tile memory densely merge into one
    run, so a contiguous tensor or a transpose of one is a single run and a column slice
    of a matrix is one run per row."""
    import torch

    item = t.element_size()
    dims = sorted((st * item, k) for k, st in zip(t.shape, t.stride()) if k > 1)
    length = item
    while dims and dims[0][0] == length:
        length *= dims.pop(0)[1]
    count = math.prod(k for _st, k in dims)
    if count > MAX_BYTE_RUNS:
        return None
    starts = torch.tensor([t.data_ptr()], dtype=torch.int64)
    for st, k in dims:
        starts = (starts[:, None] + torch.arange(k, dtype=torch.int64) * st).reshape(-1)
    return starts.sort().values, length


def runs_meet(a: tuple[Any, int], b: tuple[Any, int]) -> bool:
    """Whether two :func:`byte_runs` results share a byte. Runs of one tensor have one
    length, so for each run of ``b`` the run of ``a`` starting last before it ends is the
    one of ``a`` that reaches furthest into it."""
    import torch

    (sa, la), (sb, lb) = a, b
    i = torch.searchsorted(sa, sb + lb) - 1
    hit = i >= 0
    return bool((sa[i[hit]] + la > sb[hit]).any())


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


def memory_problem(t: Any, n: int | None = None, p: int | None = None) -> str | None:
    """Why the bytes of dense tensor ``t`` (``n`` of them from address ``p``; by default
    its own) have no memory behind them, or None when they have: a ZeroTensor (address
    0), a storage with no memory of its own (a DTensor), a storage resized to 0 bytes
    (the address is then the view's offset, of any size), or a storage shrunk under a
    view that reaches past it. Reading or writing such a tensor touches memory that is
    not its own."""
    n = t.nbytes if n is None else n
    if not n:
        return None
    if t._is_zerotensor():
        return ("is a ZeroTensor (torch._efficientzerotensor, which some autograd formulas "
                f"return for an all-zero result): its {n:,} bytes have no memory behind "
                "them. Use t.clone() instead (real zeros of the same shape)")
    try:
        storage, base = storage_base(t, 0)
    except InvalidInputError as e:
        return f"is a {type(t).__name__} with no memory of its own ({e.__cause__}); use " \
               "plain tensors: for a DTensor its local shard (t.to_local()) or the whole " \
               "tensor (t.full_tensor())"
    p = t.data_ptr() if p is None else p
    if base and base <= p and p + reach(t, n) <= base + storage.nbytes():
        return None
    if base == 0:
        return (f"has {n:,} bytes but its storage holds {storage.nbytes():,} (resized to 0, "
                "as FSDP does to free a parameter's memory); use it while its storage is "
                "allocated, or a copy made then")
    return (f"reaches byte {p - base + reach(t, n):,} of its storage, which holds only "
            f"{storage.nbytes():,} (the storage was resized under the view); use it while "
            "its storage holds the view, or a copy made then")


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


class HostRegion:
    """One page-aligned anonymous mapping of host memory, viewed as a uint8 tensor.

    The pool and the receive arena are each one region, registered with NIXL once.
    An anonymous mapping rather than ``torch.empty`` keeps the region out of glibc's
    heap, so its pages, once faulted, are never handed back and re-faulted.
    """

    def __init__(self, nbytes: int, *, prefault: bool = False) -> None:
        import numpy as np
        import torch

        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if prefault and hasattr(mmap, "MAP_POPULATE"):
            flags |= mmap.MAP_POPULATE
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=flags)
        # No MADV_HUGEPAGE: on this kind of host, first touches of huge pages stalled for
        # compaction (440 ms for 66 MiB once, against 50 ms with 4 KiB pages).
        self._populated = nbytes if prefault else 0
        self.array: np.ndarray = np.frombuffer(self._map, dtype=np.uint8)
        self.tensor: torch.Tensor = torch.from_numpy(self.array)
        self.addr: int = self.tensor.data_ptr()
        self.device = "cpu"
        self.device_id = 0
        self.torch_device = "cpu"

    def populate(self, end: int) -> None:
        """Fault in pages up to ``end`` in one kernel call, ahead of a copy or READ.

        Blocks are handed out lowest offset first and pages are never returned, so a
        high-water mark is enough. ``MADV_POPULATE_WRITE`` (Linux 5.14) faults about
        twice as fast as first touches one page at a time; where it is missing, pages
        simply fault on first use.
        """
        if end <= self._populated:
            return
        page = mmap.PAGESIZE
        start = self._populated // page * page
        stop = min(self.nbytes, -(-end // page) * page)
        try:
            self._map.madvise(_MADV_POPULATE_WRITE, start, stop - start)
        except (OSError, ValueError):
            pass
        self._populated = stop

    def close(self) -> None:
        """Unmap the region (its registration is already gone, and no view is left)."""
        self.tensor = None  # type: ignore[assignment]
        self.array = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: unmapped when it dies
            pass


class CudaRegion:
    """One allocation of CUDA memory for a pool or arena, viewed as a uint8 tensor.

    Memory from ``expandable_segments`` cannot be registered for RDMA, so that allocator
    setting is refused up front with the fix, instead of failing inside NIXL.

    Blocks are whole 4 KiB pages, as in a shared host pool: same-node receivers lease a
    sender's CUDA pool by page (see ``shared``).
    """

    align = 4096

    def __init__(self, nbytes: int) -> None:
        import os

        import torch

        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
        if "expandable_segments:true" in conf:
            from ray_rdt_pool.errors import RegistrationError

            raise RegistrationError(
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is set: CUDA memory from "
                "expandable segments cannot be registered with NIXL for RDMA. Unset it (or set "
                "expandable_segments:False) in processes that use a CUDA nixl_pool")
        if not torch.cuda.is_available():
            from ray_rdt_pool.errors import ConfigurationError

            raise ConfigurationError(
                "device='cuda' was configured but this process sees no CUDA device; "
                "configure device='cpu' or give the actor a GPU (num_gpus=1)")
        self.nbytes = nbytes = -(-nbytes // self.align) * self.align
        self.device_id = torch.cuda.current_device()
        self.torch_device = f"cuda:{self.device_id}"
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
        self.addr = self.tensor.data_ptr()
        self.device = "cuda"

    def close(self) -> None:
        """Give the memory back to torch's caching allocator."""
        self.tensor = None  # type: ignore[assignment]


_BIG_COPY = 1 << 20

# ---------------------------------------------------------------------------------------
# Threaded pack copy. Threads: the thread calling pack_into (Ray's task thread, or the
# driver's) cuts the copy into units, queues one share per helper, copies units itself
# and waits for the helpers; helper threads only ever run _PackJob.help.
# ---------------------------------------------------------------------------------------

#: Default ``threshold`` of :func:`pack_into` (the sender passes its configured
#: ``pack_threshold_bytes``): smaller copies stay on the calling thread.
_PACK_THRESHOLD = 8 << 20
#: Bytes per unit of work of a threaded pack. Big spans are cut into units of this size
#: and small spans grouped up to it. Threads take units one at a time, so one slowed by
#: another process on the same core simply takes fewer, and a unit costs one lock round
#: trip, not one per tensor.
_PACK_CHUNK = 4 << 20
#: Most helper threads the pool starts (``pack_threads`` is at most 64, caller included).
_PACK_MAX_HELPERS = 63

#: One memmove: (destination address, source address, bytes).
_Move = tuple[int, int, int]


class _PackJob:
    """The units of one threaded pack, shared by the calling thread and its helpers.

    The calling thread, and each helper that reaches the job before it is closed, take
    units one at a time until none is left or a failure stopped the job. The caller then
    closes the job and waits only for the helpers inside it: a helper still busy with
    another job finds this one closed later and drops it, so it never delays the caller.
    """

    __slots__ = ("_active", "_batch", "_closed", "_copy", "_idle", "_lock", "_next", "error",
                 "stopped", "units")

    def __init__(self, units: Sequence[Sequence[_Move]],
                 copy: Callable[[int, int, int], Any] = _memmove,
                 batch: Callable[[Sequence[_Move]], Any] | None = None) -> None:
        self.units = units
        self._copy = copy  # memmove, or a read from another process (releases the GIL)
        self._batch = batch  # or one call per unit (vectored reads of another process)
        self._next = 0  # index of the next unit to take
        self._lock = threading.Lock()
        self._active = 0  # helpers inside work()
        self._closed = False
        self._idle = threading.Event()  # set once closed with no helper inside
        self.stopped = False  # a failure in any thread: take no more units
        self.error: BaseException | None = None  # a helper's first failure

    def work(self) -> None:
        """Copy units until none is left or the job stopped (caller and helpers)."""
        units = self.units
        lock = self._lock
        copy = self._copy
        batch = self._batch
        while True:
            with lock:
                i = self._next
                if self.stopped or i >= len(units):
                    return
                self._next = i + 1
            if batch is not None:
                batch(units[i])
                continue
            for dst, src, n in units[i]:
                copy(dst, src, n)  # releases the GIL: the threads copy in parallel

    def help(self) -> None:
        """One helper's share (helper thread): never raises, failures go to ``error``."""
        with self._lock:
            if self._closed:
                return
            self._active += 1
        try:
            self.work()
        except BaseException as exc:  # re-raised by the caller in its own thread
            self.stop(exc)
        finally:
            with self._lock:
                self._active -= 1
                if self._closed and not self._active:
                    self._idle.set()

    def stop(self, exc: BaseException | None = None) -> None:
        """Let nobody take another unit; remember the first helper failure (any thread)."""
        with self._lock:
            self.stopped = True
            if exc is not None and self.error is None:
                self.error = exc

    def close(self) -> None:
        """Let no more helpers in and wait for those inside (calling thread).

        After this returns no helper writes into the destination any more, so the caller
        may free it (the sender does when the pack failed).
        """
        with self._lock:
            self._closed = True
            if not self._active:
                return
        self._idle.wait()


class _PackPool:
    """The daemon helper threads of threaded packs: started on demand, stopped by
    :func:`stop_pack_helpers` (the transport's ``shutdown``).

    An idle helper blocks in ``SimpleQueue.get`` (no CPU, no polling); each queued item is
    one helper's share of one job.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child inherits this object but not its threads
        self.jobs: queue.SimpleQueue[_PackJob | None] = queue.SimpleQueue()
        self.helpers = 0
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, job: _PackJob, helpers: int) -> None:
        """Queue ``helpers`` shares of ``job``, starting threads up to that many (caller).

        If the system refuses a new thread the job runs with fewer helpers: the caller
        copies every unit nobody else takes.
        """
        with self._lock:
            while self.helpers < helpers:
                t = threading.Thread(target=self._serve, daemon=True,
                                     name=f"ray_rdt_pool-pack-{self.helpers}")
                try:
                    t.start()
                except RuntimeError:
                    break
                self.helpers += 1
                self.threads.append(t)
            helpers = min(helpers, self.helpers)
        for _ in range(helpers):
            self.jobs.put(job)

    def _serve(self) -> None:
        """A helper thread's whole life: one share of one job at a time, until None."""
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job.help()

    def stop(self, timeout: float) -> None:
        """End every helper once the shares queued before this are done."""
        with self._lock:
            threads, self.threads = self.threads, []
            self.helpers = 0
        for _ in threads:
            self.jobs.put(None)
        for t in threads:
            t.join(timeout)


_pack_pool: _PackPool | None = None
_pack_pool_lock = threading.Lock()


def _get_pack_pool() -> _PackPool:
    """This process's helper pool, created on first use (and anew in a forked child)."""
    global _pack_pool
    pool = _pack_pool
    if pool is None or pool.pid != os.getpid():
        with _pack_pool_lock:
            pool = _pack_pool
            if pool is None or pool.pid != os.getpid():
                pool = _pack_pool = _PackPool()
    return pool


def stop_pack_helpers(timeout: float = 5.0) -> None:
    """Stop this process's pack helper threads (none is left running); a later threaded
    pack starts new ones. Called by the transport's ``shutdown``."""
    global _pack_pool
    with _pack_pool_lock:
        pool, _pack_pool = _pack_pool, None
    if pool is not None and pool.pid == os.getpid():
        pool.stop(timeout)


def _pack_units(moves: Sequence[_Move], chunk: int) -> list[list[_Move]]:
    """Cut and group ``moves`` into units of at most ``chunk`` bytes (calling thread).

    A move is cut only where its destination crosses a 64-byte boundary, so the threads
    do not write halves of one cache line.
    """
    chunk = max(chunk, 128)  # room for at least one cache-line boundary: always progress
    units: list[list[_Move]] = []
    unit: list[_Move] = []
    room = chunk
    for dst, src, n in moves:
        while n > room:
            take = ((dst + room) & ~63) - dst
            if take > 0:
                unit.append((dst, src, take))
                dst, src, n = dst + take, src + take, n - take
            if unit:
                units.append(unit)
            unit, room = [], chunk
        if n:
            unit.append((dst, src, n))
            room -= n
            if not room:
                units.append(unit)
                unit, room = [], chunk
    if unit:
        units.append(unit)
    return units


def _array_units(moves: Any, chunk: int) -> list[Any]:
    """:func:`_pack_units` for an ``(n, 3)`` int64 array of moves (a threaded pack of
    many tensors), without a Python step per move: a move above ``chunk`` bytes is cut
    on 64-byte destination boundaries into pieces of at most ``chunk``, then moves are
    grouped by the ``chunk``-sized stretch of the stream their last byte falls in, so a
    unit holds at most twice ``chunk`` bytes. Returns row slices in order
    (tests/test_pack.py holds both rules)."""
    import numpy as np

    chunk = max(chunk, 128)  # a cut always moves forward: (at + chunk) & ~63 > at
    big = np.flatnonzero(moves[:, 2] > chunk).tolist()
    if big:
        parts = []
        prev = 0
        for i in big:
            parts.append(moves[prev:i])
            dst, src, n = moves[i].tolist()
            cuts = [dst]
            while (nxt := (cuts[-1] + chunk) & ~63) < dst + n:
                cuts.append(nxt)
            starts = np.array(cuts, dtype=np.int64)
            piece = np.empty((len(cuts), 3), dtype=np.int64)
            piece[:, 0] = starts
            piece[:, 1] = starts + (src - dst)
            piece[:, 2] = np.diff(starts, append=dst + n)
            parts.append(piece)
            prev = i + 1
        parts.append(moves[prev:])
        moves = np.concatenate(parts)
    if not len(moves):
        return []
    stretch = (np.cumsum(moves[:, 2]) - 1) // chunk
    return np.split(moves, (np.flatnonzero(stretch[1:] != stretch[:-1]) + 1).tolist())


def _move_array(dst: Any, src: Any, nbytes: Any, at: int) -> Any:
    """Spans from :func:`_span_arrays` as an ``(n, 3)`` int64 array of moves, the packed
    offsets turned into addresses from ``at``."""
    import numpy as np

    moves = np.empty((len(nbytes), 3), dtype=np.int64)
    moves[:, 0] = dst + at
    moves[:, 1] = src
    moves[:, 2] = nbytes
    return moves


def _pack_threaded(tensors: Sequence[torch.Tensor], d: Described, offsets: Sequence[int],
                   blocks: Sequence[tuple[int, int]], region: HostRegion,
                   idx: Sequence[int], threads: int,
                   copy: Callable[[int, int, int], Any] = _memmove) -> None:
    """:func:`pack_into` on up to ``threads`` threads (runs on the calling thread).

    The same spans as the one-thread loop are mapped to physical moves through the block
    map and cut into units; ``threads - 1`` helpers and the calling thread copy them. The
    caller materialises the non-plain tensors meanwhile (torch ops that allocate) and
    copies those itself. It returns only once no helper touches the pool any more, and
    re-raises the first failure of any thread.
    """
    base = region.addr
    bmap = None if len(blocks) == 1 else BlockMap(blocks)
    b0 = blocks[0][0] if blocks else 0
    nbytes, ptrs, plain = d.nbytes, d.ptrs, d.plain

    def physical(dst: int, src: int, n: int) -> list[_Move]:
        if bmap is None:
            return [(base + b0 + dst, src, n)]
        out: list[_Move] = []
        for phys, m in bmap.map(dst, n):
            out.append((base + phys, src, m))
            src += m
        return out

    leftovers: list[int] = []

    def materialise() -> None:
        for i in leftovers:
            # As in the one-thread path: torch materialises the logical values.
            t = _logical(tensors[i], i).contiguous()
            for dst, src, n in physical(offsets[i], t.data_ptr(), nbytes[i]):
                copy(dst, src, n)

    batch = _batch_unit(copy is not _memmove)
    if bmap is None and batch is not None and len(idx) >= _VECTOR_SPANS:
        # Many tensors: spans, moves and units as arrays, one foreign call per unit.
        dst, src, nb = _span_arrays(idx, nbytes, ptrs, plain, offsets, leftovers)
        units = _array_units(_move_array(dst, src, nb, base + b0), _PACK_CHUNK)
        _run_job(_PackJob(units, copy, batch), threads, materialise)
        return
    moves: list[_Move] = []
    for span_dst, span_src, span_len in _all_spans(idx, nbytes, ptrs, plain, offsets,
                                                   leftovers):
        moves.extend(physical(span_dst, span_src, span_len))
    _run_moves(moves, threads, copy, materialise,
               batch if len(moves) >= _VECTOR_SPANS else None)


def copy_moves(moves: Sequence[_Move], threads: int,
               copy: Callable[[int, int, int], Any] = _memmove,
               batch: Callable[[Sequence[_Move]], Any] | None = None) -> None:
    """Run ``copy(dst, src, n)`` over ``moves`` on up to ``threads`` threads (the calling
    thread and pack helpers), cut into units of a few MiB; returns once every unit is
    done and no helper is inside any more, and re-raises the first failure of any
    thread. ``batch``, if given, copies a whole unit (a list of moves) in one call
    instead. Either must release the GIL for the threads to overlap (``memmove`` and
    ``process_vm_readv`` through ctypes do)."""
    if threads <= 1 or len(moves) == 0:
        if batch is not None:
            batch(moves)
            return
        for dst, src, n in moves:
            copy(dst, src, n)
        return
    _run_moves(moves, threads, copy, None, batch)


def _run_moves(moves: Sequence[_Move], threads: int, copy: Callable[[int, int, int], Any],
               first: Callable[[], None] | None,
               batch: Callable[[Sequence[_Move]], Any] | None = None) -> None:
    """The threaded copy of :func:`copy_moves`; ``first`` runs on the calling thread
    while the helpers start (the pack's torch materialisations)."""
    _run_job(_PackJob(_pack_units(moves, _PACK_CHUNK), copy, batch), threads, first)


def _run_job(job: _PackJob, threads: int, first: Callable[[], None] | None = None) -> None:
    """Run ``job`` on the calling thread and up to ``threads - 1`` helpers; returns once
    no helper is inside it, re-raising the first failure of any thread."""
    helpers = min(threads - 1, len(job.units) - 1, _PACK_MAX_HELPERS)
    if helpers > 0:
        _get_pack_pool().submit(job, helpers)
    try:
        if first is not None:
            first()
        job.work()
    except BaseException:
        job.stop()  # helpers finish the unit in hand and take no other
        raise
    finally:
        job.close()
    if job.error is not None:
        raise job.error


def _spans(idx: Iterable[int], nbytes: Sequence[int], ptrs: Sequence[int],
           plain: Sequence[bool], offsets: Sequence[int], leftovers: list[int]
           ) -> Iterator[tuple[int, int, int]]:
    """The copies of a pack as ``(packed offset, source address, length)`` spans: runs of
    tensors adjacent both in memory and in the packed space make one span. Tensors whose
    bytes cannot be copied as they lie go to ``leftovers``; empty ones are skipped.
    One rule for the one-thread and the threaded pack (tests/test_pack.py compares)."""
    span_src = span_dst = span_len = 0
    for i in idx:
        n = nbytes[i]
        if n == 0:
            continue
        if not plain[i]:
            leftovers.append(i)
            continue
        src = ptrs[i]
        dst = offsets[i]
        if span_len and src == span_src + span_len and dst == span_dst + span_len:
            span_len += n
            continue
        if span_len:
            yield span_dst, span_src, span_len
        span_src, span_dst, span_len = src, dst, n
    if span_len:
        yield span_dst, span_src, span_len


#: Objects with at least this many tensors find their spans with numpy (one pass over
#: arrays) rather than a Python step per tensor; below it numpy's fixed cost is larger.
_VECTOR_SPANS = 256


def _span_arrays(idx: Sequence[int] | None, nbytes: Sequence[int], ptrs: Sequence[int],
                 plain: Sequence[bool], offsets: Sequence[int], leftovers: list[int]
                 ) -> tuple[Any, Any, Any]:
    """:func:`_spans` as three int64 numpy arrays (packed offsets, source addresses,
    lengths), found in one pass over arrays: the same spans in the same order
    (tests/test_pack.py holds it)."""
    import numpy as np

    if isinstance(idx, range) and idx == range(len(nbytes)):
        idx = None  # every tensor, in order: no gather needed
    nb = np.array(nbytes, dtype=np.int64)
    src = np.array(ptrs, dtype=np.int64)
    dst = np.array(offsets, dtype=np.int64)
    ok = np.array(plain, dtype=np.bool_)
    pos = np.arange(len(nb)) if idx is None else np.array(idx, dtype=np.int64)
    if idx is not None:
        nb, src, dst, ok = nb[pos], src[pos], dst[pos], ok[pos]
    some = nb > 0
    leftovers.extend(pos[some & ~ok].tolist())
    keep = some & ok
    nb, src, dst = nb[keep], src[keep], dst[keep]
    if not len(nb):
        return dst, src, nb
    joins = np.zeros(len(nb), dtype=np.bool_)
    ends = nb[:-1]
    joins[1:] = (src[1:] == src[:-1] + ends) & (dst[1:] == dst[:-1] + ends)
    starts = np.flatnonzero(~joins)
    return dst[starts], src[starts], np.add.reduceat(nb, starts)


def _span_lists(idx: Sequence[int] | None, nbytes: Sequence[int], ptrs: Sequence[int],
                plain: Sequence[bool], offsets: Sequence[int], leftovers: list[int]
                ) -> tuple[list[int], list[int], list[int]]:
    """:func:`_span_arrays` as three lists."""
    dst, src, nb = _span_arrays(idx, nbytes, ptrs, plain, offsets, leftovers)
    return dst.tolist(), src.tolist(), nb.tolist()


def _all_spans(idx: Sequence[int] | None, nbytes: Sequence[int], ptrs: Sequence[int],
               plain: Sequence[bool], offsets: Sequence[int], leftovers: list[int]
               ) -> Iterable[tuple[int, int, int]]:
    """The spans of a pack, by :func:`_span_lists` for many tensors, else :func:`_spans`."""
    n = len(nbytes) if idx is None else len(idx)
    if n >= _VECTOR_SPANS:
        return zip(*_span_lists(idx, nbytes, ptrs, plain, offsets, leftovers))
    return _spans(range(len(nbytes)) if idx is None else idx, nbytes, ptrs, plain, offsets,
                  leftovers)


def _batched(moves: Any, stream: bool) -> bool:
    """Run ``(destination, source, bytes)`` moves (an ``(n, 3)`` int64 array, or a
    sequence of triples) in one call of the compiled helper; False (nothing copied) where
    the helper is missing."""
    fn = move_batch()
    if fn is None:
        return False
    import numpy as np

    arr = np.ascontiguousarray(moves, dtype=np.int64).reshape(-1, 3)
    fn(arr.ctypes.data, len(arr), 1 if stream else 0)
    return True


def _host_moves(moves: Sequence[_Move], total: int, stream_min: int) -> None:
    """Run host ``(destination, source, bytes)`` moves of ``total`` bytes in all: in one
    call of the compiled helper when there are many, else one copy each (streaming
    stores from ``stream_min`` bytes in all, as :func:`pack_into`)."""
    copy = _copy_for(total, stream_min)
    if len(moves) >= _VECTOR_SPANS and _batched(moves, copy is not _memmove):
        return
    for dst, src, n in moves:
        if n:
            copy(dst, src, n)


def _batch_unit(stream: bool) -> Callable[[Sequence[_Move]], Any] | None:
    """A threaded pack's per-unit copy through the compiled helper (one foreign call per
    unit of moves), or None where the helper is missing."""
    if move_batch() is None:
        return None

    def batch(unit: Sequence[_Move]) -> None:
        _batched(unit, stream)
    return batch


def pack_into(tensors: Sequence[torch.Tensor], d: Described, offsets: Sequence[int],
              blocks: Sequence[tuple[int, int]], region: HostRegion,
              which: Sequence[int] | None = None, *, threads: int = 1,
              threshold: int = _PACK_THRESHOLD, stream_min: int = 0) -> None:
    """Copy each tensor's own bytes to its packed offset in the object's pool blocks.

    ``offsets`` are positions in the object's packed space, which is the concatenation
    of ``blocks`` (physical (offset, length) pairs in ``region``); ``which`` limits the
    copy to some tensors. Runs of tensors adjacent both in memory and in the packed
    space are copied as one span, and every span is one memmove: a torch op per small
    tensor costs more than its copy (seed 000: ~8 us per fragment).

    Stores: a pack into blocks of at least ``stream_min`` bytes in all (0: never) copies
    with streaming stores where the compiled helper exists (:mod:`ray_rdt_pool.memory.fastcopy`).

    Threads: with ``threads`` > 1 and at least ``threshold`` bytes to copy, the calling
    thread and up to ``threads - 1`` daemon helper threads (started on first use, shared
    by the process) copy the spans in units of a few MiB; the call returns once every
    byte is in place and re-raises a helper's failure. Otherwise the calling thread
    copies everything, as below.
    """
    # The blocks' total bounds the bytes to copy from above and costs next to nothing, so
    # small objects pay no per-tensor sum for the threshold test.
    room = blocks[0][1] if len(blocks) == 1 else sum([n for _, n in blocks])
    copy = _copy_for(room, stream_min)
    if threads > 1 and room >= threshold and (
            sum(d.nbytes) if which is None else sum([d.nbytes[i] for i in which])) >= threshold:
        _pack_threaded(tensors, d, offsets, blocks, region,
                       range(len(d.nbytes)) if which is None else which, threads, copy)
        return
    base = region.addr
    bmap = None if len(blocks) == 1 else BlockMap(blocks)
    b0 = blocks[0][0] if blocks else 0
    nbytes, ptrs, plain = d.nbytes, d.ptrs, d.plain
    leftovers: list[int] = []

    def move(dst: int, src: int, n: int) -> None:
        if bmap is None:
            copy(base + b0 + dst, src, n)
            return
        for phys, m in bmap.map(dst, n):
            copy(base + phys, src, m)
            src += m

    if bmap is None and (len(nbytes) if which is None else len(which)) >= _VECTOR_SPANS:
        # Thousands of small tensors (an RL batch stored per sample): one foreign call for
        # all the moves instead of a ctypes call per tensor, which costs as much as
        # copying a few KiB.
        dst, src, nb = _span_arrays(which, nbytes, ptrs, plain, offsets, leftovers)
        if _batched(_move_array(dst, src, nb, base + b0), copy is not _memmove):
            spans: Iterable[tuple[int, int, int]] = ()
        else:
            spans = zip(dst.tolist(), src.tolist(), nb.tolist())
    else:
        spans = _all_spans(which, nbytes, ptrs, plain, offsets, leftovers)
    if bmap is None:
        at = base + b0
        for span_dst, span_src, span_len in spans:
            copy(at + span_dst, span_src, span_len)
    else:
        for span_dst, span_src, span_len in spans:
            move(span_dst, span_src, span_len)

    for i in leftovers:
        # Strided, conjugated or negated views: let torch materialise the logical
        # values, then move the bytes like any other span.
        t = _logical(tensors[i], i).contiguous()
        move(offsets[i], t.data_ptr(), nbytes[i])


def _logical(t: torch.Tensor, i: int) -> torch.Tensor:
    """Tensor ``i``'s logical values (its lazy conjugate and negative bits applied), or
    InvalidInputError where torch has no kernel for that (a negative view of a dtype it
    cannot negate: bool, unsigned, float8, made with ``torch._neg_view``)."""
    try:
        return t.resolve_conj().resolve_neg()
    except (NotImplementedError, RuntimeError) as e:
        raise InvalidInputError(
            f"tensor {i} ({tuple(t.shape)} {t.dtype}) is a lazy "
            f"{'negative' if t.is_neg() else 'conjugate'} view that torch cannot resolve "
            f"({type(e).__name__}: {e}); send a tensor without that bit") from e


def rebuild(block: torch.Tensor, runs: Sequence[TensorRun],
            starts: Sequence[int]) -> list[torch.Tensor]:
    """Rebuild the tensors of an object as views of one contiguous uint8 block.

    ``starts`` are the packed offsets of the runs' first tensors (``meta.run_starts()``).
    Each run of equal (shape, dtype) tensors becomes one reshape and one ``unbind``, so
    thousands of row views cost a few torch calls, not one per tensor. When ``runs`` is a
    :class:`~ray_rdt_pool.core.wire.Runs` (what the decoder returns), a repeated group costs a
    few torch calls too, however many repetitions it has: see :func:`_rebuild_group`.
    """
    out: list[torch.Tensor] = []
    if not isinstance(runs, Runs):
        for run, start in zip(runs, starts):
            _rebuild_run(block, run, start, out)
        return out
    at = 0  # index in `starts` of the group's first run
    for g, placed in zip(runs.groups, runs.layout()[0]):
        # The layout is the one run_starts() came from; `starts` only places it, so a
        # caller may pass offsets shifted as a whole.
        shift = starts[at] - placed.first[0]
        for piece_starts, stride, reps in placed.pieces(g.repeat):
            piece = [s + shift for s in piece_starts]
            if reps == 1:
                for run, start in zip(g.runs, piece):
                    _rebuild_run(block, run, start, out)
            else:
                _rebuild_group(block, g, piece, stride, reps, out)
        at += len(g.runs) * g.repeat
    return out


def _rebuild_run(block: torch.Tensor, run: TensorRun, start: int,
                 out: list[torch.Tensor]) -> None:
    dt = torch_dtype(run.dtype)
    each = run.nbytes_each
    if run.count == 1:
        out.append(block[start:start + each].view(dt).view(run.shape))
        return
    flat = block[start:start + each * run.count].view(dt)
    if each or _stack_fits(run.count, run.shape):
        out.extend(flat.view((run.count, *run.shape)).unbind(0))
    else:
        # Empty tensors whose other dims make the stack (count, *shape) overflow the
        # 64-bit counts torch keeps (``(2**60, 0)`` sixteen times: each tensor is
        # valid, their stack is not): one view each. With bytes, the stack is never
        # larger than the block.
        out.extend(flat.view(run.shape) for _ in range(run.count))


#: torch keeps element counts and strides in signed 64-bit integers.
_I64_LIMIT = 1 << 63


def _stack_fits(lead: int, shape: tuple[int, ...]) -> bool:
    """Whether torch can make a ``(lead, *shape)`` tensor: its element count, and its
    strides, are at most ``lead`` times the product of the nonzero dims."""
    n = lead
    for d in shape:
        if d:
            n *= d
    return n < _I64_LIMIT


def _rebuild_group(block: torch.Tensor, g: RunGroup, starts: Sequence[int], stride: int,
                   rep: int, out: list[torch.Tensor]) -> None:
    """The tensors of ``rep`` uniform repetitions of a group, a few torch calls per run.

    Tensor ``q`` of a run in every repetition (a *field* of the pattern) is a regular
    strided array of the block: one ``as_strided`` view of shape ``(rep, *shape)``
    and one ``unbind``. A run with more tensors than the group has repetitions is cut
    per repetition instead (one reshape and one ``unbind`` each), whichever is fewer
    calls. The results go to their places in the output with slice assignments, so no
    Python step runs per tensor.
    """
    per_rep = g.tensors_per_repeat
    res: list[Any] = [None] * (per_rep * rep)
    col = 0
    for run, s in zip(g.runs, starts):
        dt = torch_dtype(run.dtype)
        n = run.nbytes_each
        c = run.count
        if not n and not _stack_fits(max(c, rep), run.shape):
            # Empty tensors too large to stack (see _rebuild_run): one view each.
            empty = block[s:s].view(dt)
            for k in range(rep):
                at = k * per_rep + col
                res[at:at + c] = [empty.view(run.shape) for _ in range(c)]
        elif c <= rep:
            # A typed view over every repetition of the run; its storage offset is in
            # elements of dt (the layout keeps s and the stride multiples of the itemsize).
            typed = block[s:s + (rep - 1) * stride + c * n].view(dt)
            numel = run.numel
            size = (rep, *run.shape)
            strides = (stride // run.itemsize, *_contiguous_strides(run.shape))
            base = typed.storage_offset()
            for q in range(c):
                res[col + q::per_rep] = typed.as_strided(size, strides, base + q * numel).unbind(0)
        else:
            shape = (c, *run.shape)
            for k in range(rep):
                b = s + k * stride
                at = k * per_rep + col
                res[at:at + c] = block[b:b + c * n].view(dt).view(shape).unbind(0)
        col += c
    out.extend(res)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-contiguous strides in elements, as torch computes them (a 0 dim counts as 1)."""
    strides: list[int] = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def unpack_into(targets: Sequence[torch.Tensor], offsets: Sequence[int], base: int,
                total: int, device: str, device_id: int, stream_min: int = 0) -> None:
    """Copy each tensor of a received object from its block at ``base`` into ``targets``.

    Host to host is one copy per tensor (streaming stores from ``stream_min`` bytes in
    all, as :func:`pack_into`); anything involving CUDA goes through torch views of the
    block and is finished before returning.
    """
    if device == "cpu" and all(map(_IS_CPU, targets)):
        import torch

        _host_moves(list(zip(map(torch.Tensor.data_ptr, targets), [base + o for o in offsets],
                             map(_NBYTES, targets))), total, stream_min)
        return
    import torch

    block = device_block(base, total, device, device_id, None)
    with torch.no_grad():  # a requires_grad Parameter is a fine target
        for t, off in zip(targets, offsets):
            n = t.numel() * t.element_size()
            if n:
                t.copy_(block[off:off + n].view(t.dtype).view(t.shape))
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bytes(moves: Sequence[tuple[int, int, int]], device: str, device_id: int,
               stream_min: int = 0) -> None:
    """Copy ``(destination, source, bytes)`` ranges within one device's memory, finished
    before returning: on the host one copy per range (streaming stores from
    ``stream_min`` bytes in all, as :func:`pack_into`), torch copies on this thread's
    stream (then synchronised) on CUDA."""
    if device == "cpu":
        _host_moves(moves, sum([n for _d, _s, n in moves]), stream_min)
        return
    import torch

    for dst, src, n in moves:
        if n:
            device_block(dst, n, device, device_id, None).copy_(
                device_block(src, n, device, device_id, None))
    torch.cuda.current_stream(device_id).synchronize()


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
        return _bytes_as(shape, dtype, device)


def _bytes_as(shape: Sequence[int], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Uninitialized bytes viewed as a ``dtype`` tensor of ``shape``: what ``torch.empty``
    of a uint8 buffer gives under deterministic algorithms too (it fills bytes, which it
    can for every dtype)."""
    import torch

    n = math.prod(shape) * dtype.itemsize
    return torch.empty(n, dtype=torch.uint8, device=device).view(dtype).view(tuple(shape))


def empty_like_run_list(runs: Sequence[TensorRun], device: str = "cpu") -> list[torch.Tensor]:
    """Fresh tensors matching the runs (used when an object has no bytes to read)."""
    out: list[torch.Tensor] = []
    for run in runs:
        dt = torch_dtype(run.dtype)
        out.extend(empty_tensor(run.shape, dt, device) for _ in range(run.count))
    return out


# ---------------------------------------------------------------------------------------
# Blocks of device memory as tensors with their own lifetime (DLPack)
# ---------------------------------------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]
_DL_DEVICE = {"cpu": 1, "cuda": 2}
_live_blocks: dict[int, tuple[Any, Any, Callable[[], None] | None]] = {}


@_DELETER
def _dl_deleter(managed: Any) -> None:
    entry = _live_blocks.pop(ctypes.addressof(managed.contents), None)
    if entry is not None and entry[2] is not None:
        entry[2]()


def freeze_blocks_at_exit() -> None:
    """At interpreter exit: blocks still alive stop calling back into Python.

    A block's deleter is a Python callback. Tensors that outlive this point are freed
    while the interpreter tears itself down (module globals cleared first, the runtime
    later), or after it, from C++ destructors; a Python callback then raises inside
    finalization or crashes the process. So each live block's deleter becomes a C
    function that does nothing (``getpid`` ignores the pointer it is passed), and its
    DLPack record is kept alive for good, since torch reads the deleter when it frees
    the storage. Nothing is lost: the callbacks return leases and arena blocks of a
    process that is exiting. Runs from ``atexit`` (registered by the transport before
    its ``shutdown``, so after it).
    """
    addr = ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value
    if addr is None:
        return
    noop = _DELETER(addr)
    for managed, _shape, _on_free in list(_live_blocks.values()):
        managed.deleter = noop
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(managed))  # never freed: see above
    _live_blocks.clear()


_exit_hook_installed = False


def install_exit_hook() -> None:
    """Register :func:`freeze_blocks_at_exit` with ``atexit`` once per process."""
    global _exit_hook_installed
    if not _exit_hook_installed:
        import atexit

        atexit.register(freeze_blocks_at_exit)
        _exit_hook_installed = True


def device_block(addr: int, nbytes: int, device: str, device_id: int,
                 on_free: Callable[[], None] | None) -> torch.Tensor:
    """A uint8 tensor over raw memory ``[addr, addr+nbytes)`` whose storage is just that.

    Built through a DLPack capsule whose deleter runs ``on_free`` once torch frees the
    storage, i.e. when the last view of the block dies. This works for CUDA memory,
    where a numpy view of the region would not.
    """
    import torch.utils.dlpack

    managed = _DLManagedTensor()
    shape = (ctypes.c_int64 * 1)(nbytes)
    t = managed.dl_tensor
    t.data = addr
    t.device = _DLDevice(_DL_DEVICE[device], device_id)
    t.ndim = 1
    t.dtype = _DLDataType(1, 8, 1)  # kDLUInt, 8 bits, 1 lane
    t.shape = shape
    t.strides = None
    t.byte_offset = 0
    managed.deleter = _dl_deleter
    _live_blocks[ctypes.addressof(managed)] = (managed, shape, on_free)
    capsule_new = ctypes.pythonapi.PyCapsule_New
    capsule_new.restype = ctypes.py_object
    capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule: Any = None
    try:
        capsule = capsule_new(ctypes.addressof(managed), b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        # No tensor took the capsule (torch renames the one it takes): nothing will call
        # the deleter, so the memory's owner is told now (a Ctrl-C, say).
        valid = ctypes.pythonapi.PyCapsule_IsValid
        valid.restype = ctypes.c_int
        valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
        if capsule is None or valid(capsule, b"dltensor"):
            entry = _live_blocks.pop(ctypes.addressof(managed), None)
            if entry is not None and entry[2] is not None:
                entry[2]()
        raise


def pack_torch(tensors: Sequence[torch.Tensor], d: Described, offsets: Sequence[int],
               block: torch.Tensor, which: Sequence[int] | None = None, *, threads: int = 1,
               threshold: int = _PACK_THRESHOLD) -> None:
    """Copy tensors into one device block with a single batched torch op.

    Used where memmove cannot reach (CUDA memory) and for tensors converted to another
    dtype on the way (``d.dtypes`` names the packed dtype): ``torch._foreach_copy_``
    issues the copies of all tensors as one operation instead of one ``copy_`` per
    tensor, converting as it copies. Strided sources are fine: torch copies their
    logical values.

    Consecutive tensors that are evenly spaced views of one storage (the rows of a
    matrix, say), landing evenly spaced in the block, are copied as one strided tensor:
    10,000 row views cost one copy, not 10,000 (see :func:`_strided_groups`).

    Threads: on a CPU block with ``threads`` > 1 and at least ``threshold`` bytes to
    write, the copies are cut into pieces of a few MiB along their first dimension and
    run on the calling thread and pack helpers (torch releases the GIL while it copies;
    a dtype conversion runs at a fraction of memcpy speed, so it gains the most).
    """
    import torch

    idx = [i for i in (range(len(tensors)) if which is None else which) if d.nbytes[i]]
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for first, k, src_step, dst_step in _strided_groups(tensors, d, offsets, idx):
        t = tensors[first]
        # The described dtype: it differs from t.dtype when the pack converts (pack_as).
        dt = torch_dtype(d.dtypes[first])
        n = d.nbytes[first]
        o = offsets[first]
        if k == 1:
            dsts.append(block[o:o + n].view(dt).view(t.shape))
            srcs.append(_logical(t, first))
            continue
        item = t.element_size()
        span = block[o:o + dst_step * (k - 1) + n].view(dt)
        dsts.append(span.as_strided((k, *t.shape),
                                    (dst_step // item, *_contiguous_strides(tuple(t.shape)))))
        srcs.append(t.as_strided((k, *t.shape), (src_step // item, *t.stride()),
                                 t.storage_offset()))
    if not dsts:
        return
    if threads > 1 and block.device.type == "cpu" and sum(
            t.nbytes for t in dsts) >= threshold:
        _copy_pieces(dsts, srcs, threads)
        return
    with torch.no_grad():  # bytes only: never record autograd history on the pool
        torch._foreach_copy_(dsts, srcs)


def _copy_pieces(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor],
                 threads: int) -> None:
    """``dst.copy_(src)`` for each pair, cut along dim 0 into pieces of about
    ``_PACK_CHUNK`` destination bytes, on up to ``threads`` threads (caller)."""
    import torch

    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in zip(dsts, srcs):
        rows = dst.shape[0] if dst.dim() else 0
        per_row = dst.nbytes // rows if rows else 0
        step = max(1, _PACK_CHUNK // per_row) if per_row else 0
        if rows < 2 or step >= rows:
            pieces.append((dst, src))
            continue
        for a in range(0, rows, step):
            pieces.append((dst[a:a + step], src[a:a + step]))

    def copy(unit: Sequence[_Move]) -> None:
        with torch.no_grad():  # per thread: grad mode is thread-local
            for i, _, _ in unit:
                dst, src = pieces[i]
                dst.copy_(src)

    _run_job(_PackJob([[(i, 0, 0)] for i in range(len(pieces))], batch=copy), threads)


def _strided_groups(tensors: Sequence[torch.Tensor], d: Described, offsets: Sequence[int],
                    idx: Sequence[int]) -> Iterator[tuple[int, int, int, int]]:
    """Cut ``idx`` into groups ``(first index, count, source step, block step)``.

    A group of more than one holds consecutive tensors of one storage extent with the same
    shape, strides and dtype (packed as their own dtype, no lazy conjugate or negation),
    whose addresses advance by the same positive step, a multiple of the item size, and
    whose block offsets advance by another: one ``as_strided`` view covers each side.
    Anything else is a group of one.
    """
    i = 0
    while i < len(idx):
        a = idx[i]
        t = tensors[a]
        k = 1
        src_step = dst_step = 0
        if _groupable(t, d, a) and i + 1 < len(idx):
            item = t.element_size()
            storage = None
            while i + k < len(idx):
                b, prev = idx[i + k], idx[i + k - 1]
                u = tensors[b]
                s_step = d.ptrs[b] - d.ptrs[prev]
                o_step = offsets[b] - offsets[prev]
                if k == 1:
                    if s_step <= 0 or s_step % item or o_step <= 0 or o_step % item:
                        break
                    src_step, dst_step = s_step, o_step
                elif s_step != src_step or o_step != dst_step:
                    break
                if (d.shapes[b] != d.shapes[a] or u.dtype != t.dtype
                        or d.dtypes[b] != d.dtypes[a] or u.stride() != t.stride()
                        or not _groupable(u, d, b)):
                    break
                if storage is None:
                    storage = _extent(t)
                if _extent(u) != storage:
                    break
                k += 1
        yield a, k, src_step, dst_step
        i += k


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t``'s storage lies: its base address and size. Two storage objects can
    share a base address and differ in size (``torch.from_numpy`` of an array and of a
    slice of it), and an ``as_strided`` view over the smaller one cannot reach the
    other's tensors; storages of one extent are the same bytes, whatever object holds
    them."""
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _groupable(t: torch.Tensor, d: Described, i: int) -> bool:
    return (dtype_name(t.dtype) == d.dtypes[i] and not t.is_conj() and not t.is_neg()
            and t.numel() > 0)
