"""The optional helper compiled against the installed torch (``_native.cpp``): builds it
and loads it.

Torch layer: imports torch (lazily, inside the functions), never Ray or NIXL.

What it is for: :func:`ray_rdt_pool.memory.tensors.describe` reads seven facts off every tensor
of an object. The helper reads them in C++, straight off each tensor, several times
faster than the Python loop for objects of thousands of tensors. The helper is
optional: without it ``describe`` runs its Python loop, with the same results.

Built on request, never at import and never during a put: ``python -m ray_rdt_pool.memory.native
build`` (``make venv`` runs it) compiles ``_native.cpp`` with the system C++ compiler
(``$CXX``, else ``c++``) against the headers and libraries of the torch installed in this
environment. The result goes to a cache folder (``RAY_RDT_POOL_NATIVE_DIR``, default
``~/.cache/ray_rdt_pool/native``) under a file name keyed by that torch build (version and
git revision), this Python's extension suffix and the source's hash. A build for another
torch is never loaded: after a torch upgrade the helper is simply absent until it is
rebuilt. The C++ code reads torch's in-memory structures through inline functions, so
running it against a torch it was not compiled for could read wrong facts.

Lifetime: the built file lives until the cache folder is cleared; a loaded helper lives
until the process exits. :func:`load` runs once per process, on the first ``describe``
that may use it, under a lock, on whichever thread calls it.
"""

from __future__ import annotations

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
from pathlib import Path
from types import ModuleType

from ray_rdt_pool.errors import NativeBuildError

__all__ = ["artifact_path", "build", "build_tag", "cache_dir", "load", "main"]

_log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_native.cpp")
#: Environment variable naming the folder of built helpers.
DIR_ENV = "RAY_RDT_POOL_NATIVE_DIR"

_lock = threading.Lock()
_loaded = False
_module: ModuleType | None = None


def cache_dir() -> Path:
    """Where built helpers live: ``$RAY_RDT_POOL_NATIVE_DIR``, else the user cache."""
    env = os.environ.get(DIR_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ray_rdt_pool" / "native"


def build_tag() -> str:
    """The torch build a helper must be compiled for to load here: version and git
    revision of the installed torch."""
    import torch

    git = (getattr(torch.version, "git_version", None) or "unknown")[:12]
    return f"{torch.__version__}-{git}"


def artifact_path(folder: Path | None = None) -> Path:
    """The file a build for this torch, this Python and this source writes and a load
    reads."""
    src = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    safe = "".join(c if c.isalnum() or c in "-." else "_" for c in build_tag())
    return (folder or cache_dir()) / f"_native-torch{safe}-{src}{suffix}"


def _command(out: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    cxx = shlex.split(os.environ.get("CXX") or "c++")
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    incs = [f"-I{p}" for p in cpp_extension.include_paths()]
    incs.append(f"-I{sysconfig.get_paths()['include']}")
    libs = cpp_extension.library_paths()
    return [*cxx, "-O2", "-shared", "-fPIC", "-std=c++20", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f'-DTORCH_BUILD_TAG="{build_tag()}"',
            *incs, str(SOURCE), "-o", str(out),
            *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs),
            "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def build(folder: Path | None = None, *, force: bool = False) -> Path:
    """Compile the helper for the installed torch unless that build exists; return its path.

    Raises NativeBuildError when the compiler is missing or fails (the message carries
    its last output). The file appears whole or not at all (written next to its place,
    then renamed), so processes that load while another builds never see half a file.
    """
    out = artifact_path(folder)
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".building-", suffix=out.suffix, dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    cmd = _command(tmp)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise NativeBuildError(
            f"cannot run the C++ compiler {cmd[0]!r} ({e}); install one (g++ or clang++) "
            "or set CXX, then run `python -m ray_rdt_pool.memory.native build` again. Without "
            "the helper describe() uses its Python loop") from e
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise NativeBuildError(
            f"compiling {SOURCE.name} exited with status {proc.returncode}:\n"
            + "\n".join(tail) + "\nWithout the helper describe() uses its Python loop")
    os.replace(tmp, out)
    return out


def load(folder: Path | None = None) -> ModuleType | None:
    """The helper built for this torch, imported once per process; None without one.

    A file that fails to import, or reports another torch build than this process runs,
    is skipped with one warning. The caller checks the helper's answers before trusting
    them (:mod:`ray_rdt_pool.memory.tensors` compares it with the Python loop on probe tensors).
    """
    global _loaded, _module
    if _loaded:
        return _module
    with _lock:
        if not _loaded:
            _module = _import(artifact_path(folder))
            _loaded = True
    return _module


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
    """``python -m ray_rdt_pool.memory.native build [--force] | path``: build the helper for the
    installed torch, or print where it is (exit status 1 when it is not built)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m ray_rdt_pool.memory.native",
                                description="Build or locate the compiled describe helper.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the helper for the installed torch")
    b.add_argument("--force", action="store_true", help="rebuild even if it exists")
    b.add_argument("--optional", action="store_true",
                   help="report a failed build and exit 0 (the helper is optional)")
    sub.add_parser("path", help="print the helper's path; exit 1 when it is not built")
    args = p.parse_args(argv)
    if args.cmd == "path":
        path = artifact_path()
        print(path)
        return 0 if path.exists() else 1
    try:
        print(build(force=args.force))
    except NativeBuildError as e:
        print(f"ray_rdt_pool.memory.native: {e}", file=sys.stderr)
        return 0 if args.optional else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
