"""An RL experience batch from a rollout actor to a trainer actor: per-sample tensors.

Every sample has its own length, so the batch is a list of per-sample dicts of tensors:
one object, kept in the rollout's pool until the trainer reads it in one go.
Run: python examples/rl_experience.py   (joins RAY_ADDRESS's cluster, else starts one)
"""
import hashlib
import os

import ray
import torch

import ray_rdt_pool

ray_rdt_pool.register()  # in the driver, before the classes that name "nixl_pool"
ray.init(address=os.environ.get("RAY_ADDRESS", "local"),
         runtime_env={"worker_process_setup_hook": "ray_rdt_pool.setup_worker"})


def digest(samples):  # equal digests: equal fields, dtypes, shapes and bytes
    h = hashlib.sha256()
    for sample in samples:
        for name, t in sample.items():
            h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@ray.remote(enable_tensor_transport=True)
class Rollout:
    @ray.method(tensor_transport="nixl_pool")  # the batch stays here until the trainer reads
    def generate(self, samples=64):
        batch = []
        for _ in range(samples):
            n = int(torch.randint(16, 256, ()))  # this response's length
            batch.append({"input_ids": torch.randint(0, 32_000, (n,)),
                          "attention_mask": torch.ones(n, dtype=torch.bool),
                          "log_probs": -torch.rand(n), "advantages": torch.randn(n),
                          "reward": torch.randn(())})
        self.sent = digest(batch)
        return batch


@ray.remote(enable_tensor_transport=True)
class Trainer:
    def train(self, batch):  # the ref, passed as the argument, arrives as the list
        loss = -sum((s["log_probs"] * s["advantages"])[s["attention_mask"]].mean()
                    for s in batch) / len(batch)  # a policy-gradient loss, per sample
        return len(batch), sum(len(s) for s in batch), float(loss), digest(batch)


rollout, trainer = Rollout.remote(), Trainer.remote()
for step in range(1, 4):
    samples, tensors, loss, got = ray.get(trainer.train.remote(rollout.generate.remote()))
    sent = ray.get(rollout.__ray_call__.remote(lambda self: self.sent))
    print(f"step {step}: {samples} samples, {tensors} tensors, loss {loss:.4f}; "
          f"rollout sent {sent}, trainer got {got}")
