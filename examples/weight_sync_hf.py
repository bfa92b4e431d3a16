"""Weight sync into Hugging Face models: one trainer actor, two inference engine actors.

A tiny Llama built from a config (nothing is downloaded) trains in the trainer; after
every optimizer step sync() streams its weights into each engine's model, in place.
Run: python examples/weight_sync_hf.py   (joins RAY_ADDRESS's cluster, else starts one)
Needs transformers: pip install 'ray-rdt-pool[examples]'.
"""
import hashlib
import os

import ray
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ray_rdt_pool
from ray_rdt_pool.weights import WeightReceiver, WeightSender, sync

ray_rdt_pool.register()  # in the driver, before the actor classes
ray.init(address=os.environ.get("RAY_ADDRESS", "local"),
         runtime_env={"worker_process_setup_hook": "ray_rdt_pool.setup_worker"})
CONFIG = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def weights_digest(actor):  # run in an actor: equal digests, equal names and bytes
    h = hashlib.sha256()
    for name, t in actor.model.state_dict().items():
        h.update(name.encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@ray.remote(enable_tensor_transport=True)
class Trainer:
    def __init__(self):
        self.model = LlamaForCausalLM(CONFIG)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.weight_sender = WeightSender(self.model)  # sync() finds it by this name

    def train_step(self):
        ids = torch.randint(0, CONFIG.vocab_size, (4, 32))
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


@ray.remote(enable_tensor_transport=True)
class Engine:
    def __init__(self):
        self.model = LlamaForCausalLM(CONFIG).eval()  # its own random weights until a sync
        self.weight_receiver = WeightReceiver(self.model)  # checks the layout, loads in place


def digests(actors):  # trainer first, then the engines
    return ray.get([a.__ray_call__.remote(weights_digest) for a in actors])


trainer, engines = Trainer.remote(), [Engine.remote(), Engine.remote()]
print(f"before: weights {digests([trainer, *engines])}")
for step in range(1, 4):
    loss = ray.get(trainer.train_step.remote())
    report = sync(trainer, engines, version=step)  # returns once every engine has it all
    versions = [ray.get(e.__ray_call__.remote(lambda self: self.weight_receiver.version))
                for e in engines]
    print(f"step {step}: loss {loss:.3f}, {report.nbytes:,} bytes to each engine, "
          f"weights {digests([trainer, *engines])}, engine versions {versions}")
