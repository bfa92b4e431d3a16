"""The inference actor's side of weight sync: :class:`WeightReceiver`.

Owns a receiver's version and who may write its destination: the version reservations
of loads in progress, the one stream that holds the receiver between its calls
(:class:`_Stream`), and the two locks. A load checks and plans with
:mod:`~ray_rdt_pool.weights.loadplan` and writes each bucket with
:func:`~ray_rdt_pool.weights.loading.load_bucket`. Lives in the inference actor for as
long as it keeps it. Threads: any of the actor's (``max_concurrency > 1``,
:meth:`WeightReceiver.load_async`, stream calls on ``__ray_call__``); ``_lock`` guards
the state, ``_writing`` serialises the writers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ray_rdt_pool.core.selection import Slices
from ray_rdt_pool.errors import (
    CommitHookError,
    InvalidInputError,
    ManifestMismatchError,
    ManifestReleasedError,
    StaleVersionError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from ray_rdt_pool.weights.loading import load_bucket
from ray_rdt_pool.weights.loadplan import BucketPlan, LoadPlan, plan_buckets, plan_load
from ray_rdt_pool.weights.manifest import (
    BucketLayout,
    Manifest,
    PoolBucket,
    SourceBucket,
    WeightLayout,
)
from ray_rdt_pool.weights.reports import BucketReport, LoadReport, ranges, summarise
from ray_rdt_pool.weights.staging import STAGINGS, ServingLock, Shadow
from ray_rdt_pool.weights.state import (
    Casting,
    LoadWeights,
    NameMap,
    Select,
    StateLike,
    check_flag,
    memory_key,
    named_tensors,
)
from ray_rdt_pool.weights.validate import (
    Claims,
    can_cast,
    check_layout,
    dest_targets,
    find_missing,
    mapper,
    normalize_select,
    raise_problems,
    resolve,
)

#: Per destination name: (manifest name, full shape, selection read; None: all of it).
Shard = dict[str, tuple[str, tuple[int, ...], "Slices | None"]]
#: How to get a version's :data:`Shard` when a catch-up asks (rarely): a sync keeps
#: the layout it read and works the record out only then, off its hot path.
ShardRecord = Callable[[], Shard]

if TYPE_CHECKING:
    from ray import ObjectRef

    from ray_rdt_pool.same_node.peer_memory import SourceProcess
    from ray_rdt_pool.weights.loading import Relay


@dataclass
class _Stream:
    """One stream in progress on a receiver."""

    session: str
    version: int
    plan: LoadPlan | None  # the whole layout's plan; None for a lazy (bucket-by-bucket) stream
    claimed: dict[str, str] = field(default_factory=dict)  # lazy: target name -> manifest name
    skipped: int = 0
    next: int = 0
    writing: bool = False  # it wrote a bucket (its staging copy was made ready then)
    pending: dict[int, tuple[list[Any], BucketLayout | None]] = field(
        default_factory=dict)
    failed: str | None = None
    #: it still holds its version's reservation (given back once: by its commit, or by
    #: its first failure; a second give-back would drop another load's reservation)
    reserved: bool = True
    draining: bool = False
    #: lazy: destination memory written so far, across buckets (see :class:`_Check`)
    mem: Claims = field(default_factory=Claims)
    #: the sender process this receiver accepted source-read buckets from, if any
    source: SourceProcess | None = None
    #: a relayed stream's hook, handed each bucket once it is written (see weights.relay)
    relay: Relay | None = None
    #: where each destination tensor lies in the full weights once this stream commits
    #: (see ``WeightReceiver._shard``)
    shard: ShardRecord | None = None


class WeightReceiver:
    """Loads manifests into a destination in place. Lives in the inference actor.

    Args:
        dest: An ``nn.Module`` (its ``state_dict(keep_vars=True)``: live parameters and
            persistent buffers) or a ``Mapping[str, Tensor]`` of the tensors to write.
            May be ``None`` when ``load_weights`` is given.
        load_weights: A callable taking an iterable of ``(name, tensor)`` pairs, such as
            an inference engine's ``model.load_weights``. Each bucket's tensors whose
            (mapped) name is not in ``dest`` are passed to it as soon as the bucket
            arrives, in the manifest's dtype. The tensors are views of the receive arena,
            valid during the call only: copy what you keep (the arena block returns when
            the call ends). An exception in it raises :class:`LoaderError`.
        name_map: Maps a manifest name to a destination name: a dict (unlisted names
            keep their name) or a callable; ``None`` as the value skips the tensor.
        casting: dtype rule, see :func:`can_cast`. The destination's dtype is the
            target: fp32 weights load into a bf16 model converted.
        strict: Raise on destination tensors no manifest tensor maps to
            (:class:`MissingWeightsError`) and on manifest tensors whose mapped name is
            not in the destination and that no ``load_weights`` takes
            (:class:`UnexpectedWeightsError`). With ``False`` both are ignored (extras
            are skipped).
        direct: Land exactly matching buckets in the destination tensors
            (``set_target_for_ref``); ``False`` always reads into the arena and copies.
        select: Sharded pulls: ``select(name, full_shape)`` returns the part of manifest
            tensor ``name`` this receiver needs, as a tuple of ``slice`` objects (step 1,
            one per leading dimension; the rest are whole), or ``None`` for all of it.
            Only those bytes are read (``transport.fetch_selected``), and tensors nobody
            takes are not read at all. The destination tensor has the selected shape;
            ``load_weights`` gets the selected part. An answer that does not fit the
            full shape raises :class:`SelectError` before anything is read. Buckets with
            a selection go through the arena (no direct landing); aliases (tied
            tensors) get their canonical tensor's selection.
        staging: ``"inplace"`` (default): buckets are written into the destination as
            they arrive. ``"shadow"``: they land in a staging copy of the destination
            (one more copy of it: ``staging_bytes``), the engine keeps serving its
            version meanwhile, and the commit makes the new version live at once: a
            copy into the destination tensors (and, for ``load_weights``, one call with
            every tensor the sync brought), under the serving lock (:meth:`serving`).
            A sync that fails leaves the destination untouched.
        on_commit: Called with the new version once it is live (under the serving lock:
            no forward pass runs meanwhile), e.g. to reset a prefix cache. It must not
            load into this receiver.
        keep_fp8: A weight that arrives as FP8 with scales (the sender's
            ``wire_dtype``) goes to ``load_weights`` as it is, FP8, with its scales as
            ``(scale_name(name), scales)``; by default it is dequantized first (into the
            dtype the sender had). A destination tensor of that FP8 dtype always keeps
            it, its scales going to destination ``scale_name(name)``; a wider one gets
            it dequantized.
        scale_name: The name of an FP8 weight's scales, from the weight's (default
            ``name + "_scale_inv"``, as vLLM's block-FP8 layers name them).

    ``version`` is the version of the last manifest or stream fully loaded (0 before
    any); it never goes down: a load or stream that is not newer raises
    :class:`StaleVersionError` before it writes. One writer at a time, whatever the
    threads: of two loads of one version exactly one succeeds, a newer load or stream
    supersedes one in progress, and a load that fails leaves ``version`` as it was.
    """

    def __init__(self, dest: StateLike | None = None, *, load_weights: LoadWeights | None = None,
                 name_map: NameMap = None, casting: Casting = "same_kind", strict: bool = True,
                 direct: bool = True, select: Select | None = None,
                 staging: str = "inplace",
                 on_commit: Callable[[int], Any] | None = None, keep_fp8: bool = False,
                 scale_name: Callable[[str], str] | None = None) -> None:
        if select is not None and not callable(select):
            raise InvalidInputError(f"select must be callable (name, full_shape) -> slices | "
                                    f"None, got {type(select).__name__}")
        check_flag("strict", strict)
        check_flag("direct", direct)
        check_flag("keep_fp8", keep_fp8)
        if scale_name is not None and not callable(scale_name):
            raise InvalidInputError(f"scale_name must be callable (name) -> name, got "
                                    f"{type(scale_name).__name__}")
        if dest is None and load_weights is None:
            raise InvalidInputError("WeightReceiver needs a dest (module or mapping), a "
                                    "load_weights callable, or both")
        if load_weights is not None and not callable(load_weights):
            raise InvalidInputError(f"load_weights must be callable, got "
                                    f"{type(load_weights).__name__}")
        if staging not in STAGINGS:
            raise InvalidInputError(f"staging must be one of {STAGINGS}, got {staging!r}")
        if on_commit is not None and not callable(on_commit):
            raise InvalidInputError(f"on_commit must be callable (version) -> None, got "
                                    f"{type(on_commit).__name__}")
        if dest is not None:
            named_tensors(dest, "destination tensor")  # validate early
        can_cast(torch.float32, torch.float32, casting)
        mapper(name_map)
        self.dest = dest
        self.load_weights = load_weights
        self.name_map = name_map
        self.casting = casting
        self.strict = strict
        self.direct = direct
        self.select = select
        self.staging = staging
        self.on_commit = on_commit
        self.keep_fp8 = keep_fp8
        self.scale_name: Callable[[str], str] = scale_name or _default_scale_name
        # Forward passes read under it; a commit (or an in-place bucket) writes under it.
        self._serving = ServingLock()
        self._shadow = Shadow(dest, load_weights is not None) if staging == "shadow" else None
        self._version = 0
        self._loaded = False  # any complete load yet (so any first version is accepted)
        self._last_id = ""  # Manifest.id of the last complete load
        self._reserved: list[int] = []  # versions being loaded now
        # Guards the version, the reservations and the stream state. Never held while
        # waiting for _writing (taken first when both are needed).
        self._lock = threading.Lock()
        # Held while bytes are written (a whole load(), one stream bucket) and at a
        # stream's commit, so no commit ever sees another writer's bytes in flight.
        self._writing = threading.Lock()
        # The stream that holds this receiver between its calls (begin, buckets, commit).
        self._stream: _Stream | None = None
        # A load or stream wrote in place since the last commit: no version names the
        # destination's bytes until the next commit (a catch-up refuses to serve them).
        self._torn = False
        # The session of the last stream this receiver committed (an abort after a
        # source died tells the driver which receivers got that far).
        self._committed = ""
        # With select=: per destination name, the manifest name, full shape and selection
        # the committed version was read as, so that as a catch-up's peer this receiver
        # can say which shard it holds (None: unknown, or select is None).
        self._shard: ShardRecord | None = None
        # Sessions aborted before they began here (their begin call, sent by a source
        # that died, may still come): such a begin is refused. The newest few only.
        self._aborted: collections.deque[str] = collections.deque(maxlen=64)
        # (options and destination key, layout, plan) of the last check (see check()).
        self._checked: tuple[tuple[object, ...], WeightLayout, LoadPlan] | None = None

    @property
    def version(self) -> int:
        """The version of the last complete load (0 before any)."""
        return self._version

    @property
    def staging_bytes(self) -> int:
        """Bytes of memory the ``"shadow"`` staging holds now (0 ``"inplace"``)."""
        return self._shadow.nbytes if self._shadow is not None else 0

    def serving(self) -> contextlib.AbstractContextManager[None]:
        """A read section for the engine's own forward pass::

            with engine.weight_receiver.serving():
                out = model(batch)

        A commit waits for the sections in progress and holds new ones off while it
        makes the new version live, so a section never sees two versions with
        ``staging="shadow"``. With ``"inplace"`` each bucket's write waits for the
        sections in progress instead (no torn tensor, but a section between two buckets
        sees part of the new version)."""
        return self._serving.read()

    def _view(self) -> Any:
        """What a sync plans against: this receiver, or its staging copy."""
        return self if self._shadow is None else _ShadowView(self, self._shadow)

    def _begin_writing(self) -> None:
        """Before a version's first write (under ``_writing``): a staging copy starts
        from the live tensors."""
        if self._shadow is not None:
            self._shadow.begin()
    def _reserve(self, version: int, what: str = "manifest", manifest_id: str = "") -> None:
        """Check that ``version`` is newer than the last complete load and than every load
        in progress, and reserve it, atomically; else raise StaleVersionError.

        The one exception: the manifest loaded last (same ``Manifest.id``) may be loaded
        again when no load of it is in progress (``release=False`` re-loads)."""
        with self._lock:
            top = max(self._reserved, default=None)
            if top is not None and version <= top:
                raise StaleVersionError(version, top, what, loading=True)
            self._newer_locked(version, what, manifest_id)
            self._reserved.append(version)

    def _unreserve(self, version: int) -> None:
        with self._lock:
            self._unreserve_locked(version)

    def _unreserve_locked(self, version: int) -> None:
        if version in self._reserved:
            self._reserved.remove(version)

    def _newer_locked(self, version: int, what: str, manifest_id: str = "") -> None:
        """StaleVersionError unless ``version`` is newer than the last complete load (or
        is the manifest loaded last, loaded again)."""
        again = bool(manifest_id) and manifest_id == self._last_id and version == self._version
        if self._loaded and version <= self._version and not again:
            raise StaleVersionError(version, self._version, what)

    def _take_over_locked(self, version: int, what: str, manifest_id: str = "") -> None:
        """Before a load writes or a stream begins: re-check the version (a load may have
        committed a newer one since the reservation), refuse if a stream of the same or a
        newer version holds the receiver, and supersede an older one (it never commits)."""
        self._newer_locked(version, what, manifest_id)
        st = self._stream
        if st is not None and st.failed is None and st.version >= version:
            raise StaleVersionError(version, st.version, what, loading=True)
        if st is not None:
            self._drop_locked(st, f"{what} version {version} superseded it on this receiver")

    def _drop_locked(self, st: _Stream, why: str) -> None:
        """End stream ``st`` without a commit: its later buckets and its commit are refused,
        and the buckets it holds early are dropped."""
        if self._stream is st:
            self._stream = None
        self._fail_locked(st, why)

    def _commit_locked(self, version: int, what: str, manifest_id: str = "",
                       wait_s: float | None = None, shard: ShardRecord | None = None
                       ) -> None:
        """Make ``version`` live (its destination tensors read as ``shard`` says), waiting
        at most ``wait_s`` for the serving sections in progress; then call ``on_commit``
        (:class:`CommitHookError` if it raises: the version stands)."""
        self._newer_locked(version, what, manifest_id)  # never lets the version go down
        self._unreserve_locked(version)

        def live() -> None:
            self._version, self._loaded, self._last_id = version, True, manifest_id
            self._torn, self._shard = False, shard
            if self.on_commit is None:
                return
            try:
                self.on_commit(version)
            except Exception as e:
                raise CommitHookError(
                    f"version {version} was committed on this receiver, then on_commit "
                    f"raised {type(e).__name__}: {e}; the weights are live, what the hook "
                    "was to do is not done: fix the hook", version) from e

        if self._shadow is not None:
            self._shadow.commit(self._serving, self.load_weights, live, wait_s)
        else:
            with self._serving.write(wait_s):
                live()

    # -- validation --

    def check(self, layout: WeightLayout) -> LoadPlan:
        """Validate ``layout`` against the destination and plan the load; writes nothing.

        Raises a :class:`ManifestMismatchError` subclass listing every problem, or
        :class:`WeightSyncError` for a layout that contradicts itself.

        The last plan is kept and returned again for an equal layout while the options
        and every fact of the destination tensors a check reads are unchanged (each sync
        of one model sends the same layout); otherwise the layout is checked afresh.
        """
        key = self._check_key()
        memo = self._checked
        if key is not None and memo is not None and memo[0] == key and memo[1] == layout:
            return memo[2]
        plan = plan_load(self._view(), layout)
        # Kept only when nothing a check reads can change behind the key (a callable
        # name_map or select may answer otherwise next time).
        self._checked = (key, layout, plan) if key is not None else None
        return plan

    def _check_key(self) -> tuple[object, ...] | None:
        """What :meth:`check` reads besides the layout, or None when it cannot be told."""
        if self.select is not None or callable(self.name_map):
            return None
        dest = memory_key(named_tensors(self.dest, None)) if self.dest is not None else ()
        if dest is None:
            return None
        names = tuple(self.name_map.items()) if self.name_map is not None else None
        return (self.dest is None, self.load_weights is None, names, self.casting,
                self.strict, self.direct, self.staging, self.keep_fp8, self.scale_name, dest)

    # -- loading --

    def _load_bucket(self, plan: BucketPlan, ref: ObjectRef | SourceBucket | PoolBucket,
                     source: SourceProcess | None = None, relay: Relay | None = None
                     ) -> BucketReport:
        # One method for every bucket a load or stream writes: a subclass may wrap it.
        if self._shadow is not None:
            loader = self._shadow.stage if self.load_weights is not None else None
            return load_bucket(plan, ref, source, loader, relay)
        with self._serving.write():
            self._torn = True
            return load_bucket(plan, ref, source, self.load_weights, relay)

    def _accept_source(self, session: str, source: SourceProcess) -> bool:
        """For stream ``session`` (just begun): accept buckets read straight out of
        ``source`` if :meth:`_can_read_source`; buckets naming any other process are
        refused."""
        ok = self._can_read_source(source)
        with self._lock:
            st = self._stream
            if st is None or st.session != session:
                return False
            st.source = source if ok else None
        return ok

    def _can_read_source(self, source: SourceProcess) -> bool:
        """Whether this receiver can copy stream buckets straight out of ``source`` (the
        sender's process): same Ray node, ``same_node`` not ``"off"`` here, and the
        kernel lets it read that process (see docs/weight-sync.md)."""
        from ray_rdt_pool._ray.owned import can_read_source

        return can_read_source(source)

    def load(self, manifest: Manifest, *, release: bool = True) -> LoadReport:
        """Validate, then load every bucket of ``manifest`` in order, in place.

        Raises :class:`StaleVersionError` (writing nothing) when ``manifest.version`` is
        not newer than :attr:`version`, or than a load or stream in progress. Loads on
        one receiver run one at a time (a concurrent one waits, then checks its version
        again before it writes: an older one then raises). A load newer than a stream in
        progress supersedes that stream once its bucket in progress is written (the
        stream's later buckets and its commit are refused). With ``release=True`` each
        bucket's ref is removed from ``manifest`` (this process's copy) as soon as the
        bucket is loaded.
        """
        return self._load_manifest(manifest, release)

    def _load_manifest(self, manifest: Manifest, release: bool,
                       progress: Callable[[], None] | None = None,
                       before_commit: Callable[[], None] | None = None,
                       commit_wait_s: float | None = None) -> LoadReport:
        """:meth:`load`; ``progress()`` is called after each bucket and
        ``before_commit()`` before the version is committed (a driver's wait: either may
        raise to stop the load); the commit waits at most ``commit_wait_s`` for the
        serving sections in progress (the driver stops waiting after that)."""
        check_flag("release", release)
        if not isinstance(manifest, Manifest):
            raise InvalidInputError(f"load() takes a Manifest (from WeightSender.publish), "
                                    f"got {type(manifest).__name__}")
        v, mid = manifest.version, manifest.id
        self._reserve(v, "manifest", mid)
        try:
            # Refused manifests (a layout mismatch, released buckets) write nothing, so
            # they must not supersede a healthy stream either: check before taking over.
            plan = self._plan(manifest)
            with self._writing:
                with self._lock:
                    self._take_over_locked(v, "manifest", mid)
                self._begin_writing()
                report = self._load(manifest, plan, release, progress)
                if before_commit is not None:
                    before_commit()
                with self._lock:
                    self._commit_locked(v, "manifest", mid, commit_wait_s,
                                        self._shard_of(manifest.layout))
        finally:
            self._unreserve(v)
        return report

    def _plan(self, manifest: Manifest) -> LoadPlan:
        plan = self.check(manifest.layout)
        missing = [k for k, r in enumerate(manifest.refs) if r is None]
        if missing:
            raise ManifestReleasedError(
                f"bucket(s) {missing[:10]} of manifest version {manifest.version} were "
                "already released; load a fresh manifest, or pass release=False to load "
                "one twice")
        return plan

    def _load(self, manifest: Manifest, plan: LoadPlan, release: bool,
              progress: Callable[[], None] | None = None) -> LoadReport:
        reports: list[BucketReport] = []
        for bp in plan.buckets:
            box = manifest.refs[bp.index]
            assert box is not None
            reports.append(self._load_bucket(bp, box[0]))
            if release:
                manifest.refs[bp.index] = None
            del box
            if progress is not None:
                progress()
        return summarise(manifest.version, reports, plan.skipped)

    async def load_async(self, manifest: Manifest, *, release: bool = True) -> LoadReport:
        """:meth:`load` in a worker thread, for ``async def`` actor methods.

        The actor's event loop keeps serving other calls while the buckets are read and
        copied (``asyncio.to_thread``).
        """
        return await asyncio.to_thread(self.load, manifest, release=release)

    # -- streaming (called through __ray_call__ by WeightSender.stream) --

    def _begin_stream(self, session: str, layout: WeightLayout | None, version: int,
                      peer: bool = False, peer_shard: Shard | None = None) -> int:
        """Validate a streamed layout and get ready for its buckets.

        ``layout=None`` starts a lazy stream, whose buckets each bring their own
        :class:`BucketLayout`. Raises :class:`StaleVersionError` when ``version`` is not
        newer than :attr:`version`, or than a load or stream in progress. A stream in
        progress of an older version (its sender gave up, or died) is superseded: its
        later buckets and its commit are refused. Returns the number of manifest tensors
        this receiver will skip (0 for a lazy stream; :meth:`_finish_stream` returns its
        count). ``peer``: the stream comes from another engine's receiver
        (:func:`~ray_rdt_pool.weights.catch_up`), whose names are destination names,
        holding the shard ``peer_shard`` says (None: whole tensors).
        """
        self._reserve(version, "peer stream" if peer else "stream")
        try:
            shard: ShardRecord | None = None
            if peer and self.select is not None and peer_shard is not None:
                shard = functools.partial(dict, peer_shard)
            if layout is None:
                plan = None
            elif peer:
                plan = self._peer_plan(layout, peer_shard)
            else:
                plan = self.check(layout)
                shard = self._shard_of(layout)
            with self._lock:
                if session in self._aborted:
                    raise WeightSyncError(
                        f"stream {session} was aborted before it began on this receiver "
                        "(its source died or gave up); nothing was written")
                self._take_over_locked(version, "stream")
                self._stream = _Stream(session, version, plan, shard=shard)
        except BaseException:
            self._unreserve(version)
            raise
        return plan.skipped if plan is not None else 0

    def _peer_plan(self, layout: WeightLayout, peer_shard: Shard | None = None) -> LoadPlan:
        """The plan of a peer's stream: its names are destination names (no
        ``name_map``), and each lands in the destination tensor of that name, of the
        same dtype (no ``load_weights``, no ``select``: the peer sends what it holds).
        With ``select``, each tensor the peer holds in part must be the part this
        receiver selects (:class:`SelectError` names those that are not)."""
        if self.dest is None:
            raise WeightSyncError(
                "this receiver has no destination tensors (load_weights only), so it "
                "cannot take an engine's weights by name; catch it up from the trainer")
        self._check_peer_shard(layout, peer_shard)
        try:
            return plan_load(_PeerView(self), layout)
        except ManifestMismatchError as e:
            raise type(e)(f"{e} (from a peer engine, which sends the tensors it holds: "
                          "an engine with select= holds its shard only)", e.problems) from None

    def _shard_of(self, layout: WeightLayout,
                  sharded: Mapping[str, tuple[int, ...]] | None = None
                  ) -> ShardRecord | None:
        """The record of where each destination tensor lies in the full weights when
        ``layout`` is read with this receiver's ``select`` (None without one), worked out
        when asked; ``sharded``: the full shapes of names a many-rank sync sends as dim-0
        pieces."""
        if self.select is None or self.dest is None:
            return None
        return functools.partial(self._read_shard, layout, dict(sharded or {}))

    def _held_shard(self) -> Shard | None:
        """Where the committed version's tensors lie in the full weights (None: whole
        tensors, or unknown)."""
        return self._shard() if self._shard is not None else None

    def _read_shard(self, layout: WeightLayout, sharded: Mapping[str, tuple[int, ...]]
                    ) -> Shard:
        """The :data:`Shard` a :func:`_shard_of` record stands for."""
        to_dest = mapper(self.name_map)
        dests = set(dest_targets(self))
        select = self.select
        assert select is not None  # _shard_of made the record only with one
        out: Shard = {}
        whole = [(e.name, tuple(e.shape)) for e in layout.entries if e.scale_of is None]
        for mname, shape in [*whole, *(sharded or {}).items()]:
            try:
                name = to_dest(mname)
                sel = normalize_select(select(mname, shape), shape)
            except Exception:  # check() has refused such a layout already
                continue
            if name is not None and name in dests:
                out[name] = (mname, shape, sel)
        return out

    def _check_peer_shard(self, layout: WeightLayout, peer_shard: Shard | None) -> None:
        """SelectError unless every tensor of a peer's ``layout`` that the peer holds in
        part is the part this receiver's ``select`` reads (shapes alone cannot tell one
        rank's rows from another's)."""
        if peer_shard is None or self.select is None:
            return  # whole tensors on one side: the shapes tell part from whole
        problems: list[tuple[str, str, str]] = []
        for e in layout.entries:
            held = peer_shard.get(e.name)
            if held is None:
                continue
            mname, full, theirs = held
            try:
                mine = normalize_select(self.select(mname, full), full)
            except Exception as err:
                problems.append(("select", e.name, f"select({mname!r}, {full}) failed: "
                                                   f"{err}"))
                continue
            if mine != theirs:
                problems.append(("select", e.name, (
                    f"{e.name!r}: the peer holds {_part(theirs)} of {mname!r} {full}, and "
                    f"this receiver selects {_part(mine)}")))
        raise_problems(problems, "nothing was written; catch up from an engine that holds "
                                 "the same shard")

    def _current(self, session: str) -> _Stream:
        """Stream ``session`` if it holds this receiver and has not failed (call with
        ``_lock`` held); else WeightSyncError."""
        st = self._stream
        if st is None or st.session != session or st.failed is not None:
            raise WeightSyncError(f"stream {session} is not in progress on this "
                                  "receiver (a newer load or stream superseded it, or it "
                                  "was aborted)")
        return st

    def _stream_plan(self, session: str) -> LoadPlan | None:
        """Stream ``session``'s whole plan (None for a lazy stream)."""
        with self._lock:
            return self._current(session).plan

    def _accepted_source(self, session: str) -> SourceProcess | None:
        """The sender process stream ``session`` may read buckets straight out of."""
        with self._lock:
            return self._current(session).source

    def _hold_locked(self, session: str, version: int, plan: LoadPlan,
                     shard: ShardRecord | None = None) -> None:
        """A many-rank load (its version reserved, the receiver taken over) holds the
        receiver as stream ``session`` until the driver's commit or abort."""
        self._stream = _Stream(session, version, plan, shard=shard)

    def _all_loaded(self, session: str, buckets: int) -> None:
        """A many-rank load of ``session`` wrote its ``buckets`` buckets: it may commit."""
        with self._lock:
            self._current(session).next = buckets

    def _unreserve_unheld(self, session: str, version: int) -> None:
        """A many-rank load failed: give its version's reservation back, once (through
        the stream that holds it, if it got that far)."""
        with self._lock:
            st = self._stream
            if st is not None and st.session == session:
                self._drop_locked(st, "its load failed")
            else:
                self._unreserve_locked(version)

    def _relay_stream(self, session: str, hook: Relay) -> LoadPlan | None:
        """Hand stream ``session`` (just begun) the relay hook its buckets go to once
        written; returns its plan (None for a lazy stream). WeightSyncError if this
        receiver is no longer in that stream."""
        with self._lock:
            st = self._current(session)
            st.relay = hook
            return st.plan

    def _abort_stream(self, session: str | None = None) -> bool:
        """Drop the stream in progress (``session``, or any) and the buckets it holds.
        It never commits; a bucket being written now finishes, and is the last. Returns
        whether ``session`` had committed here already (nothing to drop then)."""
        from ray_rdt_pool.weights.links import forget

        with self._lock:
            st = self._stream
            if st is None or (session is not None and st.session != session):
                if session is not None and session != self._committed:
                    self._aborted.append(session)
                    forget(session)  # the signals its source sent ahead go too
                return session is not None and session == self._committed
            self._drop_locked(st, "the stream was aborted")
        # Signals for it that no receive loop will read (one that runs keeps its own).
        forget(st.session)
        return False

    def _holds(self, session: str) -> bool:
        """Whether stream ``session`` still holds this receiver, unfailed (its receive
        loop ends once an abort dropped it)."""
        with self._lock:
            st = self._stream
            return st is not None and st.session == session and st.failed is None

    def _load_stream_bucket(self, session: str, k: int,
                           box: list[ObjectRef] | list[PoolBucket | SourceBucket],
                           spec: BucketLayout | None = None) -> list[BucketReport]:
        """Load bucket ``k`` of the current stream; returns the buckets loaded by this call.

        Buckets are loaded in order. One that arrives early (an async or threaded actor
        may run the calls out of order) is kept and loaded, by the call that loads its
        predecessor, right after it; such a call returns ``[]``. After a failure the
        stream's later buckets are refused. Nothing is committed here: the version is
        committed by :meth:`_finish_stream`, which the sender calls once every receiver
        acknowledged every bucket.
        """
        with self._lock:
            st = self._stream
            if st is None or st.session != session:
                box.clear()
                raise WeightSyncError(
                    f"bucket {k} of stream {session} arrived, but this receiver is not in "
                    "that stream (a newer load or stream superseded it, or it was aborted)")
            if st.failed is not None:
                box.clear()
                raise WeightSyncError(f"bucket {k} skipped: {st.failed}")
            if (st.plan is None) != (spec is not None) or k < st.next or k in st.pending:
                self._fail_locked(st, f"bucket {k} does not belong to this stream "
                                      f"(expected {st.next})")
                box.clear()
                raise WeightSyncError(st.failed)
            st.pending[k] = (box, spec)
            if st.draining:
                return []  # the call loading an earlier bucket loads this one too
            st.draining = True
        reports: list[BucketReport] = []
        loaded_k = False
        while True:
            # One bucket per hold of _writing: a newer load waits for this bucket only,
            # and supersedes the stream before its next one.
            with self._writing:
                with self._lock:
                    item = None
                    if self._stream is st and st.failed is None:
                        item = st.pending.pop(st.next, None)
                    if item is None:
                        st.draining = False
                        if st.failed is not None and not loaded_k:
                            raise WeightSyncError(f"bucket {k} skipped: {st.failed}")
                        return reports
                    j = st.next
                kbox, kspec = item
                del item
                try:
                    if not st.writing:
                        st.writing = True
                        self._begin_writing()
                    reports.append(self._stream_one(st, j, kbox[0], kspec))
                except BaseException as e:
                    with self._lock:
                        self._fail_locked(st, f"bucket {j} failed on this receiver: {e!r}")
                        st.draining = False
                    raise
                finally:
                    kbox.clear()
                with self._lock:
                    st.next = j + 1
                loaded_k = loaded_k or j == k

    def _fail_locked(self, st: _Stream, why: str) -> None:
        """Stream ``st`` failed here: it keeps the receiver (so its later buckets are
        refused with ``why``) until it is aborted or superseded, and never commits."""
        if st.reserved:
            st.reserved = False
            self._unreserve_locked(st.version)
        if st.failed is None:
            st.failed = why
        for b, _s in st.pending.values():
            b.clear()
        st.pending.clear()

    def _stream_one(self, st: _Stream, k: int, ref: ObjectRef | SourceBucket | PoolBucket,
                    spec: BucketLayout | None
                    ) -> BucketReport:
        # Only a relayed stream passes its hook: a subclass's wrapper may take no more.
        extra = (st.relay,) if st.relay is not None else ()
        if st.plan is not None:
            return self._load_bucket(st.plan.buckets[k], ref, st.source, *extra)
        assert spec is not None
        if spec.bucket.index != k:
            raise WeightSyncError(f"bucket {k} arrived with the layout of bucket "
                                  f"{spec.bucket.index}")
        check_layout(spec.entries, (spec.bucket,), k)
        by_name = {e.name: e for e in spec.entries}
        sources = [(e.name, e) for e in spec.entries if e.scale_of is None]
        sources += [(a, by_name[c]) for a, c in spec.aliases if c in by_name]
        problems: list[tuple[str, str, str]] = []
        claimed, mem = dict(st.claimed), st.mem.copy()
        view = self._view()
        resolved, skipped, selections = resolve(view, sources, dest_targets(view), claimed,
                                                 problems, mem, lazy=True)
        raise_problems(problems, f"bucket {k} was not written; bucket(s) {ranges(range(k))} "
                         f"were, and the version stays {self._version}")
        layout = WeightLayout(spec.entries, (spec.bucket,), spec.aliases)
        rep = self._load_bucket(plan_buckets(view, layout, resolved, selections)[0], ref,
                                st.source, *extra)
        st.claimed, st.mem, st.skipped = claimed, mem, st.skipped + skipped
        return rep

    def _finish_stream(self, session: str, buckets: int, deadline: float | None = None
                       ) -> int:
        """Commit a stream after its ``buckets`` buckets: the sender calls it once every
        receiver acknowledged every bucket. Checks for destination tensors that received
        nothing (``strict``; a lazy stream's only chance to), then commits the version.
        A stream that was aborted, superseded or failed here never commits, nor one
        whose commit cannot happen by ``deadline`` (``time.time()``: the sender stops
        waiting then; serving sections may hold a commit off until it). Returns the
        number of manifest tensors skipped."""
        with self._writing, self._lock:
            st = self._stream
            if st is None or st.session != session:
                raise WeightSyncError(
                    f"stream {session} ended, but this receiver is not in that stream (a "
                    "newer load or stream superseded it, or it was aborted); the version "
                    f"stays {self._version}")
            if st.failed is not None:
                raise WeightSyncError(f"stream {session} failed on this receiver: {st.failed}")
            if st.next != buckets or st.pending:
                raise WeightSyncError(f"stream {session} ended after {buckets} bucket(s), but "
                                      f"this receiver loaded {st.next}")
            problems: list[tuple[str, str, str]] = []
            if st.plan is None:
                view = self._view()
                find_missing(view, dest_targets(view), st.claimed, problems, st.mem)
            if problems:
                self._drop_locked(st, "destination tensors received nothing")
            raise_problems(problems, f"all {buckets} bucket(s) were written, but the version "
                             f"stays {self._version}")
            wait_s = None if deadline is None else deadline - time.time()
            try:
                if wait_s is not None and wait_s <= 0:
                    raise WeightSyncTimeoutError(
                        f"the commit of stream {session} reached this receiver "
                        f"{-wait_s:.1f}s after its sender stopped waiting (the receiver "
                        "was busy); it was not committed, the version stays "
                        f"{self._version}")
                self._commit_locked(st.version, "stream", wait_s=wait_s, shard=st.shard)
                st.reserved = False  # the commit gave it back
            finally:
                if self._loaded and self._version == st.version:
                    self._committed = session  # on_commit may have raised after it
                self._drop_locked(st, "it was committed")  # or lost to a newer version
        return st.plan.skipped if st.plan is not None else st.skipped


