"""Source reads: copying tensors straight out of a same-node source process's memory.

Owns nothing of its own: a read lands in the caller's targets or in a landing of the
receive arenas (whose views own it from then on), and no NIXL READ runs. Used by the
weights API's stream. Threads: the calling thread, plus up to ``read_lanes - 1`` pack
helpers for a read of ``read_split_bytes`` or more.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ray_rdt_pool.core.selection import SelectionPlan, plan_selection
from ray_rdt_pool.errors import InvalidInputError, TransferError
from ray_rdt_pool.receive.arena import Landing, Landings
from ray_rdt_pool.same_node.peer_memory import SourceProcess, peer_batch_reader, probe_source

if TYPE_CHECKING:
    import torch

    from ray_rdt_pool.config import PoolConfig
    from ray_rdt_pool.obs.events import Events

logger = logging.getLogger(__name__)

__all__ = ["SourceReader"]


class SourceReader:
    """Reads out of same-node source processes into the receive arenas (a part of the
    receiver)."""

    def __init__(self, config: PoolConfig, events: Events, landings: Landings,
                 node_id: Callable[[], str | None]) -> None:
        self.config = config
        self.events = events
        self.landings = landings
        self._node_id = node_id

    def can_read(self, src: SourceProcess) -> bool:
        """Whether tensors of ``src`` can be read straight out of its memory: it runs on
        this Ray node, ``same_node`` is not ``"off"`` here, and a read of its probe
        succeeds (the kernel may forbid reading another process)."""
        if self.config.same_node == "off" or not isinstance(src, SourceProcess):
            return False
        node = self._node_id()
        return node is not None and node == src.node and probe_source(src)

    def read(self, src: SourceProcess, tensors: Sequence[tuple[int, tuple[int, ...], str]],
             selection: Sequence[Any] | None = None,
             targets: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Copy tensors, given as ``(address, shape, dtype name)`` in ``src``, out of that
        process's memory: into ``targets`` (contiguous CPU tensors of exactly those
        sizes), or else into a block of the receive arena whose views are returned (a
        temporary buffer when the arena is full), only the ``selection`` of each if given
        (as :func:`plan_selection`). One copy, no NIXL. Runs on the calling thread and
        up to ``read_lanes - 1`` pack helpers for ``read_split_bytes`` or more.

        Raises TransferError when the source process is gone or the kernel refuses a
        read (nothing is returned; a target may hold part of the bytes), and
        InvalidInputError for targets that do not match.
        """
        from ray_rdt_pool.core.runs import DTYPES
        from ray_rdt_pool.memory.pack_pool import copy_moves

        t_start = time.perf_counter()
        sizes = []
        for _addr, shape, dt in tensors:
            if dt not in DTYPES:
                raise InvalidInputError(f"unknown dtype {dt!r} in a source read")
            sizes.append(math.prod(shape) * DTYPES[dt][1])
        landing: Landing | None = None
        sel: SelectionPlan | None = None
        if targets is not None:
            if len(targets) != len(tensors) or selection is not None:
                raise InvalidInputError(
                    f"{len(targets)} targets for {len(tensors)} source tensors (and no "
                    "selection): pass one contiguous CPU target per tensor")
            for i, (t, n) in enumerate(zip(targets, sizes)):
                if t.device.type != "cpu" or not t.is_contiguous() or t.nbytes != n:
                    raise InvalidInputError(
                        f"target {i} ({tuple(t.shape)}, {t.dtype}, {t.device}) cannot hold "
                        f"source tensor {i} ({n} bytes): pass a contiguous CPU tensor of "
                        "that size")
            moves = [(t.data_ptr(), addr, n)
                     for t, (addr, _s, _d), n in zip(targets, tensors, sizes) if n]
        else:
            sel = plan_selection([(shape, dt) for _a, shape, dt in tensors],
                                 [addr for addr, _s, _d in tensors],
                                 selection if selection is not None else [None] * len(tensors))
            if sel.total == 0:  # this receiver takes nothing of these tensors
                from ray_rdt_pool.memory.dtypes import empty_tensor, torch_dtype

                return [empty_tensor(shape, torch_dtype(dt))
                        for shape, dt in zip(sel.shapes, sel.dtypes)]
            landing = self.landings.local(sel.total)
            moves = [(landing.addr + lo, addr, n) for lo, addr, n in sel.ranges]
        nbytes = sum(n for _d, _s, n in moves)
        tuning = self.config.tuning
        threads = tuning.read_lane_count if nbytes >= tuning.read_split_bytes else 1
        try:
            if not src.alive():
                raise OSError(3, f"process {src.pid} has exited")
            copy_moves(moves, threads, batch=peer_batch_reader(src.pid))
        except OSError as e:
            if landing is not None:
                self.landings.release(landing)
            self.events.error("err")
            raise TransferError(
                f"reading {nbytes} bytes of {len(tensors)} tensor(s) out of sender process "
                f"{src.pid} failed ({e}); it has probably exited. Sync again from a live "
                "sender") from e
        except BaseException:
            if landing is not None:
                self.landings.release(landing)
            raise
        self.events.add("source_reads")
        self.events.add("bytes_received", nbytes)
        if self.config.debug_transfers:
            logger.debug("read %d tensors, %d bytes in place from pid %d", len(tensors),
                         nbytes, src.pid)
        self.events.notify("fetch", nbytes, time.perf_counter() - t_start)
        if targets is not None:
            return list(targets)
        assert landing is not None and sel is not None
        return self.landings.selected_views(landing, sel)
