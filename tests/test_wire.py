"""The wire codec: round trips, size bounds, and rejection of every malformed input."""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_rdt_pool.errors import InvalidInputError, WireFormatError
from ray_rdt_pool.layout import packed_offsets, run_layout
from ray_rdt_pool.wire import (
    DTYPE_BY_CODE,
    DTYPES,
    MAX_DIMS,
    MAX_TENSORS,
    WIRE_VERSION,
    TensorRun,
    WireMeta,
    decode,
    encode,
    runs_from,
)

# Slow shared CI machines must not turn into deadline failures.
RELAXED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

SHAPES = st.lists(st.integers(0, 5), max_size=4).map(tuple)
RUNS = st.builds(TensorRun, SHAPES, st.sampled_from(sorted(DTYPES)), st.integers(1, 4))


def total_of(runs: tuple[TensorRun, ...] | list[TensorRun]) -> int:
    return run_layout([(r.nbytes_each, r.itemsize, r.count) for r in runs])[1]


@st.composite
def metas(draw: st.DrawFn, max_runs: int = 6) -> WireMeta:
    runs = tuple(draw(st.lists(RUNS, max_size=max_runs)))
    total = total_of(runs)
    # The packed space split into consecutive pieces at arbitrary addresses, as
    # a split pool allocation would produce.
    cuts = draw(st.lists(st.integers(1, max(1, total - 1)), max_size=4)) if total > 1 else []
    bounds = [0, *sorted(set(cuts)), total] if total else [0]
    segments = tuple(
        (s, draw(st.integers(0, 2**64 - (e - s))), e - s) for s, e in itertools.pairwise(bounds)
    )
    return WireMeta(
        agent=draw(st.text(min_size=1, max_size=20)),
        agent_version=draw(st.integers(0, 2**64 - 1)),
        device=draw(st.sampled_from(["cpu", "cuda"])),
        device_id=draw(st.integers(0, 16)),
        total=total,
        runs=runs,
        segments=segments,
    )


def simple_meta(runs: tuple[TensorRun, ...] | None = None) -> WireMeta:
    runs = runs if runs is not None else (TensorRun((2, 3), "float32", 2), TensorRun((), "int8", 1))
    total = total_of(runs)
    return WireMeta("agent-0", 7, "cuda", 1, total, runs, ((0, 0x7F0000000000, total),))


def raw_of(meta: WireMeta) -> list[Any]:
    return msgpack.unpackb(encode(meta))


def pack(raw: Any) -> bytes:
    return msgpack.packb(raw, use_bin_type=True)


def rejects(data: Any, match: str | None = None) -> str:
    with pytest.raises(WireFormatError, match=match) as info:
        decode(data)
    return str(info.value)


# -- round trips and the derived views --


@RELAXED
@given(metas())
def test_round_trip(meta: WireMeta) -> None:
    assert decode(encode(meta)) == meta
    assert decode(bytearray(encode(meta))) == meta


@RELAXED
@given(metas())
def test_derived_views_match_the_layout(meta: WireMeta) -> None:
    expanded = [(r.shape, r.dtype) for r in meta.runs for _ in range(r.count)]
    assert list(meta.shapes_dtypes()) == expanded
    assert meta.num_tensors == len(expanded)
    nbytes = [TensorRun(s, d, 1).nbytes_each for s, d in expanded]
    aligns = [DTYPES[d][1] for _, d in expanded]
    offsets, total = packed_offsets(nbytes, aligns)
    assert meta.tensor_offsets() == offsets
    assert total == meta.total
    starts = meta.run_starts()
    first = 0
    for run, start in zip(meta.runs, starts):
        assert offsets[first] == start
        first += run.count


@RELAXED
@given(st.lists(st.tuples(st.sampled_from([(1,), (2,), (2, 2)]),
                          st.sampled_from(["float32", "bfloat16"])), max_size=30))
def test_runs_from_groups_consecutive_equal_pairs(pairs: list[tuple[tuple[int, ...], str]]) -> None:
    runs = runs_from([s for s, _ in pairs], [d for _, d in pairs])
    assert [(r.shape, r.dtype) for r in runs for _ in range(r.count)] == pairs
    for x, y in itertools.pairwise(runs):
        assert (x.shape, x.dtype) != (y.shape, y.dtype)


