"""Weight sync in an RL-style loop: one trainer, two fp32 inference actors, one bf16 actor.

The trainer trains a small transformer with AdamW on seeded synthetic data. After every
step its weights sync to three inference actors with ray_rdt_pool.weights, and each
then runs a forward pass on a fixed input:

* the two fp32 actors must match the trainer's output bit for bit;
* the bf16 actor (weights converted on load) must match a bf16 copy of the trainer's
  model bit for bit, and the fp32 output within bf16 tolerances.

By default every sync streams. All actors share one Ray node, so the receivers copy each
bucket straight out of the trainer's tensors (source reads): the trainer packs nothing and
its pool is never created. With ``--packed`` the stream packs every bucket into a sender
pool smaller than the model instead (as across nodes for state that cannot be read by
reference), which shows bounded sender memory. ``--mode publish`` or ``both`` default to a
2 MiB pool, which holds the model, since publishing puts every bucket at once.
Prints a summary; exits 0 only if every check passed.

Run: python examples/weight_sync.py [--steps N] [--mode stream|publish|both] [--packed]
(pool sizes come from RAY_RDT_POOL_POOL_BYTES / RAY_RDT_POOL_ARENA_BYTES when set)
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import ray
import torch
from torch import nn

import ray_rdt_pool
from ray_rdt_pool.obs.stats import TransportStats
from ray_rdt_pool.weights import WeightReceiver, WeightSender, sync

D_MODEL, N_HEAD, N_LAYERS, VOCAB, SEQ, BATCH = 64, 4, 2, 512, 16, 8
BUCKET_BYTES = 128 << 10


def deterministic() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


class TinyLM(nn.Module):
    """Embedding, a 2-layer nn.TransformerEncoder and an output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.zeros(SEQ, D_MODEL))
        layer = nn.TransformerEncoderLayer(D_MODEL, N_HEAD, dim_feedforward=4 * D_MODEL,
                                           dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, N_LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.norm(self.encoder(x, mask=mask, is_causal=True)))


def fixed_input() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1234))


