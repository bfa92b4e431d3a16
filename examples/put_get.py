"""Tensors between two Ray actors over nixl_pool: a ray.put, and an RDT method's return.

Run: python examples/put_get.py   (joins the cluster RAY_ADDRESS names, else starts one)
"""
import hashlib
import os

import ray
import torch

import ray_rdt_pool

ray_rdt_pool.register()  # in the driver, before the classes that name "nixl_pool"
ray.init(address=os.environ.get("RAY_ADDRESS", "local"),
         runtime_env={"worker_process_setup_hook": "ray_rdt_pool.setup_worker"})


def digest(tensors):  # equal digests: equal dtypes, shapes and bytes
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@ray.remote(enable_tensor_transport=True)
class Trainer:
    def publish(self):
        weights = [torch.randn(1024, 1024), torch.randn(1024)]
        ref = ray.put(weights, _tensor_transport="nixl_pool")  # copied now: a snapshot
        sent = digest(weights)
        weights[1].zero_()  # training goes on at once; no receiver sees this write
        return [ref], sent  # inside a list, Ray hands over the ref, not the tensors

    @ray.method(tensor_transport="nixl_pool")
    def rollout(self):  # the tensors stay in this actor's pool until a receiver reads them
        batch = {"tokens": torch.randint(0, 32_000, (8, 256)), "rewards": torch.rand(8)}
        self.sent = digest(batch.values())
        return batch


@ray.remote(enable_tensor_transport=True)
class Learner:
    def load(self, refs):
        return digest(ray.get(refs[0]))  # a one-sided NIXL READ (a mapping on one node)

    def train(self, batch):  # a nixl_pool ref passed as an argument arrives as its tensors
        return digest(batch.values()), {k: tuple(t.shape) for k, t in batch.items()}


trainer, learner = Trainer.remote(), Learner.remote()
refs, sent = ray.get(trainer.publish.remote())
print(f"ray.put: trainer put {sent}, learner got {ray.get(learner.load.remote(refs))}")
got, shapes = ray.get(learner.train.remote(trainer.rollout.remote()))
sent = ray.get(trainer.__ray_call__.remote(lambda self: self.sent))
print(f"RDT method: trainer returned {sent}, learner got {got} {shapes}")
stats = ray.get(learner.__ray_call__.remote(lambda self: ray_rdt_pool.stats()))
print(f"learner received {stats.objects_received} objects over nixl_pool")
