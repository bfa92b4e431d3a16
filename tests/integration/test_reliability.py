"""Reliability of the nixl_pool transport on a real Ray cluster with real NIXL (UCX, host memory).

Faults (a sender or receiver killed before or during a fetch, the owner dropping refs while a
READ is in flight, a stalled READ), bad input with typed errors and unchanged stats, leaks over
1,000 put/get/free cycles, concurrent senders and receivers, and an allocator fragmentation
scenario. The module's actors run on the test process's shared cluster with the module's
settings (``ENV``); docs/reliability.md lists every case with its figure.

Stalls are made deterministic with SIGSTOP: a receiver's *first* READ from a sender needs the
sender to progress its UCX worker for the connection handshake, so a stopped sender holds a
first-contact READ in flight for as long as it stays stopped. (Once two agents are connected,
UCX reads with cma/process_vm_readv, which needs nothing from the target: a READ from a
connected but stopped sender still completes.) Every test that stops a process continues it in
a ``finally``.

Actors take seconds to start on this shared 2-core machine, so one sender and one receiver
live for the whole module; a test creates only the actors it kills or must meet for the
first time, and measures every figure against a baseline it takes itself.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import pytest
import ray
import torch

import ray_rdt_pool
from ray_rdt_pool.core import codec
from ray_rdt_pool.core.runs import DTYPES, TensorRun
from ray_rdt_pool.errors import TransferError, WireFormatError
from tests.stress.chaos import process_gone
from tests.support import actors
from tests.support.raycluster import actor_env, digest, driver_rdt_fetch_timeout, wait_for

pytestmark = pytest.mark.ray

# @ray.method(tensor_transport=...) validates the name when the class is defined.
ray_rdt_pool.register()

#: Ray's own bound on an RDT fetch (the default is 60 s), set for the whole cluster.
RAY_FETCH_TIMEOUT_S = 20.0
#: fetch_timeout_s of the receivers in this module. The stalled-READ test starts its second
#: READ half of this after the first, so each side of that test has 5 s of margin.
FETCH_TIMEOUT_S = 10.0
#: Slack on top of a configured timeout before "it did not hang" fails. The machine is shared
#: and slow, so it is generous: the point is the bound, not the speed.
SLACK_S = 15.0
#: fetch_timeout_s of the module's second receiver, for the cases that only need some
#: READ or lookup to time out (each waits it out once).
QUICK_FETCH_TIMEOUT_S = 3.0
POOL_BYTES = 64 << 20

#: What a receiver may see when its sender dies: our TransferError or Ray's own types.
SENDER_DIED_ERRORS = {"TransferError", "RayDirectTransportError", "ObjectFetchTimedOutError",
                      "ActorDiedError", "OwnerDiedError", "ObjectLostError"}


#: The module's actors' settings (over the shared cluster's 64 MiB pools and arenas).
ENV = {"RAY_RDT_POOL_POOL_BYTES": "64M", "RAY_RDT_POOL_ARENA_BYTES": "64M",
       "RAY_rdt_fetch_fail_timeout_milliseconds": str(int(RAY_FETCH_TIMEOUT_S * 1000))}


@pytest.fixture(scope="module", autouse=True)
def cluster(ray_cluster):
    with driver_rdt_fetch_timeout(RAY_FETCH_TIMEOUT_S):  # the driver monitors task arguments
        yield


# ---------------------------------------------------------------------------------------
# Payloads (deterministic, so the driver can compute expected digests itself)
# ---------------------------------------------------------------------------------------

DTYPE_CYCLE = [torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
               torch.int64, torch.uint8, torch.bool, torch.bfloat16, torch.float16,
               torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.uint16]


def random_tensor(g: torch.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (every byte matters to the digest)."""
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(shape)


