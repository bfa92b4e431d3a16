"""A receiver's load plan: per bucket, where each tensor of the layout goes.

Owns :class:`LoadPlan` and :class:`BucketPlan` and how they are made from a validated
layout (:func:`plan_load`): which buckets land directly in the destination tensors,
which are read into the arena and copied, which go to ``load_weights``, which parts
``select`` reads, and which destinations are compared instead of written. A plan is made
per load (or per bucket of a lazy stream) and never changed after (a receiver reuses
its last one for an equal layout, see ``WeightReceiver.check``); plans run on whichever
thread loads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ray_rdt_pool.core.selection import Slices
from ray_rdt_pool.weights.manifest import TensorEntry, WeightLayout, dtype_of, itemsize
from ray_rdt_pool.weights.state import identity_key
from ray_rdt_pool.weights.validate import (
    CheckState,
    Claims,
    ReceiverOptions,
    Target,
    ToLoader,
    check_layout,
    dest_targets,
    find_missing,
    raise_problems,
    resolve,
    selected_shape,
)


@dataclass
class BucketPlan:
    """How one bucket is loaded: landed in ``targets`` (direct) or copied via ``copies``."""

    index: int
    nbytes: int
    targets: list[torch.Tensor] | None  # direct landing buffers, one per object tensor
    copies: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (idx, dest)
    loads: list[tuple[int, str]] = field(default_factory=list)  # (idx, name) for load_weights
    #: per object tensor, the part to read (``transport.fetch_selected``; an empty dim-0
    #: slice skips a tensor nobody takes), or None: the bucket is read whole. ``nbytes``
    #: is then the selected bytes.
    select: list[Slices | None] | None = None
    #: the bucket's manifest entries in object order (what a source read copies)
    entries: list[TensorEntry] = field(default_factory=list)
    #: (idx, dest, what): destinations an earlier bucket of a lazy stream wrote from
    #: another manifest tensor; compared, not written, before anything of the bucket is
    #: (:class:`CheckState`)
    verify: list[tuple[int, torch.Tensor, str]] = field(default_factory=list)
    #: (idx, scale idx, block, dest): FP8 weights dequantized into their destination
    dequant: list[tuple[int, int, tuple[int, ...], torch.Tensor]] = field(
        default_factory=list)
    #: (idx, scale idx, block, name, dtype): FP8 weights dequantized for load_weights
    dequant_loads: list[tuple[int, int, tuple[int, ...], str, torch.dtype]] = field(
        default_factory=list)


@dataclass
class LoadPlan:
    """The result of :meth:`WeightReceiver.check`: a validated layout, planned per bucket."""

    layout: WeightLayout
    buckets: list[BucketPlan]
    skipped: int


def _can_land(d: torch.Tensor, e: TensorEntry) -> bool:
    return (d.device.type == "cpu" and d.dtype == e.torch_dtype and tuple(d.shape) == e.shape
            and d.is_contiguous() and not d.is_conj() and not d.is_neg())


def _skip(e: TensorEntry) -> Slices | None:
    """The selection that reads nothing of ``e`` (None, i.e. all of it, for a scalar)."""
    return (slice(0, 0), *(slice(0, n) for n in e.shape[1:])) if e.shape else None


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and identity_key(a) == identity_key(b)


def plan_load(opts: ReceiverOptions, layout: WeightLayout) -> LoadPlan:
    """Validate ``layout`` against the destination and plan the load; writes nothing.

    Raises a :class:`ManifestMismatchError` subclass listing every problem, or
    :class:`WeightSyncError` for a layout that contradicts itself.
    """
    check_layout(layout.entries, layout.buckets)
    dests = dest_targets(opts)
    by_name = layout.by_name()
    sources = [(e.name, e) for e in layout.entries if e.scale_of is None]
    sources += [(a, by_name[c]) for a, c in layout.aliases if c in by_name]
    problems: list[tuple[str, str, str]] = []
    claimed: dict[str, str] = {}
    mem = Claims()
    resolved, skipped, selections = resolve(opts, sources, dests, claimed, problems, mem)
    find_missing(opts, dests, claimed, problems, mem)
    raise_problems(problems)
    return LoadPlan(layout, plan_buckets(opts, layout, resolved, selections), skipped)


def plan_buckets(opts: ReceiverOptions, layout: WeightLayout, resolved: Mapping[str, Target],
                  selections: Mapping[str, Slices | None] | None = None
                  ) -> list[BucketPlan]:
    selections = selections or {}
    alias_of: dict[str, list[str]] = {}
    for a, c in layout.aliases:
        alias_of.setdefault(c, []).append(a)
    plans: list[BucketPlan] = []
    by_bucket: dict[int, list[TensorEntry]] = {}
    for e in layout.entries:
        by_bucket.setdefault(e.bucket, []).append(e)
    for b in layout.buckets:
        entries = sorted(by_bucket.get(b.index, []), key=lambda e: e.index)
        targets = [resolved.get(e.name) for e in entries]
        dests = [t if isinstance(t, torch.Tensor) else None for t in targets]
        # A bucket that must first be compared with what an earlier bucket wrote into
        # a tied destination is read into the arena, so a refusal writes none of it.
        checked = any(isinstance(t, CheckState) for t in targets) or any(
            isinstance(resolved.get(a), CheckState) for e in entries
            for a in alias_of.get(e.name, ()))
        land = opts.direct and not checked and all(
            d is not None and _can_land(d, e) for d, e in zip(dests, entries))
        if land:
            ptrs = [d.data_ptr() for d in dests if d is not None and d.numel() > 0]
            land = len(ptrs) == len(set(ptrs))
        wanted = [selections.get(e.name) for e in entries]
        select = None
        if opts.select is not None:
            # Read part of the bucket when a tensor is selected or nobody takes one
            # (an empty dim-0 slice skips it).
            taken = [_taken(e, t, alias_of, resolved) for e, t in zip(entries, targets)]
            # An FP8 weight's scales are read whenever the weight is.
            taken = [ok or (e.scale_of is not None and i > 0 and taken[i - 1])
                     for i, (ok, e) in enumerate(zip(taken, entries))]
            if any(w is not None for w in wanted) or not all(taken):
                select = [w if ok else _skip(e) for w, ok, e in zip(wanted, taken, entries)]
                land = False
        plan = BucketPlan(b.index, b.nbytes, list(dests) if land else None,  # type: ignore
                          entries=entries)
        if select is not None:
            plan.select = select
            plan.nbytes = sum(
                math.prod(selected_shape(sl, e.shape)) * itemsize(e.torch_dtype)
                for sl, e in zip(select, entries))
        for e, t in zip(entries, targets):
            fp8 = e.block is not None
            if fp8 and isinstance(t, ToLoader) and not opts.keep_fp8:
                plan.dequant_loads.append((e.index, e.index + 1, e.block, t.name,  # type: ignore[arg-type]
                                           dtype_of(e.orig or "float32")))
            elif fp8 and isinstance(t, torch.Tensor) and t.dtype != e.torch_dtype:
                plan.dequant.append((e.index, e.index + 1, e.block, t))  # type: ignore[arg-type]
            elif isinstance(t, ToLoader):
                plan.loads.append((e.index, t.name))
            elif isinstance(t, CheckState):
                plan.verify.append((e.index, t.dest, t.what))
            elif not land and t is not None:
                plan.copies.append((e.index, t))
            for a in alias_of.get(e.name, ()):
                at = resolved.get(a)
                if isinstance(at, ToLoader):
                    plan.loads.append((e.index, at.name))
                elif isinstance(at, CheckState):
                    plan.verify.append((e.index, at.dest, at.what))
                elif fp8 and isinstance(at, torch.Tensor) and at.dtype != e.torch_dtype:
                    plan.dequant.append((e.index, e.index + 1, e.block, at))  # type: ignore[arg-type]
                elif at is not None and not (isinstance(t, torch.Tensor)
                                             and _same_memory(at, t)):
                    plan.copies.append((e.index, at))
        plans.append(plan)
    return plans


def _taken(e: TensorEntry, t: Target, alias_of: Mapping[str, list[str]],
           resolved: Mapping[str, Target]) -> bool:
    """Does any name of entry ``e`` (itself or an alias) have a target?"""
    return t is not None or any(resolved.get(a) is not None
                                for a in alias_of.get(e.name, ()))
