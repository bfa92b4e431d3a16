"""Syncs that overlap serving, in process over the fake NIXL (tests/support/fakeray.py):
``staging="shadow"`` keeps the live tensors at their version until the commit makes the
next one live at once; a failed sync leaves them untouched; ``serving()`` sections never
see two versions; a ``load_weights`` engine gets every tensor in one call at the commit;
``on_commit`` sees the new version; a loader or hook that raises at the commit, and a
section that outlasts ``timeout_s``, leave versions and bytes that agree.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ray_rdt_pool._ray.runtime import Runtime
from ray_rdt_pool.errors import InvalidInputError
from ray_rdt_pool.weights import (
    CommitHookError,
    LoaderError,
    ReceiverError,
    WeightReceiver,
    WeightSender,
)
from tests.support.fakeray import make_runtime, receiver_node


@pytest.fixture()
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Runtime]]:
    yield from make_runtime(monkeypatch)


def filled(value: float, n: int = 6) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((32, 32), float(value)) for i in range(n)}


def runtime_stats() -> Any:
    from ray_rdt_pool._ray.runtime import stats

    return stats()


def values(dest: dict[str, torch.Tensor]) -> list[float]:
    return [float(t.flatten()[0]) for t in dest.values()]


class Gated(WeightReceiver):
    """Holds bucket ``hold`` until ``go``; fails at bucket ``fail_at``."""

    hold: int | None = None
    fail_at: int | None = None

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.entered, self.go = threading.Event(), threading.Event()

    def _load_bucket(self, plan: Any, *rest: Any) -> Any:
        if plan.index == self.fail_at:
            raise RuntimeError(f"injected failure on bucket {plan.index}")
        if plan.index == self.hold:
            self.entered.set()
            assert self.go.wait(10)
        return super()._load_bucket(plan, *rest)


def test_a_shadow_sync_leaves_the_live_tensors_until_its_commit(runtime: Any) -> None:
    runtime()
    dest = filled(1)
    commits: list[int] = []
    a, h = receiver_node(dest, Gated, staging="shadow", on_commit=commits.append)
    rec = a.weight_receiver
    rec.hold = 4  # type: ignore[attr-defined]
    sender = WeightSender(filled(7), bucket_bytes=4096, source_reads=False)
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(sender.stream([h], timeout_s=10)))
    th.start()
    assert rec.entered.wait(10)  # type: ignore[attr-defined]
    assert values(dest) == [1.0] * 6  # buckets 0-3 landed in the staging copy only
    assert rec.version == 0 and rec.staging_bytes == 6 * 32 * 32 * 4
    assert runtime_stats().weight_staging_bytes >= rec.staging_bytes
    rec.go.set()  # type: ignore[attr-defined]
    th.join(10)
    assert out[0].version == 1 and rec.version == 1 and commits == [1]
    assert values(dest) == [7.0] * 6  # all of it, at once


def test_a_failed_shadow_sync_leaves_the_live_tensors_untouched(runtime: Any) -> None:
    rt = runtime()
    dest = filled(1)
    a, h = receiver_node(dest, Gated, staging="shadow", direct=False)
    rec = a.weight_receiver
    rec.fail_at = 3  # type: ignore[attr-defined]
    sender = WeightSender(filled(7), bucket_bytes=4096, source_reads=False)
    with pytest.raises(RuntimeError, match="injected failure on bucket 3"):
        sender.stream([h], timeout_s=10)
    assert values(dest) == [1.0] * 6 and rec.version == 0  # not a prefix: nothing
    rec.fail_at = None  # type: ignore[attr-defined]
    # The next sync writes only some tensors of its own (a mapping of 3): the staging
    # copy was refreshed from the live tensors, so the others stay 1, not 7.
    rec.strict = False
    part = WeightSender({k: v for k, v in list(filled(9).items())[:3]}, bucket_bytes=4096,
                        source_reads=False)
    assert part.stream([h], version=5, timeout_s=10).version == 5
    assert values(dest) == [9.0] * 3 + [1.0] * 3
    assert rt.stats().pool_used == 0


def test_serving_sections_never_see_two_versions(runtime: Any) -> None:
    """A reader thread sums every tensor under ``serving()`` in a loop while three shadow
    syncs run: every sum is one version's, never a mix."""
    runtime()
    dest = filled(0, 8)
    a, h = receiver_node(dest, staging="shadow")
    rec = a.weight_receiver
    sums: list[float] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with rec.serving():
                sums.append(float(sum(t.sum() for t in dest.values())))
                time.sleep(0.0005)  # a forward pass takes a while

    reader = threading.Thread(target=serve)
    reader.start()
    try:
        for v in (1, 2, 3):
            sender = WeightSender(filled(v, 8), bucket_bytes=4096, source_reads=False)
            sender.stream([h], version=v, timeout_s=10)
    finally:
        stop.set()
        reader.join(10)
    per_version = 8 * 32 * 32
    assert set(sums) <= {0.0, 1.0 * per_version, 2.0 * per_version, 3.0 * per_version}
    assert sums == sorted(sums) and sums[-1] == 3.0 * per_version
    assert rec._shadow is not None and rec._shadow.last_pause_s > 0