def payload(seed: int, nbytes: int) -> list[torch.Tensor]:
    """One large float32 tensor plus two small ones of other dtypes."""
    g = torch.Generator().manual_seed(seed)
    return [random_tensor(g, torch.float32, (nbytes // 4,)),
            random_tensor(g, torch.int16, (3, 7)), random_tensor(g, torch.bool, (5,))]


def mixed_object(i: int) -> list[torch.Tensor]:
    """Object ``i`` of the leak test: 0 to 6 tensors of varied dtypes and shapes, some
    zero-size, some non-contiguous (transposed, strided, conjugated), a few of 128 KiB."""
    g = torch.Generator().manual_seed(1000 + i)
    kind = i % 10
    if kind == 0:
        return []  # an object of no tensors
    out = []
    for j in range(1 + (i * 7) % 6):
        dt = DTYPE_CYCLE[(i + 3 * j) % len(DTYPE_CYCLE)]
        if kind == 1:  # every tensor empty: nothing to READ
            out.append(torch.empty(0, 3, dtype=dt))
            continue
        if kind == 9 and j == 0:
            out.append(random_tensor(g, torch.float32, (32 * 1024,)))
            continue
        rows = int(torch.randint(0, 40, (1,), generator=g))
        cols = int(torch.randint(1, 40, (1,), generator=g))
        t = random_tensor(g, dt, (rows, cols))
        style = (i + j) % 4
        if style == 1:
            t = t.t()
        elif style == 2:
            t = t[:, ::2]
        elif style == 3 and dt.is_complex:
            t = t.conj()
        out.append(t)
    return out


def burst_object(g: torch.Generator) -> list[torch.Tensor]:
    n = [int(x) for x in torch.randint(1, 600, (3,), generator=g)]
    return [torch.randn(n[0], generator=g), torch.randint(-9, 9, (n[1],), generator=g),
            random_tensor(g, torch.bfloat16, (n[2],))]


def fingerprint(tensors: list[Any]) -> list[str]:
    """tests.support.raycluster.digest of each tensor copied to standard strides first.

    digest() itself raises for a tensor that is contiguous by torch's rule but whose last
    stride is not 1 (a size-1 dim with any stride, e.g. ``x[:1, ::4]``); such tensors are
    valid to send, and the leak test sends them.
    """
    return digest([torch.empty(t.shape, dtype=t.dtype).copy_(t) for t in tensors])


# ---------------------------------------------------------------------------------------
# Actors
# ---------------------------------------------------------------------------------------


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn``; its value, or its exception's type names (MRO) and message; and the time."""
    t0 = time.monotonic()
    try:
        value = fn()
    except Exception as e:
        return {"ok": False, "types": [c.__name__ for c in type(e).__mro__],
                "msg": str(e), "s": time.monotonic() - t0}
    return {"ok": True, "value": value, "s": time.monotonic() - t0}


def wire_of(ref: ray.ObjectRef) -> bytes:
    """The nixl_pool wire bytes of an object this process owns or borrows."""
    mgr = ray._private.worker.global_worker.rdt_manager
    return mgr.get_rdt_metadata(ref.hex()).tensor_transport_meta.wire


@ray.remote(enable_tensor_transport=True, max_concurrency=4, runtime_env=actor_env(ENV))
class Sender(actors.Sender):
    def __init__(self, **config):
        super().__init__(**config)
        self.held: dict[str, ray.ObjectRef] = {}

    def put(self, tensors, key: str | None = None):  # keeps the ref, not the tensors
        ref = ray.put(tensors, _tensor_transport="nixl_pool")
        if key is not None:
            self.held[key] = ref
        return [ref], fingerprint(tensors)

    def put_payload(self, seed: int, nbytes: int, key: str | None = None):
        return self.put(payload(seed, nbytes), key)

    def put_bytes(self, key: str, nbytes: int):
        """One uint8 tensor of exactly ``nbytes`` (a multiple of 64: packs with no padding)."""
        g = torch.Generator().manual_seed(nbytes + len(key))
        return self.put([random_tensor(g, torch.uint8, (nbytes,))], key)

    def put_mixed(self, first: int, n: int):
        out = []
        total = 0
        for i in range(first, first + n):
            ts = mixed_object(i)
            total += sum(t.numel() * t.element_size() for t in ts)
            out.append(([ray.put(ts, _tensor_transport="nixl_pool")], fingerprint(ts)))
        return out, total

    def burst(self, seed: int, n: int):
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            ts = burst_object(g)
            out.append(([ray.put(ts, _tensor_transport="nixl_pool")], fingerprint(ts)))
        return out

    @ray.method(tensor_transport="nixl_pool")
    def make(self, seed: int, nbytes: int):
        return payload(seed, nbytes)

    def segments(self, key: str) -> int:
        return len(codec.decode(wire_of(self.held[key])).segments)

    def wire(self, key: str) -> bytes:
        return wire_of(self.held[key])

    def drop(self, *keys: str) -> None:
        for k in keys or list(self.held):
            self.held.pop(k, None)

    def try_put(self, make: Callable[[], list[Any]]):
        """Build the tensors here (a CUDA tensor cannot travel as an argument) and put them;
        ``held``: how many of them something still references once this method let go
        (after a failed put, Ray's RDT store kept them all, for good)."""
        box = [make()]
        alive = [weakref.ref(t) for t in box[0]]
        got = outcome(lambda: ray.put(box.pop(), _tensor_transport="nixl_pool") and None)
        gc.collect()
        got["held"] = sum(w() is not None for w in alive)
        return got

    def held_count(self) -> int:
        return len(self.held)


@ray.remote(enable_tensor_transport=True, max_concurrency=4, runtime_env=actor_env(ENV))
class Receiver(actors.Receiver):
    def get(self, refs, timeout: float | None = None):
        return outcome(lambda: fingerprint(ray.get(refs[0], timeout=timeout)))

    def get_many(self, ref_lists):
        return [fingerprint(ts) for ts in ray.get([r[0] for r in ref_lists])]

    def take(self, tensors):
        return fingerprint(tensors)

    def get_into(self, refs, make_targets: Callable[[], list[Any]]):
        def run():
            bufs = make_targets()
            ray.experimental.set_target_for_ref(refs[0], bufs)
            return fingerprint(ray.get(refs[0]))
        return outcome(run)

    def fetch_wire(self, wire_bytes: bytes, make_targets: Callable[[], list[Any]] | None = None):
        """Call the transport's fetch directly, as Ray would, on hand-made metadata."""
        from ray_rdt_pool._ray.metadata import PoolTransportMetadata

        return self.fetch_meta(
            PoolTransportMetadata(tensor_meta=[], tensor_device="cpu", wire=wire_bytes),
            make_targets)

    def fetch_meta(self, meta: Any, make_targets: Callable[[], list[Any]] | None = None):
        from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

        from ray_rdt_pool._ray.transport import NixlPoolTransport

        def run():
            tr = NixlPoolTransport()
            targets = make_targets() if make_targets else None
            req = tr.fetch_multiple_tensors("ee" * 28, meta, CommunicatorMetadata(), targets)
            return fingerprint(tr.wait_fetch_complete(req, -1))
        return outcome(run)


@pytest.fixture(scope="module")
def send():
    """The module's long-lived, healthy sender."""
    s = Sender.remote()
    ray.get(s.pid.remote())
    yield s
    ray.kill(s)


@pytest.fixture(scope="module")
def recv():
    """The module's long-lived receiver; it survives every fault it is put through."""
    r = Receiver.remote(fetch_timeout_s=FETCH_TIMEOUT_S)
    ray.get(r.pid.remote())
    yield r
    ray.kill(r)


@pytest.fixture(scope="module")
def quick_recv():
    """A long-lived receiver that gives up sooner, for the cases that wait for a timeout
    but test what follows it, not its margins."""
    r = Receiver.remote(fetch_timeout_s=QUICK_FETCH_TIMEOUT_S)
    ray.get(r.pid.remote())
    yield r
    ray.kill(r)


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP a process for the duration; always SIGCONT it again (if it still exists)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def stats(actor: Any) -> Any:
    return ray.get(actor.stats.remote())


def in_flight(actor: Any, n: int) -> Any:
    """Wait until ``actor`` has ``n`` READs in flight; return its stats."""
    return wait_for(lambda: (st := stats(actor)).transfers_in_flight == n and st, timeout=60)


def kill_and_reap(actor: Any, pid: int) -> None:
    """ray.kill, then wait until the process is really gone (Ray reports the actor dead
    while the process may still be exiting, and a live process can still be READ)."""
    ray.kill(actor)
    wait_for(lambda: process_gone(pid), timeout=60)


def made(*refs: ray.ObjectRef) -> None:
    """Wait until the driver holds the nixl_pool metadata of method returns ``refs``.

    ray.wait sees the task finish before the metadata arrives, and Ray refuses to pass a
    ref nested in an argument (to be borrowed) until it has the metadata.
    """
    ray.wait(list(refs), num_returns=len(refs))
    mgr = ray._private.worker.global_worker.rdt_manager
    for ref in refs:
        assert mgr.wait_for_tensor_transport_metadata(ref.hex(), 60) is not None


def settle(s: Any, live: int | None = None) -> Any:
    """Wait until sender ``s`` holds ``live`` objects (by default, those it keeps refs to
    itself); frees run asynchronously, after the owner's refcount drops."""
    if live is None:
        live = ray.get(s.held_count.remote())
    return wait_for(lambda: (st := stats(s)).live_objects == live and st, timeout=60)


def receiver_clean(r: Any, base: Any) -> Any:
    """The receiver holds nothing more than at ``base``: no READ, no arena block."""
    st = wait_for(lambda: (x := stats(r)).transfers_in_flight == 0
                  and x.arena_used == base.arena_used and x, timeout=60)
    assert st.arena_live_blocks == base.arena_live_blocks, st
    assert st.receive_fallbacks == base.receive_fallbacks, st
    return st


def round_trip(s: Any, r: Any, seed: int, nbytes: int = 1 << 20) -> None:
    """``s`` puts a new object and ``r`` reads it byte-exact."""
    refs, expected = ray.get(s.put_payload.remote(seed, nbytes))
    got = ray.get(r.get.remote(refs))
    assert got["ok"] and got["value"] == expected, got


def figure(case: str, **values: Any) -> None:
    """Print one measured figure (shown with ``pytest -s``; docs/reliability.md quotes them)."""
    shown = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in values.items())
    print(f"FIGURE {case}: {shown}")


def err(got: dict[str, Any]) -> str:
    """The exception type of an outcome, for figures (the assertions check it)."""
    return "no error" if got["ok"] else got["types"][0]


def died_in_time(got: dict[str, Any], bound: float = FETCH_TIMEOUT_S + SLACK_S) -> None:
    assert not got["ok"], got
    assert set(got["types"]) & SENDER_DIED_ERRORS, got
    assert got["s"] < bound, got


# ---------------------------------------------------------------------------------------
# Faults: the sender dies
# ---------------------------------------------------------------------------------------


def test_sender_killed_before_fetch_of_a_ref_it_owns(send, recv):
    """ray.put in the sender makes it the owner: its death is also an owner death, which Ray
    may report (OwnerDiedError) before the transport's READ fails (TransferError)."""
    s = Sender.remote()
    warm, expected = ray.get(s.put_payload.remote(1, 4096))
    assert ray.get(recv.get.remote(warm))["value"] == expected  # connected, metadata loaded
    base = stats(recv)
    refs, _ = ray.get(s.put_payload.remote(2, 4 << 20))
    kill_and_reap(s, ray.get(s.pid.remote()))
    got = ray.get(recv.get.remote(refs))
    figure("sender killed before fetch, sender-owned ref", error=err(got), s=got["s"])
    died_in_time(got)
    receiver_clean(recv, base)
    round_trip(send, recv, 3)


def test_sender_killed_before_fetch_of_a_driver_owned_ref(send, recv):
    """A method return is owned by the driver: the receiver reaches the READ, which fails
    with TransferError, by both receive paths."""
    s = Sender.remote()
    warm = s.make.remote(1, 4096)
    made(warm)
    assert ray.get(recv.get.remote([warm]))["value"] == fingerprint(payload(1, 4096))
    base = stats(recv)
    ref = s.make.remote(2, 4 << 20)
    made(ref)
    kill_and_reap(s, ray.get(s.pid.remote()))
    # ray.get in the receiver: fetch_multiple_tensors / wait_fetch_complete ...
    got = ray.get(recv.get.remote([ref]))
    figure("sender killed before fetch, driver-owned ref, ray.get", error=err(got),
           s=got["s"], msg=got.get("msg", "")[:160])
    died_in_time(got)
    assert "TransferError" in got["types"], got
    # ... and a task argument: recv_multiple_tensors on the receiver's _ray_system thread.
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="may have"):
        ray.get(recv.take.remote(ref))
    figure("sender killed before fetch, driver-owned ref, task argument",
           s=time.monotonic() - t0)
    assert time.monotonic() - t0 < FETCH_TIMEOUT_S + SLACK_S
    receiver_clean(recv, base)
    round_trip(send, recv, 3)


