"""The two optional compiled helpers: one command builds both from the installed package,
and each is loaded lazily, once per process.

* ``copy`` (``_copy.c``): streaming-store host copies for :mod:`ray_rdt_pool.memory.fastcopy`;
  plain C, no Python headers and no torch, loaded with ctypes. Without it: memmove.
* ``describe`` (``_native.cpp``): the facts of :func:`ray_rdt_pool.memory.describe.describe`
  read in C++, compiled against the installed torch. Without it: the Python loop.

Both sources ship in this folder of the wheel. ``python -m ray_rdt_pool.memory.native
build`` (``make venv`` runs it) compiles them with the system compilers (``$CC``, else
``cc``; ``$CXX``, else ``c++``); nothing compiles at install, at import or during a put.
The results go to one cache folder (``RAY_RDT_POOL_NATIVE_DIR``, default
``~/.cache/ray_rdt_pool/native``) under file names keyed by the source's hash and this
Python's extension suffix (ABI and platform), and for ``describe`` by the torch build too:
that code reads torch's in-memory structures through inline functions, so a build for
another torch could read wrong facts and is never loaded (it is simply absent until
rebuilt).

Lifetime: a built file lives until the cache folder is cleared; a loaded helper lives
until the process exits. :func:`load` and :func:`load_copy` each run once per process,
under a lock, on whichever thread first needs the helper.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ray_rdt_pool.errors import NativeBuildError

__all__ = ["DIR_ENV", "HELPERS", "artifact_path", "build", "build_tag", "cache_dir", "load",
           "load_copy", "main"]

_log = logging.getLogger(__name__)

#: Environment variable naming the folder of built helpers.
DIR_ENV = "RAY_RDT_POOL_NATIVE_DIR"
_HERE = Path(__file__).parent


@dataclass(frozen=True)
class _Helper:
    source: str  # file name in this folder
    compiler_env: str  # the environment variable naming the compiler
    compiler: str  # the compiler without it
    with_torch: bool  # compiled against torch: its build is part of the file name
    what: str  # how messages name it
    fallback: str  # what runs without it


HELPERS = {
    "copy": _Helper("_copy.c", "CC", "cc", False, "copy helper",
                    "host copies use memmove"),
    "describe": _Helper("_native.cpp", "CXX", "c++", True, "describe helper",
                        "describe() uses its Python loop"),
}

# Both set once, under _lock, by the first load() / load_copy() of the process.
_lock = threading.Lock()
_loaded: dict[str, object] = {}


def cache_dir() -> Path:
    """Where built helpers live: ``$RAY_RDT_POOL_NATIVE_DIR``, else the user cache."""
    env = os.environ.get(DIR_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ray_rdt_pool" / "native"


def build_tag() -> str:
    """The torch build the describe helper must be compiled for to load here: version and
    git revision of the installed torch."""
    import torch

    git = (getattr(torch.version, "git_version", None) or "unknown")[:12]
    return f"{torch.__version__}-{git}"


def artifact_path(folder: Path | None = None, helper: str = "describe") -> Path:
    """The file a build of ``helper`` for this Python (and for ``describe``, this torch)
    from this source writes and a load reads."""
    spec = HELPERS[helper]
    src = hashlib.sha256((_HERE / spec.source).read_bytes()).hexdigest()[:12]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    if not spec.with_torch:
        return (folder or cache_dir()) / f"_copy-{src}{suffix}"
    safe = "".join(c if c.isalnum() or c in "-." else "_" for c in build_tag())
    return (folder or cache_dir()) / f"_native-torch{safe}-{src}{suffix}"


def _command(helper: str, out: Path) -> list[str]:
    spec = HELPERS[helper]
    cc = shlex.split(os.environ.get(spec.compiler_env) or spec.compiler)
    src = str(_HERE / spec.source)
    if not spec.with_torch:
        return [*cc, "-O2", "-shared", "-fPIC", src, "-o", str(out)]
    import torch
    from torch.utils import cpp_extension

    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    incs = [f"-I{p}" for p in cpp_extension.include_paths()]
    incs.append(f"-I{sysconfig.get_paths()['include']}")
    libs = cpp_extension.library_paths()
    return [*cc, "-O2", "-shared", "-fPIC", "-std=c++20", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f'-DTORCH_BUILD_TAG="{build_tag()}"',
            *incs, src, "-o", str(out),
            *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs),
            "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def build(folder: Path | None = None, *, force: bool = False,
          helper: str = "describe") -> Path:
    """Compile ``helper`` (``copy`` or ``describe``) unless that build exists; return its path.

    Raises NativeBuildError when the cache folder cannot be written or the compiler is
    missing or fails (the message carries its last output). The file appears whole or not
    at all (written next to its place, then renamed), so processes that load while
    another builds never see half a file.
    """
    spec = HELPERS[helper]
    out = artifact_path(folder, helper)
    if out.exists() and not force:
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=".building-", suffix=out.suffix, dir=out.parent)
    except OSError as e:
        raise NativeBuildError(
            f"cannot write the {spec.what} to {out.parent} ({e}); set {DIR_ENV} to a "
            f"writable folder. Without the helper {spec.fallback}") from e
    os.close(fd)
    tmp = Path(tmp_name)
    cmd = _command(helper, tmp)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise NativeBuildError(
            f"cannot run the compiler {cmd[0]!r} for the {spec.what} ({e}); install one "
            f"(gcc/g++ or clang/clang++) or set {spec.compiler_env}, then run `python -m "
            f"ray_rdt_pool.memory.native build` again. Without the helper {spec.fallback}"
        ) from e
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise NativeBuildError(
            f"compiling {spec.source} exited with status {proc.returncode}:\n"
            + "\n".join(tail) + f"\nWithout the helper {spec.fallback}")
    os.replace(tmp, out)
    return out


def load(folder: Path | None = None) -> ModuleType | None:
    """The describe helper built for this torch, imported once per process; None without
    one.

    A file that fails to import, or reports another torch build than this process runs,
    is skipped with one warning. The caller checks the helper's answers before trusting
    them (:mod:`ray_rdt_pool.memory.describe` compares it with the Python loop on probe
    tensors).
    """
    if "describe" not in _loaded:
        with _lock:
            if "describe" not in _loaded:
                _loaded["describe"] = _import(artifact_path(folder))
    mod = _loaded["describe"]
    return mod if isinstance(mod, ModuleType) else None


def load_copy(folder: Path | None = None) -> ctypes.CDLL | None:
    """The copy helper built from this source, opened once per process; None without one
    (a file that fails to open is skipped with one warning)."""
    if "copy" not in _loaded:
        with _lock:
            if "copy" not in _loaded:
                _loaded["copy"] = _open(artifact_path(folder, "copy"))
    lib = _loaded["copy"]
    return lib if isinstance(lib, ctypes.CDLL) else None


def _open(path: Path) -> ctypes.CDLL | None:
    if not path.exists():
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        _log.warning("ray_rdt_pool: the compiled copy helper %s does not load (%s); host "
                     "copies use memmove. Rebuild it with "
                     "`python -m ray_rdt_pool.memory.native build --force`", path, e)
        return None


def _import(path: Path) -> ModuleType | None:
    if not path.exists():
        return None
    try:
        loader = importlib.machinery.ExtensionFileLoader("ray_rdt_pool._native", str(path))
        spec = importlib.util.spec_from_file_location("ray_rdt_pool._native", path,
                                                      loader=loader)
        if spec is None:
            return None
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
    except ImportError as e:
        _log.warning("ray_rdt_pool: the compiled describe helper %s does not load (%s); "
                     "describe() uses its Python loop. Rebuild it with "
                     "`python -m ray_rdt_pool.memory.native build --force`", path, e)
        return None
    if mod.built_for() != build_tag():
        _log.warning("ray_rdt_pool: the compiled describe helper %s was built for torch %s, "
                     "this process runs %s; describe() uses its Python loop",
                     path, mod.built_for(), build_tag())
        return None
    return mod


def main(argv: list[str] | None = None) -> int:
    """``python -m ray_rdt_pool.memory.native build [--force] [--optional] | path``: build
    both helpers, or print where they are (exit status 1 when one is not built)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m ray_rdt_pool.memory.native",
                                description="Build or locate the compiled helpers.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile both helpers for this Python and torch")
    b.add_argument("--force", action="store_true", help="rebuild even if they exist")
    b.add_argument("--optional", action="store_true",
                   help="report a failed build and exit 0 (the helpers are optional)")
    sub.add_parser("path", help="print the helpers' paths; exit 1 when one is not built")
    args = p.parse_args(argv)
    if args.cmd == "path":
        paths = {name: artifact_path(helper=name) for name in HELPERS}
        for name, path in paths.items():
            print(f"{name}: {path}")
        return 0 if all(path.exists() for path in paths.values()) else 1
    failed = False
    for name in HELPERS:
        try:
            print(f"{name}: {build(force=args.force, helper=name)}")
        except NativeBuildError as e:
            failed = True
            print(f"ray_rdt_pool.memory.native: {e}", file=sys.stderr)
    return 1 if failed and not args.optional else 0
