"""Loading one bucket on a receiver: fetch it as its plan says, check it, write it.

Owns :func:`load_bucket`: a bucket arrives as a Ray object ref, a :class:`PoolBucket` or
a :class:`SourceBucket`, is checked against its layout before anything is written
(:func:`_check_arrived`), then lands in the destination tensors, is copied into them,
is compared with what an earlier bucket wrote, or goes to ``load_weights``. Holds no
state: the bucket's views are dropped when it returns or raises. Runs on the thread of
the receiver's load or stream call, under the receiver's write lock.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from ray_rdt_pool.errors import DuplicateTargetError, LoaderError, WeightSyncError
from ray_rdt_pool.weights.fp8 import dequantize
from ray_rdt_pool.weights.loadplan import BucketPlan
from ray_rdt_pool.weights.manifest import PoolBucket, SourceBucket, dtype_str
from ray_rdt_pool.weights.reports import BucketReport
from ray_rdt_pool.weights.state import LoadWeights
from ray_rdt_pool.weights.validate import selected_shape

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray import ObjectRef

    from ray_rdt_pool.same_node.peer_memory import SourceProcess

    #: Called with a bucket's plan and its tensors as they arrived, once it is written.
    Relay = Callable[[BucketPlan, Sequence[torch.Tensor]], None]


def copy_all(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``d.copy_(src)`` for each pair as a load does it: outside autograd, and for a
    destination made under ``torch.inference_mode()`` (an engine's weights, often)
    inside that mode, the only one that lets it be written in place."""
    with torch.no_grad():
        for d, src in pairs:
            if d.is_inference():
                with torch.inference_mode():
                    d.copy_(src)
            else:
                d.copy_(src)


def _same_bytes(dest: torch.Tensor, src: torch.Tensor) -> bool:
    """Would ``dest.copy_(src)`` leave ``dest`` bit for bit as it is? (NaNs included.)"""
    if tuple(dest.shape) != tuple(src.shape):
        return False
    with torch.no_grad():
        got = src.to(device=dest.device, dtype=dest.dtype)

        def raw(t: torch.Tensor) -> torch.Tensor:
            return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)

        return bool(torch.equal(raw(dest), raw(got)))


def _check_arrived(plan: BucketPlan, got: Sequence[torch.Tensor] | None = None,
                   wire: bytes | None = None) -> None:
    """WeightSyncError unless bucket ``plan.index`` arrived as its layout says: one
    tensor per entry, of the entry's dtype and shape (or, read in part, the selected
    part's). ``got``: the tensors received; ``wire``: the object's metadata (whole
    tensors), for a bucket not fetched yet. Checked before anything is written: ``copy_`` would
    broadcast or cast a tensor of another shape or dtype into the destination without a
    word, and a landing would blame the destination."""
    from ray_rdt_pool.core.codec import decode

    facts = list(decode(wire).shapes_dtypes()) if wire is not None else [
        (tuple(g.shape), dtype_str(g.dtype)) for g in got or ()]
    entries = plan.entries
    # The metadata describes whole tensors; what a partial read returns, the parts.
    whole = wire is not None or plan.select is None
    want = [(e.shape if whole else selected_shape(plan.select[e.index], e.shape),  # type: ignore[index]
             e.dtype) for e in entries]
    if len(facts) == len(entries) and all(
            facts[e.index] == (tuple(w), d) for e, (w, d) in zip(entries, want)):
        return
    raise WeightSyncError(
        f"bucket {plan.index} arrived as {len(facts)} tensor(s) {facts[:4]}"
        f"{' ...' if len(facts) > 4 else ''}, but its layout lists {len(entries)}: "
        f"{want[:4]}{' ...' if len(want) > 4 else ''}; nothing of it was written. The "
        "sender and this receiver disagree on the layout: run the same ray_rdt_pool "
        "version on both")