def test_a_read_that_fails_to_start_counts_as_a_transfer_error(recv):
    s = Sender.remote()
    warm = s.make.remote(1, 4096)
    made(warm)
    assert ray.get(recv.get.remote([warm]))["ok"]
    ref = s.make.remote(2, 4096)
    made(ref)
    base = stats(recv)
    kill_and_reap(s, ray.get(s.pid.remote()))
    got = ray.get(recv.get.remote([ref]))
    assert "TransferError" in got["types"], got
    assert stats(recv).transfer_errors == base.transfer_errors + 1


def test_first_contact_with_a_dead_sender_is_a_transfer_error(send, recv):
    s = Sender.remote()  # recv has never read from s
    ref = s.make.remote(2, 4096)
    made(ref)
    base = stats(recv)
    kill_and_reap(s, ray.get(s.pid.remote()))
    got = ray.get(recv.get.remote([ref]))
    figure("first contact with a dead sender", error=err(got), s=got["s"])
    assert not got["ok"] and got["s"] < FETCH_TIMEOUT_S + SLACK_S, got
    receiver_clean(recv, base)
    round_trip(send, recv, 4)
    assert "TransferError" in got["types"], got  # the bug: the type is nixlBackendError


def test_sender_killed_during_fetch(recv):
    """The sender dies while a READ from it is in flight (held there by SIGSTOP); then the
    same receiver reads from a sender it has never met."""
    s, s_new = Sender.remote(), Sender.remote()
    ref = s.make.remote(5, 16 << 20)
    made(ref)
    pid = ray.get(s.pid.remote())
    base = stats(recv)
    with stopped(pid):
        pending = recv.get.remote([ref])
        in_flight(recv, 1)
        t_kill = time.monotonic()
        kill_and_reap(s, pid)
        got = ray.get(pending)
        waited = time.monotonic() - t_kill
    figure("sender killed during fetch", error=err(got), s_after_kill=waited,
           msg=got.get("msg", "")[:160])
    died_in_time(got)
    assert waited < FETCH_TIMEOUT_S + SLACK_S, waited
    receiver_clean(recv, base)
    round_trip(s_new, recv, 6)
    ray.kill(s_new)


# ---------------------------------------------------------------------------------------
# Faults: the receiver dies, the owner lets go, a READ stalls
# ---------------------------------------------------------------------------------------


def test_receiver_killed_during_fetch_sender_frees_and_keeps_serving(send, recv):
    r1 = Receiver.remote()  # meets send for the first time: its READ can be held
    base = settle(send)
    ref = send.make.remote(7, 8 << 20)
    made(ref)
    assert stats(send).live_objects == base.live_objects + 1
    pid, r1_pid = ray.get(send.pid.remote()), ray.get(r1.pid.remote())
    with stopped(pid):
        pending = r1.get.remote([ref])
        in_flight(r1, 1)
        kill_and_reap(r1, r1_pid)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(pending)
    del ref, pending  # the owner (driver) drops the ref: the sender frees the blocks
    t0 = time.monotonic()
    st = settle(send, base.live_objects)
    figure("receiver killed during fetch", s_to_free=time.monotonic() - t0,
           leaked_bytes=st.pool_used - base.pool_used)
    assert st.pool_used == base.pool_used
    # The sender keeps serving others, by both receive paths.
    round_trip(send, recv, 8)
    ref = send.make.remote(9, 1 << 20)
    assert ray.get(recv.take.remote(ref)) == fingerprint(payload(9, 1 << 20))
    del ref
    st = settle(send, base.live_objects)
    assert st.pool_used == base.pool_used


