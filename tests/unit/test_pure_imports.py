"""The pure core modules import neither torch, Ray nor NIXL, and the owner modules
(registry, sender, receiver) import no Ray and no NIXL: they take the backend and the
directory as protocols, so fake-NIXL tests need no cluster."""

from __future__ import annotations

import pickle
import re
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
    "ray_rdt_pool.core.selection",
    "ray_rdt_pool.core.clock",
    "ray_rdt_pool.config",
    "ray_rdt_pool.obs.stats",
    "ray_rdt_pool.obs.events",
    "ray_rdt_pool.receive.drain",
    "ray_rdt_pool.receive.targets",
    # Ray glue that needs none of them to load: pack_as's state, the stats assembly.
    "ray_rdt_pool._ray.conversions",
    "ray_rdt_pool._ray.collect",
    "ray_rdt_pool.nixl.protocol",
    # The fake NIXL: torch only inside a READ into device memory.
    "ray_rdt_pool.testing",
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
    "ray_rdt_pool.receive.arena", "ray_rdt_pool.receive.fork", "ray_rdt_pool.receive.mapped",
    "ray_rdt_pool.receive.peers", "ray_rdt_pool.receive.source",
    "ray_rdt_pool.receive.transfers",
    "ray_rdt_pool.same_node.memfd", "ray_rdt_pool.same_node.leases",
    "ray_rdt_pool.same_node.info", "ray_rdt_pool.same_node.pool_handle",
    "ray_rdt_pool.same_node.privatize", "ray_rdt_pool.same_node.cuda",
    "ray_rdt_pool.same_node.peer_memory",
]
#: The weights API imports Ray and the transport only when it is called.
WEIGHTS_MODULES = [
    f"ray_rdt_pool.weights.{name}" for name in (
        "state", "manifest", "planning", "reports", "pool", "validate", "loadplan", "loading",
        "weight_receiver", "remote", "late", "stream", "weight_sender", "driver", "ranks",
        "rank_offer", "rank_load")
]


def test_owner_modules_import_no_ray_and_no_nixl() -> None:
    assert loaded_after_import(OWNER_MODULES + WEIGHTS_MODULES, ["ray", "nixl"]) == []


#: The torch layer: torch and the OS (torch only inside its functions), never Ray or NIXL.
MEMORY_MODULES = [
    "ray_rdt_pool.memory.dtypes", "ray_rdt_pool.memory.extent", "ray_rdt_pool.memory.describe",
    "ray_rdt_pool.memory.allocations", "ray_rdt_pool.memory.blocks", "ray_rdt_pool.memory.pack",
    "ray_rdt_pool.memory.pack_pool", "ray_rdt_pool.memory.rebuild",
    "ray_rdt_pool.memory.fastcopy", "ray_rdt_pool.memory.native",
]


def test_memory_modules_import_no_ray_no_nixl_and_torch_only_when_called() -> None:
    assert loaded_after_import(MEMORY_MODULES, HEAVY) == []


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


def test_the_error_tree_drawn_in_errors_is_the_class_tree() -> None:
    """The tree at the top of errors.py names every class of ``errors.__all__`` once,
    under its parent, with its built-in bases in brackets: a class added, moved or
    rebased without the drawing fails here."""
    from ray_rdt_pool import errors

    drawn: dict[str, tuple[str | None, set[str]]] = {}
    parents: list[str] = []
    for line in (errors.__doc__ or "").splitlines():
        m = re.fullmatch(r"    ([ │├└─]*)(\w+Error)(?: \(([\w, ]+)\))?", line)
        if m is None:
            continue
        depth = len(m.group(1)) // 4
        del parents[depth:]
        assert m.group(2) not in drawn, m.group(2)
        drawn[m.group(2)] = (parents[-1] if parents else None,
                             set(m.group(3).split(", ")) if m.group(3) else set())
        parents.append(m.group(2))
    classes = {name: getattr(errors, name) for name in errors.__all__
               if isinstance(getattr(errors, name), type)}
    actual = {}
    for name, cls in classes.items():
        ours = [b.__name__ for b in cls.__bases__ if issubclass(b, errors.RdtPoolError)]
        assert len(ours) <= 1, name
        actual[name] = (ours[0] if ours else None,
                        {b.__name__ for b in cls.__bases__} - set(ours))
    assert actual.pop("RdtPoolError") == (None, {"Exception"})  # the root: drawn bare
    assert drawn.pop("RdtPoolError") == (None, set())
    assert drawn == actual


def test_the_weight_sync_errors_are_one_class_each_and_pickle_with_their_fields() -> None:
    """The weight-sync errors live in ``ray_rdt_pool.errors`` and are the same classes
    under ``ray_rdt_pool.weights``; Ray pickles them to the caller, fields included."""
    from ray_rdt_pool import errors, weights

    for name in weights.__all__:
        obj = getattr(weights, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert obj is getattr(errors, name) and issubclass(obj, errors.WeightSyncError)
    made = [
        errors.ShapeMismatchError("m", [("shape", "w", "detail")]),
        errors.WireDtypeError("m", "w"),
        errors.StaleVersionError(3, 7, "stream", loading=True),
        errors.DuplicateNameError("w", 2, (0, 1), "detail"),
        errors.LoaderError("m", 4, ("a", "b")),
    ]
    for e in made:
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e)
        assert vars(back) == vars(e), type(e).__name__
