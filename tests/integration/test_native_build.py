"""The one command that builds the compiled helpers, run for real: the C and C++
compilers against this torch, into a fresh cache, then loaded by a new process. It
needs no Ray, but a full C++ build of the describe helper takes a CPU-minute, so it is
not a unit test (the helpers' behaviour is in tests/unit/memory/test_native.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ray_rdt_pool.memory import native


def test_one_command_builds_both_helpers_into_a_fresh_cache_and_both_load(
        tmp_path: Path) -> None:
    """``python -m ray_rdt_pool.memory.native build`` from the installed package, into an
    empty ``RAY_RDT_POOL_NATIVE_DIR``: both helpers appear under their keyed names (and
    nothing else), and a new process loads both from there on first use."""
    import os
    import subprocess
    import sys

    if shutil.which("cc") is None or shutil.which("c++") is None:
        pytest.skip("no C and C++ compiler here: the helpers are optional")
    env = {**os.environ, native.DIR_ENV: str(tmp_path / "cache")}
    env.pop("CC", None)
    env.pop("CXX", None)
    cmd = [sys.executable, "-m", "ray_rdt_pool.memory.native"]
    out = subprocess.run([*cmd, "build"], env=env, capture_output=True, text=True,
                         timeout=580, check=False)
    assert out.returncode == 0, out.stderr
    copy = native.artifact_path(tmp_path / "cache", "copy")
    desc = native.artifact_path(tmp_path / "cache", "describe")
    assert out.stdout.splitlines() == [f"copy: {copy}", f"describe: {desc}"]
    assert sorted((tmp_path / "cache").iterdir()) == sorted([copy, desc])
    assert subprocess.run([*cmd, "path"], env=env, capture_output=True, timeout=120,
                          check=False).returncode == 0
    probe = ("from ray_rdt_pool.memory import describe, fastcopy, native; "
             "print(native.load_copy() is not None, fastcopy.move_batch() is not None, "
             "native.load() is not None, describe.native_active())")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"] * 4