@pytest.mark.parametrize("form", ["ray_get", "task_argument"])
def test_owner_drops_every_ref_while_fetch_in_flight(recv, form, monkeypatch):
    """The driver drops its last ref while the receiver's READ is held by SIGSTOP.

    task_argument: ``recv`` is an out-of-order actor, so the driver's ``.remote()`` first
    waits, up to ``ORDER_WAIT_S``, for the transfer to be done before it sends the task
    (ray_rdt_pool._ray.patches._transfers_before_their_tasks). A held READ is not done, so
    with the default ORDER_WAIT_S (10 s, equal to FETCH_TIMEOUT_S) ``.remote()`` returned
    only some 20 ms before the READ timed out, and the in-flight check raced that timeout.
    A short wait here lets ``.remote()`` return while the READ is still held.
    """
    if form == "task_argument":
        monkeypatch.setattr("ray_rdt_pool._ray.patches.ORDER_WAIT_S", 1.0)
    s = Sender.remote()  # recv meets it for the first time: its READ can be held
    sbase = stats(s)
    ref = s.make.remote(11, 8 << 20)
    made(ref)
    rbase = stats(recv)
    pid = ray.get(s.pid.remote())
    expected = fingerprint(payload(11, 8 << 20))
    with stopped(pid):
        pending = recv.get.remote([ref]) if form == "ray_get" else recv.take.remote(ref)
        in_flight(recv, 1)
        del ref  # every ref the driver holds; only the pending task still names the object
    got = outcome(lambda: ray.get(pending, timeout=FETCH_TIMEOUT_S + SLACK_S + 30))
    if form == "ray_get":
        got = got["value"] if got["ok"] else got
    else:  # recv_multiple_tensors raises into the task
        got = {"ok": True, "value": got["value"]} if got["ok"] else got
    figure(f"owner drops refs during fetch ({form})", completed=got["ok"],
           error=err(got))
    # Completes byte-exact, or fails cleanly with a typed error: no hang, no torn result.
    assert (got["ok"] and got["value"] == expected) or "TransferError" in got["types"], got
    st = settle(s, sbase.live_objects)
    assert st.pool_used == sbase.pool_used
    rst = receiver_clean(recv, rbase)  # the views died with the task: arena back to base
    figure(f"owner drops refs during fetch ({form})", sender_leaked=st.pool_used - sbase.pool_used,
           arena_leaked=rst.arena_used - rbase.arena_used)
    ray.kill(s)


def test_stalled_read_gives_up_and_its_memory_comes_back_only_once_ended(recv):
    """READ a stalls past fetch_timeout_s while READ b from the same sender is in flight.

    a raises TransferError within the bound and is given up on. Its arena block returns
    only once NIXL has ended the READ: the cancel succeeds, or, when NIXL cannot cancel
    it, the receiver cuts it off by removing the sender's agent (which ends b too, with a
    typed error). Either way b ends byte-exact or with a TransferError, nothing stays
    reserved, and after SIGCONT the sender serves both objects again.
    """
    s = Sender.remote()
    ref_a, ref_b = s.make.remote(21, 1 << 20), s.make.remote(22, 2 << 20)
    made(ref_a, ref_b)
    pid = ray.get(s.pid.remote())
    base = stats(recv)
    with stopped(pid):
        fa = recv.get.remote([ref_a])
        t_a = time.monotonic()
        in_flight(recv, 1)
        # b starts half a timeout later, so it is still waiting when a gives up.
        time.sleep(max(0.0, FETCH_TIMEOUT_S / 2 - (time.monotonic() - t_a)))
        fb = recv.get.remote([ref_b])
        in_flight(recv, 2)
        got_a = ray.get(fa)
        got_b = ray.get(fb)
        cut = wait_for(lambda: (x := stats(recv)).transfers_in_flight == 0
                       and x.abandoned_transfers == 0 and x, timeout=SLACK_S)
    figure("stalled READ", error=err(got_a), s=got_a["s"], fetch_timeout_s=FETCH_TIMEOUT_S,
           sibling=err(got_b), sibling_s=got_b["s"], cut=cut.transfers_cut - base.transfers_cut)
    assert not got_a["ok"] and "TransferError" in got_a["types"], got_a
    assert "fetch_timeout_s" in got_a["msg"], got_a
    assert got_a["s"] < FETCH_TIMEOUT_S + SLACK_S, got_a
    if got_b["ok"]:  # a was cancelled; b's READ went on and finished
        assert got_b["value"] == fingerprint(payload(22, 2 << 20)), got_b
    else:  # b timed out too, or a could not be cancelled and was cut off, and b with it
        assert "TransferError" in got_b["types"], got_b
        assert "fetch_timeout_s" in got_b["msg"] or (
            cut.transfers_cut >= base.transfers_cut + 1
            and cut.remote_agents_removed >= base.remote_agents_removed + 1), (got_b, cut)
    assert got_b["s"] < FETCH_TIMEOUT_S + SLACK_S, got_b
    st = receiver_clean(recv, base)
    assert st.transfer_errors == base.transfer_errors + 1 + (not got_b["ok"])
    # The resumed sender serves the failed objects again (its metadata is reloaded).
    for ref, seed, n in ((ref_a, 21, 1 << 20), (ref_b, 22, 2 << 20)):
        again = ray.get(recv.get.remote([ref]))
        assert again["ok"] and again["value"] == fingerprint(payload(seed, n)), again
    round_trip(s, recv, 23)
    ray.kill(s)


def test_timeout_error_names_the_sender_agent(quick_recv):
    s = Sender.remote()  # first contact, so SIGSTOP holds the READ
    ref = s.make.remote(31, 4096)
    made(ref)
    pid = ray.get(s.pid.remote())
    try:
        with stopped(pid):
            got = ray.get(quick_recv.get.remote([ref]))
        assert "TransferError" in got["types"], got
        assert "from None" not in got["msg"] and "rdtpool-" in got["msg"], got
    finally:
        ray.kill(s)


# ---------------------------------------------------------------------------------------
# Bad input: a typed error naming the problem and the fix, and stats() unchanged
# ---------------------------------------------------------------------------------------


def _no_cuda_reason() -> str | None:
    if torch.cuda.is_available():
        return None
    return "CUDA is not available on this machine (CPU-only torch, no GPU): a CUDA tensor " \
           "cannot even be created, so this case runs only on a GPU host"


#: put() cases: tensor builder (run in the sender), needs CUDA, error type, message excerpts.
PUT_CASES: dict[str, tuple[Callable[[], list[Any]], bool, str, list[str]]] = {
    "mixed_meta_then_cpu": (lambda: [torch.empty(3, device="meta"), torch.ones(3)], False,
                            "InvalidInputError", ["tensor 0", "meta", "supports cpu and cuda"]),
    "quantized_dtype": (lambda: [torch.ones(2), torch.quantize_per_tensor(
        torch.ones(4), 0.1, 0, torch.qint8)], False, "InvalidInputError",
        ["torch.qint8 cannot be sent", "Convert the tensor first"]),
    # Before: torch's "Internal error: NestedTensorImpl doesn't support sizes".
    "nested_strided": (lambda: [torch.ones(2), torch.nested.nested_tensor(
        [torch.ones(2, 3), torch.ones(4, 3)])], False, "InvalidInputError",
        ["tensor 1 is a nested tensor", "t.unbind()"]),
    "mixed_cpu_and_cuda": (lambda: [torch.ones(2), torch.ones(2, device="cuda")], True,
                           "InvalidInputError", ["tensor 1 is on cuda but tensor 0 is on cpu",
                                                 "separate objects"]),
    # Before: the pack copied from address 0 and the sender died with SIGSEGV.
    "zero_tensor": (lambda: [torch.ones(2), torch._efficientzerotensor(4)], False,
                    "InvalidInputError", ["tensor 1 ((4,) torch.float32) is a ZeroTensor",
                                          "16 bytes", "t.clone()"]),
    "storage_resized_to_0": (lambda: _resized_view(), False, "InvalidInputError",
                             ["tensor 0 ((1000,) torch.float32) has 4,000 bytes",
                              "resized to 0", "while its storage is allocated"]),
}


