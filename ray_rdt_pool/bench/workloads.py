"""Workloads of the side-by-side benchmark: tensor sets, in-place updates and checksums.

Pure torch and numpy (no Ray), so the actors, the driver and the tests share one
definition. A workload is described by a :class:`WorkloadSpec` (plain data that travels
to the actors); :func:`build_tensors` makes its tensors deterministically from a seed,
:func:`tensor_layout` gives their shapes and dtypes without allocating anything (the
receiver uses it to pre-allocate target buffers), :func:`refresh` changes every byte
in place between repetitions, and :func:`checksum` digests every byte of every tensor.

Workload families:

* one-shot tensor lists: ``big``, ``many``, ``views``, ``transformer``;
* weight sync, repeated update + send steps of the transformer set: ``sync`` (one
  ``ray.put`` of the whole set per step) and ``sync_stream`` (the same set streamed in
  buckets, :func:`stream_buckets`, with at most two buckets in flight);
* an RL experience batch (:data:`EXPERIENCE_FIELDS`): ``experience`` sends one tensor
  per field, ``experience_samples`` one tensor per (sample, field), sample-major.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Workload names, in the order the CLI lists them.
WORKLOADS: tuple[str, ...] = ("big", "many", "views", "transformer", "sync", "sync_stream",
                               "experience", "experience_samples")
#: Workloads made of repeated update + send steps on the same actors (cold + warm steps).
SYNC_WORKLOADS: tuple[str, ...] = ("sync", "sync_stream")
#: The RL experience batch in its two layouts.
EXPERIENCE_WORKLOADS: tuple[str, ...] = ("experience", "experience_samples")
#: Fields of one RL experience sample: name, dtype, and whether it has a token axis
#: (``[tokens]`` per sample) or is a scalar per sample (``rewards``).
EXPERIENCE_FIELDS: tuple[tuple[str, str, bool], ...] = (
    ("input_ids", "int64", True),
    ("attention_mask", "int64", True),
    ("old_log_probs", "float32", True),
    ("advantages", "float32", True),
    ("rewards", "float32", False),
)
#: Most packed bytes per bucket for ``sync_stream`` at the full size: the weights API's
#: default (``ray_rdt_pool.weights.DEFAULT_BUCKET_BYTES``, not imported: the Ray variants
#: must run without our package).
STREAM_BUCKET_KIB_DEFAULT = 32 * 1024
#: Max buckets in flight for ``sync_stream``: the pack (put) of bucket k+1 overlaps the
#: transfer of bucket k.
STREAM_MAX_INFLIGHT = 2
#: Packed-layout alignment of a bucket's end, as in ``ray_rdt_pool.core.layout.BLOCK_ALIGN``
#: (64 bytes). :func:`stream_buckets` needs it to cut the same buckets as the weights API
#: (a test compares both).
_BLOCK_ALIGN = 64

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
    stream_bucket_kib: int = STREAM_BUCKET_KIB_DEFAULT
    exp_samples: int = 1024
    exp_tokens: int = 1024


FULL_SIZES = Sizes()
QUICK_SIZES = Sizes(
    big_mib=64,
    many_count=200,
    views_rows=2_000,
    tf_hidden=384,
    tf_vocab=8_192,
    sync_iters=4,
    # 66 MiB in 8 MiB buckets: about 9 buckets, enough for the pipeline to matter.
    stream_bucket_kib=8 * 1024,
    # 256 samples (6 MiB, 1,280 tensors per sample-major batch) keep the quick run short;
    # the full run sends the specified 1,024 x 1,024-token batch (24 MiB, 5,120 tensors).
    exp_samples=256,
)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """One workload: what to send and how many times.

    ``iterations`` is 0 for repetition-based workloads; for ``sync`` and ``sync_stream``
    it is the number of in-place update + re-send steps (the first one is the cold step).
    """

    name: str
    sizes: Sizes
    iterations: int = 0

    @property
    def is_sync(self) -> bool:
        return self.name in SYNC_WORKLOADS

    @property
    def is_stream(self) -> bool:
        """Sent bucket by bucket (``sync_stream``) rather than as one object."""
        return self.name == "sync_stream"

    @property
    def is_experience(self) -> bool:
        return self.name in EXPERIENCE_WORKLOADS

    @property
    def bucket_bytes(self) -> int:
        """Most packed bytes per bucket of a streamed workload."""
        return self.sizes.stream_bucket_kib * 1024


def make_spec(name: str, sizes: Sizes) -> WorkloadSpec:
    """Return the spec of workload ``name`` at ``sizes``."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WorkloadSpec(name, sizes, sizes.sync_iters if name in SYNC_WORKLOADS else 0)


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