def test_runs_from_accepts_lists_and_tuple_subclasses() -> None:
    class Size(tuple):  # stands in for torch.Size
        pass

    runs = runs_from([Size((2, 3)), Size((2, 3)), [4]], ["float16", "float16", "int64"])
    assert runs == (TensorRun((2, 3), "float16", 2), TensorRun((4,), "int64", 1))
    assert all(type(r.shape) is tuple for r in runs)
    assert runs_from([], []) == ()


def test_runs_from_errors() -> None:
    with pytest.raises(InvalidInputError, match="2 shapes but 1 dtypes"):
        runs_from([(1,), (1,)], ["float32"])
    with pytest.raises(InvalidInputError, match="tensor 1: unsupported dtype 'float128'"):
        runs_from([(1,), (1,)], ["float32", "float128"])
    with pytest.raises(InvalidInputError, match="non-negative"):
        runs_from([(1, -2)], ["float32"])
    with pytest.raises(InvalidInputError, match="non-integer"):
        runs_from([(1.5,)], ["float32"])
    with pytest.raises(InvalidInputError, match="at most 64"):
        runs_from([(1,) * 65], ["float32"])


def test_tensor_run_properties() -> None:
    run = TensorRun((3, 4), "complex128", 5)
    assert (run.itemsize, run.numel, run.nbytes_each) == (16, 12, 192)
    assert TensorRun((), "bool", 1).nbytes_each == 1
    assert TensorRun((0, 9), "float32", 1).nbytes_each == 0


def test_dtype_codes_are_pinned() -> None:
    # The codes are wire format: changing any of these breaks mixed-version peers.
    assert {name: code for name, (code, _) in DTYPES.items()} == {
        "bool": 1, "uint8": 2, "int8": 3, "int16": 4, "int32": 5, "int64": 6,
        "uint16": 7, "uint32": 8, "uint64": 9, "float16": 10, "bfloat16": 11,
        "float32": 12, "float64": 13, "complex32": 14, "complex64": 15,
        "complex128": 16, "float8_e4m3fn": 17, "float8_e5m2": 18,
        "float8_e4m3fnuz": 19, "float8_e5m2fnuz": 20, "float8_e8m0fnu": 21,
        "float4_e2m1fn_x2": 22,
    }
    assert {name: size for name, (_, size) in DTYPES.items() if size != 1} == {
        "int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4, "uint64": 8,
        "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4,
        "complex64": 8, "complex128": 16,
    }
    assert {DTYPE_BY_CODE[code]: code for code, _ in DTYPES.values()} == {
        n: c for n, (c, _) in DTYPES.items()}


# -- size bounds --


def _meta_for(shapes: list[tuple[int, ...]], dtype: str) -> WireMeta:
    runs = runs_from(shapes, [dtype] * len(shapes))
    total = total_of(runs)
    return WireMeta("nixl-agent-0123456789abcdef", 3, "cuda", 0, total, runs,
                    ((0, 0x7F12_3456_0000, total),))


def test_ten_thousand_row_views_encode_small() -> None:
    meta = _meta_for([(4096,)] * 10_000, "bfloat16")
    data = encode(meta)
    assert len(meta.runs) == 1
    assert len(data) <= 40_000
    assert len(data) < 1_000  # one run: the size does not grow with the count
    assert decode(data) == meta
    assert len(decode(data).tensor_offsets()) == 10_000


def test_ten_thousand_different_shapes_stay_within_the_documented_bound() -> None:
    # Documented in ray_rdt_pool.wire: at most 9 bytes per 2-D run with dims
    # below 65,536, plus a small fixed part.
    meta = _meta_for([(i + 1, 4096) for i in range(10_000)], "float16")
    assert len(meta.runs) == 10_000
    start = time.perf_counter()
    data = encode(meta)
    assert decode(data) == meta
    elapsed = time.perf_counter() - start
    assert len(data) <= 10_000 * 9 + 200
    assert elapsed < 5.0


# -- corruption --


@settings(RELAXED, max_examples=300)
@given(metas(), st.data())
def test_byte_flips_are_rejected_or_decode_to_a_consistent_meta(
    meta: WireMeta, data: st.DataObject
) -> None:
    buf = bytearray(encode(meta))
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] ^= data.draw(st.integers(1, 255))
    try:
        other = decode(bytes(buf))
    except WireFormatError:
        return
    # A flip may land on a value with no structural role (an address, a letter of
    # the agent name); the result must then be a valid meta in its own right.
    assert decode(encode(other)) == other