def _resized_view() -> list[Any]:
    """A view into a storage that was then resized to 0 bytes (FSDP frees parameters so):
    its address is its storage offset, 400, not 0."""
    base = torch.ones(1100)
    view = base[100:]
    base.untyped_storage().resize_(0)
    return [view]


@pytest.mark.parametrize("case", sorted(PUT_CASES))
def test_bad_tensors_at_put(send, case):
    make, cuda, etype, excerpts = PUT_CASES[case]
    s = send
    if cuda:
        if (reason := _no_cuda_reason()) is not None:
            pytest.skip(reason)
        s = Sender.options(num_gpus=1).remote()
    settle(s)
    keep, _ = ray.get(s.put_payload.remote(40, 4096, "live"))  # a live object must survive
    before = stats(s)
    got = ray.get(s.try_put.remote(make))
    after = stats(s)
    figure(f"put {case}", error=err(got), msg=got.get("msg", "")[:160])
    assert not got["ok"] and etype in got["types"], got
    for text in excerpts:
        assert text in got["msg"], got
    assert got["held"] == 0, got  # nothing keeps the tensors of a failed put
    assert (after.pool_used, after.live_objects, after.objects_put, after.fallbacks) == (
        before.pool_used, before.live_objects, before.objects_put, before.fallbacks)
    ray.get(s.drop.remote("live"))
    del keep
    settle(s)
    if s is not send:
        ray.kill(s)


def test_cuda_tensor_put(send):
    """A CUDA tensor with the CPU pool: received, or refused with a typed error naming CUDA."""
    if (reason := _no_cuda_reason()) is not None:
        pytest.skip(reason)
    s = Sender.options(num_gpus=1).remote()
    before = stats(s)
    got = ray.get(s.try_put.remote(lambda: [torch.ones(4, device="cuda")]))
    if not got["ok"]:
        assert "InvalidInputError" in got["types"] and "CUDA" in got["msg"], got
        after = stats(s)
        assert (after.pool_used, after.live_objects) == (before.pool_used, before.live_objects)
    ray.kill(s)


@ray.remote(enable_tensor_transport=True, runtime_env=actor_env(ENV))
class EnvProbe:
    """An actor started with RAY_RDT_POOL_POOL_BYTES=0 in its runtime_env."""

    def __init__(self):
        ray_rdt_pool.register()

    def run(self):
        def put():
            self.ref = ray.put([torch.ones(4)], _tensor_transport="nixl_pool")

        out = {}
        for value in ("0", "-1", "lots"):
            os.environ["RAY_RDT_POOL_POOL_BYTES"] = value  # "0" is what the runtime_env set
            out[value] = (outcome(put), outcome(ray_rdt_pool.stats))
        os.environ["RAY_RDT_POOL_POOL_BYTES"] = "8M"  # fixed: the first good put creates the pool
        return out, outcome(put), ray_rdt_pool.stats()


def test_bad_pool_size_from_the_environment():
    p = EnvProbe.options(runtime_env=actor_env({**ENV, "RAY_RDT_POOL_POOL_BYTES": "0"})).remote()
    assert ray.get(p.__ray_call__.remote(lambda self: os.environ["RAY_RDT_POOL_POOL_BYTES"])) == "0"
    bad, good, st = ray.get(p.run.remote())
    expect = {"0": "pool_bytes must be a positive number of bytes, got 0",
              "-1": "pool_bytes must be a positive number of bytes, got -1",
              "lots": "RAY_RDT_POOL_POOL_BYTES='lots' is not a size; use bytes or a K/M/G suffix"}
    for value, (put, _snap) in bad.items():
        figure(f"env RAY_RDT_POOL_POOL_BYTES={value}", error=err(put), msg=put.get("msg", "")[:160])
    for value, (put, snap) in bad.items():
        for got in (put, snap):  # the first put, and stats(), refuse the same way
            assert not got["ok"] and "ConfigurationError" in got["types"], (value, got)
            assert expect[value] in got["msg"], (value, got)
    assert "pass e.g. pool_bytes=1 << 30" in bad["0"][0]["msg"]
    assert good["ok"], good
    # Nothing of the failed attempts remains: one pool of 8 MiB holding the one good object.
    assert (st.pool_capacity, st.live_objects, st.objects_put, st.pool_used) == (
        8 << 20, 1, 1, 64), st
    assert st.nixl_registrations == 1
    ray.kill(p)


def _shorten_first_segment(raw: list[Any]) -> None:
    raw[7][2] = 8  # 8 bytes where the tensors need hundreds


def _too_many_tensors(raw: list[Any]) -> None:
    # One group (repeat 1) of one run: float32 [0] x (MAX_TENSORS + 1).
    raw[5], raw[6], raw[7] = 0, [1, 1, 1, 0, DTYPES["float32"][0], codec.MAX_TENSORS + 1], []


def _forge_address(raw: list[Any]) -> None:
    raw[7][1] += 1 << 40  # well-formed, but outside anything the sender registered


def _set(index: int, value: Any) -> Callable[[list[Any]], None]:
    def f(raw: list[Any]) -> None:
        raw[index] = value
    return f


#: Corrupted wire metadata at a real receiver: mangle, error type, message excerpts.
WIRE_CASES: dict[str, tuple[Any, str, list[str]]] = {
    "truncated": (lambda b: b[:-3], "WireFormatError",
                  ["not valid msgpack", "truncated or corrupted"]),
    "garbage": (lambda b: bytes(range(7, 250, 3)), "WireFormatError", ["object metadata"]),
    "other_version": (_set(0, codec.WIRE_VERSION + 1), "WireFormatError",
                      [f"version {codec.WIRE_VERSION + 1}",
                       "install the same ray_rdt_pool version"]),
    "uncovered_tensor": (_shorten_first_segment, "WireFormatError",
                         ["which the segments do not fully cover"]),
    "too_many_tensors": (_too_many_tensors, "WireFormatError",
                         [f"more than {codec.MAX_TENSORS:,} tensors"]),
    "unknown_device": (_set(3, "tpu"), "WireFormatError", ["device must be one of"]),
    "forged_address": (_forge_address, "TransferError", ["failed", "the sender may"]),
    "unknown_agent": (_set(1, "rdtpool-0-000000000000"), "TransferError",
                      ["no NIXL metadata", "'rdtpool-0-000000000000'"]),
}


@pytest.fixture(scope="module")
def wire_object(send, recv, quick_recv):
    """An object of the healthy sender that the module's receivers have read once (warm)."""
    refs, expected = ray.get(send.put.remote(
        [torch.randn(8, 8), torch.arange(4)], "wire"))
    for r in (recv, quick_recv):
        assert ray.get(r.get.remote(refs))["value"] == expected
    return refs, expected, ray.get(send.wire.remote("wire"))