def _part(sel: Slices | None) -> str:
    if sel is None:
        return "all"
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in sel) + "]"


class _ShadowView:
    """A receiver's options as a sync into its staging copy plans against them."""

    def __init__(self, rec: WeightReceiver, shadow: Shadow) -> None:
        self.dest: StateLike | None = shadow.dest()
        self.load_weights: LoadWeights | None = (shadow.stage if rec.load_weights is not None
                                                 else None)
        self.name_map = rec.name_map
        self.casting = rec.casting
        self.strict = rec.strict
        self.direct = rec.direct
        self.select = rec.select
        self.keep_fp8 = rec.keep_fp8
        self.scale_name = rec.scale_name


def _default_scale_name(name: str) -> str:
    return name + "_scale_inv"


class _PeerView:
    """A receiver's options as a peer's stream sees them (see ``_peer_plan``)."""

    def __init__(self, rec: WeightReceiver) -> None:
        self.dest: StateLike | None = rec._view().dest
        self.load_weights: LoadWeights | None = None
        self.name_map: NameMap = None
        self.casting: Casting = "no"
        self.strict = rec.strict
        self.direct = rec.direct
        self.select: Select | None = None
        self.keep_fp8 = True  # an FP8 engine's weights and scales go as they lie
        self.scale_name = rec.scale_name


def load_manifest(manifest: Manifest, dest: StateLike | None = None, *,
                  load_weights: LoadWeights | None = None, name_map: NameMap = None,
                  casting: Casting = "same_kind", strict: bool = True, direct: bool = True,
                  release: bool = True, select: Select | None = None) -> LoadReport:
    """Load ``manifest`` into ``dest`` in place: ``WeightReceiver(dest, ...).load(...)``."""
    receiver = WeightReceiver(dest, load_weights=load_weights, name_map=name_map,
                              casting=casting, strict=strict, direct=direct, select=select)
    return receiver.load(manifest, release=release)