def test_every_truncation_and_any_trailing_byte_is_rejected() -> None:
    data = encode(simple_meta())
    for k in range(len(data)):
        rejects(data[:k])
    rejects(data + b"\x00", "not valid msgpack")
    rejects(data + data, "not valid msgpack")


BAD_VALUES: list[Any] = [None, 1.5, "x", b"x", [], {}, True, -1, 2**64 - 1]
# Values from BAD_VALUES that are acceptable in a given field of simple_meta().
FINE = {1: {"x"}, 2: {2**64 - 1}, 3: set(), 4: set(), 5: set(), 6: set(), 7: set()}


@pytest.mark.parametrize("field", range(1, 8))
def test_wrong_values_in_each_field_are_rejected(field: int) -> None:
    for bad in BAD_VALUES:
        if isinstance(bad, (str, int)) and bad in FINE[field] and type(bad) is not bool:
            continue
        raw = raw_of(simple_meta())
        raw[field] = bad
        rejects(pack(raw))


def test_wrong_values_inside_runs_and_segments_are_rejected() -> None:
    base = raw_of(simple_meta())
    for field in (6, 7):
        for i in range(len(base[field])):
            for bad in (None, 1.5, "1", True, [1], -1, 99, 2**64 - 1):
                raw = raw_of(simple_meta())
                raw[field][i] = bad
                try:
                    other = decode(pack(raw))
                except WireFormatError:
                    continue
                # Only a value that still describes a consistent object may pass.
                assert type(bad) is int and decode(encode(other)) == other


def test_version_mismatch_names_both_versions_and_the_fix() -> None:
    raw = raw_of(simple_meta())
    raw[0] = WIRE_VERSION + 1
    msg = rejects(pack(raw))
    assert f"version {WIRE_VERSION + 1}" in msg and f"version {WIRE_VERSION}" in msg
    assert "same ray_rdt_pool version on the sender and the receiver" in msg
    # A newer version is reported as such even if its layout differs entirely.
    rejects(pack([WIRE_VERSION + 1, "anything"]), "wire format version")
    rejects(pack(["1", *raw[1:]]), "version must be an int")


# -- one test per error message --


def test_not_bytes() -> None:
    rejects("abc", "must be bytes, got str")
    rejects(None, "must be bytes, got NoneType")


def test_not_msgpack_or_wrong_top_level() -> None:
    rejects(b"", "not valid msgpack")
    rejects(b"\xc1", "not valid msgpack")
    rejects(pack({"a": 1}), "not valid msgpack")  # non-empty maps are refused by unpackb
    rejects(pack(5), "expected a non-empty array, got int")
    rejects(pack([]), "expected a non-empty array")
    raw = raw_of(simple_meta())
    rejects(pack(raw[:-1]), "expected 8 fields, got 7")
    rejects(pack([*raw, 0]), "expected 8 fields, got 9")
    rejects(pack([*raw[:1], "a" * 5000, *raw[2:]]), "not valid msgpack")  # overlong str


def test_scalar_fields() -> None:
    def with_field(i: int, value: Any) -> bytes:
        raw = raw_of(simple_meta())
        raw[i] = value
        return pack(raw)

    rejects(with_field(1, ""), "agent must be a non-empty str")
    rejects(with_field(1, 5), "agent must be a non-empty str")
    rejects(with_field(2, -1), "agent_version is -1, outside")
    rejects(with_field(3, "tpu"), r"device must be one of \('cpu', 'cuda'\), got 'tpu'")
    rejects(with_field(4, -1), "device_id is -1")
    rejects(with_field(5, 1.0), "total must be an int, got float")
    rejects(with_field(6, {}), "runs must be an array, got dict")
    rejects(with_field(6, 3), "runs must be an array")
    rejects(with_field(7, "x"), "segments must be an array")


def _runs_raw(flat: list[Any], total: int = 0, segs: list[int] | None = None) -> bytes:
    return pack([WIRE_VERSION, "a", 0, "cpu", 0, total, flat, segs or []])


