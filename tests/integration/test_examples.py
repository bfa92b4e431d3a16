"""The example programs, run as a user runs them: ``python examples/NAME.py``.

Each example joins the cluster ``RAY_ADDRESS`` names, else starts a local one. The test
process's shared cluster serves the module (a cluster start costs more than most
examples): every example runs against it as a driver in a subprocess with
``RAY_ADDRESS`` set (``run_example`` checks that it joined). Its workers see
tests.support.raycluster.CLUSTER_ENV (64 MiB pools and arenas, no metrics): the raylet
passes the environment of the process that started it on, and a joining driver's
runtime_env does not reach other jobs' workers. ``put_get.py`` runs without
``RAY_ADDRESS`` instead, the path where an example starts its own cluster.

The examples check nothing themselves: each prints the facts (digests of the bytes
sent and received, versions, shapes, bytes read) and these tests check them.
"""

from __future__ import annotations

import hashlib
import re

import pytest
import torch

from tests.support.raycluster import run_example

pytestmark = pytest.mark.ray

HEX = r"[0-9a-f]{16}"


@pytest.fixture(scope="module")
def address(ray_cluster: str) -> str:
    """The GCS address of the shared cluster, for the examples."""
    return ray_cluster


def lines_matching(out: str, pattern: str) -> list[tuple[str, ...]]:
    """The groups of every whole line of ``out`` that matches ``pattern``."""
    return [m.groups() for m in re.finditer(f"^{pattern}$", out, re.M)]


def check_put_get(out: str) -> None:
    (put,) = lines_matching(out, f"ray.put: trainer put ({HEX}), learner got ({HEX})")
    (method,) = lines_matching(out, f"RDT method: trainer returned ({HEX}), learner got "
                                    rf"({HEX}) (\{{.*\}})")
    assert put[0] == put[1] and method[0] == method[1], out
    assert method[2] == "{'tokens': (8, 256), 'rewards': (8,)}", out
    assert lines_matching(out, "learner received 2 objects over nixl_pool") == [()], out


def test_put_get_starts_its_own_cluster_without_ray_address() -> None:
    """The one example run without RAY_ADDRESS, as a user first runs it (the others join
    the shared cluster: the same ``ray.init`` line, the other branch)."""
    check_put_get(run_example("put_get.py"))


def test_rl_experience(address: str) -> None:
    out = run_example("rl_experience.py", address=address)
    steps = lines_matching(out, rf"step (\d): (\d+) samples, (\d+) tensors, loss \S+; "
                                rf"rollout sent ({HEX}), trainer got ({HEX})")
    assert [s[:3] for s in steps] == [(str(i), "64", "320") for i in (1, 2, 3)], out
    assert all(sent == got for *_, sent, got in steps), out
    assert len({sent for *_, sent, _ in steps}) == 3, out  # a fresh batch every step


