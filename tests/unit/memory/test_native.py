"""The compiled helpers (ray_rdt_pool.memory.native): one command builds both into the keyed
cache; the describe helper (_native.cpp) must read exactly the facts the Python loop reads,
decline everything the Python loop must judge (so the typed errors stay the same), and
never be loaded for another torch or when it lies.

Tests that need the built describe helper skip with a reason where ``python -m
ray_rdt_pool.memory.native build`` has not run (``make venv`` runs it). No Ray here.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_rdt_pool.config import PoolConfig, from_env
from ray_rdt_pool.core.runs import DTYPES
from ray_rdt_pool.errors import InvalidInputError, NativeBuildError
from ray_rdt_pool.memory import describe as D
from ray_rdt_pool.memory import native
from ray_rdt_pool.memory.dtypes import torch_dtype
from ray_rdt_pool.testing import World

BUILT = native.artifact_path().exists()
needs_helper = pytest.mark.skipif(
    not BUILT, reason="the compiled describe helper is not built for this torch; run "
    "`python -m ray_rdt_pool.memory.native build` (make venv does)")

WIRE_DTYPES = [torch_dtype(name) for name in DTYPES]


@pytest.fixture()
def helper() -> Any:
    fn = D._native_describe()
    assert fn is not None, "built for this torch, yet not loaded or refused by its check"
    return fn


def _view(base: torch.Tensor, how: int) -> torch.Tensor:
    """One of the shapes a user's tensor takes: as is, sliced, transposed, negated, ..."""
    if how == 1 and base.dim() >= 1:
        return base[1:]
    if how == 2 and base.dim() >= 2:
        return base.transpose(0, 1)
    if how == 3 and base.is_floating_point():
        return base._neg_view()
    if how == 4 and base.is_complex():
        return base.conj()
    if how == 5 and base.dim() >= 1:
        return base[::2]
    if how == 6:
        return torch.nn.Parameter(base, requires_grad=False)
    if how == 7:
        return base.unsqueeze(0).expand(2, *base.shape)
    return base


tensor_specs = st.tuples(st.sampled_from(WIRE_DTYPES),
                         st.lists(st.integers(1, 4), min_size=0, max_size=3),
                         st.integers(0, 7))


def _make(specs: list[tuple[torch.dtype, list[int], int]]) -> list[torch.Tensor]:
    import warnings

    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        for dt, shape, how in specs:
            out.append(_view(torch.empty(shape, dtype=dt), how))
    return out


@needs_helper
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tensor_specs, min_size=1, max_size=12))
def test_helper_reads_exactly_what_the_python_loop_reads(specs: list[Any]) -> None:
    tensors = _make(specs)
    fn = D._native_describe()
    assert fn is not None
    facts = fn(tensors)
    if any(t.numel() == 0 for t in tensors):  # an empty tensor may have no address
        assert D.describe(tensors) == D._describe_py(tensors, False)
        return
    assert facts is not None, "the helper declined plain dense CPU tensors"
    got = D.Described(*facts, device="cpu")
    assert got == D._describe_py(tensors, False)
    assert D.describe(tensors) == got
    # Equal shapes share one tuple, as the Python loop's 1-d shapes do.
    by_value: dict[tuple[int, ...], int] = {}
    for s in got.shapes:
        assert by_value.setdefault(tuple(s), id(s)) == id(s)


class _Sub(torch.Tensor):
    pass


def _zero_tensor() -> torch.Tensor:
    return torch._efficientzerotensor(4)


def _resized_to_zero() -> torch.Tensor:
    t = torch.ones(8)
    t.untyped_storage().resize_(0)
    return t


def _far_view_resized_to_zero() -> torch.Tensor:
    t = torch.ones(100_000)
    v = t[50_000:]  # its address is then 200,000: no longer under 64 KiB
    t.untyped_storage().resize_(0)
    return v


def _view_past_shrunk_storage() -> torch.Tensor:
    t = torch.ones(100_000)
    v = t[10:]
    t.untyped_storage().resize_(4096)
    return v


