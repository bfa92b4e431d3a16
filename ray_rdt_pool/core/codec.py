"""The versioned object metadata sent from sender to receiver, and its msgpack codec.

Pure (stdlib and msgpack; never pickle, so a peer's bytes cannot run code here). A
:class:`WireMeta` says who holds an object's bytes (NIXL agent name and registration
epoch), on which device, its tensors as :class:`~ray_rdt_pool.core.runs.Runs`, and the
*segments* mapping the object's packed space (see :mod:`ray_rdt_pool.core.layout`) onto
the sender's registered memory. Tensor offsets are not sent: both sides derive them from
the groups with :func:`~ray_rdt_pool.core.layout.group_layout`.

Encoding (version 2), a msgpack array of :data:`_NFIELDS` items::

    [version, agent, agent_version, device, device_id, total, groups, segments]

``groups`` is one flat int array holding, per group, ``repeat, nruns`` and then its
``nruns`` runs, each ``ndim, dim_0 .. dim_{ndim-1}, dtype_code, count``: the runs are
sent once and stand for ``repeat`` back-to-back repetitions. ``segments`` is one flat
int array of ``virt_off, addr, length`` triples. msgpack stores each int in 1 to 9
bytes by magnitude, so the size is about ``40 + len(agent) + sum over groups of (2 +
sum over their runs of (3 + the dims' int sizes)) + at most 27 per segment`` bytes: a
repeated pattern (an RL batch sent per sample, the row views of one weight, a state dict
repeating one layer) encodes in under 200 bytes, and 10,000 different 2-D shapes with
dims below 65,536 in at most 9 bytes per run (the tests hold both bounds).

:func:`decode` trusts nothing: every field is type- and range-checked, counts are
bounded (:data:`MAX_TENSORS`) before anything is expanded, the packed total is
recomputed from the groups, and the segments must cover every byte of every non-empty
tensor, so a receiver never reads outside what the sender described. Its work is linear
in the size of the message, never in the number of tensors it stands for.

Lifetime: a ``WireMeta`` is immutable (it caches its grouping once); any thread may
encode, decode or share one.
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from ray_rdt_pool.core.layout import Placed, group_layout
from ray_rdt_pool.core.runs import (
    DTYPE_BY_CODE,
    DTYPES,
    MAX_DIMS,
    RunGroup,
    Runs,
    TensorRun,
    group_runs,
)
from ray_rdt_pool.errors import WireFormatError

__all__ = [
    "MAX_TENSORS",
    "WIRE_VERSION",
    "WireMeta",
    "decode",
    "encode",
]

#: Format version; bump it on any change to the encoding. decode() rejects others.
#: 2: runs travel in repeated groups (version 1 sent every run).
WIRE_VERSION = 2

#: Most tensors one object may hold, 2**20. It bounds the work a malformed or
#: hostile message can cause on the receiver (offsets are expanded per tensor) while
#: staying far above real objects (a model's state dict has thousands). decode()
#: checks it before expanding anything, and a group's repeat is bounded by it too.
MAX_TENSORS = 1_048_576

#: Longest string accepted (the agent name and the device).
MAX_STR_LEN = 4096

_DEVICES = ("cpu", "cuda")
_NFIELDS = 8
_U64 = 1 << 64
_I64 = 1 << 63

_T = TypeVar("_T")


@dataclass(frozen=True)
class WireMeta:
    """What a receiver needs to read one object from the sender's memory.

    Attributes:
        agent: The sender's NIXL agent name.
        agent_version: The sender's registration epoch (>= 0); a receiver holding
            older remote metadata for ``agent`` must refresh it.
        device: "cpu" or "cuda".
        device_id: Device index on the sender.
        total: Packed size of the object, the total of the layout.
        runs: The tensors in order, as runs of equal shape and dtype: a :class:`Runs`
            (what :func:`runs_from` and :func:`decode` return) or any sequence of
            :class:`TensorRun`, grouped on first use.
        segments: ``(virt_off, remote_addr, length)`` triples sorted by
            ``virt_off``, non-overlapping: the bytes of packed range
            ``[virt_off, virt_off + length)`` live at ``remote_addr`` in the
            sender's registered memory.
    """

    agent: str
    agent_version: int
    device: str
    device_id: int
    total: int
    runs: Sequence[TensorRun]
    segments: tuple[tuple[int, int, int], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.runs, (Runs, tuple)):
            object.__setattr__(self, "runs", tuple(self.runs))

    @property
    def grouped(self) -> Runs:
        """The runs as a :class:`Runs` (grouped with :func:`group_runs` once if needed)."""
        runs = self.runs
        if isinstance(runs, Runs):
            return runs
        cached: Runs | None = self.__dict__.get("_grouped")
        if cached is None:
            cached = group_runs(runs)
            object.__setattr__(self, "_grouped", cached)  # a cache, not a field
        return cached

    @property
    def groups(self) -> tuple[RunGroup, ...]:
        """The runs gathered into repeated groups, as the wire carries them."""
        return self.grouped.groups

    @property
    def num_tensors(self) -> int:
        """Number of tensors in the object."""
        return self.grouped.num_tensors

    def run_starts(self) -> list[int]:
        """Packed offset of the first tensor of each run (of ``runs``, expanded)."""
        return self.grouped.run_starts()

    def tensor_offsets(self) -> list[int]:
        """Packed offset of every tensor, in order."""
        return self.grouped.tensor_offsets()

    def shapes_dtypes(self) -> Iterator[tuple[tuple[int, ...], str]]:
        """``(shape, dtype)`` of every tensor, in order."""
        return iter(self.grouped.shapes_dtypes())

    def map_tensors(self, f: Callable[[TensorRun], _T]) -> list[_T]:
        """``f(run)`` for every tensor, in order, computed once per distinct run."""
        return self.grouped.map_tensors(f)


# ---------------------------------------------------------------------------------------
# The codec
# ---------------------------------------------------------------------------------------


def encode(meta: WireMeta) -> bytes:
    """Serialise ``meta`` (msgpack, no pickle), its runs gathered into repeated groups.

    The result is checked exactly as :func:`decode` would check it, so a sender
    bug surfaces on the sender. Cost: linear in the groups' runs (the message size).

    Raises:
        WireFormatError: if ``meta`` is not valid (decode would reject it).
    """
    try:
        flat: list[int] = []
        for g in meta.grouped.groups:
            flat += (g.repeat, len(g.runs))
            for run in g.runs:
                flat.append(len(run.shape))
                flat.extend(run.shape)
                flat += (DTYPES[run.dtype][0], run.count)
        segs_flat: list[int] = []
        for seg in meta.segments:
            virt_off, addr, length = seg
            segs_flat += (virt_off, addr, length)
        raw = [
            WIRE_VERSION,
            meta.agent,
            meta.agent_version,
            meta.device,
            meta.device_id,
            meta.total,
            flat,
            segs_flat,
        ]
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise WireFormatError(f"cannot encode object metadata: {e!r}") from e
    _parse(raw)
    packed: bytes = msgpack.packb(raw, use_bin_type=True)
    return packed


def decode(data: bytes) -> WireMeta:
    """Parse and validate metadata produced by :func:`encode` on the sender.

    The last :data:`DECODED_KEPT` results are kept by their bytes (a WireMeta is
    immutable): a weight sync decodes each bucket's wire twice (its check, then its
    fetch), and the same model's by-reference buckets carry the same wire every sync.

    Raises:
        WireFormatError: for anything but a valid message of this WIRE_VERSION.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError(
            f"object metadata must be bytes, got {type(data).__name__}"
        )
    if isinstance(data, bytes) and len(data) <= 4096:
        return _decode_kept(data)
    return _decode(data)