#: The Llama both transformers examples build (nothing downloaded).
LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def llama_state(seed: int) -> dict[str, torch.Tensor]:
    """The state of the examples' Llama as ``torch.manual_seed(seed)`` then building it
    makes it (the vLLM-style example's trainer does exactly that)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return {k: v.detach() for k, v in LlamaForCausalLM(LlamaConfig(**LLAMA)).state_dict().items()}


def hexes(text: str) -> list[str]:
    return re.findall(HEX, text)


def test_weight_sync_hf(address: str) -> None:
    pytest.importorskip("transformers")
    out = run_example("weight_sync_hf.py", address=address)
    (before,) = lines_matching(out, r"before: weights (\[.*\])")
    trainer0, *engines0 = hexes(before[0])
    assert len(engines0) == 2 and trainer0 not in engines0, out  # only a sync makes them equal
    steps = lines_matching(out, r"step (\d): loss \S+, ([\d,]+) bytes to each engine, "
                                r"weights (\[.*\]), engine versions \[(\d+), (\d+)\]")
    assert [(s[0], s[3], s[4]) for s in steps] == [(str(i),) * 3 for i in (1, 2, 3)], out
    nbytes = sum(t.numel() * t.element_size() for t in llama_state(0).values())
    assert all(int(s[1].replace(",", "")) == nbytes for s in steps), out
    weights = [hexes(s[2]) for s in steps]
    assert all(len(w) == 3 and len(set(w)) == 1 for w in weights), out  # engines == trainer
    assert len({trainer0, *(w[0] for w in weights)}) == 4, out  # every step trained


def test_rejoin_catches_a_new_engine_up_from_a_peer(address: str) -> None:
    out = run_example("rejoin.py", address=address)
    (caught,) = lines_matching(out, r"caught up: version (\d+), ([\d,]+) bytes in \d+ ms; "
                                    r"versions \[(\d+), (\d+), (\d+)\], weights (\[.*\])")
    # The replacement has the running engines' version 2 (not the trainer's step 3).
    assert caught[:1] + caught[2:5] == ("2", "2", "2", "2"), out
    assert int(caught[1].replace(",", "")) == 8 * (256 * 256 + 256) * 4, out
    assert len(set(hexes(caught[5]))) == 1, out  # its weights are the peer's
    (after,) = lines_matching(out, r"after the next sync: versions \[(\d+), (\d+), "
                                   r"(\d+)\], weights (\[.*\])")
    assert after[:3] == ("3", "3", "3") and len(set(hexes(after[3]))) == 1, out
    assert hexes(after[3])[0] != hexes(caught[5])[0], out  # the trainer had moved on


def tp_rank_expected(state: dict[str, torch.Tensor], rank: int, tp: int = 2) -> tuple[int, str]:
    """What TP rank ``rank`` of a vLLM-style engine holds, built here from the trainer's
    full state: the bytes of its parts and the digest the example prints of its fused
    parameters (row-parallel o_proj and down_proj split on dim 1, norms whole, every
    other tensor split on dim 0; q, k, v and gate, up concatenated in that order)."""
    parts = {}
    for name, t in state.items():
        kind = name.split(".")[-2]
        parts[name] = (t if kind.endswith("norm")
                       else t.chunk(tp, 1 if kind in ("o_proj", "down_proj") else 0)[rank])
    nbytes = sum(p.numel() * p.element_size() for p in parts.values())
    fused = {}
    for name, p in parts.items():
        if ".q_proj." in name:
            k, v = (parts[name.replace("q_proj", x)] for x in ("k_proj", "v_proj"))
            fused[name.replace("q_proj", "qkv_proj")] = torch.cat([p, k, v])
        elif ".gate_proj." in name:
            up = parts[name.replace("gate_proj", "up_proj")]
            fused[name.replace("gate_proj", "gate_up_proj")] = torch.cat([p, up])
        elif not re.search(r"\.(k_proj|v_proj|up_proj)\.", name):
            fused[name] = p
    h = hashlib.sha256()
    for name, p in sorted(fused.items()):
        h.update(name.encode() + p.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return nbytes, h.hexdigest()[:16]


def test_vllm_style_engine_each_rank_loads_its_slice(address: str) -> None:
    pytest.importorskip("transformers")
    out = run_example("vllm_style_engine.py", address=address)
    ranks = lines_matching(out, rf"rank (\d): read ([\d,]+) of ([\d,]+) bytes; (\d+) params, "
                                rf"digest ({HEX})")
    state = llama_state(0)
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert [r[0] for r in ranks] == ["0", "1"], out
    for rank, read, of, params, digest in ranks:
        nbytes, want = tp_rank_expected(state, int(rank))
        assert int(of.replace(",", "")) == total, out
        # Only its part of each tensor, plus the replicated norms: about half the model.
        assert int(read.replace(",", "")) == nbytes < 0.55 * total, out
        assert (params, digest) == ("15", want), out


@pytest.mark.gpu
def test_gpu_setup(address: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("examples/gpu_setup.py needs a CUDA device (none here)")
    out = run_example("gpu_setup.py", address=address)
    (cuda,) = lines_matching(out, rf"cuda tensors: trainer sent ({HEX}), engines got (\[.*\])")
    got = re.findall(rf"\('(\S+)', '({HEX})'\)", cuda[1])
    assert len(got) == 2 and all(d.startswith("cuda") and h == cuda[0] for d, h in got), out
    (sync,) = lines_matching(out, r"weight sync: ([\d,]+) bytes to each engine; weights (\[.*\])")
    weights = hexes(sync[1])
    assert len(weights) == 3 and len(set(weights)) == 1, out
