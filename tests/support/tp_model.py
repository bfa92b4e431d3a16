"""The tensor-parallel engine model the TP weight-sync tests share: the trainer's state
under Hugging Face names, an engine that stores its parameters the way vLLM does (fused
``qkv_proj`` and ``gate_up_proj``, column- and row-parallel splits, replicated norms)
with per-parameter weight loaders, the ``select`` of a TP rank, and the reference slice
each rank must end up with. Ray workers get it by value (see the cluster tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Cfg:
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    inter: int = 512
    layers: int = 2
    vocab: int = 1024

    @property
    def q(self) -> int:
        return self.hidden

    @property
    def kv(self) -> int:
        return self.hidden // self.heads * self.kv_heads


CFG = Cfg()
TP = 2
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def trainer_state(cfg: Cfg, seed: int) -> dict[str, torch.Tensor]:
    """The trainer's state dict, with Llama's Hugging Face names, fp32."""
    g = torch.Generator().manual_seed(seed)
    h = cfg.hidden
    out = {"model.embed_tokens.weight": torch.randn(cfg.vocab, h, generator=g)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": torch.randn(h, generator=g),
            p + "self_attn.q_proj.weight": torch.randn(cfg.q, h, generator=g),
            p + "self_attn.k_proj.weight": torch.randn(cfg.kv, h, generator=g),
            p + "self_attn.v_proj.weight": torch.randn(cfg.kv, h, generator=g),
            p + "self_attn.o_proj.weight": torch.randn(h, cfg.q, generator=g),
            p + "post_attention_layernorm.weight": torch.randn(h, generator=g),
            p + "mlp.gate_proj.weight": torch.randn(cfg.inter, h, generator=g),
            p + "mlp.up_proj.weight": torch.randn(cfg.inter, h, generator=g),
            p + "mlp.down_proj.weight": torch.randn(h, cfg.inter, generator=g),
        }
    out["model.norm.weight"] = torch.randn(h, generator=g)
    out["lm_head.weight"] = torch.randn(cfg.vocab, h, generator=g)
    return out


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(shape), requires_grad=False)


class EngineModel(torch.nn.Module):
    """One TP rank of an inference engine's Llama, parameters stored as vLLM does.

    ``load_weights(pairs)`` takes the trainer's full tensors and narrows each to this
    rank; with ``presharded=True`` it takes tensors already cut to this rank (what a
    receiver with ``select=tp_select(...)`` passes) and only places them.
    """

    def __init__(self, cfg: Cfg, rank: int = 0, tp: int = 1) -> None:
        super().__init__()
        self.cfg, self.rank, self.tp = cfg, rank, tp
        h, q, kv, inter, v = cfg.hidden, cfg.q // tp, cfg.kv // tp, cfg.inter // tp, cfg.vocab
        self._loaders: dict[str, Callable[..., None]] = {}
        self.add("model.embed_tokens.weight", _param(v // tp, h), self._column)
        for i in range(cfg.layers):
            p = f"model.layers.{i}."
            self.add(p + "input_layernorm.weight", _param(h), self._replicated)
            self.add(p + "self_attn.qkv_proj.weight", _param(q + 2 * kv, h), self._qkv)
            self.add(p + "self_attn.o_proj.weight", _param(h, q), self._row)
            self.add(p + "post_attention_layernorm.weight", _param(h), self._replicated)
            self.add(p + "mlp.gate_up_proj.weight", _param(2 * inter, h), self._gate_up)
            self.add(p + "mlp.down_proj.weight", _param(h, inter), self._row)
        self.add("model.norm.weight", _param(h), self._replicated)
        self.add("lm_head.weight", _param(v // tp, h), self._column)

    def add(self, name: str, p: torch.nn.Parameter, loader: Callable[..., None]) -> None:
        self.register_parameter(name.replace(".", "__"), p)
        self._loaders[name] = loader

    def params(self) -> dict[str, torch.Tensor]:
        return {k.replace("__", "."): v for k, v in self.named_parameters()}

    # -- weight loaders (vLLM: each parameter's weight_loader) --

    def _shard(self, w: torch.Tensor, dim: int, presharded: bool) -> torch.Tensor:
        if presharded:
            return w
        n = w.shape[dim] // self.tp
        return w.narrow(dim, self.rank * n, n)

    def _replicated(self, p: torch.Tensor, w: torch.Tensor, shard: Any, pre: bool) -> None:
        p.copy_(w)

    def _column(self, p: torch.Tensor, w: torch.Tensor, shard: Any, pre: bool) -> None:
        p.copy_(self._shard(w, 0, pre))

    def _row(self, p: torch.Tensor, w: torch.Tensor, shard: Any, pre: bool) -> None:
        p.copy_(self._shard(w, 1, pre))

    def _qkv(self, p: torch.Tensor, w: torch.Tensor, shard: str, pre: bool) -> None:
        q, kv = self.cfg.q // self.tp, self.cfg.kv // self.tp
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
        p.narrow(0, offset, size).copy_(self._shard(w, 0, pre))

    def _gate_up(self, p: torch.Tensor, w: torch.Tensor, shard: int, pre: bool) -> None:
        size = self.cfg.inter // self.tp
        p.narrow(0, shard * size, size).copy_(self._shard(w, 0, pre))

    STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
               ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
               ("gate_up_proj", "up_proj", 1))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     presharded: bool = False) -> set[str]:
        params = self.params()
        loaded: set[str] = set()
        for name, w in weights:
            shard: Any = None
            for fused, part, shard_id in self.STACKED:
                if f".{part}." in name:
                    name, shard = name.replace(part, fused), shard_id
                    break
            if name not in params:
                raise KeyError(f"the engine has no parameter {name!r}")
            self._loaders[name](params[name], w, shard, presharded)
            loaded.add(name)
        return loaded


def tp_select(rank: int, tp: int) -> Callable[[str, tuple[int, ...]], Any]:
    """The part of each trainer tensor TP rank ``rank`` holds (None: replicated)."""

    def select(name: str, shape: tuple[int, ...]) -> Any:
        if any(f"{c}." in name for c in COLUMN):
            n = shape[0] // tp
            return (slice(rank * n, (rank + 1) * n),)
        if any(f"{r}." in name for r in ROW):
            n = shape[1] // tp
            return (slice(None), slice(rank * n, (rank + 1) * n))
        return None

    return select


def reference(state: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The same trainer state loaded in-process into the same engine class."""
    m = EngineModel(CFG, rank, tp)
    m.load_weights(state.items())
    return m.params()


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