def _experience_layout(s: Sizes, per_sample: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """Names, shapes and dtypes of an RL experience batch of ``exp_samples`` samples.

    Batched: one tensor per field, ``[N, tokens]`` (``rewards``: ``[N]``). Per sample:
    one tensor per (sample, field) in sample-major order, ``[tokens]`` (``rewards``: a
    0-d tensor), so consecutive tensors alternate in shape and dtype.
    """
    n, tok = s.exp_samples, s.exp_tokens
    if not per_sample:
        return [(name, (n, tok) if seq else (n,), dt) for name, dt, seq in EXPERIENCE_FIELDS]
    return [(f"{i}.{name}", (tok,) if seq else (), dt)
            for i in range(n) for name, dt, seq in EXPERIENCE_FIELDS]


def named_layout(spec: WorkloadSpec) -> list[tuple[str, tuple[int, ...], str]]:
    """Names, shapes and dtype names of the tensors the workload sends, in send order.

    Names matter for ``sync_stream`` (the weights API sends a named state) and for the
    experience batches (their fields); the other workloads get ``t<i>``.
    """
    s = spec.sizes
    if spec.name == "big":
        plain = [((s.big_mib * _MIB // 4,), "float32")]
    elif spec.name == "many":
        plain = [((s.many_kib * 1024 // 4,), "float32")] * s.many_count
    elif spec.name == "views":
        plain = [((s.views_cols,), "float32")] * s.views_rows
    elif spec.is_experience:
        return _experience_layout(s, spec.name == "experience_samples")
    else:
        return _transformer_layout(s)
    return [(f"t{i}", shape, dt) for i, (shape, dt) in enumerate(plain)]


def tensor_layout(spec: WorkloadSpec) -> list[tuple[tuple[int, ...], str]]:
    """Shapes and dtype names of the tensors the workload sends, in send order."""
    return [(shape, dt) for _, shape, dt in named_layout(spec)]


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a


def stream_buckets(spec: WorkloadSpec) -> list[list[int]]:
    """Tensor indices of each bucket of a streamed workload, in order.

    The weights API's rule (``ray_rdt_pool.weights.plan_layout``), reimplemented here
    so that Ray's variants stream the very same buckets without importing our package:
    tensors are packed in order, each at its dtype's alignment; a tensor that would take
    the bucket's 64-byte-aligned end past ``bucket_bytes`` starts a new bucket; a tensor
    larger than ``bucket_bytes`` gets a bucket of its own.
    """
    buckets: list[list[int]] = []
    cur: list[int] = []
    end = 0
    for i, (shape, dt) in enumerate(tensor_layout(spec)):
        size = _ITEMSIZE[dt]
        n = _numel(shape) * size
        if cur and _align_up(_align_up(end, size) + n, _BLOCK_ALIGN) > spec.bucket_bytes:
            buckets.append(cur)
            cur, end = [], 0
        cur.append(i)
        end = _align_up(end, size) + n
    if cur:
        buckets.append(cur)
    return buckets


def stream_bucket_bytes(spec: WorkloadSpec) -> list[int]:
    """Payload bytes of each bucket of :func:`stream_buckets` (tensor bytes, no padding)."""
    layout = tensor_layout(spec)
    return [sum(_numel(layout[i][0]) * _ITEMSIZE[layout[i][1]] for i in idx)
            for idx in stream_buckets(spec)]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "uint8": 1}


def payload_bytes(spec: WorkloadSpec) -> int:
    """Bytes of tensor data in one transfer of the workload."""
    return sum(_numel(shape) * _ITEMSIZE[dt] for shape, dt in tensor_layout(spec))


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
    if spec.is_experience:
        per_sample = spec.name == "experience_samples"
        n = len(tensor_layout(spec))
        how = (f"{n:,} tensors, one per (sample, field), sample-major" if per_sample
               else f"{n} tensors, one per field")
        return (f"RL batch of {s.exp_samples:,} samples x {s.exp_tokens:,} tokens: input_ids, "
                f"attention_mask int64, old_log_probs, advantages float32, rewards float32 "
                f"({mib:.1f} MiB; {how})")
    n = len(tensor_layout(spec))
    text = (f"{n} transformer tensors, bf16 matrices + fp32 norms/biases "
            f"(hidden {s.tf_hidden}, {s.tf_layers} layers, vocab {s.tf_vocab:,}; {mib:.1f} MiB)")
    if spec.is_stream:
        n_b = len(stream_buckets(spec))
        kib = spec.sizes.stream_bucket_kib
        size = f"{kib / 1024:g} MiB" if kib >= 1024 else f"{kib} KiB"
        text = (f"{spec.iterations} update+stream steps of {text} in {n_b} buckets of at most "
                f"{size}, {STREAM_MAX_INFLIGHT} in flight")
    elif spec.is_sync:
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


def per_tensor_floor(tensors: Sequence[Any], reps: int = 7) -> dict[str, Any]:
    """The least per-tensor work any transport must do for these tensors, in this process.

    * ``read_s``: a sender must learn each tensor's dtype, shape and address before it
      can place the bytes: three torch attribute reads per tensor from Python, or, where
      the compiled helper is built for this torch (:mod:`ray_rdt_pool.memory.native`), one pass
      of that helper, which reads them in C++ (whichever is faster; ``read_kind`` says
      which);
    * ``view_s``: a receiver must hand back one torch tensor per sent tensor: here one
      view each, made in C++ by ``unbind`` of one block per group of equal (shape,
      dtype) tensors, the cheapest way torch offers to make many tensors.

    Neither copies a byte, so the two add to what the same bytes cost in one tensor per
    field: a per-sample layout can never cost less than its batched form plus these.
    Medians of ``reps`` runs, in seconds.
    """
    import statistics
    import time

    import torch

    dtype, shape = operator.attrgetter("dtype"), operator.attrgetter("shape")
    groups: dict[tuple[tuple[int, ...], Any], int] = {}
    for t in tensors:
        key = (tuple(t.shape), t.dtype)
        groups[key] = groups.get(key, 0) + 1
    blocks = [torch.empty((n, *sh), dtype=dt) for (sh, dt), n in groups.items()]
    from ray_rdt_pool.memory.describe import describe, native_active

    native = native_active()
    reads: list[float] = []
    native_reads: list[float] = []
    views: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        list(map(dtype, tensors))
        list(map(shape, tensors))
        list(map(torch.Tensor.data_ptr, tensors))
        t1 = time.perf_counter()
        made = [b.unbind(0) for b in blocks]
        t2 = time.perf_counter()
        if native:
            describe(tensors)
            native_reads.append(time.perf_counter() - t2)
        reads.append(t1 - t0)
        views.append(t2 - t1)
        del made
    read_s, kind = statistics.median(reads), "python"
    if native_reads and statistics.median(native_reads) < read_s:
        read_s, kind = statistics.median(native_reads), "native"
    return {"tensors": len(tensors), "groups": len(groups), "reps": reps,
            "read_s": read_s, "read_kind": kind, "view_s": statistics.median(views)}


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


def _words(raw: np.ndarray) -> np.ndarray:
    """Raw bytes (uint8, last axis = one tensor's bytes) as the widest integer words that
    tile one tensor's bytes (the width depends on the tensor, not on how many are stacked)."""
    n = raw.shape[-1]
    if n % 4 == 0:
        return raw.view(np.int32)
    if n % 2 == 0:
        return raw.view(np.int16)
    return raw.view(np.int8)


def _word_view(t: Any) -> np.ndarray:
    """The raw bytes of a contiguous tensor as the widest integer words that tile them."""
    if not t.is_contiguous():
        t = t.contiguous()
    return _words(t.detach().reshape(-1).view(_torch_dtype("uint8")).numpy())


def _digests(words: np.ndarray) -> np.ndarray:
    """Per-row digests of a 2-D word array (see :func:`tensor_digest`), as uint64."""
    whole = np.add.reduce(words, axis=1, dtype=np.int64).astype(np.uint64)
    strided = np.add.reduce(words[:, 1::7], axis=1, dtype=np.int64).astype(np.uint64)
    return whole + np.uint64(3) * strided + np.uint64(17 * words.shape[1])


def _meta_digest(shape: Sequence[int], dtype: Any) -> int:
    """A fixed 64-bit digest of a tensor's shape and dtype.

    The sender and the receiver digest in different processes, and ``hash()`` of a str
    is salted per process, so a fixed hash of their text is used instead.
    """
    key = repr((tuple(int(d) for d in shape), str(dtype))).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def tensor_digest(t: Any) -> int:
    """Digest of one tensor: every byte (word sum plus a weighted strided word sum), its
    shape and its dtype.

    The strided term makes the digest sensitive to most reorderings inside a tensor.
    bf16 (and any dtype) is read as raw integer words, so NaN payloads compare exactly.
    The bytes alone would pass a receiver that rebuilt the right bytes with the wrong
    shape or dtype (a transposed header, a float read as int), so both are folded in.
    """
    meta = _meta_digest(t.shape, t.dtype)
    if t.numel() == 0:
        return meta
    w = _word_view(t)
    return (int(_digests(w.reshape(1, -1))[0]) + meta) % (1 << 64)


#: Groups of at least this many same-shape, same-dtype tensors are digested stacked.
_STACK_RUN = 8
#: Most tensors stacked into one array (bounds the temporary copy).
_STACK_MAX = 4096


def checksum(tensors: Sequence[Any]) -> int:
    """Order-sensitive digest of a list of tensors (covers every byte, the shape and the
    dtype of every tensor).

    ``sum((i + 1) * tensor_digest(t_i)) mod 2**64``. Tensors of the same shape and dtype
    (many small tensors, row views, the per-sample experience fields, wherever they sit
    in the list) are stacked into one array first, so that 10,000 tensors cost a few
    passes instead of 10,000 small numpy calls; the result is identical.
    """
    import torch

    total = np.uint64(len(tensors))
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((tuple(t.shape), t.dtype), []).append(i)
    with np.errstate(over="ignore"):
        for (shape, dtype), idx in groups.items():
            meta = np.uint64(_meta_digest(shape, dtype))
            for c in range(0, len(idx), _STACK_MAX):
                chunk = idx[c:c + _STACK_MAX]
                # Empty tensors have no bytes to stack: their digest is the shape's alone.
                if len(chunk) >= _STACK_RUN and _numel(shape) > 0:
                    stacked = torch.stack([tensors[i].detach().reshape(-1) for i in chunk])
                    raw = stacked.view(torch.uint8).numpy().reshape(len(chunk), -1)
                    digests = _digests(_words(raw)) + meta
                else:
                    digests = np.array([tensor_digest(tensors[i]) for i in chunk],
                                       dtype=np.uint64)
                weights = np.asarray(chunk, dtype=np.uint64) + np.uint64(1)
                total = total + np.add.reduce(weights * digests, dtype=np.uint64)
    return int(total)