def test_run_errors() -> None:
    rejects(_runs_raw([1, 4, 99, 1]), "run 0: unknown dtype code 99")
    rejects(_runs_raw([1, 4, 0, 1]), "unknown dtype code 0")
    rejects(_runs_raw([1, 4, True, 1]), "unknown dtype code True")
    rejects(_runs_raw([1, -4, 12, 1]), "run 0: a dim must be an int in")
    rejects(_runs_raw([1, 2**63, 12, 1]), "a dim must be an int in")
    rejects(_runs_raw([1, 4.0, 12, 1]), "a dim must be an int")
    rejects(_runs_raw([MAX_DIMS + 1, *([1] * 65), 12, 1]), "number of dims must be an int in")
    rejects(_runs_raw([-1, 12, 1]), "number of dims")
    rejects(_runs_raw([1, 4, 12, 0]), "run 0: count must be an int >= 1, got 0")
    rejects(_runs_raw([1, 4, 12]), "ends inside the run")
    rejects(_runs_raw([1, 0, 12, MAX_TENSORS + 1]), "more than 1,048,576 tensors")
    rejects(_runs_raw([1, 0, 12, MAX_TENSORS, 1, 0, 12, 1]), "more than 1,048,576 tensors")
    assert decode(_runs_raw([1, 0, 12, MAX_TENSORS])).num_tensors == MAX_TENSORS
    # float32 [4] packs into 16 bytes, rounded up to 64.
    rejects(_runs_raw([1, 4, 12, 1], 16, [0, 0, 16]), "total is 16 but the runs pack into 64")


def test_segment_errors() -> None:
    run = [1, 32, 12, 1]  # float32 [32]: 128 bytes, total 128

    def segs(*flat: Any) -> bytes:
        return _runs_raw(run, 128, list(flat))

    assert decode(segs(0, 1000, 64, 64, 5000, 64)).segments == ((0, 1000, 64), (64, 5000, 64))
    rejects(segs(0, 1000, 64, 64), "not a multiple of 3")
    rejects(segs(64, 5000, 64, 0, 1000, 64), "segment 1: starts at 0, before the end 128")
    rejects(segs(0, 1000, 96, 64, 5000, 64), "segment 1: starts at 64, before the end 96")
    rejects(segs(0, 1000, 128, 128, 0, 64), r"segment 1: \[128, 192\) reaches past")
    rejects(segs(-64, 1000, 192), "segment 0: starts at -64")
    rejects(segs(0, 1000, 0, 0, 1000, 128), "segment 0: length must be positive, got 0")
    rejects(segs(0, 1000, -5), "length must be positive, got -5")
    rejects(segs(0, -1, 128), "outside 64 bits")
    rejects(segs(0, 2**64 - 64, 128), "outside 64 bits")
    rejects(segs(0, 1000, 1.0), "segment 0: fields must be ints")
    rejects(segs(0, 1000, 64), r"run 0 \(tensors 0..0\) occupies bytes \[0, 128\)")
    rejects(segs(0, 1000, 64, 96, 5000, 32), "not fully cover")
    rejects(segs(), "not fully cover")
    assert decode(_runs_raw(run, 128, [0, 2**64 - 128, 128])).segments[0][1] == 2**64 - 128


def test_padding_and_empty_tensors_need_no_segment() -> None:
    # int8 [1] at 0, float64 [1] at 8: bytes 1..7 and the tail 16..63 are padding.
    runs = [1, 1, 3, 1, 1, 1, 13, 1, 1, 0, 12, 3]
    meta = decode(_runs_raw(runs, 64, [0, 500, 1, 8, 900, 8]))
    assert meta.tensor_offsets() == [0, 8, 16, 16, 16]
    rejects(_runs_raw(runs, 64, [0, 500, 1, 9, 900, 7]), r"run 1 \(tensors 1..1\)")
    # Only empty tensors: nothing to cover.
    assert decode(_runs_raw([2, 0, 5, 11, 4], 0)).num_tensors == 4


def test_encode_rejects_an_invalid_meta() -> None:
    good = simple_meta()
    with pytest.raises(WireFormatError, match="total is"):
        encode(WireMeta(good.agent, 0, "cpu", 0, good.total + 64, good.runs, good.segments))
    with pytest.raises(WireFormatError, match="cannot encode"):
        encode(WireMeta("a", 0, "cpu", 0, 64, (TensorRun((1,), "float128", 1),), ()))
    with pytest.raises(WireFormatError, match="not fully cover"):
        encode(WireMeta(good.agent, 0, "cpu", 0, good.total, good.runs, ()))
