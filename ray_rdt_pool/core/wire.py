"""The versioned object metadata sent from sender to receiver, and its msgpack codec.

Pure (stdlib and msgpack; never pickle, so a peer's bytes cannot run code here). The
sender describes an object as a :class:`WireMeta`: who holds the bytes (NIXL agent
name and registration epoch), on which device, the tensors as runs of equal
``(shape, dtype)`` gathered into repeated *groups*, and the *segments* mapping the
object's packed space (see :mod:`ray_rdt_pool.core.layout`) onto the sender's registered
memory. Tensor offsets are not sent: both sides derive them from the groups with
:func:`~ray_rdt_pool.core.layout.group_layout`.

Encoding (version 2), a msgpack array of :data:`_NFIELDS` items::

    [version, agent, agent_version, device, device_id, total, groups, segments]

``groups`` is one flat int array holding, per group, ``repeat, nruns`` and then its
``nruns`` runs, each ``ndim, dim_0 .. dim_{ndim-1}, dtype_code, count``: the runs are
sent once and stand for ``repeat`` back-to-back repetitions. ``segments`` is one flat
int array of ``virt_off, addr, length`` triples. msgpack stores each int in 1 to 9
bytes by magnitude, so the size is about ``40 + len(agent) + sum over groups of (2 +
sum over their runs of (3 + the dims' int sizes)) + at most 27 per segment`` bytes.

The encoder (:func:`runs_from`, or :func:`group_runs` for a sequence of runs) finds
repeated patterns itself, in time linear in the tensors: an RL batch sent per sample
(1,024 x 5 tensors of alternating shapes), 10,000 row views of one weight, or a state
dict that repeats one layer's pattern, each encode in under 200 bytes, and one field of
a repeated pattern is a regular strided array of the packed block (from the second
repetition on, and from the first unless it lies off the grid: see
:mod:`ray_rdt_pool.core.layout`). 10,000 *different*
2-D shapes with dims below 65,536 still take at most 9 bytes per run, under 100 KB in
all (the tests hold these bounds).

:func:`decode` trusts nothing: every field is type- and range-checked, counts are
bounded (:data:`MAX_TENSORS`) before anything is expanded, the packed total is
recomputed from the groups, and the segments must cover every byte of every non-empty
tensor, so a receiver never reads outside what the sender described. Its work is linear
in the size of the message, never in the number of tensors it stands for.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import msgpack

from ray_rdt_pool.core.layout import (
    Placed,
    Spec,
    group_layout,
    group_offsets,
    group_run_starts,
)
from ray_rdt_pool.errors import InvalidInputError, WireFormatError

__all__ = [
    "DTYPES",
    "DTYPE_BY_CODE",
    "MAX_DIMS",
    "MAX_TENSORS",
    "WIRE_VERSION",
    "RunGroup",
    "Runs",
    "TensorRun",
    "WireMeta",
    "decode",
    "encode",
    "group_runs",
    "runs_from",
]

#: Format version; bump it on any change to the encoding. decode() rejects others.
#: 2: runs travel in repeated groups (version 1 sent every run).
WIRE_VERSION = 2

#: Most dimensions a tensor may have. torch 2.13 builds more on the CPU, but its CUDA
#: kernels and many operators take at most 64 (a put of more is an InvalidInputError).
MAX_DIMS = 64

#: Most tensors one object may hold, 2**20. It bounds the work a malformed or
#: hostile message can cause on the receiver (offsets are expanded per tensor) while
#: staying far above real objects (a model's state dict has thousands). decode()
#: checks it before expanding anything, and a group's repeat is bounded by it too.
MAX_TENSORS = 1_048_576

#: Longest string accepted (the agent name and the device).
MAX_STR_LEN = 4096

#: Canonical dtype name (torch's, without "torch.") -> (wire code, item size in bytes).
#: The codes are part of the wire format: never renumber or reuse one; append new
#: dtypes with fresh codes.
DTYPES: dict[str, tuple[int, int]] = {
    "bool": (1, 1),
    "uint8": (2, 1),
    "int8": (3, 1),
    "int16": (4, 2),
    "int32": (5, 4),
    "int64": (6, 8),
    "uint16": (7, 2),
    "uint32": (8, 4),
    "uint64": (9, 8),
    "float16": (10, 2),
    "bfloat16": (11, 2),
    "float32": (12, 4),
    "float64": (13, 8),
    "complex32": (14, 4),
    "complex64": (15, 8),
    "complex128": (16, 16),
    "float8_e4m3fn": (17, 1),
    "float8_e5m2": (18, 1),
    "float8_e4m3fnuz": (19, 1),
    "float8_e5m2fnuz": (20, 1),
    "float8_e8m0fnu": (21, 1),
    # Two 4-bit values packed per byte; torch counts one element per byte.
    "float4_e2m1fn_x2": (22, 1),
}

#: Wire code -> canonical dtype name.
DTYPE_BY_CODE: dict[int, str] = {code: name for name, (code, _) in DTYPES.items()}

_DEVICES = ("cpu", "cuda")
_NFIELDS = 8
_U64 = 1 << 64
_I64 = 1 << 63

_T = TypeVar("_T")


@dataclass(frozen=True)
class TensorRun:
    """``count`` consecutive tensors of the same shape and dtype."""

    shape: tuple[int, ...]
    dtype: str
    count: int

    def __post_init__(self) -> None:
        # torch.Size and lists compare unequal to the tuples decode() returns;
        # normalising keeps a round trip equal.
        if type(self.shape) is not tuple:
            object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def itemsize(self) -> int:
        """Bytes per element (also the alignment of each tensor)."""
        return DTYPES[self.dtype][1]

    @property
    def numel(self) -> int:
        """Elements per tensor."""
        return math.prod(self.shape)

    @property
    def nbytes_each(self) -> int:
        """Bytes per tensor."""
        return math.prod(self.shape) * DTYPES[self.dtype][1]

    @property
    def spec(self) -> Spec:
        """``(nbytes_each, align, count)``, the run as :mod:`ray_rdt_pool.core.layout` sees it."""
        itemsize = DTYPES[self.dtype][1]
        return math.prod(self.shape) * itemsize, itemsize, self.count


@dataclass(frozen=True)
class RunGroup:
    """The runs of one repetition of a pattern, repeated ``repeat`` times back to back.

    ``repeat == 1`` is a plain stretch of runs. The repetitions of a group are uniform
    from the second on (see :mod:`ray_rdt_pool.core.layout`).
    """

    runs: tuple[TensorRun, ...]
    repeat: int = 1

    def __post_init__(self) -> None:
        if type(self.runs) is not tuple:
            object.__setattr__(self, "runs", tuple(self.runs))

    @property
    def tensors_per_repeat(self) -> int:
        """Tensors in one repetition."""
        return sum(r.count for r in self.runs)

    @property
    def num_tensors(self) -> int:
        """Tensors in all repetitions."""
        return self.tensors_per_repeat * self.repeat

    def specs(self) -> list[Spec]:
        """The runs of one repetition as layout specs."""
        return [r.spec for r in self.runs]


_Layout = tuple[list[Placed], int]


class Runs(Sequence[TensorRun]):
    """The runs of an object in order, held compactly as :class:`RunGroup` s.

    It is a ``Sequence[TensorRun]`` of the expanded runs (a group of ``m`` runs repeated
    ``R`` times counts ``m * R``), equal to any sequence holding the same runs, so
    code written for a tuple of runs keeps working; that expansion is built only when
    indexed. Everything else (:meth:`layout`, :meth:`tensor_offsets`,
    :meth:`map_tensors`, ``num_tensors``) works group by group.
    """

    __slots__ = ("_flat", "_groups", "_len", "_placed", "num_tensors")

    def __init__(self, groups: Iterable[RunGroup], *, placed: _Layout | None = None) -> None:
        self._groups: tuple[RunGroup, ...] = tuple(groups)
        self._len = sum(len(g.runs) * g.repeat for g in self._groups)
        #: Tensors in the object.
        self.num_tensors: int = sum(g.num_tensors for g in self._groups)
        self._flat: tuple[TensorRun, ...] | None = None
        self._placed = placed

    @property
    def groups(self) -> tuple[RunGroup, ...]:
        """The groups, in order."""
        return self._groups

    def _expanded(self) -> tuple[TensorRun, ...]:
        if self._flat is None:
            flat: list[TensorRun] = []
            for g in self._groups:
                flat.extend(g.runs * g.repeat)  # references to the same runs: C-level
            self._flat = tuple(flat)
        return self._flat

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> TensorRun: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[TensorRun, ...]: ...

    def __getitem__(self, i: int | slice) -> TensorRun | tuple[TensorRun, ...]:
        return self._expanded()[i]

    def __iter__(self) -> Iterator[TensorRun]:
        if self._flat is not None:
            return iter(self._flat)
        return (r for g in self._groups for _ in range(g.repeat) for r in g.runs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Runs):
            if self._groups == other._groups:
                return True
            return self._len == other._len and self._expanded() == other._expanded()
        if isinstance(other, (tuple, list)):
            return self._len == len(other) and self._expanded() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._expanded())  # as the equal tuple's

    def __repr__(self) -> str:
        return f"Runs({list(self._groups)!r})"

    def layout(self) -> _Layout:
        """:func:`~ray_rdt_pool.core.layout.group_layout` of the groups (computed once).

        Raises:
            ValueError: for an invalid run or repeat.
        """
        if self._placed is None:
            self._placed = group_layout([(g.specs(), g.repeat) for g in self._groups])
        return self._placed

    def run_starts(self) -> list[int]:
        """Packed offset of the first tensor of every run, expanded."""
        out: list[int] = []
        for placed, g in zip(self.layout()[0], self._groups):
            out += group_run_starts(placed, g.repeat)
        return out

    def tensor_offsets(self) -> list[int]:
        """Packed offset of every tensor, in order."""
        out: list[int] = []
        for placed, g in zip(self.layout()[0], self._groups):
            out += group_offsets(g.specs(), placed, g.repeat)
        return out

    def map_tensors(self, f: Callable[[TensorRun], _T]) -> list[_T]:
        """``f(run)`` for every tensor, in order, calling ``f`` once per run of a pattern
        and replicating the results (C-level list repetition, not a step per tensor)."""
        out: list[_T] = []
        for g in self._groups:
            rep: list[_T] = []
            for run in g.runs:
                rep += [f(run)] * run.count
            out += rep * g.repeat
        return out


@dataclass(frozen=True)
class WireMeta:
    """What a receiver needs to read one object from the sender's memory.

    Attributes:
        agent: The sender's NIXL agent name.
        agent_version: The sender's registration epoch (>= 0); a receiver holding
            older remote metadata for ``agent`` must refresh it.
        device: "cpu" or "cuda".
        device_id: Device index on the sender.
        total: Packed size of the object, the total of the layout.
        runs: The tensors in order, as runs of equal shape and dtype: a :class:`Runs`
            (what :func:`runs_from` and :func:`decode` return) or any sequence of
            :class:`TensorRun`, grouped on first use.
        segments: ``(virt_off, remote_addr, length)`` triples sorted by
            ``virt_off``, non-overlapping: the bytes of packed range
            ``[virt_off, virt_off + length)`` live at ``remote_addr`` in the
            sender's registered memory.
    """

    agent: str
    agent_version: int
    device: str
    device_id: int
    total: int
    runs: Sequence[TensorRun]
    segments: tuple[tuple[int, int, int], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.runs, (Runs, tuple)):
            object.__setattr__(self, "runs", tuple(self.runs))

    @property
    def grouped(self) -> Runs:
        """The runs as a :class:`Runs` (grouped with :func:`group_runs` once if needed)."""
        runs = self.runs
        if isinstance(runs, Runs):
            return runs
        cached: Runs | None = self.__dict__.get("_grouped")
        if cached is None:
            cached = group_runs(runs)
            object.__setattr__(self, "_grouped", cached)  # a cache, not a field
        return cached

    @property
    def groups(self) -> tuple[RunGroup, ...]:
        """The runs gathered into repeated groups, as the wire carries them."""
        return self.grouped.groups

    @property
    def num_tensors(self) -> int:
        """Number of tensors in the object."""
        return self.grouped.num_tensors

    def run_starts(self) -> list[int]:
        """Packed offset of the first tensor of each run (of ``runs``, expanded)."""
        return self.grouped.run_starts()

    def tensor_offsets(self) -> list[int]:
        """Packed offset of every tensor, in order."""
        return self.grouped.tensor_offsets()

    def shapes_dtypes(self) -> Iterator[tuple[tuple[int, ...], str]]:
        """``(shape, dtype)`` of every tensor, in order."""
        return iter(self.grouped.map_tensors(_shape_dtype))

    def map_tensors(self, f: Callable[[TensorRun], _T]) -> list[_T]:
        """``f(run)`` for every tensor, in order, computed once per distinct run."""
        return self.grouped.map_tensors(f)


def _shape_dtype(run: TensorRun) -> tuple[tuple[int, ...], str]:
    return run.shape, run.dtype


# ---------------------------------------------------------------------------------------
# Finding repeats (sender side)
# ---------------------------------------------------------------------------------------


def _repeats(items: list[Any], start: int, p: int, n: int) -> int:
    """How many times ``items[start:start + p]`` occurs back to back from ``start``.

    Galloping: compare 1, 2, 4, ... further repetitions at once with one C-level list
    comparison each, then binary-search the rest, so finding ``r`` repetitions costs
    O(log r) Python steps and O(r * p) C-level element comparisons.
    """
    pat = items[start:start + p]
    r = 1
    w = 1
    while True:
        at = start + r * p
        w = min(w, (n - at) // p)
        if not w or items[at:at + w * p] != pat * w:
            break
        r += w
        w *= 2
    # Fewer than w repetitions follow from `at`: binary search for their number, each
    # step comparing only the repetitions not yet confirmed.
    lo, hi = 0, w
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if items[at + lo * p:at + mid * p] == pat * (mid - lo):
            lo = mid
        else:
            hi = mid
    return r + lo


#: Earlier element runs of the same item tried as the start of a pattern, newest first.
_CANDIDATES = 4

#: How far past a match the search goes on for a longer pattern around it (items, at
#: least; or as far again as the match covers), before the match is taken.
_LOOKAHEAD = 64


def _element_runs(items: list[Any], a: int, b: int) -> list[tuple[int, int]]:
    """The maximal stretches ``(start, length)`` of equal consecutive items in ``[a, b)``."""
    out: list[tuple[int, int]] = []
    i = a
    while i < b:
        j = i + 1
        if j < b and items[j] == items[i]:
            j = i + _repeats(items, i, 1, b)
        out.append((i, j - i))
        i = j
    return out


def _find_repeats(items: list[Any]) -> list[tuple[list[tuple[int, int]], int]]:
    """Split ``items`` into ``(element runs of one repetition, repeat)`` entries, in order.

    An element run ``(start, length)`` is a maximal stretch of equal consecutive items.
    One greedy pass over the element runs: at each, the stretches since the latest few
    earlier element runs of the same item (within the current plain stretch) are
    candidate patterns; one that occurs again right away is a *match*, with all its
    back-to-back repetitions. The match reaching furthest is kept, but taken only once
    the scan is :data:`_LOOKAHEAD` items (or its own length) past it without finding
    one that reaches further: a layer pattern holding a short repeat of its own (weight,
    bias, weight, bias, ...) is then found as the layer, not as the short repeat. The
    scan jumps over the repetitions of a match, and a group never ends inside an element
    run, so its runs are exactly the object's runs.

    Cost: a few Python steps (and one hash) per element run outside repeated patterns
    (a stretch may be scanned again after a match inside it is taken), and C-level list
    comparisons, about one per item per candidate, inside them. Items must be hashable
    and comparable with ``==``.
    """
    n = len(items)
    entries: list[tuple[list[tuple[int, int]], int]] = []
    pend: list[tuple[int, int]] = []  # element runs scanned since the last entry
    last: dict[Any, list[int]] = {}  # item -> indices in pend of its element runs
    best: tuple[int, int, int, int] | None = None  # (pend index, start, period, repeat)
    best_end = deadline = 0
    i = 0
    while True:
        if best is not None and (i >= n or i >= deadline):
            k, first, p, r = best
            before = _runs_before(items, pend, k, first)
            if before:
                entries.append((before, 1))
            entries.append((_element_runs(items, first, first + p), r))
            i = best_end
            pend = []
            last.clear()
            best = None
            continue
        if i >= n:
            break
        x = items[i]
        j = i + 1
        if j < n and items[j] == x:
            j = i + _repeats(items, i, 1, n)
        seen = last.get(x)
        found: tuple[int, int, int, int] | None = None
        found_end = 0
        if seen is not None:
            for k in seen[-1:-_CANDIDATES - 1:-1]:
                first = pend[k][0]
                p = i - first
                # A cheap probe before the full comparisons inside _repeats.
                if i + p > n or items[i + p - 1] != items[i - 1]:
                    continue
                r = _repeats(items, first, p, n)
                end = first + r * p
                if r >= 2 and end < n and items[end] == items[end - 1]:
                    r -= 1  # the last run goes on past the pattern: leave that repetition
                    end -= p
                if r >= 2 and end > found_end:
                    found, found_end = (k, first, p, r), end
            seen.append(len(pend))
        else:
            last[x] = [len(pend)]
        pend.append((i, j - i))
        i = j
        if found is not None and (best is None or found_end > best_end):
            if best is not None and found[1] >= best_end:
                # A later, separate match: the scan goes on to the deadline all the same,
                # since a longer pattern may start before the kept one and cover both
                # (a layer holding two short repeats of its own); once the kept one is
                # taken, the scan resumes at its end and finds this one again.
                continue
            best, best_end = found, found_end
            deadline = best_end + max(_LOOKAHEAD, best_end - found[1])
            i = max(i, best_end)  # jump over its repetitions
    if pend:
        entries.append((pend, 1))
    return entries


def _runs_before(items: list[Any], pend: list[tuple[int, int]], k: int, first: int
                 ) -> list[tuple[int, int]]:
    """The element runs from the start of ``pend`` up to ``first``, with no gap.

    ``pend[:k]`` are the scanned element runs before the match at ``first``, but the
    scan jumps over the repetitions of a match it keeps, and a later match that starts
    inside those repetitions replaces it: the jumped-over stretch then lies before
    ``first`` and in no element run of ``pend``. It is split into element runs here, so
    no item is ever left out of the groups.
    """
    if not pend:
        return []
    out: list[tuple[int, int]] = []
    at = pend[0][0]
    for start, length in pend[:k]:
        if start > at:
            out += _element_runs(items, at, start)
        out.append((start, length))
        at = start + length
    if first > at:
        out += _element_runs(items, at, first)
    return out


def group_runs(runs: Sequence[TensorRun]) -> Runs:
    """Gather a sequence of runs into repeated groups (the runs stay as they are)."""
    if isinstance(runs, Runs):
        return runs
    items = list(runs)
    entries: list[RunGroup] = []
    for element_runs, repeat in _find_repeats(items):
        pattern: list[TensorRun] = []
        for start, length in element_runs:
            pattern += items[start:start + length]
        entries.append(RunGroup(tuple(pattern), repeat))
    out = Runs(entries)
    if out != items:  # as in runs_from: a lost run would shift every later offset
        raise WireFormatError(
            f"internal error: the encoder's grouping of {len(items)} runs does not give "
            "them back; nothing was sent. Please report this bug with the object's "
            "shapes and dtypes")
    return out


def runs_from(shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> Runs:
    """Group consecutive equal ``(shape, dtype)`` pairs into runs, and repeated patterns
    of runs into groups.

    Linear in the tensors: Python steps only where the runs do not repeat, C-level list
    comparisons where they do (about 0.1 ms per thousand tensors of a repeated pattern).

    Raises:
        InvalidInputError: if the sequences differ in length, or for an unknown
            dtype name, a negative or non-int dim, or more than MAX_DIMS dims.
    """
    if len(shapes) != len(dtypes):
        raise InvalidInputError(f"{len(shapes)} shapes but {len(dtypes)} dtypes")
    # One tuple per distinct pair: equal items then compare by identity, and an object of
    # thousands of tensors keeps only as many tuples alive as it has kinds of tensor.
    # (Thousands of live tuples survive the cyclic GC's young passes into its oldest
    # generation, and the full passes that follow walk a Ray worker's whole heap: 100+ ms.)
    items: list[Any]
    if _one_kind(shapes, dtypes):
        # Every tensor alike (the rows of one weight, a list of equal buffers): counting
        # compares by identity first, and the describe helper hands equal shapes over as
        # one object, so this costs far less than hashing a pair per tensor.
        items = [(shapes[0], dtypes[0])] * len(shapes)
    else:
        canon: dict[Any, Any] = {}
        try:
            items = [canon.setdefault(p, p) for p in zip(shapes, dtypes)]
        except TypeError:  # an unhashable shape, such as a list
            items = [canon.setdefault(p, p) for p in zip(map(tuple, shapes), dtypes)]
    entries: list[RunGroup] = []
    found = _find_repeats(items)
    for element_runs, repeat in found:
        pattern: list[TensorRun] = []
        for start, length in element_runs:
            shape, dtype = items[start]
            if dtype not in DTYPES:
                raise InvalidInputError(
                    f"tensor {start}: unsupported dtype {dtype!r}; "
                    f"supported: {', '.join(DTYPES)}"
                )
            pattern.append(TensorRun(_checked_shape(shape), dtype, length))
        entries.append(RunGroup(tuple(pattern), repeat))
    out = Runs(entries)
    # A tensor left out or misplaced here would shift every later tensor's offset:
    # wrong bytes at the receiver, not an error. So the grouping is checked against
    # the input, tensor by tensor (C-level list work, about 0.05 ms per thousand).
    if out.map_tensors(_shape_dtype) != items:
        raise WireFormatError(
            f"internal error: the encoder's grouping of {len(items)} tensors does not "
            f"give them back ({out.num_tensors} grouped); nothing was sent. Please report "
            "this bug with the object's shapes and dtypes")
    return out


def _one_kind(shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> bool:
    """Whether all of two or more tensors share one tuple shape and one dtype (C-level
    counts; a list shape takes the general path, which makes it a tuple)."""
    if len(shapes) < 2 or not isinstance(shapes[0], tuple):
        return False
    return (shapes.count(shapes[0]) == len(shapes)
            and dtypes.count(dtypes[0]) == len(dtypes))


def _checked_shape(shape: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(shape)
    # Fast path for the usual torch.Size of plain non-negative ints.
    for d in dims:
        if type(d) is not int or d < 0:
            break
    else:
        if len(dims) <= MAX_DIMS:
            return dims
    try:
        dims = tuple(map(operator.index, shape))
    except TypeError as e:
        raise InvalidInputError(f"shape {shape!r} has a non-integer dimension") from e
    if len(dims) > MAX_DIMS or any(d < 0 for d in dims):
        raise InvalidInputError(
            f"shape {shape!r} must have at most {MAX_DIMS} non-negative dimensions"
        )
    return dims


# ---------------------------------------------------------------------------------------
# The codec
# ---------------------------------------------------------------------------------------


def encode(meta: WireMeta) -> bytes:
    """Serialise ``meta`` (msgpack, no pickle), its runs gathered into repeated groups.

    The result is checked exactly as :func:`decode` would check it, so a sender
    bug surfaces on the sender. Cost: linear in the groups' runs (the message size).

    Raises:
        WireFormatError: if ``meta`` is not valid (decode would reject it).
    """
    try:
        flat: list[int] = []
        for g in meta.grouped.groups:
            flat += (g.repeat, len(g.runs))
            for run in g.runs:
                flat.append(len(run.shape))
                flat.extend(run.shape)
                flat += (DTYPES[run.dtype][0], run.count)
        segs_flat: list[int] = []
        for seg in meta.segments:
            virt_off, addr, length = seg
            segs_flat += (virt_off, addr, length)
        raw = [
            WIRE_VERSION,
            meta.agent,
            meta.agent_version,
            meta.device,
            meta.device_id,
            meta.total,
            flat,
            segs_flat,
        ]
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise WireFormatError(f"cannot encode object metadata: {e!r}") from e
    _parse(raw)
    packed: bytes = msgpack.packb(raw, use_bin_type=True)
    return packed


def decode(data: bytes) -> WireMeta:
    """Parse and validate metadata produced by :func:`encode` on the sender.

    Raises:
        WireFormatError: for anything but a valid message of this WIRE_VERSION.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError(
            f"object metadata must be bytes, got {type(data).__name__}"
        )
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            # Each array item takes at least one byte, so this never rejects a
            # valid message; no map, bin or ext appears in the format at all.
            max_array_len=len(data),
            max_str_len=MAX_STR_LEN,
            max_bin_len=0,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as e:
        # unpackb raises several unrelated types (ExtraData, FormatError,
        # StackError, UnicodeDecodeError, ValueError on truncation or limits);
        # any of them means the bytes are not a message.
        raise WireFormatError(
            f"object metadata is not valid msgpack ({type(e).__name__}: {e}); "
            f"it was truncated or corrupted, or a string or array exceeds the limits"
        ) from e
    return _parse(raw)