def load_bucket(plan: BucketPlan, ref: ObjectRef | SourceBucket | PoolBucket,
                source: SourceProcess | None = None, load_weights: LoadWeights | None = None,
                relay: Relay | None = None) -> BucketReport:
    """Load bucket ``plan.index`` from ``ref``; ``source`` is the sender process the
    stream's receiver accepted source reads from, ``load_weights`` the receiver's loader.
    ``relay`` (a relayed stream) is called once the bucket is written to the
    destination and before ``load_weights`` sees it, with the plan and the bucket's
    tensors as they arrived (the destination tensors themselves when it landed there).
    """
    import ray

    t0 = time.perf_counter()
    direct = plan.targets is not None
    src: list[torch.Tensor]
    if isinstance(ref, SourceBucket):
        if source is None or ref.source != source:
            raise WeightSyncError(
                f"bucket {plan.index} names a source process this receiver did not "
                "accept for the stream; only WeightSender.stream sends such buckets")
        got = _read_source(plan, ref)
        src = got
    elif isinstance(ref, PoolBucket):
        from ray_rdt_pool._ray.owned import fetch_owned

        _check_arrived(plan, wire=ref.wire)

        # Targets are written in place (or copied into on first sight), as a get
        # with set_target_for_ref would.
        got = fetch_owned(ref.obj_id, ref.wire, ref.device,
                          plan.targets if plan.select is None else None, plan.select)
        src = got if plan.select is not None or plan.targets is None else plan.targets
    elif plan.select is not None:
        from ray_rdt_pool._ray.owned import fetch_selected

        got = fetch_selected(ref, plan.select)
        src = got
    elif plan.targets is not None:
        from ray.experimental import set_target_for_ref

        set_target_for_ref(ref, plan.targets)
        got = ray.get(ref)
        if any(g is not t and g.data_ptr() != t.data_ptr()
               for g, t in zip(got, plan.targets)):
            # Ray ignored the targets (e.g. one was collected): copy instead.
            direct = False
            _check_arrived(plan, got)
            copy_all(zip(plan.targets, got))
        src = plan.targets
    else:
        got = ray.get(ref)
        src = got
    if src is got and not isinstance(ref, PoolBucket):
        # (Landed in the targets, the transport compared them with the object first.)
        _check_arrived(plan, got)
    for idx, d, what in plan.verify:
        if not _same_bytes(d, src[idx]):
            del got, src
            raise DuplicateTargetError(
                f"{what}, but bucket {plan.index} brings other bytes than the earlier "
                f"bucket wrote; bucket {plan.index} was not written. Tie the tensors in "
                "the sender, map one of them to None, or untie the destination",
                [("duplicate", what, "different bytes into one destination tensor")])
    if plan.copies:
        copy_all((d, src[idx]) for idx, d in plan.copies)
    if plan.dequant:
        with torch.no_grad():
            for i, j, block, d in plan.dequant:
                if d.is_inference():
                    with torch.inference_mode():
                        dequantize(src[i], src[j], block, d.dtype, out=d)
                else:
                    dequantize(src[i], src[j], block, d.dtype, out=d)
    if relay is not None:
        # Before the loader: a relay forwards the bytes as they arrived, whatever
        # load_weights does with its views (an engine may scale them in place).
        relay(plan, src)
    if plan.loads or plan.dequant_loads:
        assert load_weights is not None
        batch = [(name, src[idx]) for idx, name in plan.loads]
        batch += [(name, dequantize(src[i], src[j], block, dtype))
                  for i, j, block, name, dtype in plan.dequant_loads]
        names = [n for n, _t in batch]
        try:
            with torch.no_grad():
                load_weights(batch)
        except Exception as e:
            batch.clear()
            del got, src
            # The loader's frames may hold the arena views: let the block return.
            traceback.clear_frames(e.__traceback__)
            raise loader_error(e, names, f"while loading bucket {plan.index}",
                               "the bucket's arena block was released and the receiver's "
                               "version is unchanged", plan.index) from e
        batch.clear()
    del got, src
    return BucketReport(plan.index, plan.nbytes, direct, time.perf_counter() - t0)


def loader_error(e: Exception, names: Sequence[str], when: str, left: str,
                 bucket: int = -1) -> LoaderError:
    """The error for ``load_weights`` raising ``e`` on ``names``: ``when`` it was called
    and what that ``left`` as it was."""
    shown = ", ".join(repr(n) for n in names[:8])
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return LoaderError(
        f"load_weights raised {type(e).__name__}: {e} {when} ({len(names)} tensor(s): "
        f"{shown}{more}); {left}. Fix the loader, or map names it does not take to None "
        "with name_map", bucket, names)


def _read_source(plan: BucketPlan, sb: SourceBucket) -> list[torch.Tensor]:
    """Copy bucket ``plan.index`` straight out of the sender's tensors: into the
    destination tensors when it lands directly, else into the receive arena (only
    the selected part of each tensor with ``select``)."""
    from ray_rdt_pool._ray.owned import read_source

    entries = plan.entries
    if len(sb.addrs) != len(entries):
        raise WeightSyncError(
            f"bucket {plan.index} arrived with {len(sb.addrs)} source addresses for "
            f"{len(entries)} tensors; the sender and this receiver disagree on the layout")
    tensors = [(a, e.shape, e.dtype) for a, e in zip(sb.addrs, entries)]
    return read_source(sb.source, tensors, plan.select, plan.targets)
