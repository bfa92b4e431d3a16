"""nixl_pool between two Ray nodes: a head and a worker node started with ray.cluster_utils.Cluster.

Own cluster: two Ray nodes (the test process leaves its shared one-node cluster meanwhile).

Both nodes run on this machine: separate raylets, separate object stores, one GCS; NIXL moves
the bytes over UCX between the two processes (TCP loopback for the handshake, cma for the
data), not through either object store. No network namespaces: the point is that sender and
receiver are scheduled on different Ray nodes and nothing in the transport assumes one node
(the agent metadata travels through the GCS key-value store, the object metadata through the
owner). Custom resources pin the sender to the head ({"sender": ...}) and the receiver to the
worker node ({"receiver": 1}).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import ray_rdt_pool
from ray_rdt_pool.core.runs import DTYPES
from ray_rdt_pool.weights import WeightReceiver, WeightSender
from tests.support import actors
from tests.support.raycluster import DEFAULT_ENV, all_dtype_tensors, digest, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.own_cluster("two Ray nodes"),
              pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")]

# @ray.method(tensor_transport=...) validates the name when the class is defined.
ray_rdt_pool.register()

BIG_BYTES = 32 << 20
N_VIEWS = 1000
#: Where ray.cluster_utils.Cluster records its address; a plain ray.init() anywhere on the
#: machine joins the cluster named there.
CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")


def _restore(previous: bytes | None) -> None:
    """Put /tmp/ray/ray_current_cluster back as it was before the Cluster touched it."""
    try:
        if previous is None:
            CURRENT_CLUSTER.unlink(missing_ok=True)
        else:
            CURRENT_CLUSTER.write_bytes(previous)
    except OSError:
        pass


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    # Two read lanes whatever the core count: large READs here are split over two agents.
    env = {**DEFAULT_ENV, "RAY_RDT_POOL_POOL_BYTES": "96M", "RAY_RDT_POOL_ARENA_BYTES": "96M",
           "RAY_RDT_POOL_READ_LANES": "2"}
    saved = dict(os.environ)
    for k, v in env.items():
        os.environ[k] = v
    if ray.is_initialized():
        ray.shutdown()
    previous = CURRENT_CLUSTER.read_bytes() if CURRENT_CLUSTER.exists() else None
    node_args = {"num_cpus": 4, "object_store_memory": 200 << 20}
    c = Cluster(initialize_head=True, head_node_args={
        **node_args, "resources": {"sender": 4}, "include_dashboard": False})
    # Cluster wrote its address there; undo it at once, so that other test runs sharing this
    # machine keep starting clusters of their own instead of joining this one.
    _restore(previous)
    try:
        c.add_node(**node_args, resources={"receiver": 4})
        c.wait_for_nodes()
        ray.init(address=c.address, runtime_env={"env_vars": env}, log_to_driver=False)
        ray_rdt_pool.register()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        _restore(previous)
        os.environ.clear()
        os.environ.update(saved)


def object_set(seed: int) -> list[torch.Tensor]:
    """Every dtype the wire carries, one 32 MiB tensor and 1,000 small views of one weight."""
    g = torch.Generator().manual_seed(seed + 1)
    out = all_dtype_tensors(seed, rows=4, first_cols=3)
    out.append(torch.randn(BIG_BYTES // 4, generator=g))
    w = torch.randn(N_VIEWS, 64, generator=g)
    out.extend(w[i] for i in range(N_VIEWS))
    return out


@ray.remote(enable_tensor_transport=True, resources={"sender": 1})
class Sender(actors.Sender):
    def put(self, seed: int):
        ts = object_set(seed)
        return [ray.put(ts, _tensor_transport="nixl_pool")], digest(ts)

    @ray.method(tensor_transport="nixl_pool")
    def make(self, seed: int):
        return object_set(seed)

    def put_big(self, seed: int):
        t = [torch.randint(-(2**31), 2**31 - 1, (BIG_BYTES // 4,), dtype=torch.int32,
                           generator=torch.Generator().manual_seed(seed))]
        return [ray.put(t, _tensor_transport="nixl_pool")], digest(t)


@ray.remote(enable_tensor_transport=True, resources={"receiver": 1})
class Receiver(actors.Receiver):
    pass


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Any, Any]]:
    s, r = Sender.remote(), Receiver.remote()
    yield s, r
    ray.kill(s)
    ray.kill(r)


def test_sender_and_receiver_are_on_different_nodes(cluster, pair):
    s, r = pair
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    s_node, r_node = ray.get([s.node.remote(), r.node.remote()])
    assert s_node != r_node and {s_node, r_node} == nodes


def test_object_set_round_trips_across_nodes_by_ray_get(pair):
    s, r = pair
    refs, expected = ray.get(s.put.remote(1))
    assert len(expected) == len(DTYPES) - sum(
        not isinstance(getattr(torch, n, None), torch.dtype) for n in DTYPES) + 1 + N_VIEWS
    assert ray.get(r.get.remote(refs)) == expected
    st = ray.get(r.stats.remote())
    assert st.remote_agents >= 1 and st.receive_fallbacks == 0 and st.transfer_errors == 0
    assert st.bytes_received >= BIG_BYTES
    # Another Ray node (on the same host): same_node="map" (the default) must not map.
    assert st.mapped_gets == 0 and st.reads_posted >= 1


def test_object_set_round_trips_across_nodes_as_a_task_argument(pair):
    s, r = pair
    assert ray.get(r.take.remote(s.make.remote(2))) == digest(object_set(2))


def test_a_32_mib_object_is_read_in_two_lanes_byte_exact(pair):
    s, r = pair
    before = ray.get(r.stats.remote())
    for seed in (11, 12):
        refs, expected = ray.get(s.put_big.remote(seed))
        assert ray.get(r.get.remote(refs)) == expected
        del refs
    st = ray.get(r.stats.remote())
    # Each READ was cut over the two read lanes (RAY_RDT_POOL_READ_LANES=2), not one agent.
    assert st.split_reads - before.split_reads == 2
    assert st.reads_posted - before.reads_posted == 2
    assert st.transfer_errors == 0 and st.receive_fallbacks == 0


def test_memory_comes_back_on_both_nodes(pair):
    s, r = pair
    for seed in (3, 4):
        refs, expected = ray.get(s.put.remote(seed))
        assert ray.get(r.get.remote(refs)) == expected
        del refs
    st = wait_for(lambda: (x := ray.get(s.stats.remote())).live_objects == 0 and x, timeout=60)
    assert st.pool_used == 0 and st.fallbacks == 0 and st.nixl_registrations == 1
    rst = wait_for(lambda: (x := ray.get(r.stats.remote())).arena_used == 0 and x, timeout=60)
    assert rst.arena_live_blocks == 0 and rst.transfers_in_flight == 0
    assert rst.nixl_registrations == 1  # the arena, registered once for every object


# ---------------------------------------------------------------------------------------
# The weights API's stream across the two nodes
# ---------------------------------------------------------------------------------------


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Matrices of two dtypes, a vector, integers, and one strided view (packed)."""
    g = torch.Generator().manual_seed(seed)
    out = {f"layer{i}.w": torch.randn(256, 512, generator=g) for i in range(6)}
    out |= {f"layer{i}.b": torch.randn(512, generator=g).to(torch.bfloat16) for i in range(6)}
    out["ids"] = torch.randint(0, 1 << 40, (20000,), generator=g)
    out["proj.t"] = torch.randn(300, 200, generator=g).t()
    return out


