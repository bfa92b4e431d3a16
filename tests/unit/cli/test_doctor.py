"""``ray-rdt-pool doctor``'s checks, each fed faked inputs: what it says, and the fix.

The checks that need Ray (``actors``, ``ucx``) are split into a pure verdict
(:func:`~ray_rdt_pool.cli.doctor.judge_transfer`, :func:`~ray_rdt_pool.cli.doctor.judge_ucx`,
:func:`~ray_rdt_pool.cli.doctor.pick_pair`) tested here, and the Ray part, run once on a
real cluster by tests/integration/test_cli.py.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import sys
import types
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from ray_rdt_pool.cli import doctor
from ray_rdt_pool.memory import native

ROOT = Path(__file__).resolve().parents[3]

#: What UCX 1.23 printed with UCX_PROTO_INFO=y for a NIXL READ between two processes of
#: this host (the log prefix as UCX writes it).
PROTO_INFO = """\
[1.015504] [vm:10410:0]   +--------+-------------+-------------------------------------------+
[1.015504] [vm:10410:0]   | ucx-probe-initiator-10410 intra-node cfg#1                       |
[1.015504] [vm:10410:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.015504] [vm:10410:0]   +--------+-------------+-------------------------------------------+
[1.015504] [vm:10410:0]   | Range  | Description |                  Config                   |
[1.015504] [vm:10410:0]   +--------+-------------+-------------------------------------------+
[1.015504] [vm:10410:0]   | 0..inf | zero-copy   | cma/memory                                |
[1.015504] [vm:10410:0]   +--------+-------------+-------------------------------------------+
"""


def _by_name(checks: list[doctor.Check], name: str) -> doctor.Check:
    return next(c for c in checks if c.name == name)


# ----------------------------------------------------------------------------- platform


def test_platform_fails_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    assert doctor.check_platform().status == "ok"
    monkeypatch.setattr(sys, "platform", "darwin")
    check = doctor.check_platform()
    assert check.failed and "darwin" in check.detail and "Linux" in check.fix


# ----------------------------------------------------------------------------- versions


def _versions(monkeypatch: pytest.MonkeyPatch, **have: str | None) -> doctor.Check:
    real = doctor._version
    monkeypatch.setattr(doctor, "_version",
                        lambda d: have[d] if d in have else real(d))
    return doctor.check_versions()


def test_versions_ok_on_the_tested_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _versions(monkeypatch, ray="2.60.0", torch="2.13.0+cpu", nixl="1.5.1")
    assert check.status == "ok" and "ray 2.60.0" in check.detail and not check.fix


def test_versions_fail_on_an_untested_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _versions(monkeypatch, ray="2.61.0")
    assert check.failed and "Ray 2.61.0 is not the tested 2.60.x" in check.detail
    assert "pip install 'ray[default]==2.60.*'" in check.fix


@pytest.mark.parametrize("name, version, fix", [
    ("torch", "2.3.1", "pip install 'torch>=2.4,<3.0'"),
    ("torch", None, "pip install 'torch>=2.4,<3.0'"),
    ("nixl", "2.0.0", "pip install 'nixl>=1.5,<2.0'"),
    ("nixl", None, "pip install 'nixl>=1.5,<2.0'"),
])
def test_versions_fail_out_of_range_and_name_the_range(
        monkeypatch: pytest.MonkeyPatch, name: str, version: str | None, fix: str) -> None:
    check = _versions(monkeypatch, ray="2.60.0", **{name: version})
    assert check.failed and f"{name} {version or 'is not installed'}" in check.detail
    assert check.fix == fix


def test_versions_warn_in_range_but_untested(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _versions(monkeypatch, ray="2.60.2", torch="2.7.0+cu126", nixl="1.6.0")
    assert check.status == "warn", check
    assert "torch 2.7.0+cu126, nixl 1.6.0: in range, but not a release" in check.detail
    assert check.fix.endswith("pip install 'torch==2.13.0' 'nixl==1.5.1'")


def test_the_readme_names_the_tested_releases() -> None:
    """The pins doctor compares against are the ones the README promises."""
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines()
                if ln.startswith("Tested with"))
    for name, releases in doctor.TESTED.items():
        label = {"ray": "Ray", "torch": "torch", "nixl": "NIXL"}[name]
        assert f"{label} {releases[0]}" in line, (name, line)


# ----------------------------------------------------------------------------- nixl


def _fake_nixl(monkeypatch: pytest.MonkeyPatch, plugins: list[str],
               backend_error: Exception | None = None) -> None:
    class Agent:
        def __init__(self, name: str, config: Any) -> None:
            self.name = name

        def get_plugin_list(self) -> list[str]:
            return plugins

        def create_backend(self, name: str) -> None:
            if backend_error is not None:
                raise backend_error

    api = types.ModuleType("nixl._api")
    api.nixl_agent = Agent  # type: ignore[attr-defined]
    api.nixl_agent_config = lambda **kw: kw  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nixl._api", api)


def test_nixl_ok_with_a_ucx_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nixl(monkeypatch, ["UCX", "POSIX"])
    check = doctor.check_nixl()
    assert check.status == "ok" and "UCX, POSIX" in check.detail


def test_nixl_fails_without_a_ucx_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nixl(monkeypatch, ["POSIX"])
    check = doctor.check_nixl()
    assert check.failed and "no UCX plugin" in check.detail and "NIXL_PLUGIN_DIR" in check.fix


def test_nixl_fails_when_ucx_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nixl(monkeypatch, ["UCX"], RuntimeError("no usable transport"))
    check = doctor.check_nixl()
    assert check.failed and "no usable transport" in check.detail and "UCX_TLS" in check.fix


def test_nixl_fails_when_it_does_not_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    check = doctor.check_nixl()
    assert check.failed and "does not import" in check.detail
    assert check.fix.startswith("pip install 'nixl>=1.5,<2'")


# ----------------------------------------------------------------------------- shared memory


_Usage = namedtuple("_Usage", "total used free")


def test_shared_memory_ok(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(8 << 30, 0, 8 << 30))
    memfd, shm = doctor.check_shared_memory()
    assert (memfd.name, memfd.status) == ("memfd", "ok")
    assert shm.status == "ok" and "8.0 GiB" in shm.detail


def test_a_small_dev_shm_warns_with_the_docker_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(64 << 20, 0, 64 << 20))
    shm = _by_name(doctor.check_shared_memory(), "/dev/shm")
    assert shm.status == "warn" and "0.06 GiB" in shm.detail and "--shm-size" in shm.fix


def test_a_missing_dev_shm_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    def gone(path: str) -> Any:
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(shutil, "disk_usage", gone)
    shm = _by_name(doctor.check_shared_memory(), "/dev/shm")
    assert shm.status == "warn" and "not usable" in shm.detail and "tmpfs" in shm.fix


def test_memfd_refused_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(name: str, flags: int = 0) -> int:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "memfd_create", refused)
    memfd = _by_name(doctor.check_shared_memory(), "memfd")
    assert memfd.failed and "not permitted" in memfd.detail and "seccomp" in memfd.fix


# ----------------------------------------------------------------------------- native


def test_native_helpers_not_built_warns_with_the_build_command(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(native.DIR_ENV, str(tmp_path))  # an empty cache: nothing built
    check = doctor.check_native()
    assert check.status == "warn" and "copy, describe" in check.detail
    assert check.fix.startswith("python -m ray_rdt_pool.memory.native build")


def test_native_helpers_built_but_not_loading_warns(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(native.DIR_ENV, str(tmp_path))
    for name in native.HELPERS:
        native.artifact_path(helper=name).write_bytes(b"not a shared object")
    monkeypatch.setattr(native, "load", lambda folder=None: None)
    monkeypatch.setattr(native, "load_copy", lambda folder=None: None)
    check = doctor.check_native()
    assert check.status == "warn" and "not loadable: copy, describe" in check.detail
    assert check.fix.endswith("build --force")


def test_native_helpers_ok_when_built_and_loaded(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(native.DIR_ENV, str(tmp_path))
    for name in native.HELPERS:
        native.artifact_path(helper=name).write_bytes(b"")
    monkeypatch.setattr(native, "load", lambda folder=None: types.ModuleType("m"))
    monkeypatch.setattr(native, "load_copy", lambda folder=None: object())
    check = doctor.check_native()
    assert check.status == "ok" and str(tmp_path) in check.detail


# ----------------------------------------------------------------------------- actors, ucx


def _node(node_id: str, ip: str, alive: bool = True) -> dict[str, Any]:
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": alive}


def test_pick_pair_prefers_another_host() -> None:
    nodes = [_node("b", "10.0.0.1"), _node("a", "10.0.0.1"), _node("c", "10.0.0.2"),
             _node("d", "10.0.0.3", alive=False)]
    assert doctor.pick_pair(nodes, "a") == (["a", "c"], "two hosts")
    assert doctor.pick_pair(nodes[:2], "a") == (["a", "b"], "two nodes of one host")
    assert doctor.pick_pair([_node("a", "x"), _node("d", "y", alive=False)], "a") == (
        ["a", "a"], "one node")
    with pytest.raises(RuntimeError, match="no alive node"):
        doctor.pick_pair([_node("d", "y", alive=False)], "a")


def _report(**over: Any) -> dict[str, Any]:
    return {"sum": 10, "n": 1 << 18, "fallbacks": 0, "errors": 0, "reads": 1, "mapped": 0,
            "ucx": "", **over}


def test_judge_transfer() -> None:
    ok = doctor.judge_transfer(_report(), 10, 1 << 18, "two hosts")
    assert ok.status == "ok" and "one NIXL READ" in ok.detail and "1 MiB" in ok.detail
    mapped = doctor.judge_transfer(_report(reads=0, mapped=1), 10, 1 << 18, "one node")
    assert mapped.status == "ok" and "mapped from the sender's pool" in mapped.detail
    wrong = doctor.judge_transfer(_report(sum=11), 10, 1 << 18, "one node")
    assert wrong.failed and "other bytes" in wrong.detail
    short = doctor.judge_transfer(_report(n=5), 10, 1 << 18, "one node")
    assert short.failed
    fell = doctor.judge_transfer(_report(fallbacks=1), 10, 1 << 18, "one node")
    assert fell.failed and "fallback" in fell.detail and "actor logs" in fell.fix


def test_judge_ucx_names_the_transport_ucx_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TLS", raising=False)
    check = doctor.judge_ucx(PROTO_INFO, "1.23.0", "one node")
    assert check.status == "ok", check
    assert "UCX 1.23.0" in check.detail and "0..inf: zero-copy via cma/memory" in check.detail
    monkeypatch.setenv("UCX_TLS", "cma,tcp")
    assert "UCX_TLS=cma,tcp" in doctor.judge_ucx(PROTO_INFO, "1.23.0", "one node").detail


def test_judge_ucx_warns_without_a_table_or_without_rdma_across_hosts() -> None:
    silent = doctor.judge_ucx("nothing from UCX\n", None, "two hosts")
    assert silent.status == "warn" and "UCX_PROTO_INFO=y" in silent.fix
    tcp = PROTO_INFO.replace("cma/memory", "tcp/eth0  ")
    slow = doctor.judge_ucx(tcp, "1.23.0", "two hosts")
    assert slow.status == "warn" and "no RDMA transport" in slow.detail
    assert "ucx_info -d" in slow.fix
    # On one host tcp or cma is what UCX should pick: no warning.
    assert doctor.judge_ucx(tcp, "1.23.0", "two nodes of one host").status == "ok"


def test_captured_fds_takes_what_c_code_prints(capfd: pytest.CaptureFixture[str]) -> None:
    libc = ctypes.CDLL(None)
    with doctor._captured_fds() as out:
        libc.printf(b"from C stdio %d\n", 42)  # buffered in C until the flush
        os.write(2, b"raw stderr\n")
    assert "from C stdio 42" in out[0] and "raw stderr" in out[0]
    os.write(1, b"after\n")
    seen = capfd.readouterr()
    assert "after" in seen.out and "from C stdio" not in seen.out + seen.err


# ----------------------------------------------------------------------------- the whole


def _quiet(monkeypatch: pytest.MonkeyPatch, **fail: str) -> list[str]:
    """Fake every check (``fail`` names the failing ones and their fixes); return the
    list that records whether the actor check ran."""
    ran: list[str] = []

    def fake(name: str) -> Any:
        status = "FAIL" if name in fail else "ok"
        return lambda *a, **k: doctor.Check(name, status, f"{name} detail", fail.get(name, ""))

    monkeypatch.setattr(doctor, "check_platform", fake("platform"))
    monkeypatch.setattr(doctor, "check_versions", fake("versions"))
    monkeypatch.setattr(doctor, "check_nixl", fake("nixl"))
    monkeypatch.setattr(doctor, "check_shared_memory", lambda: [fake("memfd")()])
    monkeypatch.setattr(doctor, "check_native", fake("native helpers"))
    monkeypatch.setattr(doctor, "check_actors",
                        lambda address, timeout_s: ran.append(str(address)) or [])
    return ran


def test_a_failed_check_skips_the_actors_and_exits_1(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    ran = _quiet(monkeypatch, nixl="pip install nixl")
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert ran == []
    assert re.search(r"^FAIL\s+nixl\s+nixl detail\n\s+fix: pip install nixl$", out, re.M), out
    assert re.search(r"^FAIL\s+actors\s+not run: a check above failed", out, re.M)
    assert "2 check(s) failed: nixl, actors" in out


def test_all_ok_runs_the_actors_on_the_address(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    ran = _quiet(monkeypatch)
    assert doctor.main(["--address", "head:6379"]) == 0
    assert ran == ["head:6379"] and "all checks passed" in capsys.readouterr().out
    assert doctor.main(["--no-actors"]) == 0 and ran == ["head:6379"]


def test_a_warning_prints_its_fix_and_passes() -> None:
    text = doctor.render([doctor.Check("/dev/shm", "warn", "small", "grow it"),
                          doctor.Check("memfd", "ok", "works", "never shown")])
    assert "fix: grow it" in text and "never shown" not in text
