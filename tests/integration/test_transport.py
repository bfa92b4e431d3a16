"""The nixl_pool transport on a real Ray cluster with real NIXL (UCX moving host memory).

The module's actors run on the test process's shared cluster, with the module's settings
(``ENV``: the same-node path, small pools). Values are compared byte for byte (sha256 of
each tensor's bytes computed on both sides), never by float sums.
"""

from __future__ import annotations

import gc
import math
import sys
import weakref
from fractions import Fraction

import pytest
import ray
import torch

import ray_rdt_pool
from tests.support import actors
from tests.support.raycluster import actor_env, all_dtype_tensors, digest, wait_for

pytestmark = pytest.mark.ray

# @ray.method(tensor_transport=...) validates the name when the class is defined.
ray_rdt_pool.register()

#: The module's actors' settings. The default same-node path: every dtype and odd view
#: must come through it exactly.
ENV = {"RAY_RDT_POOL_POOL_BYTES": "32M", "RAY_RDT_POOL_ARENA_BYTES": "32M",
       "RAY_RDT_POOL_SAME_NODE": "map"}


@pytest.fixture(scope="module", autouse=True)
def cluster(ray_cluster):
    yield


def odd_tensors() -> list[torch.Tensor]:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    c = torch.randn(4, 3, dtype=torch.complex64)
    return [
        base[:, ::3],  # strided
        base.t(),  # transposed
        torch.tensor(7.5),  # 0-d
        torch.empty(0, 4, dtype=torch.int16),  # zero-size
        c.conj(),  # conjugate bit set
        -torch.ones(3, dtype=torch.float64),
        torch.ones(2, 2, dtype=torch.bfloat16).neg(),
        base[2],  # a view in the middle of a storage
        torch.empty(0, dtype=torch.float32),
    ]


def _rdt_store_size() -> int:
    """Objects in this process's RDT store (Ray's primary copies of its puts)."""
    return ray._private.worker.global_worker.rdt_manager.rdt_store.get_num_objects()