def test_a_loader_gets_every_tensor_in_one_call_at_the_commit(runtime: Any) -> None:
    runtime()
    calls: list[list[str]] = []
    a, h = receiver_node(None, load_weights=lambda pairs: calls.append([n for n, _t in pairs]),
                         staging="shadow")
    sender = WeightSender(filled(5), bucket_bytes=4096, source_reads=False)
    sender.stream([h], timeout_s=10)
    assert calls == [[f"w{i}" for i in range(6)]]  # one call, after the last bucket
    assert a.weight_receiver.staging_bytes == 0  # handed over and let go


def test_inplace_buckets_wait_for_the_serving_sections_in_progress(runtime: Any) -> None:
    runtime()
    dest = filled(1, 2)
    a, h = receiver_node(dest)
    rec = a.weight_receiver
    entered, release = threading.Event(), threading.Event()

    def section() -> None:
        with rec.serving():
            entered.set()
            release.wait(10)

    th = threading.Thread(target=section)
    th.start()
    assert entered.wait(10)
    sender = WeightSender(filled(4, 2), bucket_bytes=4096, source_reads=False)
    out: list[Any] = []
    st = threading.Thread(target=lambda: out.append(sender.stream([h], timeout_s=10)))
    st.start()
    time.sleep(0.3)
    assert values(dest) == [1.0, 1.0] and not out  # the write waits for the section
    release.set()
    st.join(10)
    th.join(10)
    assert out and values(dest) == [4.0, 4.0]


def test_bad_staging_options_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="staging must be one of"):
        WeightReceiver(filled(0), staging="double")
    with pytest.raises(InvalidInputError, match="on_commit must be callable"):
        WeightReceiver(filled(0), on_commit=3)  # type: ignore[arg-type]


def test_a_loader_that_raises_at_the_commit_commits_nothing(runtime: Any) -> None:
    """A shadow engine hands its loader the staged tensors first at the commit: if the
    loader raises, the live tensors keep the old version's bytes, as the version says,
    and the error is a LoaderError; once the loader is fixed the next sync lands."""
    runtime()
    dest = filled(1, 3)
    fail = [True]
    got: list[str] = []

    def loader(pairs: Any) -> None:
        if fail[0]:
            raise KeyError("no such layer")
        got.extend(n for n, _t in pairs)

    a, h = receiver_node(dest, load_weights=loader, staging="shadow")
    rec = a.weight_receiver
    sender = WeightSender(filled(7), bucket_bytes=4096, source_reads=False)  # w3-w5: loader
    with pytest.raises(LoaderError, match="at the commit") as err:
        sender.stream([h], version=1, timeout_s=10)
    assert isinstance(err.value.__cause__, KeyError)
    assert err.value.names == ("w3", "w4", "w5")
    assert values(dest) == [1.0] * 3 and rec.version == 0
    assert rec.staging_bytes == 3 * 32 * 32 * 4  # the copies; the staged tensors let go
    fail[0] = False
    assert sender.stream([h], version=2, timeout_s=10).version == 2
    assert values(dest) == [7.0] * 3 and rec.version == 2 and got == ["w3", "w4", "w5"]