@ray.remote(enable_tensor_transport=True, resources={"sender": 1})
class Trainer:
    def __init__(self) -> None:
        ray_rdt_pool.register()
        self.state = weights(1)
        self.weight_sender = WeightSender(self.state, bucket_bytes=1 << 20)

    def step(self) -> None:
        with torch.no_grad():
            for v in self.state.values():
                v.add_(3)

    def stream(self, receivers: list[Any]) -> Any:
        return self.weight_sender.stream(receivers), ray_rdt_pool.stats()

    def digest(self) -> list[int]:
        return digest(list(self.state.values()))


@ray.remote(enable_tensor_transport=True, resources={"receiver": 1})
class Engine:
    def __init__(self) -> None:
        ray_rdt_pool.register()
        self.state = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in weights(2).items()}
        self.weight_receiver = WeightReceiver(self.state)

    def digest(self) -> list[int]:
        return digest(list(self.state.values()))

    def stats(self) -> Any:
        return ray_rdt_pool.stats()


def test_weight_stream_across_nodes_reads_the_trainers_tensors_by_reference(cluster):
    """Buckets that lie as they are sent are READ where they lie (no pack, no pool), the
    strided one is packed; every step is exact, the trainer holds nothing once stream()
    returns, and a warm step registers nothing and reloads no metadata."""
    tr, en = Trainer.remote(), Engine.remote()
    try:
        seen = []
        for _step in range(3):
            rep, st = ray.get(tr.stream.remote([en]))
            assert rep.source_read_buckets == 0  # another node: never read in place
            assert 0 < rep.reference_buckets == rep.buckets - 1
            assert st.live_objects == 0 and st.pool_used == 0
            assert ray.get(en.digest.remote()) == ray.get(tr.digest.remote())
            est = ray.get(en.stats.remote())
            assert est.mapped_gets == 0 and est.transfer_errors == 0
            seen.append((st.nixl_registrations, est.remote_metadata_loads))
            ray.get(tr.step.remote())
        assert seen[1] == seen[2], seen
    finally:
        ray.kill(tr)
        ray.kill(en)


def test_an_engine_catches_up_from_a_peer_on_the_other_node(cluster):
    """The trainer syncs an engine on its own node; an engine on the other node gets
    that version from it, READ by reference across the nodes, with the trainer gone."""
    from ray_rdt_pool.weights import catch_up, sync

    tr = Trainer.remote()
    peer = Engine.options(resources={"sender": 1}).remote()
    late = Engine.remote()
    try:
        ray.get(tr.step.remote())
        v = sync(tr, [peer], timeout_s=60).version
        want = ray.get(tr.digest.remote())
        ray.kill(tr)
        rep = catch_up(peer, [late], timeout_s=60)
        assert rep.version == v and rep.stream is not None
        assert rep.stream.source_read_buckets == 0 and rep.stream.reference_buckets > 0
        assert ray.get(late.digest.remote()) == want
        assert ray.get(late.__ray_call__.remote(lambda s: s.weight_receiver.version)) == v
    finally:
        for a in (tr, peer, late):
            ray.kill(a)
