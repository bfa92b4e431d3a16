"""The versioned object metadata sent from sender to receiver, and its msgpack codec.

Pure (stdlib and msgpack; never pickle, so a peer's bytes cannot run code here). The
sender describes an object as a :class:`WireMeta`: who holds the bytes (NIXL agent
name and registration epoch), on which device, the tensors as runs of equal
``(shape, dtype)``, and the *segments* mapping the object's packed space (see
:mod:`ray_rdt_pool.layout`) onto the sender's registered memory. Tensor offsets are
not sent: both sides derive them from the runs with :func:`~ray_rdt_pool.layout.run_layout`.

Encoding, a msgpack array of :data:`_NFIELDS` items::

    [version, agent, agent_version, device, device_id, total, runs, segments]

``runs`` is one flat int array holding, per run, ``ndim, dim_0 .. dim_{ndim-1},
dtype_code, count``; ``segments`` is one flat int array of ``virt_off, addr,
length`` triples. msgpack stores each int in 1 to 9 bytes by magnitude, so the size
is about ``40 + len(agent) + sum over runs of (3 + the dims' int sizes) + at most
27 per segment`` bytes. Concretely: 10,000 equal row views of one weight are one run
and encode in well under 1 KB; 10,000 *different* 2-D shapes with dims below 65,536
take at most 9 bytes per run, under 100 KB in all (the tests hold both bounds).

:func:`decode` trusts nothing: every field is type- and range-checked, the packed
total is recomputed from the runs, and the segments must cover every byte of every
non-empty tensor, so a receiver never reads outside what the sender described.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import msgpack

from ray_rdt_pool.errors import InvalidInputError, WireFormatError
from ray_rdt_pool.layout import run_layout

__all__ = [
    "DTYPES",
    "DTYPE_BY_CODE",
    "MAX_DIMS",
    "MAX_TENSORS",
    "WIRE_VERSION",
    "TensorRun",
    "WireMeta",
    "decode",
    "encode",
    "runs_from",
]

#: Format version; bump it on any change to the encoding. decode() rejects others.
WIRE_VERSION = 1

#: Most dimensions a tensor may have (torch allows 64 at most too).
MAX_DIMS = 64

#: Most tensors one object may hold, 2**20. It bounds the work a malformed or
#: hostile message can cause on the receiver (offsets are expanded per tensor) while
#: staying far above real objects (a model's state dict has thousands).
MAX_TENSORS = 1_048_576

#: Longest string accepted (the agent name and the device).
MAX_STR_LEN = 4096

#: Canonical dtype name (torch's, without "torch.") -> (wire code, item size in bytes).
#: The codes are part of the wire format: never renumber or reuse one; append new
#: dtypes with fresh codes.
DTYPES: dict[str, tuple[int, int]] = {
    "bool": (1, 1),
    "uint8": (2, 1),
    "int8": (3, 1),
    "int16": (4, 2),
    "int32": (5, 4),
    "int64": (6, 8),
    "uint16": (7, 2),
    "uint32": (8, 4),
    "uint64": (9, 8),
    "float16": (10, 2),
    "bfloat16": (11, 2),
    "float32": (12, 4),
    "float64": (13, 8),
    "complex32": (14, 4),
    "complex64": (15, 8),
    "complex128": (16, 16),
    "float8_e4m3fn": (17, 1),
    "float8_e5m2": (18, 1),
    "float8_e4m3fnuz": (19, 1),
    "float8_e5m2fnuz": (20, 1),
    "float8_e8m0fnu": (21, 1),
    # Two 4-bit values packed per byte; torch counts one element per byte.
    "float4_e2m1fn_x2": (22, 1),
}

#: Wire code -> canonical dtype name.
DTYPE_BY_CODE: dict[int, str] = {code: name for name, (code, _) in DTYPES.items()}

_DEVICES = ("cpu", "cuda")
_NFIELDS = 8
_U64 = 1 << 64
_I64 = 1 << 63


@dataclass(frozen=True)
class TensorRun:
    """``count`` consecutive tensors of the same shape and dtype."""

    shape: tuple[int, ...]
    dtype: str
    count: int

    def __post_init__(self) -> None:
        # torch.Size and lists compare unequal to the tuples decode() returns;
        # normalising keeps a round trip equal.
        if type(self.shape) is not tuple:
            object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def itemsize(self) -> int:
        """Bytes per element (also the alignment of each tensor)."""
        return DTYPES[self.dtype][1]

    @property
    def numel(self) -> int:
        """Elements per tensor."""
        return math.prod(self.shape)

    @property
    def nbytes_each(self) -> int:
        """Bytes per tensor."""
        return math.prod(self.shape) * DTYPES[self.dtype][1]


@dataclass(frozen=True)
class WireMeta:
    """What a receiver needs to read one object from the sender's memory.

    Attributes:
        agent: The sender's NIXL agent name.
        agent_version: The sender's registration epoch (>= 0); a receiver holding
            older remote metadata for ``agent`` must refresh it.
        device: "cpu" or "cuda".
        device_id: Device index on the sender.
        total: Packed size of the object, the total of ``run_layout``.
        runs: The tensors in order, grouped into runs of equal shape and dtype.
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
    runs: tuple[TensorRun, ...]
    segments: tuple[tuple[int, int, int], ...]

    @property
    def num_tensors(self) -> int:
        """Number of tensors in the object."""
        return sum(r.count for r in self.runs)

    def _specs(self) -> list[tuple[int, int, int]]:
        return [(r.nbytes_each, r.itemsize, r.count) for r in self.runs]

    def run_starts(self) -> list[int]:
        """Packed offset of the first tensor of each run."""
        return run_layout(self._specs())[0]

    def tensor_offsets(self) -> list[int]:
        """Packed offset of every tensor, in order."""
        offsets: list[int] = []
        for run, start in zip(self.runs, self.run_starts()):
            n = run.nbytes_each
            if n:
                offsets.extend(range(start, start + n * run.count, n))
            else:
                offsets.extend(repeat(start, run.count))
        return offsets

    def shapes_dtypes(self) -> Iterator[tuple[tuple[int, ...], str]]:
        """``(shape, dtype)`` of every tensor, in order."""
        for run in self.runs:
            yield from repeat((run.shape, run.dtype), run.count)


