"""The pure core modules import neither torch, Ray nor NIXL, and the owner modules
(registry, sender, receiver) import no Ray and no NIXL: they take the backend and the
directory as protocols, so fake-NIXL tests need no cluster."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PURE_MODULES = [
    "ray_rdt_pool.errors",
    "ray_rdt_pool.core.layout",
    "ray_rdt_pool.core.allocator",
    "ray_rdt_pool.core.descriptors",
    "ray_rdt_pool.core.runs",
    "ray_rdt_pool.core.codec",
    "ray_rdt_pool.core.wire",
    "ray_rdt_pool.core.selection",
    "ray_rdt_pool.config",
    "ray_rdt_pool.obs.stats",
    "ray_rdt_pool.obs.events",
    # The package itself imports nothing heavy: its functions load the transport lazily.
    "ray_rdt_pool",
]
HEAVY = ["torch", "ray", "nixl"]


def loaded_after_import(modules: list[str], roots: list[str]) -> list[str]:
    """The modules under ``roots`` that importing ``modules`` loads, in a fresh interpreter
    (this test process may already have torch loaded)."""
    code = textwrap.dedent(
        f"""
        import importlib, sys
        for name in {modules!r}:
            importlib.import_module(name)
        assert all(name in sys.modules for name in {modules!r})
        print(",".join(sorted(m for m in sys.modules if m.split(".")[0] in {roots!r})))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    return [m for m in out.stdout.strip().split(",") if m]


def test_pure_modules_do_not_import_heavy_dependencies() -> None:
    assert loaded_after_import(PURE_MODULES, HEAVY) == []


OWNER_MODULES = [
    "ray_rdt_pool.registry", "ray_rdt_pool.send.sender", "ray_rdt_pool.send.overflow",
    "ray_rdt_pool.send.leased", "ray_rdt_pool.receive.receiver",
]


def test_owner_modules_import_no_ray_and_no_nixl() -> None:
    assert loaded_after_import(OWNER_MODULES, ["ray", "nixl"]) == []


def test_the_errors_the_readme_lists_are_exported_with_their_bases() -> None:
    """docs/troubleshooting.md: every class is importable from ``ray_rdt_pool`` (the
    helper's from ``ray_rdt_pool.errors``) and derives from what the page says it does."""
    import ray_rdt_pool
    from ray_rdt_pool import errors

    bases = {
        "PoolExhaustedError": (MemoryError,), "WireFormatError": (ValueError,),
        "RegistrationError": (), "TransferError": (),
        "ReadStillRunningError": (ray_rdt_pool.TransferError,), "ConfigurationError": (),
        "InvalidInputError": (ValueError, TypeError),
    }
    for name, extra in bases.items():
        cls = getattr(ray_rdt_pool, name)
        assert issubclass(cls, ray_rdt_pool.RdtPoolError) and cls is getattr(errors, name)
        assert all(issubclass(cls, b) for b in extra), name
    assert issubclass(errors.NativeBuildError, errors.RdtPoolError)