#: Decoded metadata kept by :func:`decode`.
DECODED_KEPT = 256


@functools.lru_cache(maxsize=DECODED_KEPT)
def _decode_kept(data: bytes) -> WireMeta:
    return _decode(data)


def _decode(data: bytes | bytearray | memoryview) -> WireMeta:
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            # Each array item takes at least one byte, so this never rejects a
            # valid message; no map, bin or ext appears in the format at all.
            max_array_len=len(data),
            max_str_len=MAX_STR_LEN,
            max_bin_len=0,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as e:
        # unpackb raises several unrelated types (ExtraData, FormatError,
        # StackError, UnicodeDecodeError, ValueError on truncation or limits);
        # any of them means the bytes are not a message.
        raise WireFormatError(
            f"object metadata is not valid msgpack ({type(e).__name__}: {e}); "
            f"it was truncated or corrupted, or a string or array exceeds the limits"
        ) from e
    return _parse(raw)


def _bad(what: str) -> WireFormatError:
    return WireFormatError(f"malformed object metadata: {what}")


def _int_in(value: Any, field: str, lo: int, hi: int) -> int:
    """``value`` if it is an int (not a bool) in ``[lo, hi)``."""
    if type(value) is not int:
        raise _bad(f"{field} must be an int, got {type(value).__name__}")
    if not lo <= value < hi:
        raise _bad(f"{field} is {value}, outside [{lo:,}, {hi:,})")
    return value