def _bad(what: str) -> WireFormatError:
    return WireFormatError(f"malformed object metadata: {what}")


def _int_in(value: Any, field: str, lo: int, hi: int) -> int:
    """``value`` if it is an int (not a bool) in ``[lo, hi)``."""
    if type(value) is not int:
        raise _bad(f"{field} must be an int, got {type(value).__name__}")
    if not lo <= value < hi:
        raise _bad(f"{field} is {value}, outside [{lo:,}, {hi:,})")
    return value


def _parse(raw: Any) -> WireMeta:
    """Build a WireMeta from the unpacked message, checking every field."""
    if type(raw) is not list or not raw:
        raise _bad(f"expected a non-empty array, got {type(raw).__name__}")
    version = raw[0]
    if type(version) is not int:
        raise _bad(f"the version must be an int, got {type(version).__name__}")
    if version != WIRE_VERSION:
        # Checked before the field count: another version may have other fields.
        raise WireFormatError(
            f"object metadata has wire format version {version}, but this ray_rdt_pool "
            f"reads version {WIRE_VERSION}; install the same ray_rdt_pool version on "
            f"the sender and the receiver"
        )
    if len(raw) != _NFIELDS:
        raise _bad(f"expected {_NFIELDS} fields, got {len(raw)}")
    _, agent, agent_version, device, device_id, total, groups_flat, segs_flat = raw
    if type(agent) is not str or not agent:
        raise _bad(f"agent must be a non-empty str, got {agent!r:.80}")
    try:  # decode's limit is in UTF-8 bytes; a lone surrogate has no UTF-8 at all
        agent_bytes = len(agent.encode())
    except UnicodeEncodeError as e:
        raise _bad(f"agent {agent!r:.80} is not valid Unicode ({e.reason})") from e
    if agent_bytes > MAX_STR_LEN:
        raise _bad(f"agent is {agent_bytes:,} bytes long, over the limit of {MAX_STR_LEN:,}")
    _int_in(agent_version, "agent_version", 0, _U64)
    if type(device) is not str or device not in _DEVICES:
        raise _bad(f"device must be one of {_DEVICES}, got {device!r:.80}")
    _int_in(device_id, "device_id", 0, 1 << 31)
    _int_in(total, "total", 0, _U64)
    if type(groups_flat) is not list:
        raise _bad(f"runs must be an array, got {type(groups_flat).__name__}")
    if type(segs_flat) is not list:
        raise _bad(f"segments must be an array, got {type(segs_flat).__name__}")

    groups = _parse_groups(groups_flat)
    try:
        placed, layout_total = group_layout([(g.specs(), g.repeat) for g in groups])
    except ValueError as e:
        raise _bad(str(e)) from None
    if layout_total != total:
        raise _bad(f"total is {total:,} but the runs pack into {layout_total:,} bytes")
    segments = _parse_segments(segs_flat, total)
    _check_coverage(groups, placed, segments)
    return WireMeta(
        agent=agent,
        agent_version=agent_version,
        device=device,
        device_id=device_id,
        total=total,
        runs=Runs(groups, placed=(placed, layout_total)),
        segments=tuple(segments),
    )


