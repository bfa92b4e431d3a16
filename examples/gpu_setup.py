"""A GPU set-up: a send pool in GPU memory, CUDA tensors between actors, GPU engines.

Needs a CUDA device and a CUDA build of torch; three actors share one GPU.
Run: python examples/gpu_setup.py   (joins RAY_ADDRESS's cluster, else starts one)
"""
import hashlib
import os
import sys

import ray
import torch

import ray_rdt_pool
from ray_rdt_pool.weights import WeightReceiver, WeightSender, sync

if not torch.cuda.is_available():
    sys.exit("examples/gpu_setup.py needs a CUDA device")
ray_rdt_pool.register()  # in the driver, before the classes that name "nixl_pool"
ray.init(address=os.environ.get("RAY_ADDRESS", "local"),
         runtime_env={"worker_process_setup_hook": "ray_rdt_pool.setup_worker"})


def digest(tensors):  # equal digests: equal dtypes, shapes and bytes
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def model():
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)).cuda()


@ray.remote(num_gpus=0.25, enable_tensor_transport=True)  # the three actors share a GPU
class Trainer:
    def __init__(self):
        ray_rdt_pool.configure(device="cuda")  # before the first put: the pool in GPU memory
        self.side = torch.cuda.Stream()  # the stream this actor computes what it sends on
        ray_rdt_pool.set_cuda_stream(self.side)  # so a put waits for that stream's work
        self.model = model()
        self.weight_sender = WeightSender(self.model)  # sync() finds it by this name

    def forward(self):
        self.side.wait_stream(torch.cuda.current_stream())  # the weights are in place
        with torch.cuda.stream(self.side), torch.no_grad():
            hidden = self.model(torch.randn(64, 1024, device="cuda"))  # queued, not done
        ref = ray.put([hidden], _tensor_transport="nixl_pool")  # packs once it is done
        self.side.synchronize()  # before this actor reads hidden on another stream
        return [ref], digest([hidden])


@ray.remote(num_gpus=0.25, enable_tensor_transport=True)
class Engine:
    def __init__(self):
        self.model = model()  # its own random weights until a sync
        self.weight_receiver = WeightReceiver(self.model)  # loads into its CUDA tensors

    def receive(self, refs):
        (hidden,) = ray.get(refs[0])  # lands in this actor's CUDA arena, on its GPU
        return str(hidden.device), digest([hidden])


trainer, engines = Trainer.remote(), [Engine.remote(), Engine.remote()]
refs, sent = ray.get(trainer.forward.remote())
got = ray.get([e.receive.remote(refs) for e in engines])
print(f"cuda tensors: trainer sent {sent}, engines got {got}")
report = sync(trainer, engines, version=1)
got = ray.get([a.__ray_call__.remote(lambda self: digest(self.model.parameters()))
               for a in [trainer, *engines]])
print(f"weight sync: {report.nbytes:,} bytes to each engine; weights {got}")