def _parse(raw: Any) -> WireMeta:
    """Build a WireMeta from the unpacked message, checking every field."""
    if type(raw) is not list or not raw:
        raise _bad(f"expected a non-empty array, got {type(raw).__name__}")
    version = raw[0]
    if type(version) is not int:
        raise _bad(f"the version must be an int, got {type(version).__name__}")
    if version != WIRE_VERSION:
        # Checked before the field count: another version may have other fields.
        raise WireFormatError(
            f"object metadata has wire format version {version}, but this ray_rdt_pool "
            f"reads version {WIRE_VERSION}; install the same ray_rdt_pool version on "
            f"the sender and the receiver"
        )
    if len(raw) != _NFIELDS:
        raise _bad(f"expected {_NFIELDS} fields, got {len(raw)}")
    _, agent, agent_version, device, device_id, total, groups_flat, segs_flat = raw
    if type(agent) is not str or not agent:
        raise _bad(f"agent must be a non-empty str, got {agent!r:.80}")
    try:  # decode's limit is in UTF-8 bytes; a lone surrogate has no UTF-8 at all
        agent_bytes = len(agent.encode())
    except UnicodeEncodeError as e:
        raise _bad(f"agent {agent!r:.80} is not valid Unicode ({e.reason})") from e
    if agent_bytes > MAX_STR_LEN:
        raise _bad(f"agent is {agent_bytes:,} bytes long, over the limit of {MAX_STR_LEN:,}")
    _int_in(agent_version, "agent_version", 0, _U64)
    if type(device) is not str or device not in _DEVICES:
        raise _bad(f"device must be one of {_DEVICES}, got {device!r:.80}")
    _int_in(device_id, "device_id", 0, 1 << 31)
    _int_in(total, "total", 0, _U64)
    if type(groups_flat) is not list:
        raise _bad(f"runs must be an array, got {type(groups_flat).__name__}")
    if type(segs_flat) is not list:
        raise _bad(f"segments must be an array, got {type(segs_flat).__name__}")

    groups = _parse_groups(groups_flat)
    try:
        placed, layout_total = group_layout([(g.specs(), g.repeat) for g in groups])
    except ValueError as e:
        raise _bad(str(e)) from None
    if layout_total != total:
        raise _bad(f"total is {total:,} but the runs pack into {layout_total:,} bytes")
    segments = _parse_segments(segs_flat, total)
    _check_coverage(groups, placed, segments)
    return WireMeta(
        agent=agent,
        agent_version=agent_version,
        device=device,
        device_id=device_id,
        total=total,
        runs=Runs(groups, placed=(placed, layout_total)),
        segments=tuple(segments),
    )


