"""``ray-rdt-pool stats``: a table of the nixl_pool state of several actors, for a cluster.

Role: :func:`collect` asks each actor for its ``ray_rdt_pool.stats()`` (through Ray's
``actor.__ray_call__``, which runs a function with the actor instance as first argument
inside the actor's process) and adds the driver's own; :func:`pool_table` renders the rows
as a fixed-width text table::

    actor             pid    pool used/capacity     live  arena used/capacity  ...
    driver            1234   0 B/0 B                   0  0 B/0 B
    Sender 9a3f0c12   1301   1.5 MiB/64.0 MiB (2%)     1  0 B/0 B

Calls go to the ``_ray_system`` concurrency group that Ray creates for actors with
``enable_tensor_transport=True``, so a table can be taken while the actor is busy in a
long method. Command line (best effort, for an attached cluster)::

    ray-rdt-pool stats --address auto [--namespace NS] [--json] [--timeout-s 10]
    ray-rdt-pool stats --prometheus http://127.0.0.1:PORT/metrics

The first form lists the alive actors and asks the *named* ones that loaded the
transport (Ray gives another driver a handle to an actor only by name; unnamed actors
are counted on stderr). The second builds the table from Ray's metrics export, which
covers every process with metrics on. The table goes to stdout: it is the command's
output.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from ray_rdt_pool.errors import InvalidInputError

__all__ = [
    "COLUMNS", "collect", "main", "parse_prometheus", "pool_table", "render",
    "rows_from_prometheus", "scrape",
]

#: Column titles of :func:`pool_table`, in order.
COLUMNS: tuple[str, ...] = (
    "actor", "pid", "pool used/capacity", "live", "arena used/capacity", "arena live",
    "regs/deregs", "fallbacks", "errors",
)


def _actor_stats(actor_self: Any, only_if_loaded: bool = False) -> dict[str, Any] | None:
    """Runs inside the actor: its transport stats as a dict (None if not loaded)."""
    if only_if_loaded and "ray_rdt_pool._ray.transport" not in sys.modules:
        return None
    from ray_rdt_pool._ray.runtime import stats

    row = stats().as_dict()
    row["pid"] = os.getpid()
    return row


def _label(actor: Any) -> str:
    actor_id = actor._actor_id.hex()
    try:
        cls = actor._ray_actor_creation_function_descriptor.class_name
    except Exception:
        cls = ""
    cls = cls.rsplit(".", 1)[-1]
    return f"{cls} {actor_id[:8]}" if cls else actor_id[:8]


def _submit(actor: Any, only_if_loaded: bool) -> Any:
    try:
        return actor.__ray_call__.options(concurrency_group="_ray_system").remote(
            _actor_stats, only_if_loaded)
    except Exception:  # an actor without enable_tensor_transport has no such group
        return actor.__ray_call__.remote(_actor_stats, only_if_loaded)


def collect(actors: Sequence[Any], include_driver: bool = True, timeout: float = 30.0,
            only_if_loaded: bool = False) -> list[dict[str, Any]]:
    """Stats rows of the driver (first, if ``include_driver``) and of each actor.

    Each row is ``TransportStats.as_dict()`` plus ``actor`` (a label), ``actor_id`` and
    ``pid``. An actor that fails or does not answer within ``timeout`` seconds (all actors
    together) gets a row with only ``actor``, ``actor_id`` and ``error``. With
    ``only_if_loaded``, actors whose process never imported the transport are left out.
    """
    import ray

    rows: list[dict[str, Any]] = []
    if include_driver:
        row = _actor_stats(None) or {}
        row.update(actor="driver", actor_id="driver")
        rows.append(row)
    pending: list[tuple[Any, Any]] = []
    for actor in actors:
        try:
            pending.append((actor, _submit(actor, only_if_loaded)))
        except Exception as e:
            rows.append({"actor": _label(actor), "actor_id": actor._actor_id.hex(),
                         "error": f"{type(e).__name__}: {e}"})
    refs = [ref for _a, ref in pending]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
    done = set(ready)
    for actor, ref in pending:
        base = {"actor": _label(actor), "actor_id": actor._actor_id.hex()}
        if ref not in done:
            rows.append({**base, "error": f"no answer within {timeout:g}s"})
            continue
        try:
            row = ray.get(ref)
        except Exception as e:
            rows.append({**base, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
            continue
        if row is None:
            continue
        rows.append({**row, **base})
    return rows


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _used(used: int, cap: int) -> str:
    text = f"{_size(used)}/{_size(cap)}"
    return f"{text} ({100 * used / cap:.0f}%)" if cap else text


def _cells(row: dict[str, Any]) -> list[str]:
    if "error" in row:
        return [row["actor"], "-", f"error: {row['error']}", *[""] * (len(COLUMNS) - 3)]
    return [
        str(row["actor"]),
        str(row.get("pid", "")),
        _used(row["pool_used"], row["pool_capacity"]),
        str(row["live_objects"]),
        _used(row["arena_used"], row["arena_capacity"]),
        str(row["arena_live_blocks"]),
        f"{row['nixl_registrations']}/{row['nixl_deregistrations']}",
        str(row["fallbacks"]),
        str(row["transfer_errors"]),
    ]


def render(rows: Sequence[dict[str, Any]]) -> str:
    """The rows of :func:`collect` as a fixed-width text table (one line per row)."""
    table = [list(COLUMNS), *(_cells(r) for r in rows)]
    normal = [r for r in table if not r[2].startswith("error:")]
    widths = [max(len(r[i]) for r in normal) for i in range(len(COLUMNS))]
    numeric = {1, 3, 5, 7, 8}
    lines = []
    for r in table:
        if r[2].startswith("error:"):
            lines.append(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]}")
            continue
        cells = [c.rjust(w) if i in numeric else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def pool_table(actors: Sequence[Any], include_driver: bool = True,
               timeout: float = 30.0) -> str:
    """Collect the stats of the driver and ``actors`` and render them as a text table."""
    return render(collect(actors, include_driver=include_driver, timeout=timeout))


#: Prometheus series (without the ``ray_`` prefix) -> row field, for :func:`rows_from_prometheus`.
_PROM_FIELDS: dict[str, str] = {
    "rdt_pool_sender_used_bytes": "pool_used",
    "rdt_pool_sender_capacity_bytes": "pool_capacity",
    "rdt_pool_sender_live_objects": "live_objects",
    "rdt_pool_arena_used_bytes": "arena_used",
    "rdt_pool_arena_capacity_bytes": "arena_capacity",
    "rdt_pool_arena_live_objects": "arena_live_blocks",
    "rdt_pool_nixl_registrations_total": "nixl_registrations",
    "rdt_pool_nixl_deregistrations_total": "nixl_deregistrations",
    "rdt_pool_fallbacks_total": "fallbacks",
    "rdt_pool_transfer_errors_total": "transfer_errors",
}


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition: ``(name, labels, value)`` each.

    Raises:
        InvalidInputError: if ``text`` is not in the Prometheus text format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [(s.name, s.labels, float(s.value))
                for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError as e:
        raise InvalidInputError(
            f"the text is not in the Prometheus text format ({e}); read Ray's metrics "
            "export, http://HOST:PORT/metrics with the PORT given to "
            "ray.init(_metrics_export_port=PORT)") from e


def scrape(url: str, timeout: float = 5.0) -> list[tuple[str, dict[str, str], float]]:
    """Fetch ``url`` (a Prometheus ``/metrics`` endpoint) and parse it."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse_prometheus(resp.read().decode("utf-8", "replace"))