@ray.remote(enable_tensor_transport=True)
class Trainer:
    def __init__(self, source_reads: bool = True) -> None:
        ray_rdt_pool.register()
        deterministic()
        torch.manual_seed(0)
        self.model = TinyLM()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.data = torch.Generator().manual_seed(42)
        self.weight_sender = WeightSender(self.model, bucket_bytes=BUCKET_BYTES,
                                          source_reads=source_reads)

    def train_step(self) -> float:
        self.model.train()
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=self.data)
        logits = self.model(tokens)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                           tokens[:, 1:].reshape(-1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 output, and the output of a bf16 copy of the model."""
        self.model.eval()
        with torch.no_grad():
            out = self.model(fixed_input())
            out_bf16 = copy.deepcopy(self.model).to(torch.bfloat16)(fixed_input())
        return out, out_bf16

    def model_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    def stats(self) -> TransportStats:
        return ray_rdt_pool.stats()


@ray.remote(enable_tensor_transport=True)
class Inference:
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        ray_rdt_pool.register()
        deterministic()
        torch.manual_seed(7)  # different initial weights: only a sync makes them equal
        self.model = TinyLM().to(dtype).eval()
        self.weight_receiver = WeightReceiver(self.model)

    def generate(self) -> torch.Tensor:
        with torch.no_grad():
            return self.model(fixed_input())

    def stats(self) -> TransportStats:
        return ray_rdt_pool.stats()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--mode", choices=["stream", "publish", "both"], default="stream",
                        help="stream: bounded sender memory (default); publish: every bucket "
                             "at once (the pool must hold the model); both: alternate")
    parser.add_argument("--packed", action="store_true",
                        help="streams pack every bucket into the sender pool instead of "
                             "letting the receivers read the trainer's tensors in place")
    args = parser.parse_args()

    # The default sender pool (256 KiB) is smaller than the model (about 670 KB): a
    # packed streaming sync holds at most two 128 KiB buckets in it at a time (an
    # unpacked one puts nothing there). Publishing puts every bucket at once, so then the
    # default pool holds the model.
    default_pool = "256K" if args.mode == "stream" else "2M"
    env = {"RAY_RDT_POOL_POOL_BYTES": os.environ.get("RAY_RDT_POOL_POOL_BYTES", default_pool),
           "RAY_RDT_POOL_ARENA_BYTES": os.environ.get("RAY_RDT_POOL_ARENA_BYTES", "4M")}
    ray_rdt_pool.register()  # in the driver, before the actors exist
    # A new local cluster, or the one in RAY_ADDRESS.
    extra = {} if os.environ.get("RAY_ADDRESS") else {"include_dashboard": False}
    ray.init(runtime_env={"env_vars": env}, **extra)
    deterministic()
    trainer = Trainer.remote(source_reads=not args.packed)
    fp32 = [Inference.remote(), Inference.remote()]
    bf16 = Inference.remote(torch.bfloat16)
    receivers = [*fp32, bf16]
    model_bytes = ray.get(trainer.model_bytes.remote())

    failures: list[str] = []
    peak = 0
    in_place = streamed = 0
    for step in range(1, args.steps + 1):
        loss = ray.get(trainer.train_step.remote())
        mode = args.mode if args.mode != "both" else ("stream" if step % 2 else "publish")
        report = sync(trainer, receivers, mode=mode)
        if report.stream is not None:
            peak = max(peak, report.sender_pool_used)
            in_place += report.stream.source_read_buckets
            streamed += report.stream.buckets
        ref, ref_bf16 = ray.get(trainer.reference.remote())
        outs = ray.get([r.generate.remote() for r in receivers])
        exact = [torch.equal(o, ref) for o in outs[:2]]
        bf16_exact = torch.equal(outs[2], ref_bf16)
        bf16_close = torch.allclose(outs[2].float(), ref, rtol=5e-2, atol=5e-2)
        err = float((outs[2].float() - ref).abs().max())
        direct = [f"{ld.direct_buckets}/{ld.buckets}" for ld in report.loads]
        print(f"step {step}: loss {loss:.4f}  {mode:7s} {report.seconds * 1e3:7.1f} ms  "
              f"{report.buckets} buckets  direct {direct}  fp32 bit-exact {exact}  "
              f"bf16 bit-exact {bf16_exact}  bf16 max|err| {err:.3g}")
        if not all(exact):
            failures.append(f"step {step}: fp32 outputs differ from the trainer's")
        if not (bf16_exact and bf16_close):
            failures.append(f"step {step}: bf16 output off (exact={bf16_exact}, err={err:.3g})")
        if report.stream is not None and report.stream.fallbacks:
            failures.append(f"step {step}: {report.stream.fallbacks} buckets in overflow memory")

    # Every bucket ref is gone, so the sender's pool must drain to zero.
    deadline = time.monotonic() + 30
    st = ray.get(trainer.stats.remote())
    while st.pool_used and time.monotonic() < deadline:
        time.sleep(0.05)
        st = ray.get(trainer.stats.remote())
    if st.pool_used or st.live_objects:
        failures.append(f"sender pool not drained: {st.pool_used} bytes, {st.live_objects} objs")
    if st.fallbacks:
        failures.append(f"{st.fallbacks} buckets did not fit the pool (overflow memory)")
    if peak > st.pool_capacity:
        failures.append(f"peak pool use {peak} above capacity {st.pool_capacity}")
    if args.packed and in_place:
        failures.append(f"{in_place} stream buckets were read in place with --packed")
    print(f"model {model_bytes:,} bytes; sender pool {st.pool_capacity:,} bytes, streaming peak "
          f"{peak:,} bytes, fallbacks {st.fallbacks}, objects put {st.objects_put}, "
          f"stream buckets read in place {in_place}/{streamed}")
    for a in [trainer, *receivers]:
        ray.kill(a)
    ray.shutdown()
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("OK: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
