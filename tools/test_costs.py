"""Regenerate the cost table of tests/conftest.py from a measured run (``make test-costs``).

Runs the suite once as ``make test`` does, with ``--durations=0``, sums each work unit's
set-up, call and teardown seconds (a module of integration/, stress/ or gpu/, or one test
of the modules that run test by test: tests/conftest.py ``_PER_TEST``), and rewrites the
table between the ``# BEGIN COSTS`` and ``# END COSTS`` lines of tests/conftest.py with
every unit of at least ``--min-s`` seconds. The scheduler hands out the longest units
first, so that none starts last and leaves the other workers idle; a unit not in the
table counts 1 s per test.

    python tools/test_costs.py [--workers N] [--min-s S] [--from-log FILE] -- PYTEST_ARGS

``--from-log`` reads the durations of an earlier run's output instead of running one.
The run's own output goes to stdout as it comes; a failed run writes no table.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFTEST = ROOT / "tests" / "conftest.py"
BEGIN, END = "# BEGIN COSTS", "# END COSTS"
_LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)")


def unit_costs(lines: list[str], per_test: set[str]) -> dict[str, float]:
    """Seconds per work unit (the keys of conftest's ``_COST``) from ``--durations`` lines:
    a module's sum, or for a test of a per-test module (or of unit/) the mean of its
    parametrized cases, each of which is a unit of its own."""
    total: dict[str, float] = defaultdict(float)
    cases: dict[str, set[str]] = defaultdict(set)
    for line in lines:
        m = _LINE.match(line)
        if not m:
            continue
        seconds, nodeid = float(m.group(1)), m.group(3)
        path, _, name = nodeid.partition("::")
        rel = path.split("tests/", 1)[-1] if path.startswith("tests/") else path
        top = rel.split("/", 1)[0]
        if rel in per_test or top not in ("integration", "stress", "gpu"):
            key = f"{rel}::{name.split('[', 1)[0]}"
            cases[key].add(nodeid)
        else:
            key = rel
        total[key] += seconds
    return {k: v / max(1, len(cases.get(k, ()))) for k, v in total.items()}


def _entry(key: str, seconds: float) -> str:
    line = f"    {key!r}: {max(1, round(seconds))},\n"
    if len(line) <= 101:
        return line
    head, _, tail = key.rpartition("::")  # two literals, one string
    return f"    {head + '::'!r}\n    {tail!r}: {max(1, round(seconds))},\n"


def render(costs: dict[str, float], min_s: float) -> str:
    rows = sorted(((k, v) for k, v in costs.items() if v >= min_s), key=lambda kv: -kv[1])
    body = "".join(_entry(k, v) for k, v in rows)
    return (f"{BEGIN} (written by tools/test_costs.py from a measured run: make test-costs)\n"
            f"_COST = {{\n{body}}}\n{END}")


def write_table(table: str) -> None:
    text = CONFTEST.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    CONFTEST.write_text(text[:start] + table + text[end:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="2", help="pytest-xdist workers (as make test)")
    ap.add_argument("--min-s", type=float, default=5.0,
                    help="units shorter than this stay out of the table (default 5)")
    ap.add_argument("--from-log", type=Path, help="parse this earlier run's output instead")
    ap.add_argument("pytest_args", nargs="*", default=["tests"])
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.conftest import _PER_TEST

    if args.from_log is not None:
        lines = args.from_log.read_text().splitlines()
    else:
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
               "-n", args.workers, "--dist", "loadscope", "--no-loadscope-reorder",
               "--durations=0", "--durations-min=0", *args.pytest_args]
        print("running:", " ".join(cmd), flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line.rstrip("\n"))
        if proc.wait() != 0:
            print(f"the run failed (exit {proc.returncode}): the table is unchanged",
                  file=sys.stderr)
            return 1
    costs = unit_costs(lines, set(_PER_TEST))
    if not costs:
        print("no --durations lines found: the table is unchanged", file=sys.stderr)
        return 1
    table = render(costs, args.min_s)
    write_table(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
