"""The CUDA path. Tests marked ``gpu`` need a CUDA device and are skipped without one;
the rest check, on any machine, the parts of the CUDA path that need no device.

Run the GPU part with ``microbenchmarks/gpu_check.sh`` on a machine with an NVIDIA GPU.
"""

from __future__ import annotations

import pytest
import torch

import ray_rdt_pool
from ray_rdt_pool.errors import InvalidInputError, RegistrationError
from ray_rdt_pool.tensors import CudaRegion, describe, device_block

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (none on this machine)")


def test_expandable_segments_is_refused_with_the_setting_named(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(RegistrationError, match="expandable_segments"):
        CudaRegion(1 << 20)


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised where no CUDA device exists")
def test_cuda_pool_without_a_device_names_the_fix(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with pytest.raises(ray_rdt_pool.ConfigurationError, match="device='cpu'"):
        CudaRegion(1 << 20)


def test_cuda_tensors_are_refused_when_the_cuda_path_is_off():
    # describe() is the gate; on a CPU-only build a meta tensor stands in for "not CPU".
    with pytest.raises(InvalidInputError, match="device"):
        describe([torch.ones(2), torch.empty(2, device="meta")], allow_cuda=True)


def test_device_block_frees_when_the_last_view_dies():
    import gc

    buf = torch.zeros(4096, dtype=torch.uint8)
    freed: list[int] = []
    block = device_block(buf.data_ptr() + 64, 1024, "cpu", 0, lambda: freed.append(1))
    assert block.untyped_storage().nbytes() == 1024
    view = block[8:16].view(torch.float32)
    view.fill_(1.5)
    del block
    gc.collect()
    assert not freed
    assert buf[64 + 8:64 + 16].view(torch.float32).tolist() == [1.5, 1.5]
    del view
    gc.collect()
    assert freed == [1]


# ---------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------

def _world():
    from tests.fakenixl import World

    return World()


def _runtime(world, **cfg):
    from ray_rdt_pool.config import PoolConfig
    from ray_rdt_pool.transport import Runtime

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
    blocks = pool.alloc.blocks("a")
    off = blocks[0].offset
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
    import ray

    from tests.raycluster import digest, start_ray

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
                return digest(out), ray_rdt_pool.stats().arena_used

            def get_on_cpu(self, refs):
                ray.experimental.set_target_device_for_ref(refs[0], "cpu")
                out = ray.get(refs[0])
                assert not any(t.is_cuda for t in out)
                return digest(out)

        s, r = S.remote(), R.remote()
        refs, expected = ray.get(s.put.remote())
        got, arena_used = ray.get(r.get.remote(refs))
        assert got == expected and arena_used == 0  # views died with the method's frame
        assert ray.get(r.get_on_cpu.remote(refs)) == expected
    finally:
        ray.shutdown()
