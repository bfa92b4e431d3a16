"""The checks of a weight layout against a receiver's destination, before a byte moves.

Owns the rules a load is held to: the layout agrees with itself (:func:`check_layout`),
names map to destinations (``name_map``), shapes match (after ``select``), dtypes cast
(:func:`can_cast`), and no two manifest tensors write one destination's memory
(:class:`Claims`). :func:`resolve` turns a layout's names into targets and collects
every problem; :func:`raise_problems` raises them as one ``ManifestMismatchError``. Stateless
but for the claims a caller passes in; runs on whichever thread checks a load.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from ray_rdt_pool.core.selection import Slices
from ray_rdt_pool.errors import (
    DtypeMismatchError,
    DuplicateTargetError,
    InvalidInputError,
    ManifestMismatchError,
    MissingWeightsError,
    SelectError,
    ShapeMismatchError,
    UnexpectedWeightsError,
    WeightSyncError,
)
from ray_rdt_pool.weights.fp8 import SCALE_SUFFIX, scale_selection, scale_shape
from ray_rdt_pool.weights.manifest import Bucket, TensorEntry, dtype_of, dtype_str, itemsize
from ray_rdt_pool.weights.state import (
    Casting,
    LoadWeights,
    NameMap,
    Select,
    StateLike,
    check_weight,
    identity_key,
    named_tensors,
)

#: The class a list of problems raises: that of the first kind found in this order.
_ERROR_ORDER: tuple[type[ManifestMismatchError], ...] = (
    SelectError, DuplicateTargetError, ShapeMismatchError, DtypeMismatchError, MissingWeightsError,
    UnexpectedWeightsError)


class ReceiverOptions(Protocol):
    """The options of a :class:`~ray_rdt_pool.weights.WeightReceiver` that a check reads,
    each time (a caller may change them between loads)."""

    dest: StateLike | None
    load_weights: LoadWeights | None
    name_map: NameMap
    casting: Casting
    strict: bool
    direct: bool
    select: Select | None
    keep_fp8: bool
    scale_name: Callable[[str], str]


def can_cast(src: torch.dtype, dst: torch.dtype, casting: Casting = "same_kind") -> bool:
    """The dtype rule of a load: may a ``src`` tensor be written into a ``dst`` tensor?"""
    if src == dst:
        return True
    if casting == "no":
        return False
    if casting == "unsafe":
        return True
    if casting == "same_kind":
        return bool(torch.can_cast(src, dst))
    raise InvalidInputError(f"casting must be 'no', 'same_kind' or 'unsafe', got {casting!r}")


def mapper(name_map: NameMap) -> Callable[[str], str | None]:
    if name_map is None:
        return lambda n: n
    if isinstance(name_map, Mapping):
        m = name_map
        return lambda n: m.get(n, n)
    if callable(name_map):
        return name_map
    raise InvalidInputError(f"name_map must be a mapping, a callable or None, got "
                            f"{type(name_map).__name__}")


def check_layout(entries: Sequence[TensorEntry], buckets: Sequence[Bucket],
                  first: int = 0) -> None:
    """WeightSyncError unless the layout agrees with itself, as the sender makes it:
    bucket ``i`` of ``buckets`` has index ``first + i``; each entry names one of them and
    a known dtype, a shape of non-negative ints and the bytes it makes; each bucket's
    entries sit at positions 0 to n-1, in the order of its names. The receiver plans
    its writes on these facts: a layout that breaks one left a destination unwritten
    with the version committed, or gave it another tensor's bytes."""
    problems: list[str] = []
    positions: dict[int, int] = {}
    for i, b in enumerate(buckets):
        if b.index != first + i:
            problems.append(f"bucket {first + i} is listed as bucket {b.index!r}")
        positions[b.index] = i
    names: dict[int, dict[int, str]] = {}
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            problems.append(f"{e.name!r} is listed twice")
        seen.add(e.name)
        shape_ok = type(e.shape) is tuple and all(type(k) is int and k >= 0 for k in e.shape)
        try:
            size = itemsize(dtype_of(e.dtype)) if isinstance(e.dtype, str) else None
        except InvalidInputError:
            size = None
        if not shape_ok or size is None:
            problems.append(f"{e.name!r} has shape {e.shape!r} and dtype {e.dtype!r}")
        elif e.nbytes != math.prod(e.shape) * size:
            problems.append(f"{e.name!r} ({e.shape} {e.dtype}) is said to be "
                            f"{e.nbytes!r} bytes")
        if e.bucket not in positions:
            problems.append(f"{e.name!r} is in bucket {e.bucket!r}, which the layout does "
                            "not list")
        elif names.setdefault(e.bucket, {}).setdefault(e.index, e.name) != e.name:
            problems.append(f"{e.name!r} and {names[e.bucket][e.index]!r} are both at "
                            f"position {e.index!r} of bucket {e.bucket}")
    for b in buckets:
        at = names.get(b.index, {})
        if [at.get(i) for i in range(len(b.names))] != list(b.names) or len(at) != len(b.names):
            problems.append(f"bucket {b.index}'s tensors are not at positions 0 to "
                            f"{len(b.names) - 1} in the order of its names")
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise WeightSyncError(
            f"the weight layout contradicts itself: {'; '.join(problems[:3])}{more}. Nothing "
            "was written; run the same ray_rdt_pool version on the sender and the receivers")


