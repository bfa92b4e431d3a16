"""Weight sync of a Hugging Face Llama from a trainer actor to two inference actors.

A ``LlamaForCausalLM`` built from a config (no download: random init, about 100M
parameters, or a tiny one with ``--small``) trains for a few steps with AdamW in one
trainer actor. After every step ``sync`` streams its fp32 weights to two inference
actors (fresh models with other random weights), and each inference actor's logits on a
fixed input must equal the trainer's bit for bit. After the last step the trainer sends
once more with ``wire_dtype=torch.bfloat16`` (half the bytes on the wire, converted in
the sender's pack copy; the fp32 receivers cast back on load): the logits must equal the
trainer's model with bf16-rounded weights bit for bit, and the fp32 logits within bf16
tolerance. Every actor runs with one torch thread and eager attention, in eval mode for
the logits.

    python examples/weight_sync_hf.py [--small] [--steps N] [--mode stream|publish]

Exits 0 only if every check passes. Needs ``transformers`` (in the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import ray
import torch

import ray_rdt_pool
from ray_rdt_pool.weights import WeightReceiver, WeightSender, sync

FULL = dict(vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=4)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
#: bf16 has an 8-bit significand: rounding the weights moves these logits by well under
#: this fraction of their largest magnitude.
BF16_REL_TOL = 2.0**-5


def build(shape: dict[str, int], seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, max_position_embeddings=256, tie_word_embeddings=False,
                      attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def fixed_input(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(1234))


@torch.no_grad()
def logits_of(model: Any) -> torch.Tensor:
    model.eval()
    return model(input_ids=fixed_input(model.config.vocab_size)).logits


@ray.remote(enable_tensor_transport=True)
class Trainer:
    def __init__(self, shape: dict[str, int], bucket_bytes: int) -> None:
        torch.set_num_threads(1)
        self.model = build(shape, seed=0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.data = torch.Generator().manual_seed(7)
        self.weight_sender = WeightSender(self.model, bucket_bytes=bucket_bytes)
        self.bf16_sender = WeightSender(self.model, bucket_bytes=bucket_bytes,
                                        wire_dtype=torch.bfloat16)

    def train_step(self) -> float:
        self.model.train()
        ids = torch.randint(0, self.model.config.vocab_size, (2, 32), generator=self.data)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss)

    def logits(self, bf16_weights: bool = False) -> torch.Tensor:
        if not bf16_weights:
            return logits_of(self.model)
        saved = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        try:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.copy_(p.to(torch.bfloat16))
            return logits_of(self.model)
        finally:
            self.model.load_state_dict(saved)

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def pool(self) -> tuple[int, int]:
        s = ray_rdt_pool.stats()
        return int(s.pool_used), int(s.fallbacks)


@ray.remote(enable_tensor_transport=True)
class Engine:
    def __init__(self, shape: dict[str, int], seed: int) -> None:
        torch.set_num_threads(1)
        self.model = build(shape, seed=seed)
        self.weight_receiver = WeightReceiver(self.model)

    def logits(self) -> torch.Tensor:
        return logits_of(self.model)

    def bytes_received(self) -> int:
        return int(ray_rdt_pool.stats().bytes_received)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny Llama (for the test)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mode", choices=("stream", "publish"), default="stream")
    args = ap.parse_args(argv)
    shape = SMALL if args.small else FULL
    bucket = (64 << 10) if args.small else (32 << 20)
    # Stream: the pool holds 2 buckets, or the largest tensor (the embedding) twice.
    # Publish: the pool holds the whole model.
    pool = "4M" if args.small else ("128M" if args.mode == "stream" else "512M")
    env = {"RAY_RDT_POOL_POOL_BYTES": pool,
           "RAY_RDT_POOL_ARENA_BYTES": "4M" if args.small else "64M",
           "RAY_RDT_POOL_METRICS": "0"}

    ray_rdt_pool.register()  # the driver, before the actors are created
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning",
             log_to_driver=False,
             runtime_env={"env_vars": env,
                          "worker_process_setup_hook": "ray_rdt_pool.setup_worker"})
    ok = True
    try:
        trainer = Trainer.remote(shape, bucket)
        engines = [Engine.remote(shape, seed=100 + i) for i in range(2)]
        nbytes = ray.get(trainer.nbytes.remote())
        params = nbytes // 4
        print(f"LlamaForCausalLM {params / 1e6:.1f}M params ({nbytes:,} bytes fp32), "
              f"{len(engines)} inference actors, {args.mode}, buckets of {bucket:,} bytes, "
              f"sender pool {pool}")
        wire: dict[str, int] = {}

        def run_sync(sender_attr: str, version: int) -> tuple[Any, list[int]]:
            before = ray.get([e.bytes_received.remote() for e in engines])
            rep = sync(trainer, engines, mode=args.mode, sender_attr=sender_attr,
                       version=version)
            after = ray.get([e.bytes_received.remote() for e in engines])
            return rep, [a - b for a, b in zip(after, before)]

        for step in range(1, args.steps + 1):
            loss = ray.get(trainer.train_step.remote())
            rep, got = run_sync("weight_sender", step)
            want = ray.get(trainer.logits.remote())
            exact = [bool(torch.equal(ray.get(e.logits.remote()), want)) for e in engines]
            ok &= all(exact)
            wire["fp32"] = got[0]
            print(f"step {step}: loss {loss:.4f}  fp32 sync {rep.seconds * 1e3:7.1f} ms  "
                  f"{rep.buckets} buckets  {got[0]:,} bytes/receiver  direct "
                  f"{[f'{r.direct_buckets}/{r.buckets}' for r in rep.loads]}  "
                  f"logits bit-exact {exact}")
        rep, got = run_sync("bf16_sender", args.steps + 1)
        wire["bf16"] = got[0]
        want32 = ray.get(trainer.logits.remote())
        want16 = ray.get(trainer.logits.remote(bf16_weights=True))
        outs = [ray.get(e.logits.remote()) for e in engines]
        exact = [bool(torch.equal(o, want16)) for o in outs]
        err = max(float((o - want32).abs().max()) for o in outs)
        rel = err / float(want32.abs().max())
        ok &= all(exact) and rel <= BF16_REL_TOL
        print(f"bf16 wire: sync {rep.seconds * 1e3:7.1f} ms  {got[0]:,} bytes/receiver "
              f"({got[0] / wire['fp32']:.3f} of fp32)  logits == bf16-rounded trainer "
              f"{exact}  max|err| vs fp32 {err:.4f} ({rel:.2e} of max|logit|, tolerance "
              f"{BF16_REL_TOL:.2e})")
        ok &= 0.45 < got[0] / wire["fp32"] < 0.55
        deadline = time.monotonic() + 30
        used, fallbacks = ray.get(trainer.pool.remote())
        while used and time.monotonic() < deadline:
            time.sleep(0.05)
            used, fallbacks = ray.get(trainer.pool.remote())
        ok &= used == 0 and fallbacks == 0
        print(f"sender pool drained to {used} bytes, fallbacks {fallbacks}")
    finally:
        ray.shutdown()
    print("OK: all checks passed" if ok else "FAILED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