def _receiver_figures(st: Any) -> tuple[int, ...]:
    # Not remote_agents: a peer whose READ failed to start is removed at the next
    # housekeeping (about a second later), so it may drop; it must never grow.
    return (st.arena_used, st.arena_live_blocks, st.transfers_in_flight,
            st.receive_fallbacks, st.nixl_registrations, st.objects_received)


@pytest.mark.parametrize("case", sorted(WIRE_CASES))
def test_corrupted_wire_metadata_at_a_real_receiver(send, quick_recv, wire_object, case):
    """At the receiver that gives up sooner: an unknown agent's metadata is waited for
    until its fetch_timeout_s."""
    recv = quick_recv
    _refs, _expected, good = wire_object
    mangle, etype, excerpts = WIRE_CASES[case]
    if case in ("truncated", "garbage"):
        bad = mangle(good)
    else:
        raw = msgpack.unpackb(good, raw=False)
        mangle(raw)
        bad = msgpack.packb(raw, use_bin_type=True)
    sbefore, before = stats(send), stats(recv)
    got = ray.get(recv.fetch_wire.remote(bad))
    figure(f"wire {case}", error=err(got), s=got["s"], msg=got.get("msg", "")[:160])
    assert not got["ok"] and etype in got["types"], got
    for text in excerpts:
        assert text in got["msg"], got
    assert got["s"] < FETCH_TIMEOUT_S + SLACK_S, got
    after = stats(recv)
    assert _receiver_figures(after) == _receiver_figures(before)
    assert after.remote_agents <= before.remote_agents
    safter = stats(send)
    assert (safter.pool_used, safter.live_objects) == (sbefore.pool_used, sbefore.live_objects)
    # The untouched bytes still read fine through the same code path.
    assert ray.get(recv.fetch_wire.remote(good))["ok"]


def test_too_many_tensors_is_refused_by_the_encoder_too():
    """The sender-side limit (codec.encode validates what decode would): building an object
    of MAX_TENSORS + 1 real tensors just to hit it would cost seconds per million views."""
    meta = codec.WireMeta("rdtpool-x", 1, "cpu", 0, 0,
                          (TensorRun((0,), "float32", codec.MAX_TENSORS + 1),), ())
    with pytest.raises(WireFormatError, match="more than 1,048,576 tensors"):
        codec.encode(meta)


def test_metadata_of_another_transport(recv):
    from ray.experimental.rdt.tensor_transport_manager import TensorTransportMetadata

    before = stats(recv)
    got = ray.get(recv.fetch_meta.remote(TensorTransportMetadata(
        tensor_meta=[(torch.Size([2]), torch.float32)], tensor_device="cpu")))
    figure("metadata of another transport", error=err(got), msg=got.get("msg", "")[:160])
    assert not got["ok"] and "InvalidInputError" in got["types"], got
    assert "produced by another transport" in got["msg"], got
    assert _receiver_figures(stats(recv)) == _receiver_figures(before)


def _wrong_dtype() -> list[Any]:
    return [torch.empty(8, 8, dtype=torch.float64), torch.empty(4, dtype=torch.int64)]


def _non_contiguous() -> list[Any]:
    return [torch.empty(8, 16)[:, ::2], torch.empty(4, dtype=torch.int64)]


def _numpy_array() -> list[Any]:
    import numpy as np

    return [np.empty((8, 8), dtype=np.float32), torch.empty(4, dtype=torch.int64)]


def _string() -> list[Any]:
    return ["not a tensor", torch.empty(4, dtype=torch.int64)]


#: Target buffers: builder; (type, excerpts) from Ray's ray.get path (Ray validates first);
#: (type, excerpts) from the transport's own check (fetch_multiple_tensors called directly).
TARGET_CASES: dict[str, tuple[Any, tuple[str, list[str]], tuple[str, list[str]] | None]] = {
    "wrong_dtype": (_wrong_dtype, ("ValueError", ["Dtype of tensor_buffer at index 0"]),
                    ("InvalidInputError", ["target buffer 0 is (8, 8) torch.float64",
                                           "holds (8, 8) float32",
                                           "allocate it with that shape and dtype"])),
    "non_contiguous": (_non_contiguous, ("ValueError", ["index 0 is not contiguous"]),
                       ("InvalidInputError", ["target buffer 0 must be contiguous",
                                              ".contiguous()"])),
    "numpy_array": (_numpy_array, ("ValueError", ["Dtype of tensor_buffer at index 0"]), None),
    "string": (_string, ("TypeError", ["weak reference"]), None),
}


@pytest.mark.parametrize("case", sorted(TARGET_CASES))
def test_bad_target_buffers(recv, wire_object, case):
    refs, _expected, good = wire_object
    make, (ray_type, ray_text), ours = TARGET_CASES[case]
    before = stats(recv)
    got = ray.get(recv.get_into.remote(refs, make))
    figure(f"target {case} (Ray)", error=err(got), msg=got.get("msg", "")[:160])
    assert not got["ok"] and ray_type in got["types"], got
    for text in ray_text:
        assert text in got["msg"], got
    if ours is not None:
        got = ray.get(recv.fetch_wire.remote(good, make))
        figure(f"target {case} (transport)", error=err(got), msg=got.get("msg", "")[:160])
        assert not got["ok"] and ours[0] in got["types"], got
        for text in ours[1]:
            assert text in got["msg"], got
    assert _receiver_figures(stats(recv)) == _receiver_figures(before)


def test_non_tensor_target_buffer_at_the_transport(recv, wire_object):
    _refs, _expected, good = wire_object
    before = stats(recv)
    got = ray.get(recv.fetch_wire.remote(good, _string))
    figure("target string (transport)", error=err(got), msg=got.get("msg", "")[:160])
    assert _receiver_figures(stats(recv)) == _receiver_figures(before)
    assert not got["ok"] and "InvalidInputError" in got["types"], got
    assert "target buffer 0" in got["msg"] and "torch.Tensor" in got["msg"], got


def test_cuda_target_buffer(recv, wire_object):
    if (reason := _no_cuda_reason()) is not None:
        pytest.skip(reason)
    _refs, expected, good = wire_object
    r = Receiver.options(num_gpus=1).remote()
    got = ray.get(r.fetch_wire.remote(good, lambda: [
        torch.empty(8, 8, device="cuda"), torch.empty(4, dtype=torch.int64)]))
    # Received into the GPU buffer, or refused with a typed error naming the device.
    assert (got["ok"] and got["value"] == expected) or (
        "InvalidInputError" in got["types"] and "cuda" in got["msg"]), got
    ray.kill(r)


# ---------------------------------------------------------------------------------------
# Leaks
# ---------------------------------------------------------------------------------------