def normalize_select(raw: Any, shape: tuple[int, ...]) -> Slices | None:
    """``select``'s answer as one step-1 slice per dimension, or None for the whole
    tensor. Raises ValueError (with what is wrong) for an answer that does not fit."""
    if raw is None:
        return None
    if isinstance(raw, slice):
        raw = (raw,)
    if not isinstance(raw, (tuple, list)) or not all(isinstance(x, slice) for x in raw):
        raise ValueError("it is not a tuple of slice objects")
    if len(raw) > len(shape):
        raise ValueError(f"{len(raw)} slices for a tensor of {len(shape)} dimension(s)")
    out: list[slice] = []
    for d, (sl, size) in enumerate(zip(raw, shape)):
        if sl.step not in (None, 1):
            raise ValueError(f"dim {d}: step {sl.step!r}; only step 1 is read")
        bounds = []
        for v, default in ((sl.start, 0), (sl.stop, size)):
            if v is None:
                v = default
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"dim {d}: {sl} has a non-int bound {v!r}")
            bounds.append(v + size if v < 0 else v)
        start, stop = bounds
        if not 0 <= start <= stop <= size:
            raise ValueError(f"dim {d}: {sl} does not fit size {size} "
                             f"(needs 0 <= start <= stop <= {size})")
        out.append(slice(start, stop))
    out += [slice(0, size) for size in shape[len(out):]]
    if all(sl.start == 0 and sl.stop == size for sl, size in zip(out, shape)):
        return None
    return tuple(out)


