"""The ``ray-rdt-pool`` command without a cluster: its declaration, its dispatch, a
benchmark that needs no extra, the ``--nodes`` placement on a running cluster, and
``--netns-nodes`` where the test bed cannot run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

from ray_rdt_pool import cli

ROOT = Path(__file__).resolve().parents[3]


def test_console_script_and_extras_are_declared() -> None:
    """The benchmark, the project's main job, runs from a plain install: what it needs is
    a dependency; the bench extra adds only its charts and an optional variant."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["scripts"]["ray-rdt-pool"] == "ray_rdt_pool.cli:main"
    assert any(d.startswith("psutil") for d in meta["dependencies"])
    bench = " ".join(meta["optional-dependencies"]["bench"])
    assert "matplotlib" in bench and "psutil" not in bench


def test_the_benchmark_imports_only_the_dependencies() -> None:
    """Imported with every optional package blocked, the benchmark's entry point loads."""
    code = ("import sys\n"
            "for m in ('matplotlib', 'transferqueue', 'transformers', 'pytest'):\n"
            "    sys.modules[m] = None\n"
            "import ray_rdt_pool.bench.run\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_help_lists_the_commands() -> None:
    top = subprocess.run([sys.executable, "-m", "ray_rdt_pool.cli", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert top.returncode == 0 and all(c in top.stdout for c in ("bench", "stats", "doctor"))


@pytest.mark.parametrize("command", ["bench", "stats", "doctor"])
def test_each_command_s_help_is_plain_text_with_one_timeout_spelling(command: str) -> None:
    out = subprocess.run([sys.executable, "-m", "ray_rdt_pool.cli", command, "--help"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--timeout-s" in out.stdout and not re.search(r"--timeout\b(?!-)", out.stdout)
    assert not re.search(r"``|:(data|func|class|mod|meth|attr):`", out.stdout), out.stdout


def test_no_or_unknown_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert cli.main(["benchmark"]) == 2
    assert "unknown command 'benchmark'" in capsys.readouterr().err


def test_nodes_places_the_actors_on_distinct_nodes() -> None:
    from ray_rdt_pool.bench.options import BenchError
    from ray_rdt_pool.bench.run import place_on_nodes

    nodes: list[dict[str, Any]] = [{"NodeID": "w1", "Alive": True},
                                   {"NodeID": "dead", "Alive": False},
                                   {"NodeID": "head", "Alive": True}]
    assert place_on_nodes(nodes, "head", 1, "h:1") == {"sender": "head", "receiver": "head"}
    assert place_on_nodes(nodes, "head", 2, "h:1") == {"sender": "head", "receiver": "w1"}
    # The driver on a node without the other: still two distinct live nodes.
    assert place_on_nodes(nodes, "elsewhere", 2, "h:1") == {"sender": "w1",
                                                            "receiver": "head"}
    with pytest.raises(BenchError, match=r"cluster at h:1 has 1 alive node\(s\)"):
        place_on_nodes(nodes[1:], "head", 2, "h:1")


def test_netns_nodes_needs_root_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from ray_rdt_pool.bench import options, run
    from ray_rdt_pool.bench.testbed import TestBed

    assert run.testbed_engine_counts(9) == [1, 2, 4, 8]
    assert run.testbed_engine_counts(6) == [1, 2, 4, 5]
    assert run.testbed_engine_counts(2) == [1]
    monkeypatch.setattr(TestBed, "available", classmethod(
        lambda cls, ray=True: "needs root (it creates network namespaces, veths and tc qdiscs)"))
    assert run.main(["--netns-nodes", "3", "--rate", "100mbit"]) == 2
    assert "needs root" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        options.parse_config(["--netns-nodes", "1"])
    with pytest.raises(SystemExit):
        options.parse_config(["--netns-nodes", "3", "--address", "h:1"])


def test_testbed_sync_tables_every_wire_and_relay_row_with_its_columns() -> None:
    """A run of bf16 and FP8 wires prints one row per (engines, relay, wire), each with
    the header's columns and the FP8 row's ratio against the same sync in bf16."""
    from ray_rdt_pool.bench import testbed_sync as ts

    args = ts.parse_args(["--engines", "1,2", "--relay", "none,chain", "--wire", "none,fp8",
                          "--dtype", "bf16", "--floors", "tcp"])
    assert args.wires == ["none", "fp8"] and args.dtype == "bf16"
    results = [{"ranks": 1, "engines": n, "relay": r, "wire": w,
                "median_s": (1.0 if w == "none" else 0.5) * n, "times_s": [1.0],
                "floor_s": 1.0, "tcp_chain_s": 0.9 if r == "chain" else None}
               for n in (1, 2) for r in ("none", "chain") for w in ("none", "fp8")]
    report = {"rate": "500mbit", "results": results, "floors": {"tcp": {}}, "mode": "stream",
              "size_mib": 64, "tensors": 32, "dtype": "bf16", "bucket_mib": 2.0, "syncs": 3,
              "host": {"cpu": "cpu", "cores": 2}}
    lines = ts.table(report).splitlines()
    rows = lines[3:]
    assert len(rows) == 8
    assert {ln.count("|") for ln in lines[1:]} == {lines[1].count("|")}
    fp8_rows = [ln for ln in rows if "| fp8 |" in ln]
    assert len(fp8_rows) == 4 and all("| 0.50x |" in ln for ln in fp8_rows)
    with pytest.raises(SystemExit):
        ts.parse_args(["--wire", "fp16"])


def test_an_example_that_imports_an_optional_package_names_its_extra() -> None:
    """Each example importing a package the library does not depend on says which extra
    installs it, and that extra exists."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    for path in sorted((ROOT / "examples").glob("*.py")):
        text = path.read_text()
        if re.search(r"^(from|import) transformers\b", text, re.M):
            assert "pip install 'ray-rdt-pool[examples]'" in text, path.name
            assert any(d.startswith("transformers") for d in extras["examples"])
