"""Every change this package makes to Ray's private code, and every read of it.

Ray 2.60's RDT offers no hook for what these do, so each one reaches into a private
module. Each section says which Ray it targets, why it exists, the upstream issue, and
when it can go. :func:`apply` installs the changes, once per process (``register()``
calls it after :func:`check_ray_version`); each finds Ray's original by name and leaves
a Ray laid out otherwise alone. The tensor reducer is installed by each put, since Ray
installs its own reducer late; the Parameter reducer lives with the ``pack_as`` state it
writes, in conversions.py, and is installed by ``pack_as``. This module imports no other
module of ``_ray`` but that one: what it needs of the runtime is handed to :func:`apply`.

Threads: the serializer changes run in whichever thread serializes (``ray.put``, a method
return) or deserializes a value; the object-store fetch on the sender's ``_ray_system``;
the ordering change in the thread that calls ``.remote()``; the store-entry pop in the
thread of a failed put. Only GCS key-value access (``ray.experimental.internal_kv``) lives
elsewhere, in directory.py.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import ray

from ray_rdt_pool._ray import conversions
from ray_rdt_pool.config import TRANSPORT
from ray_rdt_pool.errors import ConfigurationError, WireFormatError

logger = logging.getLogger(__name__)

#: The key Ray 2.60 files the transport under (it upper-cases names) and passes around.
RAY_NAME = TRANSPORT.upper()

#: The tensors of an object this process put, as the put copied them (the runtime's
#: ``get_snapshot``), or None; set by :func:`apply`.
_snapshot_of: Callable[[str], Any] | None = None


def apply(snapshot_of: Callable[[str], Any]) -> None:
    """Install this package's changes to Ray in this process; a no-op the second time.
    ``snapshot_of(obj_id)``: the copy a put made of an object, for object-store gets."""
    global _snapshot_of
    _snapshot_of = snapshot_of
    _transfers_before_their_tasks()
    _flat_values_as_one_object()
    _snapshots_through_the_object_store()


# ---------------------------------------------------------------------------------------
# The Ray these patches fit
# ---------------------------------------------------------------------------------------

#: The Ray minor release every section below was written against and tested with.
TESTED_RAY = "2.60"
#: Set to 1 to run on another Ray with a warning instead of an error.
ALLOW_UNTESTED_ENV = "RAY_RDT_POOL_ALLOW_UNTESTED_RAY"
_warned_untested = False  # the escape hatch warns once per process, not per register()


def check_ray_version(installed: str | None = None) -> None:
    """ConfigurationError unless Ray is the tested minor release (or the escape hatch is
    set): the private code patched below changes between Ray releases without notice."""
    global _warned_untested
    from ray_rdt_pool.config import parse_bool

    installed = ray.__version__ if installed is None else installed
    if ".".join(installed.split(".")[:2]) == TESTED_RAY:
        return
    message = (f"ray_rdt_pool is tested with Ray {TESTED_RAY}.x, but Ray {installed} is "
               "installed, and it patches private parts of Ray that change between "
               f"releases; install the tested Ray (pip install 'ray[default]=={TESTED_RAY}.*')"
               f", or set {ALLOW_UNTESTED_ENV}=1 to run on this one at your own risk")
    if not parse_bool(ALLOW_UNTESTED_ENV, os.environ.get(ALLOW_UNTESTED_ENV, "")):
        raise ConfigurationError(message)
    if not _warned_untested:
        _warned_untested = True
        warnings.warn(message, RuntimeWarning, stacklevel=4)


# ---------------------------------------------------------------------------------------
# Reads of Ray's private state
# ---------------------------------------------------------------------------------------
# Ray 2.60. Why: Ray has no public call for the current session, the serialization
# context's RDT tensor list, the transports registered in this process, the RDT object
# of a ref, or the actors of the cluster a driver is connected to (its state API picks
# a cluster of its own). Upstream issue: none found. Can go: when Ray exposes these.


def ray_session() -> object:
    """The session of this process's Ray connection; None when not connected."""
    return getattr(getattr(ray._private.worker, "_global_node", None), "session_name", None)


def _rdt_context_local() -> Any:
    """The thread-local of Ray's serialization context (``rdt_tensors`` is there)."""
    worker = ray._private.worker.global_worker
    return worker.get_serialization_context()._thread_local  # type: ignore[no-untyped-call]


