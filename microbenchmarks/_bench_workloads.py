"""Workloads of the side-by-side benchmark: tensor sets, in-place updates and checksums.

Pure torch and numpy (no Ray), so the actors, the driver and the tests share one
definition. A workload is described by a :class:`WorkloadSpec` (plain data that travels
to the actors); :func:`build_tensors` makes its tensors deterministically from a seed,
:func:`tensor_layout` gives their shapes and dtypes without allocating anything (the
receiver uses it to pre-allocate target buffers), :func:`refresh` changes every byte
in place between repetitions, and :func:`checksum` digests every byte of every tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Workload names, in the order the CLI lists them.
WORKLOADS: tuple[str, ...] = ("big", "many", "views", "transformer", "sync")

_MASK64 = (1 << 64) - 1
_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size knob of the workloads (one set for --quick, one for the full run)."""

    big_mib: int = 256
    many_count: int = 1000
    many_kib: int = 64
    views_rows: int = 10_000
    views_cols: int = 256
    tf_hidden: int = 1024
    tf_layers: int = 16
    tf_vocab: int = 32_000
    sync_iters: int = 10


FULL_SIZES = Sizes()
QUICK_SIZES = Sizes(
    big_mib=64,
    many_count=200,
    views_rows=2_000,
    tf_hidden=384,
    tf_vocab=8_192,
    sync_iters=4,
)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """One workload: what to send and how many times.

    ``iterations`` is 0 for repetition-based workloads; for ``sync`` it is the number of
    in-place update + re-send steps (the first one is the cold step).
    """

    name: str
    sizes: Sizes
    iterations: int = 0

    @property
    def is_sync(self) -> bool:
        return self.name == "sync"


def make_spec(name: str, sizes: Sizes) -> WorkloadSpec:
    """Return the spec of workload ``name`` at ``sizes``."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WorkloadSpec(name, sizes, sizes.sync_iters if name == "sync" else 0)


def _transformer_layout(s: Sizes) -> list[tuple[str, tuple[int, ...], str]]:
    """Names, shapes and dtypes of a decoder-only transformer's weights.

    Per layer: q, k, v, o, mlp-up and mlp-down matrices in bf16; two RMS-norm weights,
    a fused qkv bias, an o bias, an up bias and a down bias in fp32 (12 tensors). Plus
    a bf16 embedding, a final fp32 norm and a bf16 lm-head. At the full sizes that is
    195 tensors and about 510 MiB.
    """
    d, f, v = s.tf_hidden, 4 * s.tf_hidden, s.tf_vocab
    out: list[tuple[str, tuple[int, ...], str]] = [("embed", (v, d), "bfloat16")]
    for i in range(s.tf_layers):
        p = f"layer{i}."
        out += [
            (p + "attn_norm", (d,), "float32"),
            (p + "q", (d, d), "bfloat16"),
            (p + "k", (d, d), "bfloat16"),
            (p + "v", (d, d), "bfloat16"),
            (p + "qkv_bias", (3 * d,), "float32"),
            (p + "o", (d, d), "bfloat16"),
            (p + "o_bias", (d,), "float32"),
            (p + "mlp_norm", (d,), "float32"),
            (p + "up", (f, d), "bfloat16"),
            (p + "up_bias", (f,), "float32"),
            (p + "down", (d, f), "bfloat16"),
            (p + "down_bias", (d,), "float32"),
        ]
    out += [("final_norm", (d,), "float32"), ("lm_head", (v, d), "bfloat16")]
    return out


def tensor_layout(spec: WorkloadSpec) -> list[tuple[tuple[int, ...], str]]:
    """Shapes and dtype names of the tensors the workload sends, in send order."""
    s = spec.sizes
    if spec.name == "big":
        return [((s.big_mib * _MIB // 4,), "float32")]
    if spec.name == "many":
        return [((s.many_kib * 1024 // 4,), "float32")] * s.many_count
    if spec.name == "views":
        return [((s.views_cols,), "float32")] * s.views_rows
    return [(shape, dt) for _, shape, dt in _transformer_layout(s)]


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "uint8": 1}


def payload_bytes(spec: WorkloadSpec) -> int:
    """Bytes of tensor data in one transfer of the workload."""
    total = 0
    for shape, dt in tensor_layout(spec):
        n = 1
        for dim in shape:
            n *= dim
        total += n * _ITEMSIZE[dt]
    return total


def describe(spec: WorkloadSpec) -> str:
    """One-line human description, e.g. ``1 x 256 MiB float32``."""
    s = spec.sizes
    mib = payload_bytes(spec) / _MIB
    if spec.name == "big":
        return f"1 x {s.big_mib} MiB float32 tensor"
    if spec.name == "many":
        return f"{s.many_count:,} x {s.many_kib} KiB float32 tensors ({mib:.1f} MiB)"
    if spec.name == "views":
        return (f"{s.views_rows:,} row views of one {s.views_rows:,} x {s.views_cols} "
                f"float32 weight ({mib:.1f} MiB)")
    n = len(tensor_layout(spec))
    text = (f"{n} transformer tensors, bf16 matrices + fp32 norms/biases "
            f"(hidden {s.tf_hidden}, {s.tf_layers} layers, vocab {s.tf_vocab:,}; {mib:.1f} MiB)")
    if spec.is_sync:
        text = f"{spec.iterations} update+send steps of {text}"
    return text


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


_BLOCK = 1 << 22  # bytes of random data that fill every tensor (rotated per tensor)


def _fill_random(tensors: Sequence[Any], gen: Any) -> None:
    """Fill tensors with random bytes: one 4 MiB random block, rotated per tensor.

    Generating hundreds of MiB with ``randn`` costs seconds per variant; copying a
    random block runs at memcpy speed and still makes every tensor and every 4 MiB
    stretch distinct enough for the checksums. Values are arbitrary bit patterns (bf16
    NaNs included); nothing computes on them.
    """
    import torch

    block = torch.randint(0, 256, (2 * _BLOCK,), dtype=torch.uint8, generator=gen)
    for i, t in enumerate(tensors):
        raw = t.view(-1).view(torch.uint8)
        n = raw.numel()
        rot = (i * 7919) % _BLOCK
        for off in range(0, n, _BLOCK):
            k = min(_BLOCK, n - off)
            raw[off:off + k].copy_(block[rot:rot + k])
            rot = (rot + 4099) % _BLOCK


def build_tensors(spec: WorkloadSpec, seed: int = 0) -> tuple[list[Any], list[Any]]:
    """Make the workload's tensors.

    Returns ``(tensors, bases)``: ``tensors`` is the list that gets sent, ``bases`` the
    tensors whose in-place update changes every byte that is sent (for ``views`` the one
    weight whose rows are sent; otherwise the tensors themselves).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    if spec.name == "views":
        s = spec.sizes
        weight = torch.empty(s.views_rows, s.views_cols)
        _fill_random([weight], gen)
        return [weight[i] for i in range(s.views_rows)], [weight]
    tensors = [torch.empty(shape, dtype=_torch_dtype(dt)) for shape, dt in tensor_layout(spec)]
    _fill_random(tensors, gen)
    return tensors, tensors