@pytest.mark.parametrize("staging", ["inplace", "shadow"])
def test_an_on_commit_that_raises_leaves_the_version_committed(runtime: Any,
                                                               staging: str) -> None:
    """The hook runs after the swap: the sync raises CommitHookError saying the version
    is live, on which receiver the hook raised, and that every receiver committed."""
    runtime()
    d0, d1 = filled(1, 2), filled(1, 2)

    def hook(version: int) -> None:
        raise RuntimeError(f"could not reset the cache for {version}")

    a0, h0 = receiver_node(d0, staging=staging)
    a1, h1 = receiver_node(d1, staging=staging, on_commit=hook)
    sender = WeightSender(filled(7, 2), bucket_bytes=4096, source_reads=False)
    with pytest.raises(CommitHookError, match="was committed on this receiver") as err:
        sender.stream([h0, h1], version=3, timeout_s=10)
    e = err.value
    assert (e.version, e.receiver, e.committed) == (3, 1, (0, 1))
    assert isinstance(e.__cause__, RuntimeError)
    assert a0.weight_receiver.version == 3 and a1.weight_receiver.version == 3
    assert values(d0) == [7.0] * 2 and values(d1) == [7.0] * 2
    a1.weight_receiver.on_commit = None
    assert sender.stream([h0, h1], version=4, timeout_s=10).version == 4


def test_a_serving_section_longer_than_timeout_s_gets_no_late_commit(runtime: Any) -> None:
    """A forward pass holds receiver 1's serving section past the sync's timeout_s: its
    commit gives up by the sender's deadline instead of landing after the sender stopped
    waiting. The error names it (stalled) with receiver 0 committed, receiver 1 keeps
    its version and bytes once the section ends, and the next sync lands on both."""
    runtime()
    d0, d1 = filled(1, 2), filled(1, 2)
    a0, h0 = receiver_node(d0, staging="shadow")
    a1, h1 = receiver_node(d1, staging="shadow")
    entered, release = threading.Event(), threading.Event()

    def section() -> None:
        with a1.weight_receiver.serving():
            entered.set()
            release.wait(30)

    th = threading.Thread(target=section)
    th.start()
    assert entered.wait(10)
    sender = WeightSender(filled(7, 2), bucket_bytes=4096, source_reads=False)
    try:
        with pytest.raises(ReceiverError, match="serving\\(\\) sections") as err:
            sender.stream([h0, h1], version=1, timeout_s=2.0)
    finally:
        release.set()
        th.join(10)
    e = err.value
    assert e.receiver == 1 and e.stalled and e.committed == (0,)
    assert a0.weight_receiver.version == 1 and values(d0) == [7.0] * 2
    assert a1.weight_receiver.version == 0 and values(d1) == [1.0] * 2
    assert sender.stream([h0, h1], version=2, timeout_s=10).version == 2
    assert values(d1) == [7.0] * 2


def test_a_cancel_that_came_after_the_commit_began_does_not_hide_it() -> None:
    """``cancel()`` while the commit ran: the version stood, so ``result()`` raises the
    sync's own error saying so (here a hook's), not "cancelled, nothing committed"; a
    cancel that stopped the sync before its commit still says it was cancelled."""
    from ray_rdt_pool.weights import SyncHandle, WeightSyncError

    committing, go = threading.Event(), threading.Event()

    def late(control: Any) -> Any:
        committing.set()
        assert go.wait(10)
        raise CommitHookError("version 3 was committed on this receiver, then on_commit "
                              "raised", 3, 0, (0, 1))

    handle = SyncHandle(late)
    assert committing.wait(10)
    assert handle.cancel()
    go.set()
    with pytest.raises(CommitHookError) as err:
        handle.result(10)
    assert err.value.committed == (0, 1)

    def early(control: Any) -> Any:
        assert control.cancelled.wait(10)
        raise WeightSyncError("the sync was cancelled")

    handle = SyncHandle(early)
    handle.cancel()
    with pytest.raises(WeightSyncError, match="cancelled before it committed"):
        handle.result(10)