def serialization_context() -> Any:
    """This process's Ray serialization context (the benchmark times its paths)."""
    return ray._private.worker.global_worker.get_serialization_context()  # type: ignore[no-untyped-call]


def rdt_store() -> Any:
    """This process's RDT object store (the benchmark wraps its methods to time them)."""
    return ray._private.worker.global_worker.rdt_manager.rdt_store


def registered_transport_class(name: str) -> type | None:
    """The class registered with Ray in this process as tensor transport ``name``."""
    from ray.experimental.rdt import util as rdt_util

    info = rdt_util.transport_manager_info.get(name)
    return None if info is None else info.transport_manager_class


def lookup_rdt_object(obj_id: str, wait_s: float) -> tuple[list[Any] | None, Any] | None:
    """What this process's RDT manager knows of ``obj_id``: None if it is no RDT object it
    knows; ``(tensors, None)`` if this process holds the object itself; else ``(None,
    transport metadata)``, waiting up to ``wait_s`` for it (None if it did not come)."""
    mgr = ray._private.worker.global_worker.rdt_manager
    info = mgr.get_rdt_metadata(obj_id)
    if info is None:
        return None
    store = mgr.rdt_store
    if store.has_object(obj_id):
        return store.get_object(obj_id), None
    tmeta = info.tensor_transport_meta
    if tmeta is None:
        tmeta = mgr.wait_for_tensor_transport_metadata(obj_id, wait_s)
    return None, tmeta


def actor_is_asyncio() -> bool:
    """Whether this process is an async actor (its methods run on an event loop)."""
    try:
        worker: Any = ray._private.worker.global_worker
        return bool(worker.core_worker.current_actor_is_asyncio())
    except Exception:
        return False


def error_path_call(handle: Any) -> Any:
    """``handle.__ray_call__`` on the actor's ``_ray_system_error`` thread when it has one
    (an RDT actor's), else on its own: a call there runs while a long task holds the
    actor's own thread, as a weight stream's receive loop does.

    Targets Ray 2.60, which gives every RDT actor that group (``actor.py``) and records
    the choice on the handle (``_ray_enable_tensor_transport``). Naming a group an actor
    lacks kills it, hence the check. Can go: when Ray offers an out-of-band cancel of
    one actor task that the task itself can observe."""
    call = handle.__ray_call__
    if getattr(handle, "_ray_enable_tensor_transport", False):
        return call.options(concurrency_group="_ray_system_error")
    return call


