"""The tensors of one object as runs of equal ``(shape, dtype)``, and repeats among them.

Pure (stdlib only). A :class:`TensorRun` is ``count`` consecutive tensors of one shape
and dtype; a :class:`RunGroup` is the runs of one repetition of a pattern, repeated back
to back; :class:`Runs` is an object's runs held as groups. :func:`runs_from` (the shapes
and dtypes of a put) and :func:`group_runs` (a sequence of runs) find the repeated
patterns in time linear in the tensors, so an RL batch sent per sample, the row views of
one weight or a state dict repeating one layer each become a few groups, which
:mod:`ray_rdt_pool.core.codec` sends once each and :mod:`ray_rdt_pool.core.layout`
places group by group.

Lifetime: immutable once built (a ``Runs`` caches its expansion and layout on first
use), so any thread may share one.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

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
    "RunGroup",
    "Runs",
    "TensorRun",
    "group_runs",
    "runs_from",
]

#: Most dimensions a tensor may have. torch 2.13 builds more on the CPU, but its CUDA
#: kernels and many operators take at most 64 (a put of more is an InvalidInputError).
MAX_DIMS = 64

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

    def shapes_dtypes(self) -> list[tuple[tuple[int, ...], str]]:
        """``(shape, dtype)`` of every tensor, in order."""
        return self.map_tensors(_shape_dtype)


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
    comparisons where they do.

    Raises:
        InvalidInputError: if the sequences differ in length, or for an unknown
            dtype name, a negative or non-int dim, or more than MAX_DIMS dims.
    """
    if len(shapes) != len(dtypes):
        raise InvalidInputError(f"{len(shapes)} shapes but {len(dtypes)} dtypes")
    # One tuple per distinct pair: equal items then compare by identity, and an object of
    # thousands of tensors keeps only as many tuples alive as it has kinds of tensor, so
    # none survive into the cyclic GC's oldest generation, whose full passes walk a Ray
    # worker's whole heap.
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
    # A tensor left out or misplaced here would shift every later tensor's offset
    # (wrong bytes at the receiver, not an error), so the grouping is checked against
    # the input, tensor by tensor, with C-level list work.
    if out.shapes_dtypes() != items:
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
