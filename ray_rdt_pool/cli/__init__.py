"""The ``ray-rdt-pool`` command: ``bench``, ``stats`` and ``doctor``.

Each subcommand hands the rest of the command line to its module's ``main``:
:mod:`ray_rdt_pool.bench.run` (the side-by-side benchmark), :mod:`ray_rdt_pool.cli.stats_table`
(the pool table of a cluster's actors) and :mod:`ray_rdt_pool.cli.doctor` (checks of this
installation, each with its fix). The library never imports this package.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

__all__ = ["main"]

_USAGE = """usage: ray-rdt-pool {bench,stats,doctor} [options]

  bench    the side-by-side benchmark: Ray's object store and NIXL against nixl_pool
           (--address ADDR joins a running cluster; --netns-nodes N --rate R measures the
           weight sync on network-namespace nodes of this host)
  stats    the nixl_pool table of a cluster's actors (pool, arena, registrations)
  doctor   check versions, NIXL's backends, UCX between two actors, shared memory and
           the compiled helpers; says what to fix, exits 1 when a check fails

ray-rdt-pool COMMAND --help for each command's options.
"""


def _bench(argv: Sequence[str]) -> int:
    from ray_rdt_pool.bench.run import main

    return main(argv)


def _stats(argv: Sequence[str]) -> int:
    from ray_rdt_pool.cli.stats_table import main

    return main(argv, prog="ray-rdt-pool stats")


def _doctor(argv: Sequence[str]) -> int:
    from ray_rdt_pool.cli.doctor import main

    return main(argv)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "bench": _bench, "stats": _stats, "doctor": _doctor}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ray-rdt-pool COMMAND ARGS``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"ray-rdt-pool: unknown command {args[0]!r}\n\n{_USAGE}", end="", file=sys.stderr)
        return 2
    return command(args[1:])
