"""An engine that was killed rejoins from a running engine, while the trainer trains on.

Three engines follow a trainer. One is killed; a new one takes its place and catches up
from a running engine with catch_up(): the peer serves its weights at its version, the
trainer is not asked (it may be busy, or dead). Then the trainer's next sync reaches
all three again.
Run: python examples/rejoin.py   (joins RAY_ADDRESS's cluster, else starts one)
"""
import hashlib
import os

import ray
import torch

import ray_rdt_pool
from ray_rdt_pool.weights import WeightReceiver, WeightSender, catch_up, sync

ray_rdt_pool.register()  # in the driver, before the actor classes
ray.init(address=os.environ.get("RAY_ADDRESS", "local"),
         runtime_env={"worker_process_setup_hook": "ray_rdt_pool.setup_worker"})


def make_model():
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])


def digest(actor):  # run in an actor: equal digests, equal weights
    h = hashlib.sha256()
    for t in actor.model.state_dict().values():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@ray.remote(enable_tensor_transport=True)
class Trainer:
    def __init__(self):
        self.model = make_model()
        self.weight_sender = WeightSender(self.model)

    def train_step(self):
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)


@ray.remote(enable_tensor_transport=True)
class Engine:
    def __init__(self):
        self.model = make_model().eval()
        self.weight_receiver = WeightReceiver(self.model)

    def version(self):
        return self.weight_receiver.version


trainer, engines = Trainer.remote(), [Engine.remote() for _ in range(3)]
for step in range(1, 3):
    ray.get(trainer.train_step.remote())
    sync(trainer, engines, version=step)
ray.kill(engines[2])  # an engine fails
engines[2] = Engine.remote()  # its replacement starts with random weights, version 0
ray.get(trainer.train_step.remote())  # the trainer trains on meanwhile
report = catch_up(engines[0], [engines[2]])  # from a running engine, not the trainer
versions = ray.get([e.version.remote() for e in engines])
weights = ray.get([e.__ray_call__.remote(digest) for e in engines])
print(f"caught up: version {report.version}, {report.nbytes:,} bytes in "
      f"{report.seconds * 1e3:.0f} ms; versions {versions}, weights {weights}")
sync(trainer, engines, version=3)  # the trainer's next sync reaches all three
versions = ray.get([e.version.remote() for e in engines])
weights = ray.get([e.__ray_call__.remote(digest) for e in [trainer, *engines]])
print(f"after the next sync: versions {versions}, weights {weights}")