def _parse_groups(flat: list[Any]) -> list[RunGroup]:
    groups: list[RunGroup] = []
    n = len(flat)
    i = 0
    r = 0  # runs parsed so far, for messages
    tensors = 0
    while i < n:
        g = len(groups)
        if i + 2 > n:
            raise _bad(f"group {g}: the runs array ends inside the group header")
        repeat, nruns = flat[i], flat[i + 1]
        if type(repeat) is not int or not 1 <= repeat <= MAX_TENSORS:
            raise _bad(f"group {g}: repeat must be an int in [1, {MAX_TENSORS:,}], "
                       f"got {repeat!r:.40}")
        # Each run takes at least 3 ints (ndim, dtype code, count).
        if type(nruns) is not int or not 1 <= nruns <= (n - i - 2) // 3:
            raise _bad(f"group {g}: the number of runs must be an int in [1, "
                       f"{(n - i - 2) // 3}] (what the array holds), got {nruns!r:.40}")
        i += 2
        runs: list[TensorRun] = []
        per_repeat = 0
        for _ in range(nruns):
            ndim = flat[i] if i < n else None
            if type(ndim) is not int or not 0 <= ndim <= MAX_DIMS:
                raise _bad(f"run {r}: the number of dims must be an int in [0, {MAX_DIMS}], "
                           f"got {ndim!r:.40}")
            j = i + 1 + ndim
            if j + 2 > n:
                raise _bad(f"run {r}: the runs array ends inside the run")
            dims = flat[i + 1 : j]
            for d in dims:
                if type(d) is not int or not 0 <= d < _I64:
                    raise _bad(f"run {r}: a dim must be an int in [0, 2**63), got {d!r:.40}")
            code = flat[j]
            if type(code) is not int or code not in DTYPE_BY_CODE:
                raise _bad(f"run {r}: unknown dtype code {code!r:.40}")
            # Zero dims make the byte count 0, so the layout checks pass any other dims;
            # a shape whose nonzero dims reach 2**63 bytes is refused here, before torch
            # meets it at the receiver with an untyped error. torch itself builds some of
            # them ((0, 2**62) float32: its limits count elements), so such a put is
            # refused too, typed; no real tensor has such a shape.
            span = DTYPES[DTYPE_BY_CODE[code]][1]
            for d in dims:
                span *= d or 1
            if span >= _I64:
                raise _bad(f"run {r}: the dims {tuple(dims)!r:.80} span {span:,} bytes or "
                           "more once their zeros are left out; torch holds at most "
                           "2**63 - 1")
            count = flat[j + 1]
            if type(count) is not int or count < 1:
                raise _bad(f"run {r}: count must be an int >= 1, got {count!r:.40}")
            per_repeat += count
            # Checked per run, before anything is expanded: a tiny message cannot
            # stand for more tensors than a real object may hold.
            if tensors + per_repeat * repeat > MAX_TENSORS:
                raise _bad(f"more than {MAX_TENSORS:,} tensors in one object")
            runs.append(TensorRun(tuple(dims), DTYPE_BY_CODE[code], count))
            i = j + 2
            r += 1
        tensors += per_repeat * repeat
        groups.append(RunGroup(tuple(runs), repeat))
    return groups


def _parse_segments(flat: list[Any], total: int) -> list[tuple[int, int, int]]:
    if len(flat) % 3:
        raise _bad(f"the segments array holds {len(flat)} ints, not a multiple of 3")
    segments: list[tuple[int, int, int]] = []
    prev_end = 0
    for k in range(0, len(flat), 3):
        v, a, n = flat[k], flat[k + 1], flat[k + 2]
        s = k // 3
        if type(v) is not int or type(a) is not int or type(n) is not int:
            raise _bad(f"segment {s}: fields must be ints")
        if n <= 0:
            raise _bad(f"segment {s}: length must be positive, got {n}")
        if v < prev_end:
            raise _bad(f"segment {s}: starts at {v:,}, before the end {prev_end:,} of the "
                       f"previous one (segments must be sorted and disjoint)")
        if v + n > total:
            raise _bad(f"segment {s}: [{v:,}, {v + n:,}) reaches past the total {total:,}")
        if a < 0 or a + n > _U64:
            raise _bad(f"segment {s}: address range [{a:#x}, +{n:,}) is outside 64 bits")
        segments.append((v, a, n))
        prev_end = v + n
    return segments


