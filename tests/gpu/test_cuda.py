"""The CUDA path on a device: tests marked ``gpu`` need a CUDA device and are skipped
with a reason without one. The parts that need no device are in
tests/unit/memory/test_cuda_logic.py.

Run the GPU part with ``microbenchmarks/gpu_check.sh`` on a machine with an NVIDIA GPU.
"""

from __future__ import annotations

import pytest
import torch

import ray_rdt_pool

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (none on this machine)")


# ---------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------

def _world():
    from ray_rdt_pool.testing import World

    return World()


def _runtime(world, **cfg):
    from ray_rdt_pool._ray.runtime import Runtime
    from ray_rdt_pool.config import PoolConfig

    cfg.setdefault("pool_bytes", 64 << 20)
    cfg.setdefault("arena_bytes", 64 << 20)
    cfg.setdefault("metrics", False)
    return Runtime(PoolConfig(**cfg), backend_factory=world.factory, directory=world)


@pytest.mark.gpu
@needs_gpu
def test_cuda_tensors_into_a_host_pool_round_trip():
    """A cross-device pool: CUDA tensors are packed (one foreach copy) into host memory
    and read back byte for byte (the READ through the in-process fake)."""
    import pickle

    world = _world()
    s, r = _runtime(world, device="cpu"), _runtime(world, device="cpu")
    ts = [torch.randn(300, 7, device="cuda"), torch.arange(10, device="cuda"),
          torch.randn(64, 64, device="cuda").t(),
          torch.ones(5, device="cuda", dtype=torch.bfloat16)]
    meta = pickle.loads(pickle.dumps(s.put("a", ts)))
    out = r.wait(r.fetch("a", meta, None), -1)
    for a, b in zip(out, ts):
        assert a.is_cuda and torch.equal(a, b)  # lands on the senders' device type
    assert set(r.receiver.arenas) == {"cuda"}
    host = [torch.empty_like(t, device="cpu").contiguous() for t in ts]
    out = r.wait(r.fetch("a", meta, host), -1)  # set_target_device_for_ref(ref, "cpu")
    for a, b in zip(out, ts):
        assert not a.is_cuda and torch.equal(a, b.cpu())


