"""Chaos test of the ``nixl_pool`` transport: many transfers with random faults mixed in.

``python -m tests.stress.chaos --transfers 500 --seed 0 [--json out.json]`` starts a
local Ray cluster of its own (``address="local"``), two sender actors and three receiver
actors, and makes ``--transfers`` transfers between them. A ``random.Random(seed)`` decides
every choice: sender, receiver, payload, receive path and fault. Fault kinds:

* ``none``: a plain ``ray.get`` in the receiver, or the ref passed as a task argument
  (a method return of ``@ray.method(tensor_transport="nixl_pool")``).
* ``user_timeout``: ``ray.get(ref, timeout=<tiny>)`` in the receiver.
* ``freed_ref``: the driver drops its ref right after handing it to the receiver (the
  sender never keeps one), before or while the receiver fetches.
* ``abort``: the receiving task is cancelled (``ray.cancel``) shortly after submission.
* ``oversized``: an object of 10 to 16 MiB, larger than the senders' 8 MiB pool.
* ``sender_killed``: midway, one sender is killed with objects outstanding: some fetches
  race the kill, the rest start after its process is gone and must raise. A replacement
  sender then takes its place.

Every source tensor is changed in place right after it was put (or returned), so the
receiver must see a snapshot. Each transfer ends as ``ok`` (sha256 of every tensor
matches the one taken at put time), ``typed_error`` (an exception of a type allowed for
its fault kind), ``corrupt`` (returned, checksum mismatch), ``untyped_error`` (any other
exception) or ``hung`` (no answer within the harness's own bound). At the end every live
actor's ``ray_rdt_pool.stats()`` must return to its baseline: empty pool and arena, no READ
in flight, no lease held or waited for, no NIXL registration beyond the ones taken after
warm-up (and a receive arena made later, once).

All actors run on one Ray node, and the three receivers get objects by each same-node
path (:data:`RECEIVER_SAME_NODE`): receiver 0 maps the senders' pools (the default),
receiver 1 reads with NIXL (``same_node="off"``), receiver 2 copies out of the mapping.

The engine is :func:`run_chaos`; ``tests/stress/test_chaos.py`` runs a small version.
"""

from __future__ import annotations

import argparse
import collections
import gc
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

_MIB = 1 << 20

#: Fault kinds drawn per transfer (sender_killed is not drawn: the kill step makes those).
DRAWN_FAULTS = ("none", "user_timeout", "freed_ref", "abort", "oversized")
FAULTS = (*DRAWN_FAULTS, "sender_killed")
#: Relative weights of the drawn fault kinds.
FAULT_WEIGHTS = {"none": 45, "user_timeout": 15, "freed_ref": 15, "abort": 15, "oversized": 8}
OUTCOMES = ("ok", "typed_error", "corrupt", "untyped_error", "hung")

#: Exception type names that count as a typed outcome for each fault kind. Any fault may
#: meet our own errors (every one derives from RdtPoolError) or Ray's bound on an RDT fetch.
_COMMON = frozenset({"RdtPoolError", "ObjectFetchTimedOutError"})
ALLOWED_ERRORS: dict[str, frozenset[str]] = {
    "none": _COMMON,
    "oversized": _COMMON,
    "user_timeout": _COMMON | {"GetTimeoutError", "TimeoutError"},
    "freed_ref": _COMMON | {"ObjectFreedError", "ReferenceCountingAssertionError"},
    "abort": _COMMON | {"TaskCancelledError"},
    "sender_killed": _COMMON | {"ActorDiedError", "OwnerDiedError", "ObjectLostError",
                                "RayActorError", "ActorUnavailableError",
                                "RayDirectTransportError"},
}

#: Sizes of the actors' memory. Objects drawn "oversized" are 10 to 16 MiB: they never fit.
POOL_BYTES = 8 * _MIB
ARENA_BYTES = 64 * _MIB
OVERSIZED_MIB = (10, 16)
#: Receivers give up a READ after this long; Ray's own bound on an RDT fetch is longer.
FETCH_TIMEOUT_S = 10.0
RAY_FETCH_TIMEOUT_S = 20.0
#: The harness's own bounds: nothing waits longer than these.
GET_BOUND_S = 45.0
RESULT_BOUND_S = 90.0
CLEAN_BOUND_S = 60.0

#: Stats that must be zero at the end (and after warm-up).
ZERO_FIELDS = ("pool_used", "live_objects", "arena_used", "arena_live_blocks",
               "transfers_in_flight", "mapped_objects", "leased_objects")

#: How each receiver gets objects from the (same-node) senders: every path in one run.
RECEIVER_SAME_NODE = ("map", "off", "copy")