def _check_coverage(
    groups: list[RunGroup],
    placed: list[Placed],
    segments: list[tuple[int, int, int]],
) -> None:
    """Every byte of every non-empty tensor must lie in some segment.

    Works on the *gaps* (packed ranges no segment covers) instead of on the tensors: a
    gap is checked against the uniform pieces of the groups it meets, and inside a
    piece it can only meet the repetition it starts in and the next one (a gap as long
    as the stride would meet every run), so the cost is O((segments + groups) * log
    runs), never O(tensors).
    """
    gaps: list[tuple[int, int]] = []
    pos = 0
    for v, _a, n in segments:
        if v > pos:
            gaps.append((pos, v))
        pos = v + n
    gaps.append((pos, _U64 * 2))  # past the last segment
    gi = 0
    first_run = 0
    first_tensor = 0
    for g, where in zip(groups, placed):
        nruns = len(g.runs)
        done = 0  # repetitions of g before the current piece
        for starts, stride, reps in where.pieces(g.repeat):
            # The non-empty runs of one repetition, relative to its start.
            base = starts[0]
            rel_lo: list[int] = []
            rel_hi: list[int] = []
            which: list[int] = []
            for j, (run, s) in enumerate(zip(g.runs, starts)):
                length = run.nbytes_each * run.count
                if length:
                    rel_lo.append(s - base)
                    rel_hi.append(s - base + length)
                    which.append(j)
            if rel_lo:
                lo = base + rel_lo[0]
                hi = base + (reps - 1) * stride + rel_hi[-1]
                while gaps[gi][1] <= lo:
                    gi += 1
                k = gi
                while k < len(gaps) and gaps[k][0] < hi:
                    a, b = max(gaps[k][0], lo), min(gaps[k][1], hi)
                    if reps > 1:
                        b = min(b, a + stride)  # a whole stride meets every run anyway
                    hit = _gap_hits(a, b, base, stride, reps, rel_lo, rel_hi)
                    if hit is not None:
                        rep, idx = hit
                        j = which[idx]
                        run = g.runs[j]
                        rep += done
                        t0 = (first_tensor + rep * g.tensors_per_repeat
                              + sum(x.count for x in g.runs[:j]))
                        s0 = base + (rep - done) * stride + rel_lo[idx]
                        r = first_run + rep * nruns + j
                        raise _bad(
                            f"run {r} (tensors {t0}..{t0 + run.count - 1}) occupies bytes "
                            f"[{s0:,}, {s0 + rel_hi[idx] - rel_lo[idx]:,}) which the segments "
                            f"do not fully cover"
                        )
                    k += 1
            done += reps
        first_run += nruns * g.repeat
        first_tensor += g.num_tensors


def _gap_hits(a: int, b: int, base: int, stride: int, reps: int,
              rel_lo: list[int], rel_hi: list[int]) -> tuple[int, int] | None:
    """(repetition, index of the run) of the first non-empty run meeting ``[a, b)``, or
    None. The gap is no longer than the stride (or the piece has one repetition), so it
    meets repetitions ``rep`` and ``rep + 1`` at most."""
    if a >= b:
        return None
    rep = (a - base) // stride if stride else 0
    for r in (rep, rep + 1):
        if r >= reps:
            break
        x, y = a - base - r * stride, b - base - r * stride
        idx = bisect_right(rel_hi, x)  # the first run ending after x
        if idx < len(rel_lo) and rel_lo[idx] < y:
            return r, idx
        if not stride:
            break
    return None