DECLINED = {
    "a non-tensor item": lambda: [torch.ones(2), 3],
    "a Tensor subclass": lambda: [torch.ones(2).as_subclass(_Sub)],
    "a sparse tensor": lambda: [torch.ones(2, 2).to_sparse()],
    "a nested tensor": lambda: [torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])],
    "a meta tensor": lambda: [torch.empty(4, device="meta")],
    "a ZeroTensor": lambda: [torch.ones(2), _zero_tensor()],
    "a storage resized to 0": lambda: [_resized_to_zero()],
    "a view far into a storage resized to 0": lambda: [_far_view_resized_to_zero()],
    "a view past a shrunk storage": lambda: [_view_past_shrunk_storage()],
    "an empty tensor": lambda: [torch.ones(3), torch.empty(0)],
    "an unsupported dtype": lambda: [torch.ones(2), torch.empty(2, dtype=torch.bits8)],
}


@needs_helper
@pytest.mark.parametrize("case", sorted(DECLINED))
def test_helper_declines_and_the_python_loop_decides(case: str, helper: Any) -> None:
    """For anything but plain dense CPU tensors the helper answers None; describe then
    behaves exactly as without the helper: the same typed error, or the same facts."""
    tensors = DECLINED[case]()
    assert helper(tensors) is None
    outcomes = []
    for use in (True, False):
        try:
            outcomes.append(("ok", D.describe(tensors, native=use)))
        except InvalidInputError as e:
            outcomes.append(("error", str(e)))
    assert outcomes[0] == outcomes[1]
    if case not in ("an empty tensor", "a Tensor subclass"):
        assert outcomes[0][0] == "error", f"{case} must be refused"