CLUSTER_ENV = {
    "RAY_RDT_POOL_POOL_BYTES": str(POOL_BYTES),
    "RAY_RDT_POOL_ARENA_BYTES": str(ARENA_BYTES),
    "RAY_RDT_POOL_FETCH_TIMEOUT_S": str(FETCH_TIMEOUT_S),
    "RAY_RDT_POOL_METRICS": "0",
    "RAY_DEDUP_LOGS": "0",
    "RAY_rdt_fetch_fail_timeout_milliseconds": str(int(RAY_FETCH_TIMEOUT_S * 1000)),
}
#: What the senders see: the package's same-node default, so that the receivers of every
#: path (RECEIVER_SAME_NODE) meet a sender that offers its pool.
SENDER_ENV = {**CLUSTER_ENV, "RAY_RDT_POOL_SAME_NODE": "map"}


# ---------------------------------------------------------------------------------------
# Payloads: seeded random bytes of several dtypes and shapes, many sent as views
# ---------------------------------------------------------------------------------------

_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int8", "int16", "int32",
                "int64", "uint8", "bool", "complex64")


def build_payload(seed: int, oversized: bool) -> tuple[list[Any], list[Any]]:
    """The tensors of one object, and the raw uint8 buffers under them (to mutate).

    Normal objects: 1 to 4 tensors of at most 64 KiB each (views: transposed, strided,
    narrowed, a row, or zero-size). Oversized ones add one contiguous 10 to 16 MiB tensor.
    """
    import torch

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    tensors, raws = [], []
    for _ in range(rng.randint(1, 4)):
        dt = getattr(torch, rng.choice(_DTYPE_NAMES))
        item = torch.empty(0, dtype=dt).element_size()
        rows, cols = rng.randint(1, 64), rng.randint(1, 8192 // (8 * max(item, 1)))
        raw = torch.randint(0, 256, (rows * cols * item,), dtype=torch.uint8, generator=g)
        if dt == torch.bool:
            raw = raw % 2  # valid bools; the mutation below (xor 1) keeps them valid
        base = raw.view(dt).view(rows, cols)
        style = rng.choice(("whole", "t", "stride", "narrow", "row", "empty"))
        if style == "t":
            t = base.t()
        elif style == "stride":
            t = base[:, ::2]
        elif style == "narrow":
            start = rng.randrange(rows)
            t = base.narrow(0, start, rng.randint(1, rows - start))
        elif style == "row":
            t = base[rng.randrange(rows)]
        elif style == "empty":
            t = base[:0]
        else:
            t = base
        tensors.append(t)
        raws.append(raw)
    if oversized:
        nbytes = rng.randint(OVERSIZED_MIB[0] * _MIB, OVERSIZED_MIB[1] * _MIB) // 64 * 64
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        tensors.insert(rng.randint(0, len(tensors)), raw.view(torch.float32))
        raws.append(raw)
    return tensors, raws


def checksum(tensors: Any) -> list[str]:
    """dtype, shape and sha256 of every byte of each tensor (standard strides first)."""
    import torch

    out = []
    for t in tensors:
        t = t.detach().resolve_conj().resolve_neg().cpu()
        c = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # standard strides, even size-1 dims
        raw = c.reshape(-1).view(torch.uint8)
        h = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
        out.append(f"{c.dtype}|{tuple(c.shape)}|{h}")
    return out


def mutate(raws: list[Any]) -> None:
    """Change every byte of the sources in place (xor 1): a by-reference read shows it."""
    for raw in raws:
        raw.bitwise_xor_(1)


def nbytes_of(tensors: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


def error_names(e: BaseException) -> list[str]:
    """Type names of ``e`` and of what it wraps: the MRO of each, most specific first.

    A task's error arrives as ``RayTaskError(X)``, which also derives from X; its ``cause``
    is the original exception.
    """
    names: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        cause = getattr(cur, "cause", None)
        if isinstance(cause, BaseException):
            names.extend(c.__name__ for c in type(cause).__mro__)
        names.extend(c.__name__ for c in type(cur).__mro__)
        cur = cause if isinstance(cause, BaseException) else None
    return list(dict.fromkeys(names))


def error_summary(e: BaseException) -> dict[str, Any]:
    names = error_names(e)
    return {"ok": False, "types": names, "error": names[0], "msg": str(e)[-1500:]}


# ---------------------------------------------------------------------------------------
# Actors (defined after ray_rdt_pool.register(): see make_actor_classes)
# ---------------------------------------------------------------------------------------


def held_by_ray_store() -> tuple[int, int]:
    """(objects, arena bytes) that Ray's RDT store of this process holds for tasks that
    will never run.

    Ray receives a task argument on ``_ray_system`` into its RDT store before the task
    runs, and pops it when the task consumes it. A task cancelled in between never pops
    it (Ray 2.60 frees nothing there), so the tensors, views of our arena, stay alive
    until the process exits. This is Ray's to fix; the chaos run counts those bytes
    apart from leaks of the transport. Ray internals, read best effort.
    """
    from ray._private.worker import global_worker

    store = global_worker.rdt_manager.rdt_store
    objects = 0
    storages: dict[int, int] = {}
    with store._lock:
        for entries in store._rdt_store.values():
            for entry in entries:
                if entry.is_primary or not isinstance(entry.data, list):
                    continue
                objects += 1
                for t in entry.data:
                    s = t.untyped_storage()
                    storages[s.data_ptr()] = s.nbytes()
    return objects, sum(storages.values())


def make_actor_classes() -> tuple[Any, Any]:
    import ray
    import torch  # noqa: F401  (actors unpickle torch tensors)

    import ray_rdt_pool

    ray_rdt_pool.register()  # @ray.method(tensor_transport=...) checks the name

    # Every setting in the actor's own runtime_env: on a cluster shared with other tests
    # (manage_cluster=False) the job's settings are another's.
    @ray.remote(enable_tensor_transport=True, max_concurrency=4,
                runtime_env={"env_vars": dict(SENDER_ENV)})
    class ChaosSender:
        def __init__(self) -> None:
            ray_rdt_pool.register()
            self.made: dict[str, tuple[list[Any], list[str]]] = {}

        def pid(self) -> int:
            return os.getpid()

        def put(self, seed: int, oversized: bool) -> dict[str, Any]:
            """ray.put an object, change its sources in place, return the ref nested (the
            sender keeps no copy of it) and the checksum taken before the change."""
            tensors, raws = build_payload(seed, oversized)
            expected = checksum(tensors)
            try:
                ref = ray.put(tensors, _tensor_transport="nixl_pool")
            except Exception as e:
                return error_summary(e)
            mutate(raws)
            return {"ok": True, "refs": [ref], "expected": expected,
                    "nbytes": nbytes_of(tensors)}

        @ray.method(tensor_transport="nixl_pool")
        def make(self, seed: int, oversized: bool, key: str) -> list[Any]:
            tensors, raws = build_payload(seed, oversized)
            self.made[key] = (raws, checksum(tensors))
            return tensors

        def release_made(self, keys: list[str]) -> dict[str, list[str]]:
            """Change the sources of method returns ``keys`` in place (the driver calls this
            once it holds their metadata); return their checksums from before the change."""
            out = {}
            for k in keys:
                raws, expected = self.made.pop(k)
                mutate(raws)
                out[k] = expected
            return out

        def stats(self) -> dict[str, Any]:
            return ray_rdt_pool.stats().as_dict()

    @ray.remote(enable_tensor_transport=True, max_concurrency=4)
    class ChaosReceiver:
        def __init__(self) -> None:
            ray_rdt_pool.register()

        def pid(self) -> int:
            return os.getpid()

        def get(self, refs: list[Any], timeout: float | None = None,
                delay: float = 0.0) -> dict[str, Any]:
            """ray.get the object; its checksum, or the error. Never raises."""
            if delay:
                time.sleep(delay)
            t0 = time.monotonic()
            try:
                tensors = ray.get(refs[0], timeout=GET_BOUND_S if timeout is None else timeout)
            except Exception as e:
                out = error_summary(e)
                out["bounded"] = timeout is None and "GetTimeoutError" in out["types"]
                out["s"] = time.monotonic() - t0
                return out
            s = time.monotonic() - t0
            got = checksum(tensors)
            del tensors
            return {"ok": True, "checksum": got, "s": s}

        def take(self, tensors: list[Any]) -> dict[str, Any]:
            """A task argument: Ray fetched the tensors before calling this."""
            got = checksum(tensors)
            del tensors
            return {"ok": True, "checksum": got, "s": 0.0}

        def stats(self) -> dict[str, Any]:
            st = ray_rdt_pool.stats().as_dict()
            st["held_by_ray_objects"], st["held_by_ray_bytes"] = held_by_ray_store()
            return st

    return ChaosSender, ChaosReceiver


# ---------------------------------------------------------------------------------------
# The schedule
# ---------------------------------------------------------------------------------------


@dataclass
class Transfer:
    index: int
    fault: str
    sender: int  # slot 0 or 1
    receiver: int  # 0, 1 or 2
    path: str  # "get": ray.get in the receiver; "arg": a task argument
    owner: str  # "sender": ray.put in the sender; "driver": a method return
    seed: int
    oversized: bool
    timeout: float | None = None  # user_timeout: ray.get's timeout in the receiver
    delay: float = 0.0  # freed_ref: the receiver waits this long before its ray.get
    cancel_after: float = 0.0  # abort: seconds between submission and ray.cancel
    phase: str = ""  # sender_killed: "racing" (fetch before the kill) or "after_death"
    nbytes: int = 0
    object_id: str = ""
    outcome: str = ""
    error: str = ""
    message: str = ""
    seconds: float = 0.0
    expected: list[str] = field(default_factory=list, repr=False)


def draw_schedule(n: int, seed: int) -> tuple[list[Transfer], int, int]:
    """Every transfer's plan; the index where the kill step starts and the victim slot.

    The kill step takes the 6 transfers from that index (2 racing the kill, 4 fetched after
    the sender's process is gone). Each drawn fault kind occurs at least once.
    """
    rng = random.Random(seed)
    kill_n = 6
    if n < len(DRAWN_FAULTS) + kill_n + 2:
        raise ValueError(f"--transfers must be at least {len(DRAWN_FAULTS) + kill_n + 2}")
    drawn = n - kill_n
    kinds = list(DRAWN_FAULTS) + rng.choices(
        list(FAULT_WEIGHTS), weights=list(FAULT_WEIGHTS.values()), k=drawn - len(DRAWN_FAULTS))
    rng.shuffle(kinds)
    kill_at = rng.randint(int(n * 0.4), int(n * 0.6) - kill_n)
    victim = rng.randrange(2)
    kinds[kill_at:kill_at] = ["sender_killed"] * kill_n
    plan = []
    for i, fault in enumerate(kinds):
        t = Transfer(index=i, fault=fault, sender=rng.randrange(2), receiver=rng.randrange(3),
                     path=rng.choice(("get", "arg")), owner="driver",
                     seed=rng.randrange(1 << 31), oversized=fault == "oversized")
        if fault == "user_timeout":
            t.path = "get"
            t.timeout = rng.choice((0.0, 0.0002, 0.001, 0.003, 0.01, 0.05))
        elif fault == "freed_ref":
            t.delay = rng.choice((0.0, 0.0, 0.002, 0.01))
        elif fault == "abort":
            t.cancel_after = rng.choice((0.0, 0.0, 0.001, 0.005, 0.02))
        elif fault == "sender_killed":
            t.sender = victim
            t.phase = "racing" if i - kill_at < 2 else "after_death"
        if t.path == "get":
            t.owner = rng.choice(("sender", "driver"))
        plan.append(t)
    return plan, kill_at, victim


# ---------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------


class _Harness:
    def __init__(self, senders: list[Any], receivers: list[Any], sender_cls: Any,
                 log: Any) -> None:
        self.senders = senders
        self.receivers = receivers
        self.sender_cls = sender_cls
        self.log = log
        self.key = 0
        self.by_object: dict[str, Transfer] = {}
        self.warmup_problems: list[Transfer] = []
        self.baseline: dict[str, dict[str, Any]] = {}

    # -- helpers -------------------------------------------------------------------------

    @staticmethod
    def made(refs: list[Any], bound: float = GET_BOUND_S) -> list[bool]:
        """Wait until the driver holds the nixl_pool metadata of method returns ``refs``
        (Ray refuses to pass a ref nested in an argument before that)."""
        import ray

        if not refs:
            return []
        ray.wait(refs, num_returns=len(refs), timeout=bound)
        mgr = ray._private.worker.global_worker.rdt_manager
        deadline = time.monotonic() + bound
        return [mgr.wait_for_tensor_transport_metadata(
            r.hex(), max(0.0, deadline - time.monotonic())) is not None for r in refs]

    def produce(self, batch: list[Transfer]) -> dict[int, list[Any]]:
        """Create the batch's objects; their refs by transfer index (nested in a list).
        A transfer whose object could not be made gets its outcome here."""

        put_calls, make_calls = {}, {}
        for t in batch:
            s = self.senders[t.sender]
            if t.owner == "sender":
                put_calls[t.index] = s.put.remote(t.seed, t.oversized)
            else:
                self.key += 1
                key = f"k{self.key}"
                make_calls[t.index] = (key, s.make.remote(t.seed, t.oversized, key))
        refs: dict[int, list[Any]] = {}
        by_index = {t.index: t for t in batch}
        for i, call in put_calls.items():
            got = self._result(call)
            if got["ok"]:
                refs[i] = got["refs"]
                by_index[i].object_id = got["refs"][0].hex()
                by_index[i].expected = got["expected"]
                by_index[i].nbytes = got["nbytes"]
            else:
                self.classify(by_index[i], got)
        ready = self.made([r for _, r in make_calls.values()])
        keys_by_sender: dict[int, list[tuple[int, str]]] = collections.defaultdict(list)
        for (i, (key, ref)), ok in zip(make_calls.items(), ready):
            t = by_index[i]
            if not ok:
                got = self._result(ref)  # the method itself failed: its error
                self.classify(t, got if not got["ok"] else {
                    "ok": False, "types": ["HarnessTimeout"], "error": "HarnessTimeout",
                    "msg": "no transport metadata within the bound", "hung": True})
                continue
            refs[i] = [ref]
            t.object_id = ref.hex()
            keys_by_sender[t.sender].append((i, key))
        for slot, pairs in keys_by_sender.items():
            got = self._result(self.senders[slot].release_made.remote([k for _, k in pairs]))
            for i, key in pairs:
                if got["ok"]:
                    by_index[i].expected = got["value"][key]
                else:
                    self.classify(by_index[i], got)
                    refs.pop(i, None)
        return refs

    @staticmethod
    def _result(call: Any, bound: float = RESULT_BOUND_S) -> dict[str, Any]:
        """ray.get one call, never raising: its value (a dict is returned as is)."""
        import ray

        try:
            value = ray.get(call, timeout=bound)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(call)
            return {"ok": False, "types": ["HarnessTimeout"], "error": "HarnessTimeout",
                    "msg": f"no answer within {bound}s", "hung": True}
        except Exception as e:
            return error_summary(e)
        if isinstance(value, dict) and "ok" in value:
            return value
        return {"ok": True, "value": value}

    def classify(self, t: Transfer, got: dict[str, Any]) -> None:
        t.seconds = float(got.get("s", 0.0))
        if got["ok"]:
            if not t.expected:
                t.outcome, t.message = "untyped_error", "no expected checksum (harness)"
            elif got["checksum"] == t.expected:
                t.outcome = "ok"
            else:
                t.outcome = "corrupt"
                bad = [j for j, (a, b) in enumerate(zip(got["checksum"], t.expected)) if a != b]
                t.message = (f"tensors {bad} of {len(t.expected)} differ "
                             f"(got {len(got['checksum'])} tensors)")
            return
        t.message = got.get("msg", "")
        if got.get("hung") or got.get("bounded"):
            t.outcome, t.error = "hung", got["error"]
            return
        allowed = ALLOWED_ERRORS[t.fault]
        typed = [n for n in got["types"] if n in allowed]
        if typed:
            t.outcome = "typed_error"
            # The most specific name: the exception's (or its cause's) own class.
            t.error = next(n for n in got["types"] if not n.startswith("RayTaskError"))
        else:
            t.outcome, t.error = "untyped_error", got["error"]

    def consume(self, batch: list[Transfer], refs: dict[int, list[Any]]) -> None:
        """Hand every object of the batch to its receiver (faults applied); classify."""
        import ray

        calls: dict[int, Any] = {}
        for t in batch:
            if t.index not in refs:
                continue
            r = self.receivers[t.receiver]
            if t.path == "arg":
                calls[t.index] = r.take.remote(refs[t.index][0])
            else:
                calls[t.index] = r.get.remote(refs[t.index], t.timeout, t.delay)
            if t.fault == "freed_ref":
                del refs[t.index]  # the driver's last ref: only the pending task holds it
        for t in sorted((t for t in batch if t.fault == "abort" and t.index in calls),
                        key=lambda t: t.cancel_after):
            if t.cancel_after:
                time.sleep(t.cancel_after)
            ray.cancel(calls[t.index])
        deadline = time.monotonic() + RESULT_BOUND_S
        by_index = {t.index: t for t in batch}
        for i, call in calls.items():
            self.classify(by_index[i], self._result(call,
                                                    max(1.0, deadline - time.monotonic())))
        refs.clear()

    def run_batch(self, batch: list[Transfer]) -> None:
        refs = self.produce(batch)
        self.by_object.update((t.object_id, t) for t in batch if t.object_id)
        self.consume(batch, refs)

    def kill_step(self, batch: list[Transfer], victim: int) -> dict[str, Any]:
        """Objects outstanding from the victim; 'racing' ones are fetched as it is killed,
        the 'after_death' ones once its process is gone. Then a replacement starts."""
        import ray

        refs = self.produce(batch)
        self.by_object.update((t.object_id, t) for t in batch if t.object_id)
        racing = [t for t in batch if t.phase == "racing"]
        after = [t for t in batch if t.phase == "after_death"]
        victim_actor = self.senders[victim]
        pid = ray.get(victim_actor.pid.remote(), timeout=RESULT_BOUND_S)
        calls = {}
        for t in racing:
            if t.index in refs:
                r = self.receivers[t.receiver]
                calls[t.index] = (r.take.remote(refs[t.index][0]) if t.path == "arg"
                                  else r.get.remote(refs[t.index]))
        t_kill = time.monotonic()
        ray.kill(victim_actor, no_restart=True)
        reaped = _wait(lambda: process_gone(pid), CLEAN_BOUND_S)
        kill_s = time.monotonic() - t_kill
        by_index = {t.index: t for t in batch}
        for i, call in calls.items():
            self.classify(by_index[i], self._result(call))
        self.consume(after, refs)
        # The restart: a new sender process in the victim's slot, warmed up like the others.
        self.senders[victim] = self.sender_cls.remote()
        ray.get(self.senders[victim].pid.remote(), timeout=RESULT_BOUND_S)
        self.warm_up([victim], list(range(len(self.receivers))))
        name = f"sender{victim}"
        self.baseline[name] = self.settle([name], against_baseline=False)[name]
        self.log(f"killed sender{victim} (pid {pid}, gone after {kill_s:.2f}s, "
                 f"reaped={reaped}); replacement started")
        return {"victim": victim, "pid": pid, "reaped": reaped, "kill_to_gone_s": kill_s}

    def warm_up(self, sender_slots: list[int], receiver_slots: list[int]) -> None:
        """Every given sender sends to every given receiver once by each path, so every
        receiver has met every sender (and the pools and arenas exist) before the run."""
        batch = []
        for s in sender_slots:
            for r in receiver_slots:
                for path, owner in (("get", "sender"), ("arg", "driver")):
                    batch.append(Transfer(index=-1 - len(batch), fault="none", sender=s,
                                          receiver=r, path=path, owner=owner,
                                          seed=7 + len(batch), oversized=False))
        self.run_batch(batch)
        # Plain transfers between healthy actors: each failure is reported as a problem.
        self.warmup_problems.extend(t for t in batch if t.outcome != "ok")

    def actors(self) -> dict[str, Any]:
        out = {f"sender{i}": s for i, s in enumerate(self.senders)}
        out.update({f"receiver{i}": r for i, r in enumerate(self.receivers)})
        return out

    def settle(self, names: list[str] | None = None, bound: float = CLEAN_BOUND_S,
               against_baseline: bool = True) -> dict[str, dict[str, Any]]:
        """Poll the actors' stats (all together) until none holds anything and, with
        ``against_baseline``, each has its baseline's NIXL registrations; the last stats."""
        import ray

        actors = self.actors()
        names = list(actors) if names is None else names
        deadline = time.monotonic() + bound
        last: dict[str, dict[str, Any]] = {}
        while True:
            for name in names:
                try:
                    last[name] = ray.get(actors[name].stats.remote(), timeout=RESULT_BOUND_S)
                except Exception as e:
                    last[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            if all(self._clean(n, last[n], against_baseline) for n in names) or (
                    time.monotonic() > deadline):
                return last
            time.sleep(0.1)

    def _clean(self, name: str, st: dict[str, Any], against_baseline: bool) -> bool:
        if "error" in st or any(_held(st, f) != 0 for f in ZERO_FIELDS):
            return False
        base = self.baseline.get(name)
        return not against_baseline or base is None or _extra_regions(st, base) == 0

    def _describe(self, object_id: str) -> str:
        t = self.by_object.get(object_id)
        if t is None:
            return f"{object_id[:16]} (not a transfer of this run)"
        return (f"#{t.index} {t.fault} {t.path}/{t.owner} sender{t.sender}->receiver"
                f"{t.receiver} {t.outcome} {t.error}".rstrip())

    def diagnose(self, names: list[str]) -> dict[str, Any]:
        """For actors that did not come back to baseline: how many objects Ray's RDT store
        still holds there, then what a forced gc.collect() in the actor changes (a leak
        that goes away after it is a reference cycle holding an ObjectRef or a tensor)."""
        import ray

        def rdt_store_objects(self: Any) -> list[str]:
            from ray._private.worker import global_worker

            store = global_worker.rdt_manager.rdt_store
            with store._lock:  # Ray internals: best effort, for the diagnosis only
                return [k for k, q in store._rdt_store.items() if q]

        def collect(self: Any) -> int:
            return gc.collect()

        actors = self.actors()
        out: dict[str, Any] = {}
        for name in names:
            try:
                held = ray.get(actors[name].__ray_call__.remote(rdt_store_objects), timeout=30)
                out[name] = {
                    "rdt_store_objects": len(held),
                    "held_by_ray": [self._describe(oid) for oid in held],
                    "gc_collected": ray.get(actors[name].__ray_call__.remote(collect),
                                            timeout=30)}
            except Exception as e:
                out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        after = self.settle(names, bound=10.0)
        for name in names:
            st = after[name]
            out[name]["after_gc"] = st if "error" in st else {
                f: st[f] for f in (*ZERO_FIELDS, "registered_regions")}
        return out


def _extra_regions(st: dict[str, Any], base: dict[str, Any]) -> int:
    """Registered regions beyond the baseline. A receiver that maps same-node objects
    makes its arena only at its first NIXL READ (an overflow object, say), which may come
    after the baseline: that one region is the arena, created once, not a leak."""
    extra = int(st["registered_regions"]) - int(base.get("registered_regions", 0))
    if st.get("arena_capacity", 0) and not base.get("arena_capacity", 0):
        extra -= 1
    return extra


def _held(st: dict[str, Any], field: str) -> int:
    """What ``st`` holds of ``field`` beyond what Ray's store keeps for cancelled tasks.

    A received object Ray keeps holds an arena block, or, mapped from a same-node
    sender, a lease: received bytes and objects are counted over both, under the arena
    fields, and ``mapped_objects`` adds nothing of its own."""
    if field == "arena_used":
        return (int(st["arena_used"]) + int(st.get("mapped_bytes", 0))
                - int(st.get("held_by_ray_bytes", 0)))
    if field == "arena_live_blocks":
        return (int(st["arena_live_blocks"]) + int(st.get("mapped_objects", 0))
                - int(st.get("held_by_ray_objects", 0)))
    if field == "mapped_objects":
        return 0
    return int(st[field])


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie has no memory left to read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # a zombie has no memory left to read


def _wait(predicate: Any, bound: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + bound
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def start_cluster(num_cpus: int = 8) -> dict[str, str | None]:
    """A fresh local Ray cluster whose workers see CLUSTER_ENV; the driver's previous
    values of those variables (to restore with :func:`stop_cluster`)."""
    import ray

    saved = {k: os.environ.get(k) for k in CLUSTER_ENV}
    os.environ.update(CLUSTER_ENV)  # the driver reads the same settings
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             object_store_memory=512 * _MIB, runtime_env={"env_vars": dict(CLUSTER_ENV)},
             log_to_driver=False)
    return saved


def stop_cluster(saved: dict[str, str | None]) -> None:
    import ray

    ray.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def run_chaos(transfers: int = 500, seed: int = 0, batch: int = 8, verbose: bool = False,
              manage_cluster: bool = True, settle_s: float = CLEAN_BOUND_S) -> dict[str, Any]:
    """Run the chaos schedule; the report (see module docstring). With ``manage_cluster``
    it starts and shuts down its own local cluster, else it uses the connected one.
    ``settle_s`` bounds the final wait for every actor to return to its baseline."""

    def log(msg: str) -> None:
        if verbose:
            print(f"[chaos {time.monotonic() - t_start:7.1f}s] {msg}", file=sys.stderr,
                  flush=True)

    t_start = time.monotonic()
    plan, kill_at, victim = draw_schedule(transfers, seed)
    saved = start_cluster() if manage_cluster else None
    try:
        sender_cls, receiver_cls = make_actor_classes()
        import ray

        senders = [sender_cls.remote() for _ in range(2)]
        receivers = [receiver_cls.options(runtime_env={"env_vars": {
            **CLUSTER_ENV, "RAY_RDT_POOL_SAME_NODE": mode}}).remote()
            for mode in RECEIVER_SAME_NODE]
        ray.get([a.pid.remote() for a in senders + receivers], timeout=RESULT_BOUND_S)
        t_ready = time.monotonic()
        log(f"cluster and 5 actors up in {t_ready - t_start:.1f}s")
        h = _Harness(senders, receivers, sender_cls, log)
        h.warm_up([0, 1], [0, 1, 2])
        h.baseline = h.settle(against_baseline=False)
        log("warm-up done; baseline " + ", ".join(
            f"{n}: {b.get('registered_regions')} regions" for n, b in h.baseline.items()))
        t_run = time.monotonic()
        kill: dict[str, Any] = {}
        i = 0
        while i < len(plan):
            if i == kill_at:
                kill = h.kill_step([t for t in plan[i:] if t.fault == "sender_killed"], victim)
                i += sum(1 for t in plan if t.fault == "sender_killed")
                continue
            end = min(i + batch, len(plan))
            if i < kill_at < end:
                end = kill_at
            h.run_batch(plan[i:end])
            i = end
            if verbose and (i // batch) % 10 == 0:
                log(f"{i}/{len(plan)} transfers")
        t_done = time.monotonic()
        gc.collect()  # drop any ref the driver still holds in a cycle
        final = h.settle(bound=settle_s)
        t_end = time.monotonic()
        dirty = [n for n, st in final.items() if not h._clean(n, st, True)]
        diagnosis = h.diagnose(dirty) if dirty else {}
        report = _report(plan, h.warmup_problems, kill, h.baseline, final, diagnosis, seed,
                         {"total_s": t_end - t_start, "setup_s": t_run - t_start,
                          "transfers_s": t_done - t_run, "settle_s": t_end - t_done})
        for actor in h.actors().values():
            ray.kill(actor)
        return report
    finally:
        if manage_cluster:
            stop_cluster(saved)


def _report(plan: list[Transfer], warmup_problems: list[Transfer], kill: dict[str, Any],
            baseline: dict[str, Any],
            final: dict[str, Any], diagnosis: dict[str, Any], seed: int,
            times: dict[str, float]) -> dict[str, Any]:
    outcomes = collections.Counter(t.outcome for t in plan)
    by_fault: dict[str, dict[str, int]] = {
        f: dict(collections.Counter(t.outcome for t in plan if t.fault == f)) for f in FAULTS}
    errors: dict[str, dict[str, int]] = {
        f: dict(collections.Counter(t.error for t in plan if t.fault == f and t.error))
        for f in FAULTS}
    # Objects the victim had made before it died (one it failed to make is not outstanding).
    after = [t for t in plan if t.phase == "after_death" and t.object_id]
    leaks: dict[str, Any] = {}
    leaked_bytes = held_by_ray = held_by_ray_objects = 0
    for name, st in final.items():
        base = baseline.get(name, {})
        if "error" in st:
            leaks[name] = st
            continue
        held = {f: _held(st, f) for f in ZERO_FIELDS if _held(st, f)}
        regions = _extra_regions(st, base)
        if regions:
            held["extra_registered_regions"] = regions
        leaked_bytes += _held(st, "pool_used") + _held(st, "arena_used")
        held_by_ray += st.get("held_by_ray_bytes", 0)
        held_by_ray_objects += st.get("held_by_ray_objects", 0)
        if held:
            leaks[name] = held
    problems = [asdict(t) for t in plan
                if t.outcome in ("corrupt", "untyped_error", "hung")
                or (t.fault in ("none", "oversized") and t.outcome != "ok")]
    warmup = [asdict(t) for t in warmup_problems]
    for p in problems + warmup:
        p.pop("expected", None)
    return {
        "seed": seed,
        "transfers": len(plan),
        "faults": dict(collections.Counter(t.fault for t in plan)),
        "outcomes": {o: outcomes.get(o, 0) for o in OUTCOMES},
        "by_fault": by_fault,
        "errors": errors,
        "paths": dict(collections.Counter(f"{t.path}/{t.owner}" for t in plan)),
        "bytes_sent": sum(t.nbytes for t in plan),
        "corrupt": outcomes.get("corrupt", 0),
        "untyped_error": outcomes.get("untyped_error", 0),
        "hung": outcomes.get("hung", 0),
        "from_killed_after_death": len(after),
        "from_killed_raised": sum(1 for t in after if t.outcome != "ok"),
        "from_killed_typed": sum(1 for t in after if t.outcome == "typed_error"),
        "kill": kill,
        "leaked_bytes": leaked_bytes,
        "held_by_ray_bytes": held_by_ray,
        "held_by_ray_objects": held_by_ray_objects,
        "leaks": leaks,
        "leak_diagnosis": diagnosis,
        "fallbacks": {n: st.get("fallbacks") for n, st in final.items()
                      if n.startswith("sender")},
        "baseline_regions": {n: b.get("registered_regions") for n, b in baseline.items()},
        "final_stats": final,
        "problems": problems,
        "warmup_problems": warmup,
        "times": {k: round(v, 2) for k, v in times.items()},
    }


def format_report(rep: dict[str, Any]) -> str:
    lines = [f"chaos: {rep['transfers']} transfers, seed {rep['seed']}, "
             f"{rep['bytes_sent'] / _MIB:.1f} MiB put, {rep['times']['total_s']:.1f}s "
             f"(transfers {rep['times']['transfers_s']:.1f}s)", ""]
    cols = list(OUTCOMES)
    lines.append(f"{'fault':<15}{'count':>6}" + "".join(f"{c:>14}" for c in cols))
    for f in FAULTS:
        row = rep["by_fault"][f]
        lines.append(f"{f:<15}{rep['faults'].get(f, 0):>6}"
                     + "".join(f"{row.get(c, 0):>14}" for c in cols))
    lines.append(f"{'total':<15}{rep['transfers']:>6}"
                 + "".join(f"{rep['outcomes'][c]:>14}" for c in cols))
    lines.append("")
    for f, errs in rep["errors"].items():
        if errs:
            lines.append(f"errors ({f}): " + ", ".join(f"{k} x{v}" for k, v in errs.items()))
    lines.append(f"killed sender: {rep['from_killed_raised']} of "
                 f"{rep['from_killed_after_death']} transfers after its death raised "
                 f"({rep['from_killed_typed']} typed)")
    lines.append(f"corrupt transfers: {rep['corrupt']}   untyped errors: "
                 f"{rep['untyped_error']}   hung: {rep['hung']}")
    lines.append(f"held by Ray's store for cancelled tasks: {rep['held_by_ray_bytes']} bytes "
                 f"in {rep['held_by_ray_objects']} objects (Ray never frees them)")
    lines.append(f"leaked bytes: {rep['leaked_bytes']}   "
                 f"leaks: {rep['leaks'] if rep['leaks'] else 'none'}")
    for name, d in rep["leak_diagnosis"].items():
        lines.append(f"  {name}: {d}")
    for p in rep["warmup_problems"]:
        lines.append(f"  warm-up problem {p['path']}/{p['owner']} sender{p['sender']}->receiver"
                     f"{p['receiver']} -> {p['outcome']} {p['error']} {p['message'][-300:]!r}")
    for p in rep["problems"][:20]:
        lines.append(f"  problem #{p['index']} {p['fault']} {p['path']}/{p['owner']} "
                     f"-> {p['outcome']} {p['error']} {p['message'][-200:]!r}")
    if len(rep["problems"]) > 20:
        lines.append(f"  ... {len(rep['problems']) - 20} more problems (see --json)")
    return "\n".join(lines)


def passed(rep: dict[str, Any]) -> bool:
    """The run's verdict: nothing corrupt, untyped or hung; no leak; warm-up, no-fault and
    oversized transfers all ok; every transfer from the killed sender after its death
    raised."""
    clean_faults = all(set(rep["by_fault"][f]) <= {"ok"} for f in ("none", "oversized"))
    return (rep["corrupt"] == 0 and rep["untyped_error"] == 0 and rep["hung"] == 0
            and not rep["warmup_problems"]
            and rep["leaked_bytes"] == 0 and not rep["leaks"] and clean_faults
            and rep["from_killed_raised"] == rep["from_killed_after_death"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transfers", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8, help="transfers in flight together")
    ap.add_argument("--json", help="write the full report here")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    rep = run_chaos(args.transfers, args.seed, args.batch, args.verbose)
    print(format_report(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1, default=str)
    ok = passed(rep)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