def _parse_groups(flat: list[Any]) -> list[RunGroup]:
    groups: list[RunGroup] = []
    n = len(flat)
    i = 0
    r = 0  # runs parsed so far, for messages
    tensors = 0
    while i < n:
        g = len(groups)
        if i + 2 > n:
            raise _bad(f"group {g}: the runs array ends inside the group header")
        repeat, nruns = flat[i], flat[i + 1]
        if type(repeat) is not int or not 1 <= repeat <= MAX_TENSORS:
            raise _bad(f"group {g}: repeat must be an int in [1, {MAX_TENSORS:,}], "
                       f"got {repeat!r:.40}")
        # Each run takes at least 3 ints (ndim, dtype code, count).
        if type(nruns) is not int or not 1 <= nruns <= (n - i - 2) // 3:
            raise _bad(f"group {g}: the number of runs must be an int in [1, "
                       f"{(n - i - 2) // 3}] (what the array holds), got {nruns!r:.40}")
        i += 2
        runs: list[TensorRun] = []
        per_repeat = 0
        for _ in range(nruns):
            ndim = flat[i] if i < n else None
            if type(ndim) is not int or not 0 <= ndim <= MAX_DIMS:
                raise _bad(f"run {r}: the number of dims must be an int in [0, {MAX_DIMS}], "
                           f"got {ndim!r:.40}")
            j = i + 1 + ndim
            if j + 2 > n:
                raise _bad(f"run {r}: the runs array ends inside the run")
            dims = flat[i + 1 : j]
            for d in dims:
                if type(d) is not int or not 0 <= d < _I64:
                    raise _bad(f"run {r}: a dim must be an int in [0, 2**63), got {d!r:.40}")
            code = flat[j]
            if type(code) is not int or code not in DTYPE_BY_CODE:
                raise _bad(f"run {r}: unknown dtype code {code!r:.40}")
            # Zero dims make the byte count 0, so the layout checks pass any other dims;
            # a shape whose nonzero dims reach 2**63 bytes is refused here, before torch
            # meets it at the receiver with an untyped error. torch itself builds some of
            # them ((0, 2**62) float32: its limits count elements), so such a put is
            # refused too, typed; no real tensor has such a shape.
            span = DTYPES[DTYPE_BY_CODE[code]][1]
            for d in dims:
                span *= d or 1
            if span >= _I64:
                raise _bad(f"run {r}: the dims {tuple(dims)!r:.80} span {span:,} bytes or "
                           "more once their zeros are left out; torch holds at most "
                           "2**63 - 1")
            count = flat[j + 1]
            if type(count) is not int or count < 1:
                raise _bad(f"run {r}: count must be an int >= 1, got {count!r:.40}")
            per_repeat += count
            # Checked per run, before anything is expanded: a tiny message cannot
            # stand for more tensors than a real object may hold.
            if tensors + per_repeat * repeat > MAX_TENSORS:
                raise _bad(f"more than {MAX_TENSORS:,} tensors in one object")
            runs.append(TensorRun(tuple(dims), DTYPE_BY_CODE[code], count))
            i = j + 2
            r += 1
        tensors += per_repeat * repeat
        groups.append(RunGroup(tuple(runs), repeat))
    return groups