@needs_helper
def test_a_helper_that_disagrees_with_the_python_loop_is_refused(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real = native.load()
    assert real is not None

    class Lying:
        scalar_types = staticmethod(real.scalar_types)
        init = staticmethod(real.init)

        @staticmethod
        def describe(tensors: Any) -> Any:
            facts = real.describe(tensors)
            if facts is not None and len(facts[4]) > 1:
                facts[4][-1] += 64  # one wrong address in a long object
            return facts

    monkeypatch.setattr(native, "load", lambda folder=None: Lying)
    with caplog.at_level(logging.WARNING, logger="ray_rdt_pool.memory.describe"):
        assert D._checked_native() is None
    assert "disagrees with the Python loop" in caplog.text
    monkeypatch.setattr(native, "load", lambda folder=None: real)
    assert D._checked_native() is not None


@needs_helper
def test_a_helper_built_for_another_torch_is_not_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The file name keys the torch build; a file whose own tag differs is skipped too."""
    real_tag, real_path = native.build_tag(), native.artifact_path()
    monkeypatch.setattr(native, "build_tag", lambda: "9.9.9-0123456789ab")
    other = native.artifact_path(tmp_path)
    assert "9.9.9" in other.name and other.name != real_path.name
    assert native._import(other) is None  # nothing built for that torch
    shutil.copy(real_path, other)  # a file under the name, built for the real torch
    with caplog.at_level(logging.WARNING, logger="ray_rdt_pool.memory.native"):
        assert native._import(other) is None
    assert f"built for torch {real_tag}" in caplog.text


def test_a_failed_build_raises_a_typed_error_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for helper, env in (("describe", "CXX"), ("copy", "CC")):
        monkeypatch.setenv(env, "false")  # a compiler that always fails
        with pytest.raises(NativeBuildError, match="exited with status 1"):
            native.build(tmp_path, helper=helper)
        monkeypatch.setenv(env, str(tmp_path / "no-such-compiler"))
        with pytest.raises(NativeBuildError, match=f"install one .* or set {env}"):
            native.build(tmp_path, helper=helper)
    assert list(tmp_path.iterdir()) == []
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    with pytest.raises(NativeBuildError, match=native.DIR_ENV):
        native.build(unwritable / "cache", helper="copy")


def test_the_cli_reports_where_the_helpers_are(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    both = native.artifact_path().exists() and native.artifact_path(helper="copy").exists()
    assert native.main(["path"]) == (0 if both else 1)
    assert capsys.readouterr().out.splitlines() == [
        f"copy: {native.artifact_path(helper='copy')}", f"describe: {native.artifact_path()}"]
    monkeypatch.setenv(native.DIR_ENV, str(tmp_path))
    assert native.cache_dir() == tmp_path
    assert native.main(["path"]) == 1
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("CXX", "false")
    assert native.main(["build"]) == 1
    assert native.main(["build", "--optional"]) == 0
    err = capsys.readouterr().err
    assert "compiling _copy.c exited with status 1" in err
    assert "compiling _native.cpp exited with status 1" in err


def test_native_off_never_calls_the_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Tuning.native`` (``RAY_RDT_POOL_NATIVE=0``) keeps every describe of a put,
    and of a fetch into target buffers, on the Python loop."""
    assert from_env({"RAY_RDT_POOL_NATIVE": "0"}).tuning.native is False
    assert PoolConfig().tuning.native is True

    def boom(tensors: Any) -> Any:
        raise AssertionError("the helper ran although native is off")

    monkeypatch.setattr(D, "_NATIVE", [boom])
    from tests.support.fake_world import make, roundtrip, same

    world = World()
    s, r = make(world, native=False), make(world, native=False)
    ts = [torch.randn(3, 4), torch.arange(5)]
    targets = [torch.empty(3, 4), torch.empty(5, dtype=torch.int64)]
    assert same(roundtrip(s, r, "a", ts, targets), ts)
    with pytest.raises(AssertionError, match="although native is off"):
        D.describe(ts)  # and the default is on: the spy is live


@needs_helper
def test_threads_racing_to_the_first_describe_load_and_check_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper is loaded and checked once per process, whichever threads ask first."""
    import threading

    checks = []
    real = D._checked_native

    def counted() -> Any:
        checks.append(threading.get_ident())
        return real()

    monkeypatch.setattr(D, "_NATIVE", [])
    monkeypatch.setattr(D, "_checked_native", counted)
    ts = [torch.arange(6.0).view(2, 3), torch.ones(4, dtype=torch.int64)]
    start = threading.Barrier(8)
    got: list[Any] = []

    def first_put() -> None:
        start.wait()
        got.append((D._native_describe(), D.describe(ts)))

    threads = [threading.Thread(target=first_put) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(checks) == 1 and len(got) == 8
    assert len({id(fn) for fn, _ in got}) == 1 and got[0][0] is not None
    assert all(d == D._describe_py(ts, False) for _, d in got)


@needs_helper
def test_the_first_put_under_deterministic_algorithms_checks_and_loads_the_helper(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.use_deterministic_algorithms(True)`` (as many training scripts set) makes
    ``torch.empty`` fill what it allocates, which torch cannot do for every wire dtype
    (float4_e2m1fn_x2): the probe objects of the helper's check must not depend on that,
    or the first put of such a process fails untyped."""
    monkeypatch.setattr(D, "_NATIVE", [])
    ts = [torch.arange(6.0).view(2, 3), torch.ones(4, dtype=torch.int64)]
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = D.describe(ts)
    finally:
        torch.use_deterministic_algorithms(was)
    assert got == D._describe_py(ts, False)
    assert D._native_describe() is not None, "the helper passed its check: it is used"


def test_a_helper_whose_check_raises_leaves_describe_on_the_python_loop(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Whatever goes wrong while the helper is loaded and checked, a put takes the Python
    loop (with one warning), never the error."""
    def broken() -> Any:
        raise NotImplementedError("a probe torch cannot make")

    monkeypatch.setattr(D, "_NATIVE", [])
    monkeypatch.setattr(D, "_checked_native", broken)
    ts = [torch.arange(6.0).view(2, 3)]
    with caplog.at_level(logging.WARNING, logger="ray_rdt_pool.memory.describe"):
        assert D.describe(ts) == D._describe_py(ts, False)
    assert D._native_describe() is None
    assert "a probe torch cannot make" in caplog.text
