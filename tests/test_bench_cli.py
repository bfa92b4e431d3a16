"""Tests of the side-by-side benchmark CLI (microbenchmarks.bench) and its helpers.

The end-to-end test runs the CLI as a subprocess in its smallest configuration against a
real local Ray cluster with real NIXL, then checks the JSON: every available variant and
every workload is there with verified checksums, and an unavailable variant says why.
No timing is asserted. The other tests are pure and fast (checksums, config, ratios).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from microbenchmarks import _bench_report as R
from microbenchmarks import _bench_workloads as W
from microbenchmarks._bench_actors import (
    OUR_VARIANTS,
    RAY_VARIANTS,
    VARIANT_NAMES,
    our_transport_unavailable_reason,
)
from microbenchmarks.bench import Progress, Runner, parse_config

ROOT = Path(__file__).resolve().parents[1]

TINY = ["--quick", "--reps", "1", "--warmup", "0", "--big-mib", "1", "--many-count", "10",
        "--many-kib", "4", "--views-rows", "50", "--views-cols", "16", "--tf-hidden", "32",
        "--tf-layers", "2", "--tf-vocab", "64", "--sync-iters", "2", "--idle-s", "0.1",
        "--no-ucx-probe"]


@pytest.mark.ray
def test_cli_smallest_run_writes_complete_json(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "microbenchmarks.bench", *TINY, "--json", str(out_json),
         "--plot", str(out_png)],
        cwd=ROOT, capture_output=True, text=True, timeout=540,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    data = json.loads(out_json.read_text())
    assert out_png.stat().st_size > 0
    assert data["ok"] is True and not data["failures"] and not data["checksum_mismatches"]
    assert set(data["summary"]) == set(W.WORKLOADS)
    assert set(data["variants"]) == set(VARIANT_NAMES)

    ours_reason = our_transport_unavailable_reason()
    for name, info in data["variants"].items():
        if not info["available"]:
            # Only our transport may be missing, and then the JSON must say why.
            assert name in OUR_VARIANTS, f"Ray variant {name} unavailable: {info['reason']}"
            assert ours_reason is not None, f"{name} marked unavailable but it imports fine"
            assert isinstance(info["reason"], str) and info["reason"].strip()
            assert all(s["variant"] != name for s in data["samples"])
            continue
        assert info["actors"]["sender"]["pid"] != info["actors"]["receiver"]["pid"]
        assert info["actors"]["sender"]["zero_copy_active"] is (name == "objstore_zc")
        for workload in W.WORKLOADS:
            row = data["summary"][workload]["variants"].get(name)
            assert row is not None, f"{name}/{workload} missing from the summary"
            assert row["checksums_ok"] is True, f"{name}/{workload}: {row}"
            assert row["n_measured"] >= 1
            assert row["phases"]["e2e_s"]["median"] > 0
    if ours_reason is None:
        assert all(data["variants"][v]["available"] for v in OUR_VARIANTS)
    for s in data["samples"]:
        assert s["checksum_ok"] is True, s
        assert s["checksum_sender"] == s["checksum_receiver"]
    # The sync workload reports its cold iteration apart from the warm ones.
    kinds = {s["kind"] for s in data["samples"] if s["workload"] == "sync"}
    assert kinds == {"cold", "warm"}


def test_checksum_covers_every_byte_and_order() -> None:
    import torch

    spec = W.make_spec("transformer", W.Sizes(tf_hidden=16, tf_layers=2, tf_vocab=32))
    tensors, bases = W.build_tensors(spec, seed=1)
    ref = W.checksum(tensors)
    assert W.checksum([t.clone() for t in tensors]) == ref
    # One flipped bit in the last bf16 element of one matrix changes the digest.
    bad = [t.clone() for t in tensors]
    bad[1].view(torch.int16).reshape(-1)[-1] ^= 1
    assert W.checksum(bad) != ref
    # Swapping two same-shape tensors changes it too.
    swapped = list(tensors)
    swapped[2], swapped[3] = swapped[3], swapped[2]
    assert W.checksum(swapped) != ref
    # An in-place refresh changes every word, so stale bytes cannot pass.
    W.refresh(bases, 0)
    assert W.checksum(tensors) != ref


def test_checksum_stacked_path_matches_per_tensor_digests() -> None:
    spec = W.make_spec("views", W.Sizes(views_rows=40, views_cols=8))
    views, _ = W.build_tensors(spec)
    expected = len(views)
    for i, t in enumerate(views):
        expected = (expected + (i + 1) * W.tensor_digest(t)) % (1 << 64)
    assert W.checksum(views) == expected


def test_quick_config_and_pool_sizing() -> None:
    cfg = parse_config(["--quick", "--variants", "nixl,nixl_pool", "--workloads", "big"])
    assert cfg.sizes == W.QUICK_SIZES and cfg.reps == 3 and cfg.variants == ["nixl", "nixl_pool"]
    assert cfg.pool_bytes >= W.payload_bytes(W.make_spec("big", cfg.sizes))
    with pytest.raises(SystemExit):
        parse_config(["--variants", "nope"])


def test_objstore_views_skip_is_explained() -> None:
    from microbenchmarks._bench_actors import variant_by_name

    runner = Runner(parse_config(["--quick"]), Progress(1, io.StringIO()))
    reason = runner.skip_reason(variant_by_name("objstore"), "views")
    assert reason and "GiB" in reason
    assert runner.skip_reason(variant_by_name("objstore_zc"), "views") is None
    small = Runner(parse_config(TINY), Progress(1, io.StringIO()))
    assert small.skip_reason(variant_by_name("objstore"), "views") is None


def test_speedup_is_ray_time_over_our_time() -> None:
    def sample(variant: str, e2e: float) -> dict:
        return {"variant": variant, "workload": "big", "rep": 1, "kind": "measured",
                "e2e_s": e2e, "checksum_ok": True}

    samples = [sample("objstore_zc", 0.2), sample("nixl_pool_ray", 0.4), sample("nixl_pool", 0.1)]
    summary = R.summarize(samples, {"big": 10**8}, RAY_VARIANTS, OUR_VARIANTS, ["big"])
    ratios = summary["big"]["ratios"]
    assert ratios["best_ray"] == "objstore_zc"
    assert ratios["speedup"]["nixl_pool"]["vs_best_ray"] == pytest.approx(2.0)
    assert ratios["speedup"]["nixl_pool"]["vs_ray_pool"] == pytest.approx(4.0)
    text = R.format_workload("big", "x", summary["big"], {}, {}, VARIANT_NAMES, False, "get")
    assert "x2.00 vs best Ray" in text