def rows_from_prometheus(samples: Sequence[tuple[str, dict[str, str], float]]
                         ) -> list[dict[str, Any]]:
    """Table rows built from Ray's exported ``ray_rdt_pool_*`` series, one per process."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for name, labels, value in samples:
        field = _PROM_FIELDS.get(name.removeprefix("ray_"))
        # NaN and +Inf are valid samples of the format (a gauge never set): no count.
        if field is None or "actor" not in labels or not math.isfinite(value):
            continue
        actor = labels["actor"]
        key = (actor, labels.get("WorkerId", ""))
        row = rows.get(key)
        if row is None:
            label = f"driver {key[1][:8]}" if actor == "driver" else actor[:16]
            row = rows[key] = {"actor": label, "actor_id": actor, "pid": "",
                               **dict.fromkeys(_PROM_FIELDS.values(), 0)}
        if field == "transfer_errors":
            row[field] += int(value)
        else:
            row[field] = int(value)
    return sorted(rows.values(), key=lambda r: r["actor"])


def _alive_actors() -> list[dict[str, Any]]:
    """Alive actors of the connected cluster, as dicts with actor_id, class_name, name,
    namespace (read from its GCS: never another cluster's)."""
    from ray_rdt_pool._ray.patches import alive_actors

    return alive_actors()


def _reachable_handles(alive: Sequence[dict[str, Any]], namespace: str | None
                       ) -> tuple[list[Any], int]:
    """Handles of the named actors among ``alive``, and how many could not be reached.

    Ray hands out handles to an actor another driver created only by name
    (``ray.get_actor``), so unnamed actors are counted, not shown.
    """
    import ray

    handles, missed = [], 0
    for a in alive:
        if not a["name"]:
            missed += 1
            continue
        try:
            handles.append(ray.get_actor(a["name"], namespace=a["namespace"] or namespace))
        except Exception:
            missed += 1
    return handles, missed


def main(argv: Sequence[str] | None = None, prog: str = "ray-rdt-pool stats"
         ) -> int:
    """``ray-rdt-pool stats``: print the table for every actor with the transport."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Show the nixl_pool sender pool and receive arena of every alive named "
                    "actor that loaded the transport, or of every process that exports "
                    "the transport's metrics (--prometheus).")
    parser.add_argument("--address", default="auto", help="Ray cluster address (auto)")
    parser.add_argument("--namespace", default=None, help="namespace of the named actors")
    parser.add_argument("--timeout-s", type=float, default=10.0,
                        help="seconds to wait for all actors together")
    parser.add_argument("--prometheus", metavar="URL", default=None,
                        help="build the table from Ray's metrics export instead, e.g. "
                             "http://127.0.0.1:8080/metrics (covers unnamed actors)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)

    if args.prometheus:
        try:
            rows = rows_from_prometheus(scrape(args.prometheus, timeout=args.timeout_s))
        except InvalidInputError as e:
            print(f"{args.prometheus}: {e}", file=sys.stderr)
            return 2
    else:
        import ray

        ray.init(address=args.address, namespace=args.namespace, log_to_driver=False,
                 logging_level=logging.WARNING)
        try:
            alive = _alive_actors()
            handles, missed = _reachable_handles(alive, args.namespace)
            rows = collect(handles, include_driver=False, timeout=args.timeout_s,
                           only_if_loaded=True)
        finally:
            ray.shutdown()
        if missed:
            print(f"{missed} of {len(alive)} alive actors are unnamed (or in another "
                  "namespace) and cannot be reached from this driver; use pool_table() in "
                  "the driver that holds their handles, or --prometheus URL",
                  file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1, sort_keys=True))
    elif rows:
        print(render(rows))
    else:
        print("no process with ray_rdt_pool found", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
