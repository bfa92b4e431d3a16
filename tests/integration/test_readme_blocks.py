"""The README's code, run as a user would run it.

Every fenced block whose info string is exactly ``python`` is a complete
program and runs; blocks of any other language (``bash``: ``pip install``, ``make``)
do not. Each program runs in a subprocess of its own, as ``python block.py`` would, as a
driver that joins the test process's shared cluster (``RAY_ADDRESS``; a plain
``ray.init()`` joins the cluster it names), with this checkout on ``PYTHONPATH``, none of
the test session's ``RAY_RDT_POOL_*`` settings, and 64 MiB pools and arenas (the
defaults reserve 1 GiB each; the cluster's workers see the same,
tests.support.raycluster.CLUSTER_ENV). It must exit 0, and a line
``print(...)  # TEXT`` promises that ``TEXT`` is printed as a line of its output.
The block extraction and the docs checks are in tests/unit/test_readme.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.raycluster import subprocess_env

ROOT = Path(__file__).resolve().parents[2]


README = ROOT / "README.md"


_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def python_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks whose info string is ``python``, in order."""
    return [body for info, body in _FENCE.findall(text) if info.strip() == "python"]


def promised_lines(block: str) -> list[str]:
    """The ``TEXT`` of each ``print(...)  # TEXT`` line of a block."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s+#\s*(.+)$", block, re.M)]


@pytest.mark.ray
@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text()))))
def test_readme_python_block_runs(index: int, tmp_path: Path, ray_cluster: str) -> None:
    block = python_blocks(README.read_text())[index]
    program = tmp_path / f"readme_block_{index}.py"
    program.write_text(block)
    env = subprocess_env(RAY_ADDRESS=ray_cluster, PYTHONPATH=str(ROOT),
                         RAY_RDT_POOL_POOL_BYTES="64M", RAY_RDT_POOL_ARENA_BYTES="64M")
    proc = subprocess.run([sys.executable, str(program)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = [line.strip() for line in proc.stdout.splitlines()]
    for want in promised_lines(block):
        assert want in printed, (want, proc.stdout[-3000:])
    assert printed, "the block printed nothing"