def test_no_leak_over_1000_put_get_free_cycles(recv):
    """1,000 mixed objects (0 to 6 tensors, 14 dtypes, zero-size, non-contiguous, up to
    128 KiB) put, read byte-exact and freed, 50 per round: afterwards both sides hold
    nothing and no NIXL registration was added after the first round."""
    per, rounds = 50, 20
    send = Sender.remote()  # its own sender: "nothing left" means zero, not a baseline
    sbase = settle(send)
    rbase = stats(recv)
    total = 0
    t0 = time.monotonic()
    for k in range(rounds):
        items, nbytes = ray.get(send.put_mixed.remote(k * per, per))
        total += nbytes
        got = ray.get(recv.get_many.remote([refs for refs, _ in items]))
        assert got == [d for _, d in items], f"round {k}: a digest differs"
        del items
        if k == 0:
            swarm, rwarm = settle(send, sbase.live_objects), stats(recv)
    # Every object fits the pool at once, so a slow free can never force a fallback.
    assert total < POOL_BYTES
    s_end = settle(send, sbase.live_objects)
    r_end = receiver_clean(recv, rbase)
    figure("1,000 put/get/free cycles", s=time.monotonic() - t0, bytes=total,
           pool_used=s_end.pool_used, live=s_end.live_objects, arena_used=r_end.arena_used,
           arena_blocks=r_end.arena_live_blocks,
           sender_regs_after_warmup=s_end.nixl_registrations - swarm.nixl_registrations,
           receiver_regs_after_warmup=r_end.nixl_registrations - rwarm.nixl_registrations)
    assert s_end.pool_used == sbase.pool_used == 0
    assert s_end.nixl_registrations == swarm.nixl_registrations
    assert s_end.objects_put - sbase.objects_put == s_end.objects_freed - sbase.objects_freed
    objects = [mixed_object(i) for i in range(per * rounds)]
    with_tensors = sum(1 for ts in objects if ts)  # an empty list never reaches the pool
    with_bytes = sum(1 for ts in objects if any(t.numel() for t in ts))  # others need no READ
    assert s_end.objects_put - sbase.objects_put == with_tensors
    assert s_end.fallbacks == sbase.fallbacks
    assert (r_end.arena_used, r_end.arena_live_blocks) == (0, 0)
    assert r_end.nixl_registrations == rwarm.nixl_registrations
    assert r_end.transfer_errors == rbase.transfer_errors
    assert r_end.objects_received - rbase.objects_received == with_bytes
    ray.kill(send)


# ---------------------------------------------------------------------------------------
# Concurrency
# ---------------------------------------------------------------------------------------


def test_four_put_threads_and_four_concurrent_receivers(send, recv):
    """4 threads of one actor (max_concurrency=4) put 100 objects each, in 4 rounds of 25;
    while a round is being put, 4 receivers read the previous round at the same time."""
    receivers = [recv] + [Receiver.remote() for _ in range(3)]
    sbase = settle(send)
    rbases = [stats(r) for r in receivers]
    previous: list[Any] = []
    checked = 0
    t0 = time.monotonic()
    for k in range(5):
        puts = [send.burst.remote(1000 * k + t, 25) for t in range(4)] if k < 4 else []
        reads = [r.get_many.remote([refs for refs, _ in previous]) for r in receivers]
        expected = [d for _, d in previous]
        for got in ray.get(reads):
            assert got == expected
            checked += len(got)
        previous = [item for batch in ray.get(puts) for item in batch]
    assert checked == 4 * 400
    figure("4 put threads x 100, 4 receivers", s=time.monotonic() - t0, reads=checked)
    st = settle(send, sbase.live_objects)
    assert st.pool_used == sbase.pool_used
    assert st.objects_put - sbase.objects_put == 400
    for r, base in zip(receivers, rbases):
        rst = receiver_clean(r, base)
        assert rst.objects_received - base.objects_received == 400
        assert rst.transfer_errors == base.transfer_errors
    for r in receivers[1:]:
        ray.kill(r)


# ---------------------------------------------------------------------------------------
# Allocator under stress, end to end
# ---------------------------------------------------------------------------------------