def allocate_like_layout(spec: WorkloadSpec) -> list[Any]:
    """Pre-allocate (and pre-fault) receive buffers matching the workload's layout."""
    import torch

    out = []
    for shape, dt in tensor_layout(spec):
        t = torch.empty(shape, dtype=_torch_dtype(dt))
        t.zero_()  # touch every page now, not during the timed transfer
        out.append(t)
    return out


def refresh(bases: Sequence[Any], step: int) -> None:
    """Change every sent word in place: add ``1 + step % 7`` to its raw integer bits.

    A float ``add_`` would be a no-op for large bf16 values and is slow for bf16 on CPU;
    nudging the bits (a few ulps) changes every 16/32-bit word of every tensor, so a
    receiver that kept stale bytes from an earlier repetition fails its checksum.
    """
    import torch

    for b in bases:
        words = b.view(torch.int32) if b.element_size() % 4 == 0 else b.view(torch.int16)
        words.add_(1 + step % 7)


def _word_view(t: Any) -> np.ndarray:
    """The raw bytes of a contiguous tensor as the widest integer words that tile them."""
    if not t.is_contiguous():
        t = t.contiguous()
    raw = t.detach().reshape(-1).view(_torch_dtype("uint8")).numpy()
    n = raw.nbytes
    if n % 4 == 0:
        return raw.view(np.int32)
    if n % 2 == 0:
        return raw.view(np.int16)
    return raw.view(np.int8)


def _digests(words: np.ndarray) -> np.ndarray:
    """Per-row digests of a 2-D word array (see :func:`tensor_digest`), as uint64."""
    whole = np.add.reduce(words, axis=1, dtype=np.int64).astype(np.uint64)
    strided = np.add.reduce(words[:, 1::7], axis=1, dtype=np.int64).astype(np.uint64)
    return whole + np.uint64(3) * strided + np.uint64(17 * words.shape[1])


def tensor_digest(t: Any) -> int:
    """Digest of every byte of one tensor: word sum plus a weighted strided word sum.

    The strided term makes the digest sensitive to most reorderings inside a tensor.
    bf16 (and any dtype) is read as raw integer words, so NaN payloads compare exactly.
    """
    if t.numel() == 0:
        return 0
    w = _word_view(t)
    return int(_digests(w.reshape(1, -1))[0])


#: Runs of at least this many same-shape, same-dtype tensors are digested stacked.
_STACK_RUN = 8


def checksum(tensors: Sequence[Any]) -> int:
    """Order-sensitive digest of a list of tensors (covers every byte of every tensor).

    ``sum((i + 1) * tensor_digest(t_i)) mod 2**64``. Runs of same-shape tensors (many
    small tensors, row views) are stacked into one array first so that 10,000 tensors
    cost one pass instead of 10,000 small numpy calls; the result is identical.
    """
    import torch

    n = len(tensors)
    total = np.uint64(n)
    with np.errstate(over="ignore"):
        i = 0
        while i < n:
            t = tensors[i]
            j = i + 1
            while (j < n and j - i < 4096 and tensors[j].dtype == t.dtype
                   and tensors[j].shape == t.shape):
                j += 1
            if j - i >= _STACK_RUN and t.numel() > 0:
                stacked = torch.stack([x.reshape(-1) for x in tensors[i:j]])
                digests = _digests(_word_view(stacked).reshape(j - i, -1))
            else:
                j = i + 1
                digests = np.array([tensor_digest(t)], dtype=np.uint64)
            weights = np.arange(i + 1, j + 1, dtype=np.uint64)
            total = total + np.add.reduce(weights * digests, dtype=np.uint64)
            i = j
    return int(total)