def runs_from(shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> tuple[TensorRun, ...]:
    """Group consecutive equal ``(shape, dtype)`` pairs into runs (one pass).

    Raises:
        InvalidInputError: if the sequences differ in length, or for an unknown
            dtype name, a negative or non-int dim, or more than MAX_DIMS dims.
    """
    if len(shapes) != len(dtypes):
        raise InvalidInputError(f"{len(shapes)} shapes but {len(dtypes)} dtypes")
    runs: list[TensorRun] = []
    prev_shape: Sequence[int] = ()
    prev_dtype = ""
    count = 0
    for shape, dtype in zip(shapes, dtypes):
        if count and dtype == prev_dtype and shape == prev_shape:
            count += 1
            continue
        if count:
            runs.append(TensorRun(_checked_shape(prev_shape), prev_dtype, count))
        if dtype not in DTYPES:
            raise InvalidInputError(
                f"tensor {sum(r.count for r in runs)}: unsupported dtype {dtype!r}; "
                f"supported: {', '.join(DTYPES)}"
            )
        prev_shape, prev_dtype, count = shape, dtype, 1
    if count:
        runs.append(TensorRun(_checked_shape(prev_shape), prev_dtype, count))
    return tuple(runs)


def _checked_shape(shape: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(shape)
    # Fast path for the usual torch.Size of plain non-negative ints.
    for d in dims:
        if type(d) is not int or d < 0:
            break
    else:
        if len(dims) <= MAX_DIMS:
            return dims
    try:
        dims = tuple(map(operator.index, shape))
    except TypeError as e:
        raise InvalidInputError(f"shape {shape!r} has a non-integer dimension") from e
    if len(dims) > MAX_DIMS or any(d < 0 for d in dims):
        raise InvalidInputError(
            f"shape {shape!r} must have at most {MAX_DIMS} non-negative dimensions"
        )
    return dims


def encode(meta: WireMeta) -> bytes:
    """Serialise ``meta`` (msgpack, no pickle).

    The result is checked exactly as :func:`decode` would check it, so a sender
    bug surfaces on the sender.

    Raises:
        WireFormatError: if ``meta`` is not valid (decode would reject it).
    """
    try:
        runs_flat: list[int] = []
        for run in meta.runs:
            runs_flat.append(len(run.shape))
            runs_flat.extend(run.shape)
            runs_flat.append(DTYPES[run.dtype][0])
            runs_flat.append(run.count)
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
            runs_flat,
            segs_flat,
        ]
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise WireFormatError(f"cannot encode object metadata: {e!r}") from e
    _parse(raw)
    packed: bytes = msgpack.packb(raw, use_bin_type=True)
    return packed


def decode(data: bytes) -> WireMeta:
    """Parse and validate metadata produced by :func:`encode` on the sender.

    Raises:
        WireFormatError: for anything but a valid message of this WIRE_VERSION.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError(
            f"object metadata must be bytes, got {type(data).__name__}"
        )
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
    _, agent, agent_version, device, device_id, total, runs_flat, segs_flat = raw
    if type(agent) is not str or not agent:
        raise _bad(f"agent must be a non-empty str, got {agent!r:.80}")
    _int_in(agent_version, "agent_version", 0, _U64)
    if type(device) is not str or device not in _DEVICES:
        raise _bad(f"device must be one of {_DEVICES}, got {device!r:.80}")
    _int_in(device_id, "device_id", 0, 1 << 31)
    _int_in(total, "total", 0, _U64)
    if type(runs_flat) is not list:
        raise _bad(f"runs must be an array, got {type(runs_flat).__name__}")
    if type(segs_flat) is not list:
        raise _bad(f"segments must be an array, got {type(segs_flat).__name__}")

    runs, specs = _parse_runs(runs_flat)
    starts, layout_total = run_layout(specs)
    if layout_total != total:
        raise _bad(f"total is {total:,} but the runs pack into {layout_total:,} bytes")
    segments = _parse_segments(segs_flat, total)
    _check_coverage(specs, starts, segments)
    return WireMeta(
        agent=agent,
        agent_version=agent_version,
        device=device,
        device_id=device_id,
        total=total,
        runs=tuple(runs),
        segments=tuple(segments),
    )


def _parse_runs(flat: list[Any]) -> tuple[list[TensorRun], list[tuple[int, int, int]]]:
    runs: list[TensorRun] = []
    specs: list[tuple[int, int, int]] = []
    n = len(flat)
    i = 0
    tensors = 0
    while i < n:
        r = len(runs)
        ndim = flat[i]
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
        count = flat[j + 1]
        if type(count) is not int or count < 1:
            raise _bad(f"run {r}: count must be an int >= 1, got {count!r:.40}")
        tensors += count
        if tensors > MAX_TENSORS:
            raise _bad(f"more than {MAX_TENSORS:,} tensors in one object")
        dtype = DTYPE_BY_CODE[code]
        itemsize = DTYPES[dtype][1]
        shape = tuple(dims)
        runs.append(TensorRun(shape, dtype, count))
        specs.append((math.prod(shape) * itemsize, itemsize, count))
        i = j + 2
    return runs, specs


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
    specs: list[tuple[int, int, int]],
    starts: list[int],
    segments: list[tuple[int, int, int]],
) -> None:
    """Every byte of every non-empty tensor must lie in some segment."""
    # Runs occupy increasing ranges and the segments are sorted, so one forward walk
    # over the covered intervals (adjacent segments joined) suffices.
    covered: list[list[int]] = []
    for v, _, n in segments:
        if covered and covered[-1][1] == v:
            covered[-1][1] = v + n
        else:
            covered.append([v, v + n])
    k = 0
    first = 0
    for r, ((nbytes_each, _, count), start) in enumerate(zip(specs, starts)):
        end = start + nbytes_each * count
        if end > start:
            while k < len(covered) and covered[k][1] <= start:
                k += 1
            if k == len(covered) or covered[k][0] > start or covered[k][1] < end:
                raise _bad(
                    f"run {r} (tensors {first}..{first + count - 1}) occupies bytes "
                    f"[{start:,}, {end:,}) which the segments do not fully cover"
                )
        first += count