def alive_actors() -> list[dict[str, Any]]:
    """The alive actors of the cluster this process is connected to, from its GCS:
    ``actor_id``, ``class_name``, ``name``, ``namespace``. Not Ray's state API
    (``ray.util.state.list_actors``), which picks its own cluster (``RAY_ADDRESS``, the
    newest ``ray start``) and so may list another one's."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    accessor = state._connect_and_get_accessor()
    out = []
    for raw in accessor.get_actor_table(None, "ALIVE"):
        a = gcs_pb2.ActorTableData.FromString(raw)  # type: ignore[attr-defined]
        out.append({"actor_id": a.actor_id.hex(), "class_name": a.class_name,
                    "name": a.name, "namespace": a.ray_namespace or None})
    return out


# ---------------------------------------------------------------------------------------
# Ray's tensor reducer, pickled by reference
# ---------------------------------------------------------------------------------------
# Ray 2.60: ``SerializationContext.serialize_rdt_objects`` installs a torch.Tensor reducer
# whose deserializer is a nested function, which cloudpickle pickles by value into every
# object, scanning ``sys.modules`` (thousands of modules once torch is loaded) each time.
# The functions below keep Ray's contract (a tensor of an RDT object becomes its index in
# the context's list; any other tensor, plain pickle bytes) at module level, so each
# object carries only their name; each receiver imports this module to resolve it.
# Upstream issue: none found. Can go: when Ray's RDT reducer is a module-level function.


def _tensor_to_rdt(tensor: Any) -> int | bytes:
    local = _rdt_context_local()
    if getattr(local, "use_external_transport", False):
        local.rdt_tensors.append(tensor)
        return len(local.rdt_tensors) - 1
    import pickle

    return pickle.dumps(tensor)


def _tensor_from_rdt(val: int | bytes) -> Any:
    if isinstance(val, int):
        return _rdt_context_local().rdt_tensors[val]
    import pickle

    return pickle.loads(val)


def _reduce_tensor(tensor: Any) -> tuple[Any, tuple[int | bytes]]:
    return _tensor_from_rdt, (_tensor_to_rdt(tensor),)


#: The qualified name of the deserializer Ray's RDT serializer defines per call.
_RAY_RDT_DESERIALIZER = "SerializationContext.serialize_rdt_objects.<locals>.deserialize"


def by_reference_tensor_reducer() -> None:
    """Put :func:`_reduce_tensor` in Ray's place, once Ray's RDT reducer is installed.

    Only that reducer is replaced (recognised by its deserializer's name): a reducer
    someone else installed is left alone. Ray installs its reducer again in a new
    serialization context (``ray.shutdown`` then ``ray.init``); the next put replaces it
    again. A dict lookup per put."""
    import torch
    from ray import cloudpickle

    dispatch = cloudpickle.CloudPickler.dispatch
    current = dispatch.get(torch.Tensor)
    if current is _reduce_tensor or current is None:
        return
    for cell in getattr(current, "__closure__", None) or ():
        try:
            name = getattr(cell.cell_contents, "__qualname__", None)
        except ValueError:  # an empty cell
            continue
        if name == _RAY_RDT_DESERIALIZER:
            dispatch[torch.Tensor] = _reduce_tensor
            return


# ---------------------------------------------------------------------------------------
# A flat list, tuple or dict of tensors: one Python object for Ray's serializer
# ---------------------------------------------------------------------------------------
# Ray 2.60: ``SerializationContext.serialize_rdt_objects`` serializes an RDT object's
# value with msgpack, handing every tensor to its Python fallback one by one (an extension
# record, a pickled entry and a reducer call per tensor, and the same again on the
# receiver), which costs more than the pack itself for thousands of small tensors. For a
# flat list, tuple or str-keyed dict of plain tensors of this transport, Ray is handed
# one small stand-in and the tensors directly, in the order its own walk would list them
# (each distinct tensor once, first seen first). Anything else goes Ray's way.
# Upstream issue: none for this path found; related: ray-project/ray#65475 (O(N)
# overheads per tensor in RDT's NIXL backend), open.
# Can go: when Ray's RDT serializer costs no Python call per tensor.


class _FlatTensors:
    """Stands for a list, tuple or dict of tensors in Ray's serialized value."""

    __slots__ = ("keys", "kind", "n", "order")

    def __init__(self, kind: str, n: int, keys: list[str] | None,
                 order: list[int] | None) -> None:
        self.kind, self.n = kind, n
        self.keys = keys  # a dict's keys, in order; None for a list or tuple
        # Per item, its index among the distinct tensors; None: every item is distinct.
        self.order = order

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _flat_from_rdt, (self.kind, self.n, self.keys, self.order)


def _flat_from_rdt(kind: str, n: int, keys: list[str] | None,
                   order: list[int] | None) -> Any:
    """The receiver's side: the container, rebuilt from the tensors Ray received."""
    got = _rdt_context_local().rdt_tensors
    if len(got) != n:
        raise WireFormatError(
            f"a nixl_pool object's value names {n} tensors but {len(got)} arrived; run "
            "the same ray_rdt_pool version on the sender and the receiver")
    if order is not None:
        _check_order(order, n)
    items = got if order is None else [got[i] for i in order]
    if kind == "list":
        return list(items)
    if kind == "tuple":
        return tuple(items)
    if keys is None or len(keys) != len(items):
        raise WireFormatError(f"a nixl_pool object's dict value of {len(items)} tensors "
                              f"carries {None if keys is None else len(keys)} keys")
    return dict(zip(keys, items))


def _check_order(order: Sequence[Any], n: int) -> None:
    """WireFormatError unless ``order`` is what :func:`flat_tensors` makes for ``n``
    distinct tensors: each of 0..n-1 at least once, first seen in increasing order (a
    repeat names one seen before)."""
    seen = 0
    for i in order:
        if type(i) is not int or not 0 <= i <= seen or i >= n:
            raise WireFormatError(
                f"a nixl_pool object's value places tensor {i!r} where only tensors 0 to "
                f"{min(seen, n - 1)} of its {n} may come; run the same ray_rdt_pool version "
                "on the sender and the receiver")
        seen += i == seen
    if seen != n:
        raise WireFormatError(
            f"a nixl_pool object's value places {seen} of its {n} tensors; run the same "
            "ray_rdt_pool version on the sender and the receiver")


def flat_tensors(value: Any, tensor_type: type) -> tuple[_FlatTensors, list[Any]] | None:
    """``value`` as (its stand-in, its distinct tensors) when it is a non-empty list,
    tuple or str-keyed dict of tensors of exactly ``tensor_type``; None otherwise."""
    kind = type(value)
    keys: list[str] | None = None
    if kind is list or kind is tuple:
        items = value
    elif kind is dict:
        keys = list(value)
        if not all(type(k) is str for k in keys):
            return None
        items = list(value.values())
    else:
        return None
    # C-level passes (map, set): this runs on every put of up to thousands of tensors.
    if not items or set(map(type, items)) != {tensor_type}:
        return None
    name = "list" if kind is list else "tuple" if kind is tuple else "dict"
    if len(set(map(id, items))) == len(items):
        return _FlatTensors(name, len(items), keys, None), list(items)
    first: dict[int, int] = {}
    order = [first.setdefault(id(t), len(first)) for t in items]
    tensors: list[Any] = [None] * len(first)
    for t, i in zip(items, order):
        tensors[i] = t
    return _FlatTensors(name, len(tensors), keys, order), tensors


def _flat_values_as_one_object() -> None:
    """Route this transport's flat values past Ray's per-tensor serializer (see above).

    Wraps ``SerializationContext.serialize_rdt_objects`` once per process (``ray.put``
    and method returns both call it); other transports and other values are untouched.
    The wrapper also opens the pack_as notes of Parameters for the value it serializes."""
    import torch
    from ray._private.serialization import SerializationContext

    if getattr(SerializationContext, "_nixl_pool_flat", False):
        return
    if not all(callable(getattr(SerializationContext, name, None))
               for name in ("serialize_rdt_objects", "_serialize_to_msgpack")):
        return  # a Ray laid out otherwise: its own serializer handles every value
    through_ray = SerializationContext.serialize_rdt_objects
    tensor_type = torch.Tensor
    state = conversions.state

    def serialize_rdt_objects(self: Any, value: Any, tensor_transport: str) -> Any:
        ours = tensor_transport == RAY_NAME
        noting = getattr(state, "dtypes", None) is not None
        if noting:  # notes of Parameters are for the put being serialized now only
            state.aliases = None
        if ours:
            flat = flat_tensors(value, tensor_type)
            if flat is not None:
                return self._serialize_to_msgpack(flat[0]), flat[1]
            if noting:
                state.aliases = {}
        try:
            return through_ray(self, value, tensor_transport)
        except BaseException:
            if noting:
                state.aliases = None
            raise

    SerializationContext.serialize_rdt_objects = serialize_rdt_objects  # type: ignore[method-assign]
    SerializationContext._nixl_pool_flat = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------
# A get through Ray's object store: the snapshot, not the caller's live tensors
# ---------------------------------------------------------------------------------------
# Ray 2.60: ``ray.get(ref, _use_object_store=True)`` runs ``rdt_store.__ray_fetch_rdt_
# object__`` on the sender (``_ray_system``), which returns the primary copy in Ray's RDT
# store, the caller's own tensors as they are then, so a change made after the put
# reached the receiver. Ours returns copies of the pool's snapshot for an object this
# transport holds (never views of the pool), each host tensor wrapped to pickle as its
# dtype's wire name, shape and bytes, since torch cannot load back its own pickle of
# several dtypes (uint16/32/64, complex32, float8, float4). Ray's RDT store is left
# alone, so an actor's plain get of its own ref still returns its original tensors. The
# receiver pickles this function by reference, so a sender that never registered runs
# it too (and falls back to Ray's). A get that reaches the sender while its put is still
# packing finds no snapshot yet and gets the tensors as they are then.
# Upstream issue: none found. Can go: when Ray lets a transport answer object-store gets.

_rays_fetch_rdt_object: Callable[[Any, str], Any] | None = None  # Ray's, once replaced


def _fetch_rdt_object(self: Any, obj_id: str) -> Any:
    from ray.experimental.rdt import rdt_store

    fetch = _rays_fetch_rdt_object or rdt_store.__ray_fetch_rdt_object__
    live = fetch(self, obj_id)  # waits until the object exists, raises its error
    snapshot = _snapshot_of(obj_id) if _snapshot_of is not None else None
    if snapshot is None:
        return live
    return [_StoredTensor(t) if t.device.type == "cpu" else t for t in snapshot]


class _StoredTensor:
    """A host tensor of a snapshot on its way through Ray's object store: pickled as its
    dtype's wire name, its shape and its bytes, whatever its dtype (see above)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        import torch

        from ray_rdt_pool.memory.dtypes import dtype_name

        t = self.tensor
        return _tensor_from_store, (dtype_name(t.dtype), tuple(t.shape),
                                    t.reshape(-1).view(torch.uint8).numpy())


def _tensor_from_store(dtype: str, shape: tuple[int, ...], raw: Any) -> Any:
    """The receiver's side of :class:`_StoredTensor`: a new tensor with a storage of its
    own (Ray's buffer is read-only and shared), holding ``raw`` byte for byte."""
    import numpy
    import torch

    from ray_rdt_pool.memory.dtypes import empty_tensor, torch_dtype

    out = empty_tensor(shape, torch_dtype(dtype))
    want = out.numel() * out.element_size()
    if getattr(raw, "nbytes", None) != want:
        # copyto would broadcast a short array over the tensor: never fill it so.
        raise WireFormatError(
            f"a snapshot tensor of shape {tuple(shape)} and dtype {dtype} came through "
            f"Ray's object store with {getattr(raw, 'nbytes', None)} bytes, not {want}; "
            "the sender runs another ray_rdt_pool version: install the same one on both")
    if want:
        numpy.copyto(out.reshape(-1).view(torch.uint8).numpy(), raw)
    return out


def _snapshots_through_the_object_store() -> None:
    """Put :func:`_fetch_rdt_object` in place of Ray's ``__ray_fetch_rdt_object__``, once;
    a Ray without that function is left alone."""
    global _rays_fetch_rdt_object
    from ray.experimental.rdt import rdt_store

    current = getattr(rdt_store, "__ray_fetch_rdt_object__", None)
    if current is None or current is _fetch_rdt_object:
        return
    _rays_fetch_rdt_object = current
    rdt_store.__ray_fetch_rdt_object__ = _fetch_rdt_object


# ---------------------------------------------------------------------------------------
# Transfers before their tasks, for out-of-order actors
# ---------------------------------------------------------------------------------------
# Ray 2.60: an async or threaded actor waits for an RDT task argument inside the task's
# executor until ``__ray_recv__`` has stored the tensors, while the core worker hands
# tasks to every concurrency group from one thread; in a burst, that thread can block
# handing a task to the busy default group, so a ``__ray_recv__`` that arrives after its
# consuming task is never dispatched, and the wait ends only at
# ``RAY_rdt_fetch_fail_timeout_milliseconds`` ("not found in RDT object store").
# Ray's own ``nixl`` fails the same way when its transfers arrive late.
# ``RDTManager.queue_or_trigger_out_of_band_tensor_transfer`` is wrapped: a ``.remote()``
# to such an actor with a ``nixl_pool`` argument first waits for the argument's producer,
# lets Ray submit the transfer, then waits for a no-op queued behind it on
# ``_ray_system``, so the tensors are stored before the task that uses them is sent.
# Each wait is bounded by ORDER_WAIT_S; other destinations and transports are untouched,
# and so is an argument that a method of the calling actor produces and that does not
# exist yet (that method is queued behind the very task making the call).
# Upstream issue: no issue for this exact case found; related: ray-project/ray#52825
# (tasks of one concurrency group blocked behind another's) and #60954.
# Can go: when Ray dispatches ``_ray_system`` tasks independently of other groups.

#: Longest a ``.remote()`` waits for the producer of a nixl_pool argument.
ORDER_WAIT_S = 10.0


def _noop(self: Any) -> None:
    return None


def _transfers_before_their_tasks() -> None:
    """Wrap Ray's transfer submission once per process (see above)."""
    from ray._raylet import ObjectRef
    from ray.experimental.rdt.rdt_manager import RDTManager

    if getattr(RDTManager, "_nixl_pool_ordered", False):
        return
    submit = RDTManager.queue_or_trigger_out_of_band_tensor_transfer

    def ordered(self: Any, dst_actor: Any, task_args: Any) -> Any:
        if not getattr(dst_actor, "_ray_allow_out_of_order_execution", False):
            return submit(self, dst_actor, task_args)
        ours = False
        for arg in task_args:
            if not isinstance(arg, ObjectRef):
                continue
            info = self.get_rdt_metadata(arg.hex())
            if info is None or info.tensor_transport_backend != RAY_NAME:
                continue
            if info.tensor_transport_meta is None and _made_by_this_actor(arg):
                # Its producer is queued behind the task running this call: waiting could
                # only time out, so Ray queues the transfer as it would without this.
                continue
            ours = True
            if info.tensor_transport_meta is None:
                ready, _ = ray.wait([arg], timeout=ORDER_WAIT_S)
                # A failed producer's return is its error: no metadata ever comes for it.
                if ready and not _holds_an_error(arg):
                    self.wait_for_tensor_transport_metadata(arg.hex(), ORDER_WAIT_S)
        out = submit(self, dst_actor, task_args)
        if ours:
            behind = dst_actor.__ray_call__.options(concurrency_group="_ray_system").remote(
                _noop)
            ray.wait([behind], timeout=ORDER_WAIT_S)
        return out

    RDTManager.queue_or_trigger_out_of_band_tensor_transfer = ordered  # type: ignore[method-assign]
    RDTManager._nixl_pool_ordered = True  # type: ignore[attr-defined]


def _holds_an_error(ref: Any) -> bool:
    """Whether the finished object ``ref`` is an error (its task failed) rather than a
    value, read from its metadata as Ray's own get does before it fetches RDT tensors,
    without deserializing (which would fetch them). False where that cannot be told."""
    try:
        from ray._private import ray_constants

        core = ray._private.worker.global_worker.core_worker  # type: ignore[attr-defined]
        meta = core.get_objects([ref], 0)[0][1]
        return bool(meta) and meta.split(b",")[0] != ray_constants.OBJECT_METADATA_TYPE_PYTHON
    except Exception:  # not local, or a Ray laid out otherwise: wait for the metadata
        return False


def _made_by_this_actor(ref: Any) -> bool:
    """Whether ``ref`` is the return of a task of the actor this process runs (False on a
    driver, or where Ray's ids do not tell)."""
    try:
        me = ray._private.worker.global_worker.actor_id
        if me is None or me.is_nil():
            return False
        return bool(ref.task_id().actor_id() == me)
    except Exception:  # an id layout this Ray does not have: assume not
        return False


# ---------------------------------------------------------------------------------------
# The RDT store entry of a failed put
# ---------------------------------------------------------------------------------------
# Ray 2.60: ``RDTStore.add_object_primary`` stores the primary copy (the caller's tensors)
# before it calls our extract, and registers the ref only after extract returned. When
# extract raises (``PoolExhaustedError`` with ``strict``, ``InvalidInputError``), nothing
# pops that entry, so the tensors stay referenced for the life of the process.
# Upstream issue: none found (ray-project/ray#62842 changed the store's retry handling).
# Can go: when Ray stores the primary copy only after extract succeeded.


def drop_primary_copy(obj_id: str, tensors: list[Any]) -> None:
    """Pop the RDT store entry the failed put of ``obj_id`` made: the only one for it,
    primary, holding exactly ``tensors``. Best effort: a Ray laid out otherwise is left
    alone."""
    try:
        store = ray._private.worker.global_worker.rdt_manager.rdt_store
        with store._lock:
            queue = store._rdt_store.get(obj_id)
            if (queue is not None and len(queue) == 1 and queue[0].is_primary
                    and queue[0].data is tensors):
                store.pop_object(obj_id)
    except Exception:
        logger.debug("could not drop the RDT store entry of failed put %s", obj_id,
                     exc_info=True)
