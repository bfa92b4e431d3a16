"""Weight sync into a vLLM-style engine with tensor parallelism 2: a Hugging Face Llama
in the trainer (q_proj, k_proj, ...), fused parameters in the engine (qkv_proj,
gate_up_proj), each TP rank reading only its part of each tensor (select) and fusing it
in load_weights. Run: python examples/vllm_style_engine.py (joins RAY_ADDRESS, if set)
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
TP, Q, KV, INTER = 2, 32, 16, 64  # rows per rank of q_proj, k_proj (and v_proj), gate_proj
# vLLM's stacked parameters: trainer name -> (fused name, first row of its part in it).
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", Q), "v_proj": ("qkv_proj", Q + KV),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", INTER)}
ROWS = {"qkv_proj": Q + 2 * KV, "gate_up_proj": 2 * INTER}  # of a fused parameter, per rank


@ray.remote(enable_tensor_transport=True)
class Trainer:
    def __init__(self):
        torch.manual_seed(0)  # the test rebuilds these weights to check each rank's part
        self.model = LlamaForCausalLM(CONFIG)
        self.weight_sender = WeightSender(self.model)  # sync() finds it by this name


@ray.remote(enable_tensor_transport=True)
class EngineRank:
    def __init__(self, rank):
        self.rank, self.params = rank, {}
        self.weight_receiver = WeightReceiver(load_weights=self.load_weights,
                                              select=self.select)

    def select(self, name, shape):  # the part of a trainer tensor this rank reads
        kind, r = name.split(".")[-2], self.rank
        if kind.endswith("norm"):
            return None  # replicated: the whole tensor
        if kind in ("o_proj", "down_proj"):  # row parallel: this rank's columns
            return (slice(None), slice(r * shape[1] // TP, (r + 1) * shape[1] // TP))
        return (slice(r * shape[0] // TP, (r + 1) * shape[0] // TP),)  # column parallel

    def load_weights(self, weights):  # vLLM's loader: an iterable of (name, tensor)
        for name, w in weights:  # w: this rank's part, a view valid during the call only
            kind = name.split(".")[-2]
            fused, row = STACKED.get(kind, (kind, 0))
            name = name.replace(kind, fused)
            if name not in self.params:  # an engine allocates these when it starts
                self.params[name] = torch.empty(ROWS.get(fused, len(w)), *w.shape[1:])
            self.params[name][row:row + len(w)] = w  # a copy: the engine keeps its memory

    def describe(self):  # the bytes this rank read, and a digest of what it holds
        h = hashlib.sha256()
        for name, t in sorted(self.params.items()):
            h.update(name.encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return ray_rdt_pool.stats().bytes_received, len(self.params), h.hexdigest()[:16]


trainer, ranks = Trainer.remote(), [EngineRank.remote(rank) for rank in range(TP)]
report = sync(trainer, ranks, version=1)
for rank, actor in enumerate(ranks):
    nbytes, params, digest = ray.get(actor.describe.remote())
    print(f"rank {rank}: read {nbytes:,} of {report.nbytes:,} bytes; {params} params, "
          f"digest {digest}")