@ray.remote(enable_tensor_transport=True, runtime_env=actor_env(ENV))
class Sender(actors.Sender):
    def native_active(self) -> bool:
        from ray_rdt_pool.memory.describe import native_active

        return native_active()

    def put_dtypes(self, seed: int = 0):
        ts = all_dtype_tensors(seed)
        return [ray.put(ts, _tensor_transport="nixl_pool")], digest(ts)

    def put_odd(self):
        ts = odd_tensors()
        return [ray.put(ts, _tensor_transport="nixl_pool")], digest(ts)

    def put_jagged(self):
        """A jagged nested tensor: Ray pickles it as its values and offsets, two dense
        tensors that this transport moves."""
        parts = [torch.arange(6.0).reshape(2, 3), torch.arange(12.0).reshape(4, 3)]
        j = torch.nested.nested_tensor(parts, layout=torch.jagged)
        return [ray.put([j, torch.ones(3)], _tensor_transport="nixl_pool")], digest(parts)

    def put_with(self, tensors, transport: str | None):
        """A put through another transport (None: Ray's object store) from this actor."""
        if transport is None:
            return [ray.put(tensors)], digest(tensors)
        return [ray.put(tensors, _tensor_transport=transport)], digest(tensors)

    def put_counting_flat(self, value):
        """Put ``value``; also say whether it went as one stand-in object past Ray's
        per-tensor serializer (see patches.flat_tensors)."""
        from ray_rdt_pool._ray import patches

        took = []
        real = patches.flat_tensors

        def spy(v, tensor_type):
            out = real(v, tensor_type)
            took.append(out is not None)
            return out

        patches.flat_tensors = spy
        try:
            ref = ray.put(value, _tensor_transport="nixl_pool")
        finally:
            patches.flat_tensors = real
        return [ref], took == [True]

    def tensor_reducer(self):
        """Which torch.Tensor reducer cloudpickle uses here, and whether a tensor pickled
        outside an RDT object still round-trips through it."""
        from ray import cloudpickle

        from ray_rdt_pool._ray import patches

        t = torch.arange(5.0)
        blob = cloudpickle.dumps([t])
        return {"ours": cloudpickle.CloudPickler.dispatch[torch.Tensor]
                is patches._reduce_tensor,
                "function_by_value": b"serialize_rdt_objects" in blob,
                "round_trip": torch.equal(cloudpickle.loads(blob)[0], t)}

    def put_that_fails(self, nbytes: int):
        """A put of one new tensor of ``nbytes`` that should fail: the error's type, and
        whether anything still holds the tensor once this method dropped it."""
        t = torch.zeros(nbytes // 4)
        alive = weakref.ref(t)
        try:
            ray.put([t], _tensor_transport="nixl_pool")
            error = "no error"
        except Exception as e:
            error = type(e).__name__
        del t
        gc.collect()
        return error, alive() is not None, _rdt_store_size()

    @ray.method(tensor_transport="nixl_pool")
    def watched(self, nbytes: int):
        """Return one new tensor of ``nbytes``, watched through a weak reference."""
        t = torch.zeros(nbytes // 4)
        self.watch = weakref.ref(t)
        return [t]

    def store_size(self):
        return _rdt_store_size()

    def watched_alive(self):
        gc.collect()
        return self.watch() is not None, _rdt_store_size()

    def put_parameters_as_bf16(self):
        """pack_as over Parameters: a list of one, and a dict that mixes a Parameter, a
        plain tensor and a Parameter left out of the mapping."""
        from ray_rdt_pool._ray.conversions import pack_as

        p, q = torch.nn.Parameter(torch.arange(8.0)), torch.nn.Parameter(torch.ones(2))
        plain = torch.arange(4.0)
        with pack_as({id(p): torch.bfloat16, id(plain): torch.bfloat16}):
            ray.put([q])  # Ray's object store, in the block: no note outlives it
            refs = [ray.put([p], _tensor_transport="nixl_pool"),
                    ray.put({"w": p, "b": plain, "q": q, "n": 3}, _tensor_transport="nixl_pool")]
        return refs

    def own_get_is_original(self):
        """This actor's plain get of its own ref: its original tensors (Ray's store)."""
        ts = [torch.ones(4)]
        return ray.get(ray.put(ts, _tensor_transport="nixl_pool"))[0] is ts[0]

    def mutate(self, key: str):
        for t in self.kept[key]:
            t.add_(1)

    @ray.method(tensor_transport="nixl_pool")
    def one(self, n: int):
        return torch.arange(n, dtype=torch.int32)

    @ray.method(tensor_transport="nixl_pool")
    def many(self, n: int):
        return [torch.full((n,), float(i)) for i in range(4)]

    @ray.method(tensor_transport="nixl_pool")
    def nested(self):
        return {"w": torch.ones(4, 4), "meta": {"step": 3, "b": [torch.zeros(2), "x"]}}



@ray.remote(enable_tensor_transport=True, runtime_env=actor_env(ENV))
class Receiver(actors.Receiver):
    def __init__(self):
        super().__init__()
        self.held = None

    def get(self, refs, hold: bool = False):
        out = ray.get(refs[0])
        if hold:
            self.held = out
        return digest(out)

    def get_through_store(self, refs):
        out = ray.get(refs[0], _use_object_store=True)
        return digest(out), [t.untyped_storage().nbytes() for t in out]

    def raw_bytes_through_store(self, refs):
        """Each tensor's bytes as they lie (a bool's too: digest copies, which makes
        every nonzero byte of a bool 1), read through Ray's object store."""
        out = ray.get(refs[0], _use_object_store=True)
        return [t.contiguous().reshape(-1).view(torch.uint8).tolist() for t in out]

    def get_jagged(self, refs):
        j, dense = ray.get(refs[0])
        return j.is_nested, str(j.layout), digest(list(j.unbind())), digest([dense])

    def get_into(self, refs, shapes_dtypes):
        bufs = [torch.full(s, 0, dtype=d) for s, d in shapes_dtypes]
        ray.experimental.set_target_for_ref(refs[0], bufs)
        out = ray.get(refs[0])
        return digest(bufs), all(a is b for a, b in zip(out, bufs))

    def into_param_swapping_memory(self, refs):
        """Receive into a Parameter twice (registered on its second sighting), swap its
        memory (``p.data = new``) and receive twice more: every read must land in the
        memory the tensor has now."""
        p = torch.nn.Parameter(torch.zeros(1 << 16))
        first = ray_rdt_pool.stats().nixl_registrations
        out = []
        for swap in (False, False, True, False):
            if swap:
                p.data = torch.zeros(1 << 16)
            ray.experimental.set_target_for_ref(refs[0], [p])
            got = ray.get(refs[0])
            out.append((got[0] is p, digest([p.detach()])[0]))
        st = ray_rdt_pool.stats()
        return out, st.nixl_registrations - first, st.registration_cache_entries

    def get_all(self, refs):
        """One ray.get of several refs: Ray starts every fetch before waiting on any."""
        return [digest(ts) for ts in ray.get(refs)]

    def take(self, x):
        if isinstance(x, dict):
            return {"w": digest([x["w"]]), "step": x["meta"]["step"],
                    "b": digest([x["meta"]["b"][0]]), "s": x["meta"]["b"][1]}
        return digest(x if isinstance(x, list) else [x])

    def describe(self, refs):
        """The received value's shape: its type, keys, which items are the same object,
        and the digest of its tensors (flattened the way the test flattens them)."""
        v = ray.get(refs[0])
        items = v[0] if type(v) is list and v and type(v[0]) is list else v
        keys = list(items) if isinstance(items, dict) else None
        ts = list(items.values()) if isinstance(items, dict) else list(items)
        tensors = [t for t in ts if isinstance(t, torch.Tensor)]
        same = [[j for j, u in enumerate(ts) if u is t] for t in ts]
        return type(v).__name__, keys, same, digest(tensors), [
            type(t).__name__ for t in ts]

    def same(self, value):
        return value

    def kinds(self, refs):
        """Each tensor of the value: its type, dtype, requires_grad and values."""
        v = ray.get(refs[0])
        items = v.values() if isinstance(v, dict) else v
        return [(type(t).__name__, str(t.dtype), t.requires_grad, t.tolist())
                for t in items if isinstance(t, torch.Tensor)]

    def release(self):
        self.held = None


def receiver(same_node: str):
    """A receiver with its own same_node setting (the module's default is "map")."""
    return Receiver.options(runtime_env=actor_env({**ENV, "RAY_RDT_POOL_SAME_NODE": same_node})
                            ).remote()


@pytest.fixture(scope="module")
def pair():
    """One sender and one receiver shared by the tests that need no fresh state
    (actor start-up dominates this module's run time)."""
    return Sender.remote(), Receiver.remote()


@pytest.fixture(scope="module")
def spare():
    """A second sender, and a receiver of each same_node mode, for the tests that read a
    sender's or a receiver's figures from zero; each test frees its objects and lets go
    of its views before it ends."""
    return {"sender": Sender.remote(), "off": receiver("off"), "map": receiver("map")}


@pytest.fixture(scope="module")
def small():
    """A sender with a 4 MiB pool whose emptied overflow regions go at once
    (``overflow_linger_s=0``), for the tests of objects the pool cannot hold."""
    return Sender.remote(pool_bytes=4 << 20, overflow_linger_s=0)


@pytest.fixture(scope="module")
def no_overflow():
    """A sender with a 1 MiB pool and no overflow memory, which never puts."""
    return Sender.remote(pool_bytes=1 << 20, overflow=False)


def test_all_dtypes_round_trip_between_actors(pair):
    s, r = pair
    refs, expected = ray.get(s.put_dtypes.remote())
    assert ray.get(r.get.remote(refs)) == expected
    names = {e.split("|")[0] for e in expected}
    assert {"torch.bool", "torch.bfloat16", "torch.complex64", "torch.complex128"} <= names


def test_actors_read_tensor_facts_in_cpp_where_the_helper_is_built(pair):
    """Where ``python -m ray_rdt_pool.memory.native build`` ran (make venv does), a sender actor
    loads the helper and passes its check, so the round trips of this module run
    through it; the Python loop is covered by tests/unit/memory/test_native.py."""
    from ray_rdt_pool.memory.native import artifact_path

    if not artifact_path().exists():
        pytest.skip("the compiled describe helper is not built for this torch")
    s, _ = pair
    assert ray.get(s.native_active.remote()) is True


def test_odd_tensors_round_trip_contiguous(pair):
    s, r = pair
    refs, expected = ray.get(s.put_odd.remote())
    assert ray.get(r.get.remote(refs)) == expected


@pytest.mark.parametrize("order", ["ABABCABCACABCA", "BCBABACBACBCCBACBCCA"])
def test_an_irregular_order_of_tensor_kinds_round_trips_byte_exact(pair, order):
    """Orders the encoder once grouped wrongly: a tensor was left out of the wire
    metadata and every later one was packed at a shifted offset (wrong bytes)."""
    s, r = pair
    kinds = {"A": ((3,), torch.float32), "B": ((5, 2), torch.int64),
             "C": ((7,), torch.bfloat16)}
    ts = [torch.arange(i * 100, i * 100 + math.prod(shape)).to(dt).reshape(shape)
          for i, (shape, dt) in enumerate(kinds[c] for c in order)]
    refs, expected = ray.get(s.put.remote(ts))
    assert ray.get(r.get.remote(refs)) == expected


def test_a_jagged_nested_tensor_round_trips(pair):
    s, r = pair
    before = ray.get(s.stats.remote()).objects_put
    refs, parts = ray.get(s.put_jagged.remote())
    assert ray.get(r.get_jagged.remote(refs)) == (True, "torch.jagged", parts,
                                                  digest([torch.ones(3)]))
    assert ray.get(s.stats.remote()).objects_put == before + 1  # through this transport


def test_empty_list_round_trips(pair):
    s, r = pair
    refs, expected = ray.get(s.put.remote([]))
    assert expected == []
    assert ray.get(r.get.remote(refs)) == []


def test_method_returns_and_task_arguments(pair):
    s, r = pair
    assert ray.get(r.take.remote(s.one.remote(10))) == digest([torch.arange(10, dtype=torch.int32)])
    assert ray.get(r.take.remote(s.many.remote(5))) == digest(
        [torch.full((5,), float(i)) for i in range(4)])
    nested = ray.get(r.take.remote(s.nested.remote()))
    assert nested == {"w": digest([torch.ones(4, 4)]), "step": 3,
                      "b": digest([torch.zeros(2)]), "s": "x"}


def test_a_method_return_with_no_tensors_round_trips(pair):
    """Ray stores a nixl_pool method's return as an RDT object even when it holds no
    tensors, and fetches it on every get and task argument: it must come back as it was
    (it raised TransferError, "no wire bytes"), with nothing put, read or mapped."""
    s, r = pair
    figures = ("objects_put", "objects_received", "reads_posted", "mapped_gets",
               "arena_capacity")

    def snap(st):
        return [getattr(st, f) for f in figures], st.live_objects

    before = [snap(ray.get(a.stats.remote())) for a in (s, r)] + [snap(ray_rdt_pool.stats())]
    for value in [(1, "x"), Fraction(1, 3), {"step": 3, "name": None}, []]:
        assert ray.get(s.echo.remote(value)) == value
        assert ray.get(r.same.remote(s.echo.remote(value))) == value
    after = [snap(ray.get(a.stats.remote())) for a in (s, r)] + [snap(ray_rdt_pool.stats())]
    assert [f for f, _live in after] == [f for f, _live in before]
    # Ray may free an earlier test's object meanwhile: live objects can only have gone.
    assert all(a <= b for (_f, a), (_g, b) in zip(after, before)), (before, after)


def test_driver_gets_from_actor_and_actor_gets_from_driver(pair):
    s, r = pair
    out = ray.get(s.many.remote(3))
    assert digest(out) == digest([torch.full((3,), float(i)) for i in range(4)])
    ts = [torch.randn(100, 7), torch.arange(5)]
    ref = ray.put(ts, _tensor_transport="nixl_pool")
    assert ray.get(r.get.remote([ref])) == digest(ts)
    assert digest(ray.get(ref)) == digest(ts)


def test_several_receivers_concurrently_and_one_after_another(pair, spare):
    s, r0 = pair
    rs = [r0, spare["map"], Receiver.remote()]
    ts = [torch.randn(256, 256), torch.randn(1000).to(torch.bfloat16)]
    refs, expected = ray.get(s.put.remote(ts))
    assert ray.get([r.get.remote(refs) for r in rs]) == [expected] * 3
    for r in rs:
        assert ray.get(r.get.remote(refs)) == expected


def test_snapshot_semantics_mutation_after_put_is_not_seen(pair):
    s, r = pair
    ts = [torch.zeros(1000), torch.arange(10)]
    refs, expected = ray.get(s.put.remote(ts, keep="k"))
    ray.get(s.mutate.remote("k"))
    assert ray.get(r.get.remote(refs)) == expected
    ray.get(s.drop.remote())


def test_a_get_through_the_object_store_is_the_snapshot_too(pair):
    """``ray.get(ref, _use_object_store=True)`` has the sender pickle the object's tensors
    for Ray's object store at get time: those were the caller's live tensors, so a
    mutation made after the put reached the receiver. Now it is the put's snapshot,
    each tensor in a storage of its own size; the sender's own plain get still returns
    its original tensors, and other objects still go Ray's way."""
    s, r = pair
    ts = [torch.zeros(1000), torch.arange(10), torch.ones(3, 3)[:, 1]]
    refs, expected = ray.get(s.put.remote(ts, keep="os"))
    ray.get(s.mutate.remote("os"))
    assert digest(ray.get(refs[0], _use_object_store=True)) == expected
    assert ray.get(r.get_through_store.remote(refs)) == (expected, [4000, 80, 12])
    assert ray.get(s.own_get_is_original.remote()) is True
    ray.get(s.drop.remote())
    many = [torch.full((3,), float(i)) for i in range(4)]
    assert digest(ray.get(s.many.remote(3), _use_object_store=True)) == digest(many)
    assert ray.get(s.echo.remote((1, "x")), _use_object_store=True) == (1, "x")
    other, dig = ray.get(s.put_with.remote(ts[:2], "nixl"))
    assert digest(ray.get(other[0], _use_object_store=True)) == dig


def test_a_get_through_the_object_store_carries_every_wire_dtype(pair):
    """torch cannot load back its own pickle of a tensor of several dtypes the wire
    carries (uint16/32/64, complex32, the float8 kinds, float4_e2m1fn_x2: torch.load's
    legacy storage path raises AttributeError), so ``_use_object_store=True`` failed
    with Ray's RaySystemError for any object holding one, also where its direct get
    worked; and the snapshot's clone made every nonzero byte of a bool 1. Both
    transports failed the same way. Now every dtype arrives byte for byte."""
    s, r = pair
    refs, expected = ray.get(s.put_dtypes.remote())
    got, sizes = ray.get(r.get_through_store.remote(refs))
    assert got == expected
    assert sizes == [t.nbytes for t in all_dtype_tensors(0)]  # a storage of its own each
    odd = [torch.tensor([0, 1, 2, 255], dtype=torch.uint8).view(torch.bool)]
    refs, _ = ray.get(s.put.remote(odd))
    assert ray.get(r.raw_bytes_through_store.remote(refs)) == [[0, 1, 2, 255]]


@pytest.mark.parametrize("same_node", ["off", "map"])
def test_garbage_collection_returns_blocks_to_the_pool(spare, same_node):
    s, r = spare["sender"], spare[same_node]
    base = ray.get(s.stats.remote())
    refs, expected = ray.get(s.put.remote([torch.randn(1 << 16), torch.randn(33)]))
    during = ray.get(s.stats.remote())
    assert during.live_objects == base.live_objects + 1
    assert during.pool_used > base.pool_used
    assert ray.get(r.get.remote(refs, True)) == expected  # the receiver keeps the views
    del refs
    after = wait_for(lambda: (st := ray.get(s.stats.remote())).live_objects == 0 and st)
    assert after.objects_freed >= 1
    held = ray.get(r.stats.remote())
    if same_node == "off":  # a READ: the sender's blocks are free, the receiver's arena not
        assert after.pool_used == 0 and held.arena_used > 0
    else:  # mapped views: their lease holds the sender's block until they die
        assert after.leased_objects == 1 and after.pool_used > 0
        assert held.mapped_objects == 1 and held.arena_used == 0 and held.reads_posted == 0
    ray.get(r.release.remote())
    assert wait_for(lambda: (x := ray.get(r.stats.remote())).arena_used == 0
                    and x.mapped_objects == 0)
    st = wait_for(lambda: (x := ray.get(s.stats.remote())).pool_used == 0 and x)
    assert st.leased_objects == 0


def test_target_buffers_land_in_user_tensors(pair):
    s, r = pair
    ts = [torch.randn(64, 32), torch.arange(100, dtype=torch.int64), torch.ones(7).bool()]
    refs, expected = ray.get(s.put.remote(ts))
    got, same_objects = ray.get(r.get_into.remote(refs, [(t.shape, t.dtype) for t in ts]))
    assert got == expected
    assert same_objects


def test_target_buffers_that_do_not_match_raise(pair):
    s, r = pair
    ts = [torch.randn(8, 8), torch.arange(4)]
    refs, _ = ray.get(s.put.remote(ts))
    with pytest.raises(ray.exceptions.RayTaskError) as ei:
        ray.get(r.get_into.remote(refs, [(torch.Size([8, 9]), torch.float32),
                                         (torch.Size([4]), torch.int64)]))
    assert "Shape" in str(ei.value) or "shape" in str(ei.value)
    with pytest.raises(ray.exceptions.RayTaskError) as ei:
        ray.get(r.get_into.remote(refs, [(torch.Size([8, 8]), torch.float32)]))
    assert "Length" in str(ei.value) or "buffers" in str(ei.value)


def test_object_larger_than_pool_is_still_a_snapshot(small, pair):
    """Pool of 4 MiB, tensor of 8 MiB, mutated right after the put: the receiver reads
    the bytes of the put, from overflow memory that goes away with the object."""
    s, r = small, pair[1]
    before = ray.get(s.stats.remote()).fallbacks
    t = torch.full((2 << 20,), 5.0)  # 8 MiB
    refs, expected = ray.get(s.put.remote([t], keep="big"))
    ray.get(s.mutate.remote("big"))  # t += 1 in the sender, in place
    assert ray.get(r.get.remote(refs)) == expected == digest([torch.full((2 << 20,), 5.0)])
    st = ray.get(s.stats.remote())
    assert (st.fallbacks - before, st.overflow_objects, st.overflow_bytes) == (1, 1, 8 << 20)
    # A pooled object still works next to it.
    refs2, expected2 = ray.get(s.put.remote([torch.arange(10)]))
    assert ray.get(r.get.remote(refs2)) == expected2
    del refs
    ray.get(s.drop.remote("big"))
    wait_for(lambda: ray.get(s.stats.remote()).overflow_capacity == 0)
    st = ray.get(s.stats.remote())
    assert (st.overflow_objects, st.overflow_bytes, st.registered_regions) == (0, 0, 1)


def test_one_get_of_refs_put_before_and_after_a_deregistration(small, pair):
    """The sender deregisters memory between two puts (an overflow region goes away), so
    the second object names a newer epoch and the receiver must reload the sender's
    metadata while the first READ of the same ray.get holds a lease. It must not wait for
    that READ (Ray waits on neither fetch before starting both)."""
    s, r = small, pair[1]
    base = ray.get(r.stats.remote())
    warm, expected_warm = ray.get(s.put.remote([torch.arange(5)]))
    assert ray.get(r.get.remote(warm)) == expected_warm  # the receiver knows the sender
    before, exp_before = ray.get(s.put.remote([torch.full((1000,), 1.0)]))
    big, _ = ray.get(s.put.remote([torch.zeros(2 << 20)]))  # 8 MiB: an overflow region
    regs = ray.get(s.stats.remote()).nixl_deregistrations
    del big
    wait_for(lambda: ray.get(s.stats.remote()).nixl_deregistrations > regs)
    after, exp_after = ray.get(s.put.remote([torch.full((1000,), 2.0)]))
    got = ray.get(r.get_all.remote([before[0], after[0], warm[0]]), timeout=60)
    assert got == [exp_before, exp_after, expected_warm]
    st = ray.get(r.stats.remote())
    assert st.transfers_in_flight == 0
    assert (st.transfers_cut, st.transfer_errors) == (base.transfers_cut, base.transfer_errors)


def test_an_overflowing_pool_makes_its_receivers_reload_nothing_per_object(pair):
    """Object after object too large for the pool: the emptied overflow region stays
    registered (overflow_linger_s, 10 s by default) and takes the next one, so the
    receiver loads the sender's metadata once. Before, each object's region was
    deregistered with it and every receiver replaced its view of the sender's agent
    (remove, then add): a metadata load per object, and with NIXL 1.5.1 a TCP
    connection per read lane left open in both processes each time."""
    s, r = Sender.remote(pool_bytes=4 << 20), pair[1]
    for i in range(4):
        refs, expected = ray.get(s.put.remote([torch.full((2 << 20,), float(i))]))  # 8 MiB
        assert ray.get(r.get.remote(refs)) == expected
        del refs
        wait_for(lambda: ray.get(s.stats.remote()).overflow_objects == 0)
        if i == 0:
            loads = ray.get(r.stats.remote()).remote_metadata_loads
            st0 = ray.get(s.stats.remote())
    st = ray.get(s.stats.remote())
    assert ray.get(r.stats.remote()).remote_metadata_loads == loads
    assert (st.nixl_registrations, st.nixl_deregistrations) == (
        st0.nixl_registrations, st0.nixl_deregistrations)
    assert st.overflow_capacity > 0  # lingering, for the next one


@pytest.mark.parametrize("same_node", ["off", "map"])
def test_target_parameter_whose_memory_is_swapped(spare, same_node):
    """The registration cache is keyed by the storage: after ``p.data = new`` the new
    memory is registered and read into, never the old one. Mapped (same node), targets
    are one copy out of the mapping: the current memory, and no registration at all."""
    s, r = spare["sender"], receiver(same_node)  # a new receiver: its arena is counted
    refs, expected = ray.get(s.put.remote([torch.arange(1 << 16, dtype=torch.float32)]))
    out, new_regs, entries = ray.get(r.into_param_swapping_memory.remote(refs))
    assert [o for o, _d in out] == [True] * 4
    assert [d for _o, d in out] == expected * 4
    if same_node == "off":
        # the arena; the first storage on its second sighting; the new one on its second
        assert new_regs == 3 and entries == 2
    else:
        assert new_regs == 0 and entries == 0
        assert ray.get(r.stats.remote()).mapped_gets == 4


def test_full_pool_still_sends_snapshots(small, pair):
    """The pool is full of live objects and a 3 MiB object arrives at a 4 MiB pool."""
    s, r = small, pair[1]
    wait_for(lambda: ray.get(s.stats.remote()).live_objects == 0)  # earlier tests' objects
    held = [ray.get(s.put.remote([torch.zeros(256 << 10)]))[0] for _ in range(3)]
    t = torch.full((768 << 10,), 5.0)
    refs, expected = ray.get(s.put.remote([t], keep="x"))
    ray.get(s.mutate.remote("x"))
    assert ray.get(r.get.remote(refs)) == expected
    assert ray.get(s.stats.remote()).overflow_objects == 1 and len(held) == 3


def test_without_overflow_a_full_pool_raises_pool_exhausted_with_sizes(no_overflow):
    s = no_overflow
    with pytest.raises(ray.exceptions.RayTaskError) as ei:
        ray.get(s.put.remote([torch.randn(1 << 19)]))
    msg = str(ei.value)
    assert "PoolExhaustedError" in msg
    assert "2,097,152 bytes" in msg and "1,048,576" in msg
    assert "raise pool_bytes" in msg and "overflow=True" in msg
    st = ray.get(s.stats.remote())
    assert st.pool_used == 0 and st.live_objects == 0 and st.fallbacks == 0


def test_a_failed_put_or_return_lets_go_of_the_tensors(no_overflow):
    """Ray stores an object's tensors in its RDT store before it calls our extract, and
    registers the ref only after extract returned: when extract raised, nothing ever
    popped the entry and the caller's tensors stayed referenced for the process's life."""
    s = no_overflow  # it never put an object
    assert ray.get(s.store_size.remote()) == 0
    assert ray.get(s.put_that_fails.remote(2 << 20)) == ("PoolExhaustedError", False, 0)
    with pytest.raises(ray.exceptions.RayTaskError, match="PoolExhaustedError"):
        ray.get(s.watched.remote(2 << 20))
    assert ray.get(s.watched_alive.remote()) == (False, 0)
    st = ray.get(s.stats.remote())
    assert (st.pool_used, st.live_objects, st.objects_put) == (0, 0, 0)


def test_bad_input_gives_typed_errors_and_leaves_pool_unchanged(no_overflow):
    s = no_overflow  # not the pair's: that sender may still hold objects awaiting GC
    live_refs, _ = ray.get(s.put.remote([torch.ones(3)]))  # create the pool
    before = ray.get(s.stats.remote())
    with pytest.raises(ray.exceptions.RayTaskError) as ei:
        ray.get(s.put.remote([torch.ones(3), torch.empty(3, device="meta")]))
    assert "InvalidInputError" in str(ei.value) and "device" in str(ei.value)
    with pytest.raises(ray.exceptions.RayTaskError) as ei:
        ray.get(s.put.remote([torch.ones(2).to_sparse()]))
    assert "InvalidInputError" in str(ei.value) or "sparse" in str(ei.value).lower()
    after = ray.get(s.stats.remote())
    assert (after.pool_used, after.live_objects) == (before.pool_used, before.live_objects)
    assert before.live_objects == 1
    del live_refs


def test_unregistered_transport_name_is_rejected():
    with pytest.raises(ValueError, match="NIXL_POOOL"):
        ray.put([torch.ones(2)], _tensor_transport="nixl_poool")


@ray.remote(enable_tensor_transport=True, runtime_env=actor_env(ENV))
class NoNixlReceiver:
    def __init__(self):
        ray_rdt_pool.register()
        sys.modules["nixl._api"] = None  # type: ignore[assignment]
        sys.modules["nixl"] = None  # type: ignore[assignment]

    def get(self, refs):
        try:
            ray.get(refs[0])
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"


def test_receiver_without_nixl_gets_a_registration_error(pair):
    s, r = pair[0], NoNixlReceiver.remote()
    refs, _ = ray.get(s.put.remote([torch.ones(4)]))
    msg = ray.get(r.get.remote(refs))
    assert "NIXL is not usable" in msg and "pip install nixl" in msg


def test_the_environment_names_reach_the_workers():
    """An actor reads every setting from RAY_RDT_POOL_ + its option's name, tuning ones
    included (the module's RAY_RDT_POOL_POOL_BYTES=32M among them), and nothing from a
    name from before that rule."""
    @ray.remote(enable_tensor_transport=True, runtime_env=actor_env(ENV))
    class Probe:
        def run(self):
            from ray_rdt_pool import config
            from ray_rdt_pool._ray.runtime import runtime

            ray_rdt_pool.register()
            self.kept = ray.put([torch.ones(4)], _tensor_transport="nixl_pool")  # the pool
            return (ray_rdt_pool.stats().pool_capacity, runtime().config.options(),
                    config.Tuning().read_split_bytes)

    env = {"RAY_RDT_POOL_PACK_THREADS": "3", "RAY_RDT_POOL_DEBUG_TRANSFERS": "1",
           "RAY_RDT_POOL_REGISTRATION_CACHE_BYTES": "64M", "RAY_RDT_POOL_READ_SPLIT": "4M"}
    capacity, options, default_split = ray.get(
        Probe.options(runtime_env=actor_env({**ENV, **env})).remote().run.remote())
    assert capacity == 32 << 20 and options["pool_bytes"] == 32 << 20
    assert (options["pack_threads"], options["debug_transfers"]) == (3, True)
    assert options["registration_cache_bytes"] == 64 << 20
    assert options["read_split_bytes"] == default_split != 4 << 20  # the old name: unread


def test_configure_errors_are_typed():
    @ray.remote(enable_tensor_transport=True, runtime_env=actor_env(ENV))
    class C:
        def run(self):
            out = []
            ray_rdt_pool.configure(pool_bytes=1 << 20)
            for kwargs in ({"pool_bytes": 2 << 20}, {"pool_bytes": 0}, {"bogus": 1}):
                try:
                    ray_rdt_pool.configure(**kwargs)
                    out.append("ok")
                except ray_rdt_pool.ConfigurationError as e:
                    out.append(str(e))
            ray_rdt_pool.register()
            ray.put([torch.ones(2)], _tensor_transport="nixl_pool")
            try:
                ray_rdt_pool.configure(pool_bytes=4 << 20)
            except ray_rdt_pool.ConfigurationError as e:
                out.append(str(e))
            return out

    out = ray.get(C.remote().run.remote())
    assert "already called" in out[0]
    assert "positive number of bytes" in out[1]
    assert "unknown configuration option" in out[2]
    assert "after nixl_pool was first used" in out[3]


def test_concurrent_puts_from_threads_in_one_actor(pair):
    @ray.remote(enable_tensor_transport=True, max_concurrency=4, runtime_env=actor_env(ENV))
    class ThreadedSender:
        def __init__(self):
            ray_rdt_pool.register()

        def burst(self, seed: int, n: int):
            g = torch.Generator().manual_seed(seed)
            out = []
            for _ in range(n):
                ts = [torch.randn(int(torch.randint(1, 500, (1,), generator=g)), generator=g)
                      for _ in range(3)]
                out.append(([ray.put(ts, _tensor_transport="nixl_pool")], digest(ts)))
            return out

        def stats(self):
            return ray_rdt_pool.stats()

    s, r = ThreadedSender.remote(), pair[1]
    batches = ray.get([s.burst.remote(seed, 25) for seed in range(4)])
    items = [item for b in batches for item in b]
    assert len(items) == 100
    got = ray.get([r.get.remote(refs) for refs, _ in items])
    assert got == [d for _, d in items]
    del items, batches
    assert wait_for(lambda: ray.get(s.stats.remote()).live_objects == 0)
    assert ray.get(s.stats.remote()).pool_used == 0


def _metadata_sizes(self):
    """In a sender: the pickled size of the metadata of 10,000 views of one weight, and of
    its wire bytes."""
    import pickle

    w = torch.randn(10_000, 256)
    views = [w[i] for i in range(10_000)]
    ref = ray.put(views, _tensor_transport="nixl_pool")
    mgr = ray._private.worker.global_worker.rdt_manager
    meta = mgr.get_rdt_metadata(ref.hex()).tensor_transport_meta
    return len(pickle.dumps(meta)), len(meta.wire)


def test_metadata_is_compact_and_agent_metadata_is_not_inside(pair):
    pickled, wire = ray.get(pair[0].__ray_call__.remote(_metadata_sizes))
    assert wire < 1000, wire  # one run of 10,000 equal views
    assert pickled < 2000, pickled


def test_repeated_fetches_reuse_registrations(pair):
    s, r = pair
    refs, expected = ray.get(s.put.remote([torch.randn(1000)]))
    ray.get(r.get.remote(refs))
    warm = ray.get(r.stats.remote()).nixl_registrations
    for _ in range(5):
        refs, expected = ray.get(s.put.remote([torch.randn(1000)]))
        assert ray.get(r.get.remote(refs)) == expected
    assert ray.get(r.stats.remote()).nixl_registrations == warm
    assert ray.get(s.stats.remote()).nixl_registrations == 1


def test_rays_tensor_reducer_is_replaced_by_one_pickled_by_reference(pair):
    """Ray's RDT reducer carries a function pickled by value in every object (about 1.4 ms
    a put here). After our first put the actor uses ours, which Ray's object store and
    Ray's own nixl transport, sharing that reducer in the process, must still round-trip."""
    s, r = pair
    ts = [torch.arange(10.0), torch.ones(3, 3, dtype=torch.int64), torch.tensor(2.5)]
    # Nested, so not a flat value: Ray's serializer (and its reducer) handles it.
    refs, flat = ray.get(s.put_counting_flat.remote([ts]))
    assert not flat
    assert ray.get(r.describe.remote(refs))[3] == digest(ts)
    assert ray.get(s.tensor_reducer.remote()) == {
        "ours": True, "function_by_value": False, "round_trip": True}
    for transport in (None, "nixl", "nixl_pool"):
        refs, dig = ray.get(s.put_with.remote(ts, transport))
        assert ray.get(r.get.remote(refs)) == dig, transport
        if transport is None:
            assert digest(ray.get(refs[0])) == dig  # the driver, by the object store


def test_pack_as_converts_parameters(pair):
    """A Parameter takes Ray's serializer, whose pickling hands on ``p.data``, a new
    tensor object: pack_as's ``id(p)`` never matched it and the Parameter arrived as
    float32 with no error. It arrives as a bf16 Parameter now, still requiring grad."""
    s, r = pair
    one, mixed = ray.get(s.put_parameters_as_bf16.remote())
    eight = [float(i) for i in range(8)]
    assert ray.get(r.kinds.remote([one])) == [("Parameter", "torch.bfloat16", True, eight)]
    assert ray.get(r.kinds.remote([mixed])) == [
        ("Parameter", "torch.bfloat16", True, eight),
        ("Tensor", "torch.bfloat16", False, [0.0, 1.0, 2.0, 3.0]),
        ("Parameter", "torch.float32", True, [1.0, 1.0])]


def _flat_cases():
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.int64)
    c = torch.tensor(1.5)
    return [
        ("list", [a, b, c], True),
        ("tuple", (a, b, c), True),
        ("dict", {"w": a, "b": b, "s": c}, True),
        ("same tensor twice", [a, b, a], True),
        ("same tensor twice, nested: Ray's path", [[a, b, a]], False),
        ("a non-tensor item: Ray's path", [a, 3, b], False),
        ("int keys: Ray's path", {0: a, 1: b}, False),
        ("a Parameter: Ray's path", [a, torch.nn.Parameter(b.float())], False),
    ]


@pytest.mark.parametrize("case", range(len(_flat_cases())),
                         ids=[c[0] for c in _flat_cases()])
def test_flat_values_skip_rays_per_tensor_serializer_and_come_back_the_same(pair, case):
    """A flat list, tuple or str-keyed dict of tensors goes to Ray as one stand-in object
    (Ray's per-tensor msgpack and pickle cost about 9 us a tensor on each side); anything
    else goes Ray's way. Either way the receiver gets the same type, keys, aliasing (a
    tensor put twice is one object twice, as Ray's pickler gives) and bytes."""
    s, r = pair
    name, value, flat = _flat_cases()[case]
    refs, took_flat = ray.get(s.put_counting_flat.remote(value))
    assert took_flat is flat
    kind, keys, same, dig, types = ray.get(r.describe.remote(refs))
    items = value[0] if name.endswith("nested: Ray's path") else value
    ts = list(items.values()) if isinstance(items, dict) else list(items)
    assert kind == type(value).__name__
    assert keys == (list(value) if isinstance(value, dict) else None)
    assert same == [[j for j, u in enumerate(ts) if u is t] for t in ts]
    assert types == [type(t).__name__ for t in ts]
    assert dig == digest([t.detach() if isinstance(t, torch.Tensor) else t
                          for t in ts if isinstance(t, torch.Tensor)])


def test_receiver_loads_each_senders_metadata_once(spare):
    s = Sender.remote()  # one the receiver has never met
    r = spare["off"]  # NIXL metadata: only READs need it
    ray.get(r.stats.remote())
    before = ray.get(r.stats.remote())
    for _ in range(3):
        refs, expected = ray.get(s.put.remote([torch.ones(8)]))
        assert ray.get(r.get.remote(refs)) == expected
    after = ray.get(r.stats.remote())
    assert after.remote_metadata_loads == before.remote_metadata_loads + 1
    assert after.remote_agents == before.remote_agents + 1