def test_fragmented_pool_still_takes_a_large_object_split_across_blocks(recv):
    """A 4 MiB pool filled with 8 live 320 KiB objects, each followed by three 64 KiB ones;
    the small ones are freed, leaving 8 holes of 192 KiB (1.5 MiB free, no hole above
    192 KiB). A 1 MiB object must still go into the pool, split over the fewest holes (6),
    with no fallback, and read byte-exact; freeing everything coalesces the pool again."""
    kib = 1024
    s = Sender.remote(pool_bytes=4 << 20)
    for g in range(8):
        ray.get(s.put_bytes.remote(f"L{g}", 320 * kib))
        for j in range(3):
            ray.get(s.put_bytes.remote(f"s{g}{j}", 64 * kib))
    full = stats(s)
    assert (full.pool_used, full.pool_free, full.live_objects) == (4 << 20, 0, 32), full
    ray.get(s.drop.remote(*[f"s{g}{j}" for g in range(8) for j in range(3)]))
    holes = settle(s, 8)
    assert (holes.pool_free, holes.pool_largest_free_block, holes.pool_free_blocks) == (
        1536 * kib, 192 * kib, 8), holes
    refs, expected = ray.get(s.put_bytes.remote("big", 1024 * kib))
    after = stats(s)
    assert after.fallbacks == 0 and after.nixl_registrations == 1, after
    segments = ray.get(s.segments.remote("big"))
    figure("fragmented pool", segments=segments, fallbacks=after.fallbacks,
           largest_hole_kib=holes.pool_largest_free_block // kib)
    assert segments == 6  # ceil(1024 / 192): the fewest possible
    # 5 holes used whole, 64 KiB of a sixth: 128 + 2 x 192 KiB left.
    assert (after.pool_free, after.pool_largest_free_block) == (512 * kib, 192 * kib), after
    got = ray.get(recv.get.remote(refs))
    assert got["ok"] and got["value"] == expected, got
    del refs
    ray.get(s.drop.remote())
    end = settle(s)
    assert (end.pool_used, end.pool_free_blocks, end.pool_largest_free_block) == (
        0, 1, 4 << 20), end
    ray.kill(s)


def _relay(self, refs, i: int):
    """In a relay actor: receive ``refs`` (larger than this actor's arena), then put an
    object of its own."""
    got = fingerprint(ray.get(refs[0]))
    return self.put(payload(10_000 + i, 64 << 10)), got


def test_a_relay_receiving_outside_its_arena_makes_its_receivers_reload_nothing(send, recv):
    """An actor that receives and sends (a pipeline stage, an inference actor sending
    rollouts) lands each object its 1 MiB arena cannot hold in a one-off registered buffer.
    That buffer is receive-side memory, named by no object the actor sends: registering and
    deregistering it must not make the receivers of the actor's own objects reload its
    metadata. They did, for every object: a GCS lookup, and (a deregistration) a remove
    and re-add of the relay's agent, each of which NIXL 1.5.1 pays with a TCP connection
    per read lane that stays open (a socket in each process) for good."""
    relay = Sender.remote(arena_bytes=1 << 20)
    n = 6
    base = None
    for i in range(n):
        refs, want = ray.get(send.put_payload.remote(i, 2 << 20))
        (out, want_out), got = ray.get(relay.__ray_call__.remote(_relay, refs, i))
        assert got == want
        got = ray.get(recv.get.remote(out))
        assert got["ok"] and got["value"] == want_out, got
        if base is None:  # first contact with the relay: one load
            base = stats(recv)
    after, rst = stats(recv), stats(relay)
    assert rst.receive_fallbacks == n, rst  # every object landed in a one-off buffer
    assert rst.nixl_deregistrations >= n, rst
    figure("relay receiving outside its arena",
           receiver_reloads=after.remote_metadata_loads - base.remote_metadata_loads)
    assert after.remote_metadata_loads == base.remote_metadata_loads, (base, after)
    ray.get(relay.drop.remote())
    ray.kill(relay)


def _sockets(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _age_peers(self, seconds: float) -> int:
    """In a receiver: make every loaded peer look idle for ``seconds`` more, then run the
    housekeeping the progress thread runs once a second; returns the peers loaded."""
    from ray_rdt_pool._ray.runtime import runtime

    rcv = runtime().receiver
    with rcv.lock:
        for p in rcv.peers.by_name.values():
            p.last_used -= seconds
        rcv.peers.next_housekeeping = 0.0
    rcv.reap()
    return len(rcv.peers.by_name)


def test_a_sender_idle_for_half_an_hour_is_read_again_over_the_same_connection(send):
    """A trainer that syncs every few minutes: its receivers removed its agent after 120 s
    idle and added it again at the next object. With NIXL 1.5.1 a removed agent's TCP
    connection stays open (a socket in each process, per read lane), so every such sync
    leaked a socket per lane in the trainer and one in the receiver, for good, while the
    removal itself frees nothing (a dead sender's socket stays too). Idle peers go after
    an hour now; failed peers, and the least recently used beyond 256, as before."""
    r = Receiver.remote(fetch_timeout_s=FETCH_TIMEOUT_S)
    rpid, spid = ray.get(r.pid.remote()), ray.get(send.pid.remote())
    round_trip(send, r, 1)
    before = stats(r)
    socks = _sockets(spid), _sockets(rpid)
    kept = ray.get(r.__ray_call__.remote(_age_peers, 1800.0))
    round_trip(send, r, 2)
    after = stats(r)
    figure("sender idle for half an hour", sender_sockets_added=_sockets(spid) - socks[0],
           receiver_sockets_added=_sockets(rpid) - socks[1])
    assert kept == 1
    assert after.remote_agents_removed == before.remote_agents_removed, after
    assert after.remote_metadata_loads == before.remote_metadata_loads, after
    assert after.remote_agents == 1
    ray.kill(r)


# ---------------------------------------------------------------------------------------
# Overflow regions: reuse keeps them, shutdown and exit release them quietly
# ---------------------------------------------------------------------------------------


def _overflow_steadily(self, seconds: float, period: float, nbytes: int) -> tuple[int, Any]:
    """In a sender: put an object of ``nbytes`` (more than the pool holds) and drop it,
    every ``period`` s for ``seconds``; how many were put, and the stats once the last
    was freed (read here: a round trip to the driver could outlast the linger)."""
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ref = ray.put([torch.ones(nbytes, dtype=torch.uint8)], _tensor_transport="nixl_pool")
        del ref
        n += 1
        time.sleep(period)
    return n, wait_for(lambda: (x := ray_rdt_pool.stats()).live_objects == 0 and x)


def test_an_overflow_region_in_steady_use_stays_registered():
    """A 6 MiB object put and freed every 0.2 s for 6 s, with a 4 MiB pool and a 2 s
    overflow_linger_s. The region's idle time was stamped at its first free and never
    cleared by the puts that reused it, so it was deregistered overflow_linger_s after
    it first emptied, again and again: each time an epoch reset that makes every
    receiver replace its view of the sender (with NIXL 1.5.1, leaving TCP connections
    open). Now its linger restarts at each free: no deregistration while it is in use,
    and it goes once really idle for the linger."""
    linger = 2.0
    s = Sender.remote(pool_bytes=4 << 20, overflow_linger_s=linger)
    base = stats(s)
    n, st = ray.get(s.__ray_call__.remote(_overflow_steadily, 3 * linger, 0.2, 6 << 20))
    figure("overflow region reused steadily", objects=n,
           deregistrations=st.nixl_deregistrations - base.nixl_deregistrations)
    assert st.fallbacks == n, st  # every object overflowed
    assert st.nixl_deregistrations == base.nixl_deregistrations, st
    assert st.nixl_registrations == base.nixl_registrations + 2, st  # the pool, one region
    assert st.overflow_capacity > 0, st
    gone = wait_for(lambda: (x := stats(s)).overflow_capacity == 0 and x, timeout=60)
    assert gone.nixl_deregistrations == base.nixl_deregistrations + 1, gone
    ray.kill(s)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _overflow_then_shutdown(self) -> dict[str, Any]:
    """In a sender with a 4 MiB pool: one overflow region left empty and lingering, one
    still holding an object; ``ray_rdt_pool.shutdown()``, then that object freed. What
    ray_rdt_pool logged at WARNING or above meanwhile, and which regions were unmapped
    (their mappings closed) after the shutdown and after the free."""
    from ray_rdt_pool._ray.runtime import runtime

    rt = runtime()
    small = ray.put([torch.ones(6 << 20, dtype=torch.uint8)], _tensor_transport="nixl_pool")
    # Larger than a 64 MiB region: a region of its own.
    held = ray.put([torch.ones(72 << 20, dtype=torch.uint8)], _tensor_transport="nixl_pool")
    regions = list(rt.sender.overflow)
    log = logging.getLogger("ray_rdt_pool")
    handler = _Records()
    log.addHandler(handler)
    try:
        del small
        wait_for(lambda: rt.stats().overflow_objects == 1, timeout=60)
        ray_rdt_pool.shutdown()
        after_shutdown = [r.mem._map.closed for r in regions]
        del held
        # The region leaves the list under the sender lock and is unmapped just after.
        wait_for(lambda: not rt.sender.overflow and regions[1].mem._map.closed, timeout=60)
        after_free = [r.mem._map.closed for r in regions]
    finally:
        log.removeHandler(handler)
    return {"regions": len(regions), "after_shutdown": after_shutdown,
            "after_free": after_free, "stranded": len(rt.registry._stranded),
            "warnings": [f"{r.name}: {r.getMessage()}" for r in handler.records
                         if r.levelno >= logging.WARNING]}


def test_shutdown_releases_overflow_regions_quietly():
    """``shutdown()`` destroyed the NIXL agent first and only then dropped the lingering
    overflow region: its deregistration failed, a WARNING with a traceback was logged,
    and its memory stayed mapped (stranded) until the process exited. Now the empty
    regions go while the agent exists, and one that empties after the shutdown (Ray
    frees its last object later) is unmapped with no NIXL call left to fail."""
    s = Sender.remote(pool_bytes=4 << 20, overflow_linger_s=600.0)
    got = ray.get(s.__ray_call__.remote(_overflow_then_shutdown), timeout=180)
    assert got["regions"] == 2, got
    assert got["warnings"] == [], got
    assert got["after_shutdown"] == [True, False], got  # the lingering one went at once
    assert got["after_free"] == [True, True] and got["stranded"] == 0, got
    ray.kill(s)