def selected_shape(sel: Slices | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape if sel is None else tuple(sl.stop - sl.start for sl in sel)


class ToLoader:
    """A manifest tensor that goes to ``load_weights`` under ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class CheckState:
    """A destination tensor an earlier bucket of a lazy stream already wrote from another
    manifest tensor (a tie the sender sent twice, or two tensors into one tied
    destination): the bucket compares its bytes instead of writing them, and refuses the
    bucket unless they are equal."""

    __slots__ = ("dest", "what")

    def __init__(self, dest: torch.Tensor, what: str) -> None:
        self.dest = dest
        self.what = what


Target = torch.Tensor | ToLoader | CheckState | None


class Claims(dict[tuple[Any, ...], tuple[str, int, str, str]]):
    """Destination memory claimed so far: identity key -> (canonical manifest name, its
    bucket, the manifest name written there, the destination name). ``spans`` holds the
    byte ranges of the contiguous claimed tensors, (device, start, end, destination
    name), sorted and disjoint; ``strided`` the others with their spanned runs
    (:func:`~ray_rdt_pool.memory.extent.spanned_runs`), so that a destination that shares bytes
    with another without being the same tensor (a slice of it, a dtype view, a
    conjugate, a transpose, a column slice crossing another) is found, while strided
    views that interleave without sharing a byte are not."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[str, int, int, str]] = []
        self.strided: list[tuple[str, int, int, str, tuple[Any, int] | None]] = []

    def copy(self) -> Claims:
        c = Claims()
        c.update(self)
        c.spans = list(self.spans)
        c.strided = list(self.strided)
        return c

    def overlap(self, d: torch.Tensor, dn: str) -> tuple[str, bool] | None:
        """The claimed destination that ``d`` (named ``dn``, not claimed yet) shares
        bytes with, as (its name, False), or None, when ``d`` is then recorded. (name,
        True) when ``d`` and a strided claimed tensor span each other's bytes but have
        too many runs to compare (over ``MAX_SPANNED_RUNS``): they are refused, since they
        could not be shown apart."""
        import bisect

        from ray_rdt_pool.memory.extent import reach, runs_meet, spanned_runs

        if not d.nbytes:
            return None
        dev, start = str(d.device), d.data_ptr()
        end = start + reach(d, d.nbytes)
        dense = d.is_contiguous()
        mine: list[tuple[Any, int] | None] = []  # d's runs, made once when first needed

        def meets(theirs: tuple[Any, int] | None, name: str) -> tuple[str, bool] | None:
            if not mine:
                mine.append((_one(start), end - start) if dense else spanned_runs(d))
            if mine[0] is None or theirs is None:
                return name, True
            return (name, False) if runs_meet(mine[0], theirs) else None

        # The last span starting at or before ``start``, then those starting before ``end``.
        i = bisect.bisect_right(self.spans, (dev, start, math.inf, ""))
        j = i - 1 if i and self.spans[i - 1][0] == dev and self.spans[i - 1][2] > start else i
        while j < len(self.spans) and self.spans[j][0] == dev and self.spans[j][1] < end:
            _dev, s, e, name = self.spans[j]
            found = (name, False) if dense else meets((_one(s), e - s), name)
            if found is not None:
                return found
            j += 1
        for sdev, s, e, name, theirs in self.strided:
            if sdev == dev and s < end and start < e:
                found = meets(theirs, name)
                if found is not None:
                    return found
        if dense:
            self.spans.insert(i, (dev, start, end, dn))
        else:
            self.strided.append((dev, start, end, dn, mine[0] if mine else spanned_runs(d)))
        return None


def _one(addr: int) -> torch.Tensor:
    """The start of a single run, as :func:`~ray_rdt_pool.memory.extent.spanned_runs` lists it."""
    return torch.tensor([addr], dtype=torch.int64)


def dest_targets(opts: ReceiverOptions) -> dict[str, torch.Tensor]:
    # Unchecked: a lazy stream asks for them at every bucket, and only the ones a
    # manifest tensor writes need checking (_claim does, once per load or bucket).
    return dict(named_tensors(opts.dest, None)) if opts.dest is not None else {}


def resolve(opts: ReceiverOptions, sources: Sequence[tuple[str, TensorEntry]],
             dests: Mapping[str, torch.Tensor], claimed: dict[str, str],
             problems: list[tuple[str, str, str]], mem: Claims | None = None,
             lazy: bool = False
             ) -> tuple[dict[str, Target], int, dict[str, Slices | None]]:
    """Map each source name to its target (a dest tensor, the loader, or skipped),
    and each entry with a target to its selection (``select``).

    ``mem`` collects the destination memory written: two different manifest tensors
    into one destination tensor (a tied destination, an untied sender) is a
    ``duplicate`` problem, since only the last one written would stay; in a ``lazy``
    stream, where a tie across buckets is sent twice, a later bucket's tensor is
    compared with what the earlier one wrote instead (:class:`CheckState`)."""
    mem = Claims() if mem is None else mem
    mapname = mapper(opts.name_map)
    resolved: dict[str, Target] = {}
    selections: dict[str, Slices | None] = {}
    bad_select: set[str] = set()
    skipped = 0
    for name, e in sources:
        try:
            dn = mapname(name)
            if dn is not None and not isinstance(dn, str):
                raise TypeError(f"returned a {type(dn).__name__}")
        except Exception as err:
            resolved[name] = None
            problems.append(("unexpected", name, (
                f"name_map({name!r}) failed ({type(err).__name__}: {err}); make it "
                "return a destination name (a str), or None to skip the tensor")))
            continue
        if dn is None:
            resolved[name] = None
            skipped += 1
            continue
        d = dests.get(dn)
        if d is None and opts.load_weights is None:
            resolved[name] = None
            skipped += 1
            if opts.strict:
                problems.append(("unexpected", name, f"{name!r} (as {dn!r}) is not in "
                                 "the destination; map it to None to skip it"))
            continue
        if dn in claimed:
            problems.append(("duplicate", name, f"{name!r} and {claimed[dn]!r} both map "
                             f"to {dn!r}"))
            continue
        claimed[dn] = name
        if e.name not in selections and e.name not in bad_select:
            try:
                selections[e.name] = _select(opts, e)
            except ValueError as err:
                bad_select.add(e.name)
                problems.append(("select", e.name, str(err)))
        if e.name in bad_select:
            continue
        shape = selected_shape(selections[e.name], e.shape)
        what = "in the manifest" if shape == e.shape else \
            f"as selected (of {e.shape} in the manifest)"
        if e.block is not None:
            _resolve_scale(opts, name, dn, e, d, dests, claimed, resolved, selections,
                           problems)
        if d is None:
            resolved[name] = ToLoader(dn)
            continue
        if tuple(d.shape) != shape:
            problems.append(("shape", name, f"{name!r} is {shape} {what} but "
                             f"{dn!r} is {tuple(d.shape)} in the destination"))
        elif not can_cast(e.torch_dtype, d.dtype, opts.casting):
            problems.append(("dtype", name, f"{name!r} is {e.dtype} in the manifest and "
                             f"{dn!r} is {dtype_str(d.dtype)}; casting={opts.casting!r} "
                             "does not allow that conversion"))
        else:
            resolved[name] = _claim(mem, lazy, name, dn, d, e, problems)
    return resolved, skipped, selections


def _resolve_scale(opts: ReceiverOptions, name: str, dn: str, e: TensorEntry,
                   d: torch.Tensor | None, dests: Mapping[str, torch.Tensor],
                   claimed: dict[str, str], resolved: dict[str, Target],
                   selections: dict[str, Slices | None],
                   problems: list[tuple[str, str, str]]) -> None:
    """Where the scales of FP8 weight ``name`` (entry ``e``, into ``dn``: ``d``, or the
    loader) go: nowhere when the receiver dequantizes it; with ``keep_fp8`` (or an FP8
    destination of its dtype) to destination ``scale_name(dn)`` or the loader. And the
    part of them a selection of the weight reads."""
    sname = e.name + SCALE_SUFFIX
    try:
        selections[sname] = scale_selection(selections.get(e.name), e.shape, e.block or (),
                                            e.name)
    except ValueError as err:
        problems.append(("select", e.name, str(err)))
        return
    keep = d.dtype == e.torch_dtype if d is not None else opts.keep_fp8
    if not keep:
        return
    sdn = opts.scale_name(dn)
    sd = dests.get(sdn)
    if sd is None:
        if opts.load_weights is not None:
            resolved[sname] = ToLoader(sdn)
        else:
            problems.append(("missing", sdn, (
                f"{name!r} arrives as FP8 with scales, kept as FP8 in {dn!r}, but its "
                f"scales' destination {sdn!r} is not in the destination; add it (float32, "
                f"{scale_shape(e.shape, e.block or ())}), or let the receiver dequantize "
                "into a wider dtype")))
        return
    want = selected_shape(selections[sname], scale_shape(e.shape, e.block or ()))
    if tuple(sd.shape) != want or not sd.is_floating_point():
        problems.append(("shape", sdn, (
            f"the scales of {name!r} are {want} float32, but {sdn!r} is "
            f"{tuple(sd.shape)} {dtype_str(sd.dtype)} in the destination")))
        return
    claimed[sdn] = sname
    resolved[sname] = sd


def _claim(mem: Claims, lazy: bool, name: str, dn: str, d: torch.Tensor, e: TensorEntry,
           problems: list[tuple[str, str, str]]) -> Target:
    """``d`` as the target of manifest name ``name`` (entry ``e``), unless another
    manifest tensor already writes that memory (see :func:`resolve`)."""
    if d.numel() == 0:
        return d
    check_weight(dn, d, "destination tensor")  # its memory may have gone since
    key = identity_key(d)
    prior = mem.get(key)
    if prior is None:
        met = mem.overlap(d, dn)
        if met is not None:
            other, unsure = met
            from ray_rdt_pool.memory.extent import MAX_SPANNED_RUNS

            how = (f"spans the bytes of destination {other!r} in over "
                   f"{MAX_SPANNED_RUNS:,} strided runs, too many to show that they do "
                   "not overlap" if unsure else
                   f"shares memory with destination {other!r} without being the same "
                   "tensor (a slice, a view of another dtype or layout of it): one "
                   "would overwrite the other's bytes")
            problems.append(("duplicate", name, (
                f"destination {dn!r} (for {name!r}) {how}. Give each weight memory "
                "of its own, or map one of them to None")))
            return None
        mem[key] = (e.name, e.bucket, name, dn)
        return d
    canon, bucket, pname, pdn = prior
    if canon == e.name:
        return d  # one manifest tensor under two names (tied on both sides)
    if lazy and bucket != e.bucket:
        return CheckState(d, f"{name!r} (into {dn!r}) and {pname!r} (into {pdn!r}, bucket "
                         f"{bucket}) are one tensor in the destination")
    problems.append(("duplicate", name, (
        f"{name!r} and {pname!r} are different tensors in the manifest, but {dn!r} and "
        f"{pdn!r} are one tensor (tied) in the destination, which would keep only the "
        "one written last; tie them in the sender too (it then sends the tensor once), "
        "map one of them to None, or untie the destination")))
    return None


def _select(opts: ReceiverOptions, e: TensorEntry) -> Slices | None:
    """``select``'s part of entry ``e``, normalized; ValueError naming the fix if it
    does not fit."""
    if opts.select is None:
        return None
    try:
        raw = opts.select(e.name, e.shape)
    except Exception as err:
        raise ValueError(
            f"select({e.name!r}, {e.shape}) raised {type(err).__name__}: {err}; make "
            "select return a tuple of step-1 slices for every manifest tensor, or None "
            "for the whole tensor") from None
    try:
        return normalize_select(raw, e.shape)
    except ValueError as err:
        raise ValueError(
            f"select({e.name!r}, {e.shape}) returned {raw!r}: {err}. Return a tuple of "
            "step-1 slices within the full shape (e.g. (slice(r * n, (r + 1) * n),) for "
            "a dim-0 shard), or None for the whole tensor") from None


def find_missing(opts: ReceiverOptions, dests: Mapping[str, torch.Tensor],
                 claimed: Mapping[str, str], problems: list[tuple[str, str, str]],
                 written: Claims) -> None:
    """Destination names that receive nothing (``strict``). A name that is another
    name of a destination tensor that receives something (a tied weight: same
    memory, shape, strides and dtype; ``written`` from :func:`resolve`) is written
    with it: a sender's ``named_parameters()`` lists a tied tensor once, a
    ``state_dict`` under every name."""
    if not opts.strict:
        return
    for dn, d in dests.items():
        if dn not in claimed and not (d.numel() > 0 and identity_key(d) in written):
            problems.append(("missing", dn, f"destination {dn!r} receives no tensor "
                             "from the manifest"))


def raise_problems(problems: list[tuple[str, str, str]], written: str = "nothing was written"
           ) -> None:
    if problems:
        kinds = {p[0] for p in problems}
        cls = next((c for c in _ERROR_ORDER if c.kind in kinds), ManifestMismatchError)
        shown = "\n  ".join(f"[{k}] {d}" for k, _n, d in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise cls(f"the weight manifest does not match the destination ({len(problems)} "
                  f"problem(s); {written}):\n  {shown}{more}", problems)
