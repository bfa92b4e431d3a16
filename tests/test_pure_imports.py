"""The pure core modules import neither torch, Ray nor NIXL."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PURE_MODULES = [
    "ray_rdt_pool.errors",
    "ray_rdt_pool.layout",
    "ray_rdt_pool.allocator",
    "ray_rdt_pool.merge",
    "ray_rdt_pool.wire",
    "ray_rdt_pool.config",
    "ray_rdt_pool.snapshot",
    # The package itself imports nothing heavy: its functions load the transport lazily.
    "ray_rdt_pool",
]
HEAVY = ["torch", "ray", "nixl"]


def test_pure_modules_do_not_import_heavy_dependencies() -> None:
    # A fresh interpreter, since this test process may already have torch loaded.
    code = textwrap.dedent(
        f"""
        import importlib, sys
        for name in {PURE_MODULES!r}:
            importlib.import_module(name)
        assert all(name in sys.modules for name in {PURE_MODULES!r})
        heavy = {HEAVY!r}
        print(",".join(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"pure modules pulled in: {out.stdout.strip()}"
