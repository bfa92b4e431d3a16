"""The command line of the test bed: its options and ``python -m ray_rdt_pool.bench.testbed``.

:func:`add_bed_args` and :func:`bed_from_args` give another command (such as
:mod:`ray_rdt_pool.bench.testbed_sync`) the test bed's options; :func:`main` runs a
driver on a test bed, checks whether one can run here, or cleans up leftovers.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ray_rdt_pool.bench.netns import TestBedError
from ray_rdt_pool.bench.netns_cleanup import cleanup_stale
from ray_rdt_pool.bench.testbed import TestBed


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """A SIGTERM ends the CLI through its `finally`s, so the test bed is cleaned up."""
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _env_pairs(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise SystemExit(f"--env takes KEY=VALUE, got {item!r}")
        out[k] = v
    return out


def add_bed_args(ap: argparse.ArgumentParser, nodes: int | None = 2) -> None:
    """The options of a test bed (shared by the CLIs that build one)."""
    if nodes is not None:
        ap.add_argument("--nodes", type=int, default=nodes, help="Ray nodes (node 0 is the head)")
    ap.add_argument("--rate", default="500mbit",
                    help="per-node link rate, egress and ingress, as tc writes it; 'none' = "
                         "unlimited (default 500mbit)")
    ap.add_argument("--burst", default="512kb", help="tbf burst (default 512kb)")
    ap.add_argument("--latency", default="100ms", help="tbf latency (default 100ms)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for every node and the driver (repeatable)")
    ap.add_argument("--num-cpus", type=int, default=1, help="CPUs each node advertises")
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the Ray logs in /tmp/rtb/<tag>/ after the run")


def bed_from_args(args: argparse.Namespace, nodes: int, env: Mapping[str, str] | None = None
                  ) -> TestBed:
    rate = None if str(args.rate).lower() in ("none", "0", "") else args.rate
    return TestBed(nodes=nodes, rate=rate, burst=args.burst, latency=args.latency,
                   env={**(env or {}), **_env_pairs(args.env)}, num_cpus=args.num_cpus,
                   keep_logs=args.keep_logs)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ray_rdt_pool.bench.testbed_cli",
        description="Run a Ray driver on a multi-node test bed: N Ray nodes in network "
                    "namespaces of this host, each link limited to --rate.",
        epilog="example: python -m ray_rdt_pool.bench.testbed --nodes 3 --rate 500mbit -- "
               "driver.py ARGS")
    add_bed_args(ap)
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="driver timeout, seconds")
    ap.add_argument("--check", action="store_true", help="say whether a test bed can run here")
    ap.add_argument("--cleanup", action="store_true",
                    help="remove the leftovers of crashed test-bed runs, then exit")
    ap.add_argument("-v", "--verbose", action="store_true", help="log every command")
    ap.add_argument("driver", nargs="?", help="the driver script (.py)")
    ap.add_argument("driver_args", nargs=argparse.REMAINDER, help="its arguments")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(message)s", stream=sys.stderr)
    if args.check:
        reason = TestBed.available()
        print("test bed: available" if reason is None else f"test bed: unavailable: {reason}")
        return 0 if reason is None else 1
    if args.cleanup:
        print(f"removed leftovers of runs: {cleanup_stale() or 'none'}")
        return 0
    if not args.driver:
        ap.error("give a driver script (after --), or --check / --cleanup")
    driver_args = args.driver_args[1:] if args.driver_args[:1] == ["--"] else args.driver_args
    with _sigterm_as_exit(), bed_from_args(args, args.nodes) as bed:
        print(f"test bed {bed.tag}: {bed.n} nodes {[n.ip for n in bed.nodes]}, rate "
              f"{bed.rate or 'unlimited'}, up in {bed.timings['bring_up']:.1f} s",
              file=sys.stderr)
        try:
            bed.run_driver(args.driver, driver_args, timeout=args.timeout_s, echo=True)
        except TestBedError as e:
            print(str(e).split("\n", 1)[0], file=sys.stderr)
            return 1
    return 0