def _parse_segments(flat: list[Any], total: int) -> list[tuple[int, int, int]]:
    if len(flat) % 3:
        raise _bad(f"the segments array holds {len(flat)} ints, not a multiple of 3")
    segments: list[tuple[int, int, int]] = []
    prev_end = 0
    for k in range(0, len(flat), 3):
        v, a, n = flat[k], flat[k + 1], flat[k + 2]
        s = k // 3
        if type(v) is not int or type(a) is not int or type(n) is not int:
            raise _bad(f"segment {s}: fields must be ints")
        if n <= 0:
            raise _bad(f"segment {s}: length must be positive, got {n}")
        if v < prev_end:
            raise _bad(f"segment {s}: starts at {v:,}, before the end {prev_end:,} of the "
                       f"previous one (segments must be sorted and disjoint)")
        if v + n > total:
            raise _bad(f"segment {s}: [{v:,}, {v + n:,}) reaches past the total {total:,}")
        if a < 0 or a + n > _U64:
            raise _bad(f"segment {s}: address range [{a:#x}, +{n:,}) is outside 64 bits")
        segments.append((v, a, n))
        prev_end = v + n
    return segments


def _check_coverage(
    groups: list[RunGroup],
    placed: list[Placed],
    segments: list[tuple[int, int, int]],
) -> None:
    """Every byte of every non-empty tensor must lie in some segment.

    Works on the *gaps* (packed ranges no segment covers) instead of on the tensors: a
    gap is checked against the uniform pieces of the groups it meets, and inside a
    piece it can only meet the repetition it starts in and the next one (a gap as long
    as the stride would meet every run), so the cost is O((segments + groups) * log
    runs), never O(tensors).
    """
    gaps: list[tuple[int, int]] = []
    pos = 0
    for v, _a, n in segments:
        if v > pos:
            gaps.append((pos, v))
        pos = v + n
    gaps.append((pos, _U64 * 2))  # past the last segment
    gi = 0
    first_run = 0
    first_tensor = 0
    for g, where in zip(groups, placed):
        nruns = len(g.runs)
        done = 0  # repetitions of g before the current piece
        for starts, stride, reps in where.pieces(g.repeat):
            # The non-empty runs of one repetition, relative to its start.
            base = starts[0]
            rel_lo: list[int] = []
            rel_hi: list[int] = []
            which: list[int] = []
            for j, (run, s) in enumerate(zip(g.runs, starts)):
                length = run.nbytes_each * run.count
                if length:
                    rel_lo.append(s - base)
                    rel_hi.append(s - base + length)
                    which.append(j)
            if rel_lo:
                lo = base + rel_lo[0]
                hi = base + (reps - 1) * stride + rel_hi[-1]
                while gaps[gi][1] <= lo:
                    gi += 1
                k = gi
                while k < len(gaps) and gaps[k][0] < hi:
                    a, b = max(gaps[k][0], lo), min(gaps[k][1], hi)
                    if reps > 1:
                        b = min(b, a + stride)  # a whole stride meets every run anyway
                    hit = _gap_hits(a, b, base, stride, reps, rel_lo, rel_hi)
                    if hit is not None:
                        rep, idx = hit
                        j = which[idx]
                        run = g.runs[j]
                        rep += done
                        t0 = (first_tensor + rep * g.tensors_per_repeat
                              + sum(x.count for x in g.runs[:j]))
                        s0 = base + (rep - done) * stride + rel_lo[idx]
                        r = first_run + rep * nruns + j
                        raise _bad(
                            f"run {r} (tensors {t0}..{t0 + run.count - 1}) occupies bytes "
                            f"[{s0:,}, {s0 + rel_hi[idx] - rel_lo[idx]:,}) which the segments "
                            f"do not fully cover"
                        )
                    k += 1
            done += reps
        first_run += nruns * g.repeat
        first_tensor += g.num_tensors


def _gap_hits(a: int, b: int, base: int, stride: int, reps: int,
              rel_lo: list[int], rel_hi: list[int]) -> tuple[int, int] | None:
    """(repetition, index of the run) of the first non-empty run meeting ``[a, b)``, or
    None. The gap is no longer than the stride (or the piece has one repetition), so it
    meets repetitions ``rep`` and ``rep + 1`` at most."""
    if a >= b:
        return None
    rep = (a - base) // stride if stride else 0
    for r in (rep, rep + 1):
        if r >= reps:
            break
        x, y = a - base - r * stride, b - base - r * stride
        idx = bisect_right(rel_hi, x)  # the first run ending after x
        if idx < len(rel_lo) and rel_lo[idx] < y:
            return r, idx
        if not stride:
            break
    return None
