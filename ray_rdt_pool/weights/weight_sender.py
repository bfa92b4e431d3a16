"""The trainer's side of weight sync: :class:`WeightSender`.

Owns what a sender keeps between syncs: its source, its options, the versions it used,
whether a one-shot source is spent, and the storages of by-reference buckets that stay
registered between streams. :meth:`WeightSender.publish` puts every bucket as a Ray
object; :meth:`WeightSender.stream` runs a :class:`~ray_rdt_pool.weights.stream.StreamSession`.
Lives in the trainer actor, as long as the caller keeps it; one sync at a time (calls
from one thread, the actor's).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ray_rdt_pool.errors import DuplicateNameError, InvalidInputError, SourceExhaustedError
from ray_rdt_pool.weights.fp8 import WireScale, check_wire_scale
from ray_rdt_pool.weights.manifest import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_WIRE_SCALE,
    BucketLayout,
    Manifest,
    TensorEntry,
    WeightLayout,
    layout_of,
)
from ray_rdt_pool.weights.planning import (
    LayoutMemo,
    check_bucket_bytes,
    check_wire_dtype,
    conversions,
    iter_buckets,
    named_pairs,
    plan_layout,
    quantized,
)
from ray_rdt_pool.weights.pool import pool_stats, release_registrations
from ray_rdt_pool.weights.remote import RECEIVER_ATTR, actor_handles, check_timeout
from ray_rdt_pool.weights.reports import StreamReport
from ray_rdt_pool.weights.state import (
    Source,
    SourceLike,
    StateLike,
    WireDtype,
    check_flag,
    check_shard,
)
from ray_rdt_pool.weights.stream import StreamSession, check_relay

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from ray_rdt_pool._ray.beats import Beat


def _transport() -> str:
    from ray_rdt_pool import TRANSPORT

    return TRANSPORT


def _put_bucket(tensors: list[torch.Tensor], entries: Sequence[TensorEntry]) -> ObjectRef:
    """``ray.put`` one bucket; tensors whose entry names another dtype are converted by
    the pack copy itself (``transport.pack_as``), not by a separate cast."""
    import ray

    tensors = quantized(tensors, entries)
    convert = conversions(tensors, entries)
    if not convert:
        return ray.put(tensors, _tensor_transport=_transport())
    from ray_rdt_pool._ray.conversions import pack_as

    with pack_as(convert):
        return ray.put(tensors, _tensor_transport=_transport())


class WeightSender:
    """Publishes a named state as ``nixl_pool`` buckets. Lives in the trainer actor.

    Args:
        source: The state to send. Either a state (an ``nn.Module``, a
            ``Mapping[str, Tensor]``), or a lazy source: an iterable or generator of
            ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``), or a
            zero-argument callable returning any of these (called once per sync).
            An iterator or generator is one-shot: a second sync raises
            :class:`SourceExhaustedError`; pass a callable instead. Optional when every
            call passes ``state=``.
        bucket_bytes: Most packed bytes per bucket. For :meth:`stream` keep
            ``max_inflight * bucket_bytes`` within the sender's ``pool_bytes``, and
            ``bucket_bytes`` within each receiver's ``arena_bytes`` (buckets that are
            copied rather than landed directly go through the arena).
        wire_dtype: The dtype tensors are sent as. A ``torch.dtype`` (floating point)
            applies to every floating-point tensor (integer and bool tensors are sent
            as they are), e.g. ``torch.bfloat16`` sends fp32 master weights in half the
            bytes; a callable ``(name, tensor) -> dtype | None`` decides per tensor
            (``None``: as it is). The conversion is the pack copy into the pool (no
            separate cast); the layout carries the wire dtypes and sizes, and receivers
            cast to their destination dtypes. A conversion down the casting order
            (float -> int, complex -> real) raises :class:`WireDtypeError` before the
            bucket is put. A tied tensor is sent once, as its first name decides.
            ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` sends a tensor as FP8 with
            scales (``wire_scale``), quantized in the pack (see docs/weight-sync.md,
            "FP8 on the wire").
        wire_scale: The scale groups of FP8 tensors: ``"tensor"``, ``"row"`` or a
            ``(rows, cols)`` block of 2-D tensors (default ``(128, 128)``, the block-FP8
            layout of vLLM); a tensor that is not 2-D takes one scale.
        source_reads: Let :meth:`stream` skip the pool: when every receiver runs on
            this Ray node and may read this process, each receiver copies the buckets
            straight out of the source tensors; otherwise, for the module or mapping
            given as ``source``, each receiver READs them by reference over NIXL (their
            storages stay registered in the transport's storage cache until a stream no
            longer sends them, or :meth:`close`). Either way the source tensors must not
            change while ``stream()`` runs (see docs/weight-sync.md, "How the bytes
            move"). ``False``: always the pool.
        shard: ``(rank, world)`` when this sender is one of ``world`` trainer ranks whose
            tensors are dim-0 shards (FSDP): a name that several ranks hold is the
            concatenation, along dim 0 and in rank order, of their tensors (each rank's
            rows may differ in number, or be none), and ``sync([rank_0, ...,
            rank_world-1], receivers)`` must list the ranks in that order. ``None``
            (default): the names this sender holds are its own (see
            docs/weight-sync.md, "Many trainer ranks").

    Each publish snapshots the state (the pool copy is made at ``ray.put``), and a stream
    returns only after every receiver loaded every bucket and committed, so either way
    the trainer may keep training as soon as the call returns. ``version`` is the
    version of the last successful publish or stream (0 before any); a call without
    ``version=`` uses one more than the highest version this sender used, successful
    or not, so a retry after a stream that failed on some receivers (others may have
    committed it) is never refused as stale.
    """

    def __init__(self, source: Source | None = None, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 wire_dtype: WireDtype = None, source_reads: bool = True,
                 shard: tuple[int, int] | None = None,
                 wire_scale: WireScale = DEFAULT_WIRE_SCALE) -> None:
        check_bucket_bytes(bucket_bytes)
        self.shard = check_shard(shard)
        check_flag("source_reads", source_reads)
        check_wire_dtype(wire_dtype)
        self.wire_scale = check_wire_scale(wire_scale)
        self.source = source
        self.bucket_bytes = bucket_bytes
        self.wire_dtype = wire_dtype
        self.source_reads = source_reads
        self.version = 0
        self._used = 0  # the highest version sent to any receiver, successful or not
        self._spent = False  # a one-shot (iterator) source was consumed
        # Storage keys of the source tensors the last stream sent by reference: their
        # registrations stay in the transport's storage cache for the next stream, and
        # go once a stream no longer sends them (a replaced tensor) or at close().
        self._ref_keys: set[Any] = set()
        self._layouts = LayoutMemo()  # the last stream's layout, for the next one
        # Many-rank syncs: what this rank offered, per sync, until it is served.
        self._offers: dict[str, Any] = {}

    def close(self) -> None:
        """Let go of the NIXL registrations kept for by-reference streams (the storages
        of the source's tensors, in the transport's storage cache). The sender stays
        usable: a later stream registers them again. A sender that is dropped without
        ``close()`` leaves them to the cache's LRU bound (``registration_cache_bytes``)."""
        keys, self._ref_keys = self._ref_keys, set()
        release_registrations(keys)

    # -- many-rank offers (weights.rank_offer makes and serves them) --

    def _hold_offer(self, group: str, held: Any, version: int | None = None) -> None:
        """Keep what this rank offered for many-rank sync ``group`` until it is served;
        ``version``: the version offered, used up from now on whatever happens."""
        self._offers[group] = held
        if version is not None:
            self._used = max(self._used, version)

    def _offer(self, group: str) -> Any | None:
        return self._offers.get(group)

    def _take_offer(self, group: str) -> Any | None:
        return self._offers.pop(group, None)

    def _release_stale_offers(self) -> None:
        """Free the offers whose serve never came in time (their driver died between the
        offer and the serve)."""
        now = time.monotonic()
        for group, held in list(self._offers.items()):
            if not held.serving and now >= held.deadline:
                del self._offers[group]
                held.release()

    def _served(self, version: int, ref_keys: set[Any]) -> None:
        """A many-rank sync served from this rank ended: ``version`` was sent, and the
        storages it read by reference stay registered; those it no longer sends
        (replaced tensors) go."""
        if ref_keys or self._ref_keys:
            release_registrations(self._ref_keys - ref_keys)
            self._ref_keys = ref_keys
        self.version = max(self.version, version)

    def _acquire(self, state: SourceLike | None
                 ) -> tuple[StateLike | None, Iterator[tuple[str, torch.Tensor]] | None]:
        """This sync's weights: ``(state, None)`` for a module or mapping, else
        ``(None, pairs)`` for a lazy source (consumed once, as the buckets are made)."""
        if state is None:
            src = self.source
            if src is None:
                raise InvalidInputError("WeightSender has no source; pass state= or source=")
            if isinstance(src, Iterator):
                if self._spent:
                    raise SourceExhaustedError(
                        f"the WeightSender's source is a one-shot {type(src).__name__}, "
                        "already consumed by an earlier sync; pass a zero-argument "
                        "callable that returns a fresh iterable, e.g. WeightSender(lambda: "
                        "model.named_parameters()), or pass state= to each call")
                self._spent = True
                return None, named_pairs(src)
            if callable(src) and not isinstance(src, torch.nn.Module):
                src = src()
            state = src
        if isinstance(state, (torch.nn.Module, Mapping)):
            return state, None
        if isinstance(state, Iterable) and not isinstance(state, (str, bytes, torch.Tensor)):
            return None, named_pairs(state)
        raise InvalidInputError(
            f"a weight source is an nn.Module, a Mapping[str, Tensor], an iterable of "
            f"(name, tensor) pairs or a callable returning one; got {type(state).__name__}")

    def _next_version(self, version: int | None) -> int:
        if version is None:
            return max(self.version, self._used) + 1
        if isinstance(version, bool) or not isinstance(version, int):
            raise InvalidInputError(f"version must be an int, got {version!r}")
        return version

    def layout(self, state: SourceLike | None = None) -> WeightLayout:
        """The layout the next publish would have (no data is moved).

        A lazy source is consumed to compute it (a callable is called once more; a
        one-shot iterator is spent).
        """
        eager, pairs = self._acquire(state)
        if eager is not None:
            return plan_layout(eager, self.bucket_bytes, self.wire_dtype, self.wire_scale)[0]
        assert pairs is not None
        specs = []
        for packed in iter_buckets(pairs, self.bucket_bytes, self.wire_dtype,
                                    self.wire_scale):
            specs.append(packed.spec)
            del packed
        return layout_of(specs, self.bucket_bytes)

    def publish(self, state: SourceLike | None = None, *, version: int | None = None
                ) -> Manifest:
        """Put every bucket now and return the manifest.

        ``version`` is the manifest's version (an int, e.g. the trainer step); without
        it, one more than the highest version this sender used. Receivers refuse a
        manifest that is not newer than their last complete load
        (:class:`StaleVersionError`).

        A lazy source is consumed whole here, bucket by bucket: each bucket is put as
        soon as it is full and its source tensors are dropped then. Every bucket is a
        snapshot: the trainer may modify its weights as soon as this returns. Buckets
        that do not fit the pool are copied into overflow memory (listed in
        ``Manifest.overflow``; with ``strict=True`` in the pool config they raise
        ``PoolExhaustedError`` instead). Nothing is ever sent by reference unless the
        trainer registered its memory with ``register_memory()``. Use :meth:`stream`
        for states larger than the pool. A lazy source that repeats a name raises
        :class:`DuplicateNameError` and publishes nothing.
        """

        return self._publish(state, self._next_version(version), True)

    def _publish(self, state: SourceLike | None, v: int, final: bool) -> Manifest:
        """:meth:`publish` of version ``v``; ``final=False`` (a many-rank offer) leaves
        :attr:`version` to be set once the receivers have it."""
        eager, pairs = self._acquire(state)
        refs: list[list[ObjectRef] | None] = []
        overflow: list[int] = []
        fallbacks = pool_stats().fallbacks

        def put(k: int, tensors: list[torch.Tensor], entries: Sequence[TensorEntry]) -> None:
            nonlocal fallbacks
            refs.append([_put_bucket(tensors, entries)])
            now = pool_stats().fallbacks
            if now != fallbacks:
                overflow.append(k)
                fallbacks = now

        if eager is not None:
            layout, groups = plan_layout(eager, self.bucket_bytes, self.wire_dtype,
                                         self.wire_scale)
            for k, tensors in enumerate(groups):
                put(k, tensors, [e for e in layout.entries if e.bucket == k])
        else:
            assert pairs is not None
            specs: list[BucketLayout] = []
            try:
                for packed in iter_buckets(pairs, self.bucket_bytes, self.wire_dtype,
                                            self.wire_scale):
                    specs.append(packed.spec)
                    put(packed.spec.bucket.index, packed.tensors, packed.spec.entries)
                    packed.tensors.clear()  # the pool holds the snapshot now
                    del packed
            except DuplicateNameError as e:
                refs.clear()  # frees the buckets put so far
                raise DuplicateNameError(e.name, e.bucket, (),
                                         "publish() published nothing") from None
            except BaseException:
                refs.clear()
                raise
            layout = layout_of(specs, self.bucket_bytes)
        if final:
            self.version = v
        self._used = max(self._used, v)  # the next default is past every version used
        return Manifest(layout, refs, v, tuple(overflow), int(pool_stats().pool_used),
                        uuid.uuid4().hex)

    def stream(self, receivers: Sequence[ActorHandle], state: SourceLike | None = None, *,
               version: int | None = None, receiver_attr: str = RECEIVER_ATTR,
               max_inflight: int = 2, timeout_s: float = 300.0, relay: str | None = None,
               relay_order: str = "caller") -> StreamReport:
        """Sync ``receivers`` bucket by bucket with bounded sender pool memory.

        Each receiver actor must hold a :class:`WeightReceiver` at ``receiver_attr``.
        ``version`` as in :meth:`publish`; a receiver whose last complete load is not
        older refuses the stream when it begins (:class:`StaleVersionError`, before any
        bucket is put).

        For a module or mapping, every receiver first validates the whole layout (a
        mismatch raises here, before any bucket is put). For a lazy source (an iterable
        of pairs) the layout is not known up front: each bucket is filled as pairs
        arrive and sent with its own :class:`BucketLayout`, which each receiver
        validates before writing that bucket; a mismatch then raises at that bucket
        (earlier buckets are loaded, the receivers' versions unchanged), and
        ``strict`` missing tensors are found after the last bucket.

        Each receiver costs three Ray calls whatever the bucket count: begin, one
        ``receive`` call that loads every bucket, and the commit. The buckets travel on
        the data plane: for each bucket, wait until fewer than ``max_inflight`` buckets
        are out and the pool has room for it, pack it into the pool as an object this
        stream owns (:class:`PoolBucket`: not a Ray object), and signal it ready to the
        receivers (a NIXL notification); each signals back once it wrote the bucket, and
        the bucket is freed once every receiver did. "Room" means the pool has the
        bucket's bytes free and this stream's pool use (``pool_used`` beyond what was
        in use when the stream began) stays within ``max_inflight * bucket_bytes``. A
        lazy source is only pulled for the next bucket once there is room for a full
        bucket, and the sender drops its tensors as soon as their bucket is packed, so
        beyond the model and the pool the sync holds at most ``max_inflight`` buckets
        of source tensors plus one tensor. No bucket is ever packed without room, so
        there is no fallback registration. With ``max_inflight >= 2`` packing bucket
        ``k+1`` overlaps the receivers' reads of bucket ``k``; ``max_inflight=1``
        serialises them.

        ``source_reads=True`` skips the pack for a bucket whose tensors lie as they are
        sent, and keeps its tensors until every receiver read it: with every receiver
        on this Ray node and able to read this process, the receivers get the tensors'
        addresses and copy them out of this process (:class:`SourceBucket`);
        otherwise, for the module or mapping this sender holds as ``source`` (not
        ``state=``), whose bytes fit the storage cache (``registration_cache_bytes``),
        they READ them by reference over NIXL. Other buckets go through the pool as
        above.

        Once every receiver has every bucket, the sender tells each to commit
        (:meth:`WeightReceiver._finish_stream`) and waits for it: a receiver never
        commits a stream this sender gave up on, and when ``stream()`` returns every
        receiver's ``version`` is the new one.

        ``timeout_s`` is "no progress for this long": a sync takes as long as its
        buckets need, and raises :class:`WeightSyncTimeoutError` (naming the receivers
        it waits for) once nothing moved for ``timeout_s``: no bucket done, no pool
        room. A receiver that dies raises :class:`ReceiverError` naming it. Raises
        ``PoolExhaustedError`` if a bucket cannot fit the pool at all (up front for a
        module or mapping, at that bucket for a lazy source),
        :class:`DuplicateNameError` if a lazy source repeats a name, and re-raises a
        receiver's error. On any error (a begin refused included) every receiver is
        told to drop the stream; a receiver whose receive call had not started yet
        reads nothing. The sender frees every bucket it still holds once no receive
        call may read it: at once, or when that call ends. A failure at the commit
        itself may leave some receivers committed (``ReceiverError.committed``); the
        version is used up either way (the next default version is past it).

        ``relay="chain"`` sends each bucket once, to the first receiver of a chain; each
        receiver reads it from the one before it (from its destination tensors, or a
        snapshot in its own pool of at most ``max_inflight`` buckets, taken as the
        bucket arrived), while that one reads the next bucket. ``relay_order="caller"``
        chains the receivers as given, ``"placement"`` groups them by Ray node, this
        node's first. A receiver that dies or stops answering for ``timeout_s`` raises
        :class:`RelayReceiverError` naming it; no receiver commits then. A receiver
        with ``select=`` can only be last.
        """
        return self._stream(receivers, state, version=version, receiver_attr=receiver_attr,
                            max_inflight=max_inflight, timeout_s=timeout_s, relay=relay,
                            relay_order=relay_order)

    def _stream(self, receivers: Sequence[ActorHandle], state: SourceLike | None = None, *,
                version: int | None = None, receiver_attr: str = RECEIVER_ATTR,
                max_inflight: int = 2, timeout_s: float = 300.0, relay: str | None = None,
                relay_order: str = "caller", beat: Beat | None = None,
                peer: bool = False, session: str = "",
                peer_shard: Any = None) -> StreamReport:
        """:meth:`stream`; ``beat``: the driver's wait, told of progress (and able to
        cancel the stream before it commits); ``session``: the driver's id for it;
        ``peer_shard``: a catch-up's peer says which shard it holds."""
        receivers = actor_handles(receivers, "stream()")
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) \
                or max_inflight < 1:
            raise InvalidInputError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
        deadline_s = check_timeout(timeout_s)
        check_relay(relay, relay_order)
        self._release_stale_offers()
        t0 = time.perf_counter()
        v = self._next_version(version)
        eager, pairs = self._acquire(state)
        st = StreamSession(
            receivers, v, receiver_attr=receiver_attr, max_inflight=max_inflight,
            timeout_s=deadline_s, bucket_bytes=self.bucket_bytes, wire_dtype=self.wire_dtype,
            wire_scale=self.wire_scale,
            source_reads=self.source_reads,
            by_reference=state is None and isinstance(self.source, (torch.nn.Module, Mapping)),
            relay=relay, order=relay_order, beat=beat, peer=peer, session=session,
            peer_shard=peer_shard)
        st.plan(eager, pairs, self._layouts)
        # From here on ``v`` may be committed by some receiver, even if the stream fails:
        # the next default version is past it.
        self._used = max(self._used, v)
        try:
            st.run()
        except BaseException:
            self._ref_keys |= st.ref_keys  # the next complete stream sorts them out
            raise
        self.version = v
        if st.by_ref or self._ref_keys:
            # Tensors the source no longer holds (replaced) need not stay registered.
            release_registrations(self._ref_keys - st.ref_keys)
            self._ref_keys = st.ref_keys
        return st.report(t0)