@pytest.mark.gpu
@needs_gpu
def test_stream_ordering_the_pool_sees_the_producers_final_bytes():
    world = _world()
    s = _runtime(world, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros(1 << 22, device="cuda")
        for _ in range(50):  # long enough that an unsynchronised copy would see zeros
            x.add_(1)
    s.sender.cuda_stream = side
    s.put("a", [x])
    pool = s.sender.pool
    off = s.sender.sent["a"].blocks[0][0]
    got = pool.mem.tensor[off:off + x.numel() * 4].view(torch.float32)
    torch.cuda.synchronize()
    assert bool((got == 50).all())


@pytest.mark.gpu
@needs_gpu
def test_cuda_put_of_registered_memory_only_needs_no_copy():
    """The advertised GPU zero-copy use: every tensor inside register_memory() storage,
    so the CUDA pack has nothing to copy (it used to crash unpacking an empty block list)."""
    world = _world()
    s, r = _runtime(world, device="cuda"), _runtime(world, device="cuda")
    w = torch.randn(64, 256, device="cuda")
    s.backend()
    s.registry.pin(w)
    ts = [w[i] for i in range(64)] + [torch.empty(0, device="cuda")]
    out = r.wait(r.fetch("z", s.put("z", ts), None), -1)
    assert all(torch.equal(a, b) for a, b in zip(out, ts))
    assert s.stats().zero_copy_tensors == 64 and s.stats().pool_used == 0


@pytest.mark.gpu
@needs_gpu
def test_copy_into_cuda_parameters_that_require_grad():
    world = _world()
    s, r = _runtime(world), _runtime(world)
    src = [torch.randn(1000, device="cuda")]
    p = torch.nn.Parameter(torch.zeros(1000, device="cuda"))  # requires_grad, a leaf
    out = r.wait(r.fetch("a", s.put("a", src), [p]), -1)  # first sighting: copy out
    assert out[0] is p and torch.equal(p.detach(), src[0])
    assert r.stats().arena_used == 0


@pytest.mark.gpu
@needs_gpu
def test_real_ray_round_trip_between_actors_on_one_gpu():
    import time

    import ray

    from tests.support.raycluster import digest, start_ray

    start_ray({"RAY_RDT_POOL_DEVICE": "cuda"}, num_gpus=1)
    try:
        @ray.remote(num_gpus=0.5, enable_tensor_transport=True)
        class S:
            def __init__(self):
                ray_rdt_pool.register()

            def put(self):
                g = torch.Generator(device="cuda").manual_seed(0)
                ts = [torch.randn(1 << 20, device="cuda", generator=g),
                      torch.randn(128, 128, device="cuda", generator=g).to(torch.bfloat16),
                      torch.arange(1000, device="cuda")]
                return [ray.put(ts, _tensor_transport="nixl_pool")], digest(ts)

        @ray.remote(num_gpus=0.5, enable_tensor_transport=True)
        class R:
            def __init__(self):
                ray_rdt_pool.register()

            def get(self, refs):
                out = ray.get(refs[0])
                assert all(t.is_cuda for t in out)
                return digest(out)

            def arena_used(self):
                return ray_rdt_pool.stats().arena_used

            def get_on_cpu(self, refs):
                ray.experimental.set_target_device_for_ref(refs[0], "cpu")
                out = ray.get(refs[0])
                assert not any(t.is_cuda for t in out)
                return digest(out)

        s, r = S.remote(), R.remote()
        refs, expected = ray.get(s.put.remote())
        assert ray.get(r.get.remote(refs)) == expected
        deadline = time.monotonic() + 10  # views died with the method's frame: the
        while ray.get(r.arena_used.remote()) and time.monotonic() < deadline:  # block
            time.sleep(0.1)  # comes back on the receiver's next progress tick
        assert ray.get(r.arena_used.remote()) == 0
        assert ray.get(r.get_on_cpu.remote(refs)) == expected
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------------------
# Same node, CUDA pool: CUDA IPC instead of a NIXL READ
# ---------------------------------------------------------------------------------------


def _ipc_actors():
    import ray

    from tests.support.raycluster import digest

    @ray.remote(num_gpus=0.25, enable_tensor_transport=True)
    class S:
        def __init__(self):
            ray_rdt_pool.register()

        def put(self, seed, n=1 << 20):
            g = torch.Generator(device="cuda").manual_seed(seed)
            base = torch.randn(256, 64, device="cuda", generator=g)
            ts = [torch.randn(n, device="cuda", generator=g),
                  torch.randn(128, 128, device="cuda", generator=g).to(torch.bfloat16),
                  torch.arange(1000, device="cuda") * (seed + 1),
                  base.t(), base[3], torch.tensor(7.5 + seed, device="cuda")]
            return [ray.put(ts, _tensor_transport="nixl_pool")], digest(ts)

        def stats(self):
            s = ray_rdt_pool.stats()
            return s.pool_used, s.leased_objects, s.live_objects

    @ray.remote(num_gpus=0.25, enable_tensor_transport=True)
    class R:
        def __init__(self, same_node):
            ray_rdt_pool.register()
            ray_rdt_pool.configure(same_node=same_node)

        def get(self, refs, scribble=False):
            out = ray.get(refs[0])
            assert all(t.is_cuda for t in out)
            d = digest(out)
            if scribble:  # a receiver that writes into what it got
                for t in out:
                    t.fill_(3)
                torch.cuda.synchronize()
            s = ray_rdt_pool.stats()
            return d, s.mapped_gets, s.reads_posted, s.mapped_objects

        def get_on_cpu(self, refs):
            ray.experimental.set_target_device_for_ref(refs[0], "cpu")
            out = ray.get(refs[0])
            assert not any(t.is_cuda for t in out)
            return digest(out)

    return S, R


@pytest.mark.gpu
@needs_gpu
def test_same_node_cuda_pool_is_read_through_cuda_ipc():
    """Two actors on one GPU, CUDA pools: a get makes no NIXL READ (one device-to-device
    copy out of the sender's pool, opened through CUDA IPC), the result is private (a
    receiver's writes reach nobody else), leases drop at once, and nothing leaks."""
    import time

    import ray

    from tests.support.raycluster import start_ray

    start_ray({"RAY_RDT_POOL_DEVICE": "cuda", "RAY_RDT_POOL_SAME_NODE": "map"}, num_gpus=1)
    try:
        S, R = _ipc_actors()
        s, r1, r2, r3 = S.remote(), R.remote("map"), R.remote("copy"), R.remote("off")
        refs, expected = ray.get(s.put.remote(0))
        d1, mapped, reads, held = ray.get(r1.get.remote(refs, True))
        assert d1 == expected and (mapped, reads, held) == (1, 0, 0)
        d2, mapped, reads, _ = ray.get(r2.get.remote(refs))
        assert d2 == expected and (mapped, reads) == (1, 0)  # r1's writes stayed in r1
        d3, mapped, reads, _ = ray.get(r3.get.remote(refs))
        assert d3 == expected and (mapped, reads) == (0, 1)  # same_node=off: a NIXL READ
        assert ray.get(r1.get_on_cpu.remote(refs)) == expected  # a READ into host memory
        assert ray.get(s.stats.remote())[1] == 0  # copies leave no lease behind
        del refs
        for i in range(1, 41):  # reuse of freed blocks: every get sees its own object
            refs, expected = ray.get(s.put.remote(i, 1 << (10 + i % 8)))
            d, mapped, reads, held = ray.get(r1.get.remote(refs))
            assert d == expected and held == 0, i
            del refs
        assert (mapped, reads) == (41, 1)  # the one READ: get_on_cpu
        deadline = time.monotonic() + 20
        while ray.get(s.stats.remote()) != (0, 0, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.get(s.stats.remote()) == (0, 0, 0)  # every block back in the pool
    finally:
        ray.shutdown()


@pytest.mark.gpu
@needs_gpu
def test_gpu_check_sanity_cuda_ipc_export_opens_in_another_process():
    """The torch calls the CUDA IPC path rests on, in a child process (a process cannot
    open its own IPC handle)."""
    import subprocess
    import sys

    from ray_rdt_pool.same_node.cuda import export_cuda_pool

    t = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
    exp = export_cuda_pool(t.view(torch.uint8))
    torch.cuda.synchronize()
    code = (
        "import sys, torch\n"
        "from ray_rdt_pool.same_node.cuda import CudaExport, CudaMapping\n"
        f"c = CudaExport({exp.uuid!r}, {exp.handle!r}, {exp.size}, {exp.offset}, "
        f"{exp.ref_handle!r}, {exp.ref_offset}, {exp.event_handle!r}, {exp.event_sync})\n"
        "m = CudaMapping(c, 4 << 20)\n"
        "x = torch.empty(0, dtype=torch.uint8, device='cuda').set_(m.storage).view(torch.int32)\n"
        "assert torch.equal(x.cpu(), torch.arange(1 << 20, dtype=torch.int32)), 'bytes differ'\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


@pytest.mark.gpu
@needs_gpu
def test_weight_sync_between_gpu_actors_streams_and_publishes_exactly():
    """The weights API on CUDA pools, one GPU: into live CUDA tensors, into a
    load_weights callable, and with a dim-0 selection (half of each tensor); every byte
    checked on the host, and same-node gets made no NIXL READ."""
    import ray

    from ray_rdt_pool.weights import WeightReceiver, WeightSender, sync
    from tests.support.raycluster import start_ray

    start_ray({"RAY_RDT_POOL_DEVICE": "cuda", "RAY_RDT_POOL_SAME_NODE": "map"}, num_gpus=1)
    try:
        @ray.remote(num_gpus=0.25, enable_tensor_transport=True)
        class Node:
            def __init__(self):
                ray_rdt_pool.register()

            def trainer(self, seed):
                g = torch.Generator(device="cuda").manual_seed(seed)
                self.state = {f"l{i}.w": torch.randn(512, 256, device="cuda", generator=g)
                              for i in range(8)}
                self.state["l0.b"] = torch.randn(256, device="cuda", generator=g).to(
                    torch.bfloat16)
                self.weight_sender = WeightSender(self.state, bucket_bytes=1 << 20)
                return {k: v.cpu() for k, v in self.state.items()}

            def receiver(self, shapes, kind):
                self.got = {}
                if kind == "dest":
                    self.state = {k: torch.zeros(s, dtype=d, device="cuda")
                                  for k, (s, d) in shapes.items()}
                    self.weight_receiver = WeightReceiver(self.state)
                    return

                def load(items):
                    for name, t in items:
                        assert t.is_cuda
                        self.got[name] = t.cpu().clone()
                sel = (lambda name, shape: (slice(0, shape[0] // 2),)) if kind == "half" \
                    else None
                self.weight_receiver = WeightReceiver(load_weights=load, select=sel)

            def result(self):
                s = ray_rdt_pool.stats()
                got = self.got or {k: v.cpu() for k, v in self.state.items()}
                return got, s.mapped_gets, s.reads_posted

        tr, r1, r2, r3 = (Node.remote() for _ in range(4))
        for version, mode in enumerate(("stream", "publish"), start=1):
            want = ray.get(tr.trainer.remote(version))
            shapes = {k: (tuple(v.shape), v.dtype) for k, v in want.items()}
            ray.get([r1.receiver.remote(shapes, "dest"), r2.receiver.remote(shapes, "load"),
                     r3.receiver.remote(shapes, "half")])
            sync(tr, [r1, r2, r3], mode=mode, max_inflight=2, version=version)
            for r, part in ((r1, None), (r2, None), (r3, "half")):
                got, mapped, reads = ray.get(r.result.remote())
                assert set(got) == set(want), mode
                for k, w in want.items():
                    w = w[: w.shape[0] // 2] if part else w
                    assert got[k].dtype == w.dtype and torch.equal(got[k], w), (mode, k)
                assert mapped > 0 and reads == 0, (mode, mapped, reads)
    finally:
        ray.shutdown()


@pytest.mark.gpu
@needs_gpu
def test_weight_stream_over_nixl_into_cuda_destinations():
    """Weight streams where NIXL carries the bytes (``same_node="off"``) into CUDA
    destinations: from a CUDA trainer (its buckets packed into the CUDA pool, then READ
    VRAM to VRAM) and from a CPU trainer (its module READ by reference, host to VRAM, no
    pack). Two versions each; every byte checked on the host; the trainer holds no pool
    block once a stream returns, and a warm by-reference stream registers nothing."""
    import ray

    from ray_rdt_pool.weights import WeightReceiver, WeightSender, sync
    from tests.support.raycluster import start_ray

    start_ray({"RAY_RDT_POOL_SAME_NODE": "off"}, num_gpus=1)
    try:
        @ray.remote(num_gpus=0.25, enable_tensor_transport=True)
        class Node:
            def __init__(self, device):
                ray_rdt_pool.register()
                ray_rdt_pool.configure(device=device, same_node="off")
                self.device = device

            def trainer(self, seed):
                g = torch.Generator().manual_seed(seed)
                self.state = {f"l{i}.w": torch.randn(256, 512, generator=g).to(self.device)
                              for i in range(6)}
                self.state["l0.b"] = torch.randn(512, generator=g).to(torch.bfloat16).to(
                    self.device)
                if not hasattr(self, "weight_sender"):
                    self.weight_sender = WeightSender(self.state, bucket_bytes=1 << 20)
                else:  # the same tensors, new values: the sender's source is unchanged
                    for k, v in self.weight_sender.source.items():
                        v.copy_(self.state[k])
                    self.state = self.weight_sender.source
                return {k: v.cpu() for k, v in self.state.items()}

            def receiver(self, shapes):
                if not hasattr(self, "weight_receiver"):
                    self.state = {k: torch.zeros(s, dtype=d, device="cuda")
                                  for k, (s, d) in shapes.items()}
                    self.weight_receiver = WeightReceiver(self.state)

            def result(self):
                s = ray_rdt_pool.stats()
                return ({k: v.cpu() for k, v in self.state.items()}, s.mapped_gets,
                        s.reads_posted)

            def sender_stats(self):
                s = ray_rdt_pool.stats()
                return s.pool_used, s.live_objects, s.nixl_registrations

        for trainer_device in ("cuda", "cpu"):
            tr, r1, r2 = Node.remote(trainer_device), Node.remote("cuda"), Node.remote("cuda")
            regs = []
            for version in (1, 2):
                want = ray.get(tr.trainer.remote(version))
                shapes = {k: (tuple(v.shape), v.dtype) for k, v in want.items()}
                ray.get([r1.receiver.remote(shapes), r2.receiver.remote(shapes)])
                rep = sync(tr, [r1, r2], mode="stream", max_inflight=2, version=version)
                st = rep.stream
                assert st is not None and st.source_read_buckets == 0
                if trainer_device == "cpu":  # a module on the host: READ where it lies
                    assert st.reference_buckets == st.buckets > 0, st
                else:  # CUDA tensors are packed (a snapshot in the CUDA pool)
                    assert st.reference_buckets == 0, st
                for r in (r1, r2):
                    got, mapped, reads = ray.get(r.result.remote())
                    assert mapped == 0 and reads > 0, (trainer_device, mapped, reads)
                    for k, w in want.items():
                        assert got[k].dtype == w.dtype and torch.equal(got[k], w), \
                            (trainer_device, version, k)
                used, live, n_regs = ray.get(tr.sender_stats.remote())
                assert (used, live) == (0, 0), (trainer_device, used, live)
                regs.append(n_regs)
            if trainer_device == "cpu":
                assert regs[1] == regs[0], regs  # warm: nothing registered again
            for a in (tr, r1, r2):
                ray.kill(a)
    finally:
        ray.shutdown()
