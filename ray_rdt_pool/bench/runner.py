"""The measuring loop of the side-by-side benchmark: actor pairs and the :class:`Runner`.

A :class:`Pair` is one variant's sender and receiver actors (:mod:`ray_rdt_pool.bench.actors`);
the :class:`Runner` times each workload's transfers over them and records one sample per
repetition (the phases are described in :mod:`ray_rdt_pool.bench.run`).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Any

from ray_rdt_pool.bench import workloads as W
from ray_rdt_pool.bench.actors import Receiver, Sender
from ray_rdt_pool.bench.options import MIB, BenchError, Config
from ray_rdt_pool.bench.progress import Progress, measure_idle, pid_gone
from ray_rdt_pool.bench.variants import (
    OUR_VARIANTS,
    ZERO_COPY_ENV,
    Variant,
    our_transport_unavailable_reason,
    register_ours,
    transferqueue_unavailable_reason,
    variant_by_name,
)


@dataclasses.dataclass
class Pair:
    variant: Variant
    sender: Any
    receiver: Any
    infos: dict[str, Any]
    broken: bool = False

    @property
    def pids(self) -> dict[str, int]:
        """The PIDs of the actors on this host (another host's PID means nothing here)."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        return {role: info["pid"] for role, info in self.infos.items()
                if info["node_id"] == here}


_CLASSES: dict[tuple[str, bool], Any] = {}


def _actor_class(role: str, rdt: bool) -> Any:
    """``ray.remote`` class for a role, with or without ``enable_tensor_transport``."""
    import ray

    key = (role, rdt)
    if key not in _CLASSES:
        base = Sender if role == "sender" else Receiver
        cls = type(f"{base.__name__}{'RDT' if rdt else 'Plain'}", (base,), {})
        _CLASSES[key] = ray.remote(  # type: ignore[call-overload]
            num_cpus=0, enable_tensor_transport=rdt)(cls)
    return _CLASSES[key]


def make_pair(variant: Variant, cfg: Config) -> Pair:
    """Start the variant's sender and receiver, wait until both are ready, check them."""
    import ray

    env = {ZERO_COPY_ENV: "1"} if variant.zero_copy else {}
    handles = {}
    for role in ("sender", "receiver"):
        opts: dict[str, Any] = {"max_restarts": 0}
        if cfg.placement is None:
            opts["resources"] = {role: 1}
        else:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                cfg.placement[role], soft=False)
        if env:
            opts["runtime_env"] = {"env_vars": env}
        handles[role] = _actor_class(role, variant.rdt).options(**opts).remote(
            variant, cfg.pool_bytes)
    infos = dict(zip(handles, ray.get([h.info.remote() for h in handles.values()],
                                      timeout=cfg.timeout_s)))
    pair = Pair(variant, handles["sender"], handles["receiver"], infos)
    zc = infos["sender"]["zero_copy_active"]
    if zc != variant.zero_copy:
        kill_pair(pair)
        raise BenchError(
            f"{variant.name}: {ZERO_COPY_ENV} is {'on' if zc else 'off'} in the sender's "
            f"serializer, expected {'on' if variant.zero_copy else 'off'}")
    if cfg.nodes == 2 and infos["sender"]["node_id"] == infos["receiver"]["node_id"]:
        kill_pair(pair)
        raise BenchError(f"{variant.name}: sender and receiver landed on the same node")
    if variant.tq:
        # The sender starts TransferQueue (its controller and storage actors are the
        # sender's children); only then can the receiver attach to it.
        try:
            infos["sender"]["tq_init_s"] = ray.get(pair.sender.tq_init.remote(),
                                                   timeout=cfg.timeout_s)
            infos["receiver"]["tq_init_s"] = ray.get(pair.receiver.tq_init.remote(),
                                                     timeout=cfg.timeout_s)
        except Exception:
            kill_pair(pair)
            raise
    return pair


def kill_pair(pair: Pair, wait_s: float = 20.0) -> None:
    """Kill both actors and wait until their processes are gone."""
    import ray

    if pair.variant.tq:
        # Stop TransferQueue's controller and storage actors cleanly; they would also go
        # with the sender (their owner), but not before their sockets time out.
        try:
            ray.get(pair.sender.tq_close.remote(), timeout=30)
        except Exception:
            pass
    for h in (pair.sender, pair.receiver):
        try:
            ray.kill(h, no_restart=True)
        except Exception:
            pass
    deadline = time.monotonic() + wait_s
    pids = list(pair.pids.values())
    while time.monotonic() < deadline and not all(pid_gone(p) for p in pids):
        time.sleep(0.05)


# ----------------------------------------------------------------------------- measuring


class Runner:
    """Runs the configured variants and workloads and collects samples."""

    def __init__(self, cfg: Config, progress: Progress) -> None:
        self.cfg = cfg
        self.progress = progress
        self.samples: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.mismatches: list[str] = []
        self.variant_info: dict[str, dict[str, Any]] = {}
        self.skipped: dict[str, dict[str, str]] = {}
        self.idle: dict[str, Any] = {}
        #: experience workloads: W.per_tensor_floor in our sender's process
        self.tensor_floor: dict[str, dict[str, Any]] = {}
        self._ours_registered = False
        order = [w for w in W.WORKLOADS if w in cfg.workloads]
        # sync first, on fresh actors, so its first iteration is really cold; the streamed
        # sync right after it, so the two weight-sync workloads run back to back.
        first = [w for w in W.SYNC_WORKLOADS if w in order]
        self.workload_order = first + [w for w in order if w not in first]
        self.specs = {w: W.make_spec(w, cfg.sizes) for w in self.workload_order}
        self.payloads = {w: W.payload_bytes(s) for w, s in self.specs.items()}

    def skip_reason(self, variant: Variant, workload: str) -> str | None:
        """Why a variant/workload pair is not measured (None: it is).

        Plain pickling of a row view (no zero-copy) writes the view's whole base storage,
        so ``objstore`` would serialize rows x weight bytes for ``views``; past half the
        object store that cannot finish in a sane time (or at all).
        """
        spec = self.specs[workload]
        if variant.tq and not spec.is_experience:
            return ("TransferQueue stores RL samples (kv_batch_put of a TensorDict, one key "
                    "per sample): measured on the experience workloads only")
        if variant.ours and variant.target and spec.is_stream:
            return ("the weights API lands every bucket in the receiver's tensors itself "
                    "(set_target_for_ref); that is the nixl_pool row")
        if variant.transport is None and not variant.zero_copy and workload == "views":
            s = self.cfg.sizes
            serialized = s.views_rows * s.views_rows * s.views_cols * 4
            if serialized > self.cfg.object_store_bytes // 2:
                return (f"pickle writes each view's whole {self.payloads[workload] / MIB:.1f}"
                        f" MiB base storage: {s.views_rows:,} views would serialize "
                        f"{serialized / (1 << 30):.1f} GiB (> half the object store)")
        return None

    def n_transfers(self, workload: str) -> int:
        spec = self.specs[workload]
        return spec.iterations if spec.is_sync else self.cfg.warmup + self.cfg.reps

    def _check_sum(self, sample: dict[str, Any], variant: str, workload: str, rep: int,
                   upd: dict[str, Any], res: dict[str, Any], where: str) -> None:
        """Compare the receiver's checksum with the sender's; record a mismatch."""
        sample["checksum_ok"] = res["checksum"] == upd["checksum"]
        if not sample["checksum_ok"]:
            msg = (f"CHECKSUM MISMATCH variant={variant} workload={workload} rep={rep}: "
                   f"sender {upd['checksum']:#x}, receiver {res['checksum']:#x} "
                   f"({res['n_tensors']} tensors {where})")
            self.mismatches.append(msg)
            self.progress.note(msg)

    def _failed_sample(self, sample: dict[str, Any], exc: Exception, variant: str,
                       workload: str, rep: int) -> dict[str, Any]:
        """Record a repetition that raised: the error on the sample, and a run failure."""
        sample["error"] = f"{type(exc).__name__}: {exc}"
        sample["traceback"] = traceback.format_exc(limit=8)
        self._fail(f"variant={variant} workload={workload} rep={rep}: "
                   f"{sample['error'].splitlines()[0][:300]}")
        return sample

    def _fail(self, text: str) -> None:
        self.failures.append(text)
        self.progress.note("FAIL: " + text)

    # -- availability ---------------------------------------------------------------

    def availability(self) -> dict[str, str]:
        """Reasons for variants that cannot run here (empty when all can)."""
        out = {}
        ours_reason = (our_transport_unavailable_reason()
                       if any(v in OUR_VARIANTS for v in self.cfg.variants) else None)
        for name in self.cfg.variants:
            v = variant_by_name(name)
            if v.ours and ours_reason:
                out[name] = ours_reason
            elif v.target and self.cfg.fetch == "arg":
                out[name] = "set_target_for_ref needs the ray.get path (--fetch get)"
            elif v.tq:
                why = transferqueue_unavailable_reason()
                if why is None and self.cfg.fetch == "arg":
                    why = "TransferQueue has no task-argument path (--fetch get only)"
                if why is not None:
                    out[name] = why
        return out

    def uses_transferqueue(self, unavailable: dict[str, str]) -> bool:
        """Whether TransferQueue's actors will be started (they need logical CPUs)."""
        return any(variant_by_name(n).tq and n not in unavailable for n in self.cfg.variants) \
            and any(s.is_experience for s in self.specs.values())

    def _register_ours_in_driver(self) -> None:
        if not self._ours_registered:
            register_ours(None)
            self._ours_registered = True

    # -- one transfer ---------------------------------------------------------------

    def transfer(self, pair: Pair, workload: str, rep: int, kind: str) -> dict[str, Any]:
        import ray

        if self.specs[workload].is_stream:
            return self.transfer_stream(pair, workload, rep, kind)
        cfg, v = self.cfg, pair.variant
        sample: dict[str, Any] = {"variant": v.name, "workload": workload, "rep": rep,
                                  "kind": kind, "payload_bytes": self.payloads[workload],
                                  "fetch_path": "kv_batch_get" if v.tq else cfg.fetch}
        try:
            upd = ray.get(pair.sender.refresh.remote(rep), timeout=cfg.timeout_s)
            sample.update(sender_update_s=upd["update_s"], sender_checksum_s=upd["checksum_s"],
                          checksum_sender=upd["checksum"])
            if v.tq:
                t0 = time.monotonic()
                res = ray.get(pair.receiver.tq_consume.remote(pair.sender.tq_produce.remote()),
                              timeout=cfg.timeout_s)
            elif cfg.fetch == "get":
                t0 = time.monotonic()
                res = ray.get(pair.receiver.consume.remote(pair.sender.produce.remote()),
                              timeout=cfg.timeout_s)
            else:
                method = pair.sender.produce_ret
                if v.transport is not None:
                    method = method.options(tensor_transport=v.transport)
                t0 = time.monotonic()
                res = ray.get(pair.receiver.consume_arg.remote(method.remote()),
                              timeout=cfg.timeout_s)
            rel = ray.get(pair.sender.wait_released.remote(cfg.release_timeout_s),
                          timeout=cfg.timeout_s + cfg.release_timeout_s)
        except Exception as exc:
            return self._failed_sample(sample, exc, v.name, workload, rep)
        got = res["r_got"]
        put_s = res["s_put_end"] - res["s_start"] if "s_start" in res else None
        fetch_s = got - res["r_start"] if cfg.fetch == "get" or v.tq else None
        if v.tq:
            release_s = res["release_s"]  # kv_clear of the batch in the receiver
        else:
            release_s = (rel["freed_at"] - res["r_end"]) if rel["freed_at"] else None
        sample.update(
            e2e_s=got - t0,
            put_s=put_s,
            fetch_s=fetch_s,
            # the sender's put and the receiver's get calls, with the hand-off between
            # them left out (the per-sample vs batched target compares these)
            put_get_s=put_s + fetch_s if put_s is not None and fetch_s is not None else None,
            dispatch_s=res["s_start"] - t0 if "s_start" in res else None,
            handoff_s=res["r_start"] - res["s_put_end"] if "s_put_end" in res else None,
            **_receiver_fields(res),
            meta_bytes=rel["meta_bytes"],
            release_s=release_s,
            release_timed_out=bool(v.rdt and rel["freed_at"] is None),
            gbps=self.payloads[workload] / (got - t0) / 1e9,
            # ours: the parts of put and get spent inside ray_rdt_pool itself
            ours_put_s=res.get("ours_put_s"),
            ours_get_s=res.get("ours_get_s"),
        )
        if rel.get("stats") is not None:
            sample["sender_stats"] = rel["stats"]
        self._check_sum(sample, v.name, workload, rep, upd, res, "received")
        if v.rdt and rel["freed_at"] is None:
            self.progress.note(f"warning: {v.name}/{workload} rep {rep}: object not freed "
                               f"within {cfg.release_timeout_s:.0f} s (release n/a)")
        if res["into_targets"] is False:
            self.progress.note(f"warning: {v.name}/{workload} rep {rep}: tensors were not "
                               "fetched into the target buffers")
        return sample

    def transfer_stream(self, pair: Pair, workload: str, rep: int, kind: str
                        ) -> dict[str, Any]:
        """One ``sync_stream`` step: update the weights in place, stream them, verify.

        ``e2e``: from the driver submitting the sender's stream to the moment the last
        bucket was in the receiver's weights. ``put``: the sender's ``ray.put`` calls of
        every bucket, summed; ``fetch``: the receiver's bucket loads, summed (they
        overlap each other, so put + fetch may exceed e2e).
        """
        import ray

        cfg, v = self.cfg, pair.variant
        sample: dict[str, Any] = {"variant": v.name, "workload": workload, "rep": rep,
                                  "kind": kind, "payload_bytes": self.payloads[workload],
                                  "fetch_path": "stream"}
        try:
            upd = ray.get(pair.sender.refresh.remote(rep), timeout=cfg.timeout_s)
            sample.update(sender_update_s=upd["update_s"], sender_checksum_s=upd["checksum_s"],
                          checksum_sender=upd["checksum"])
            t0 = time.monotonic()
            snd = ray.get(pair.sender.stream_to.remote(pair.receiver, cfg.timeout_s),
                          timeout=2 * cfg.timeout_s)
            res = ray.get(pair.receiver.stream_result.remote(), timeout=cfg.timeout_s)
            if res["r_got"] is None:
                raise BenchError("the stream ended but the receiver loaded no bucket")
        except Exception as exc:
            return self._failed_sample(sample, exc, v.name, workload, rep)
        got = res["r_got"]
        sample.update(
            e2e_s=got - t0,
            put_s=snd["put_s"],
            fetch_s=res["fetch_s"],
            dispatch_s=snd["s_start"] - t0,
            sender_stream_s=snd["s_end"] - snd["s_start"],
            **_receiver_fields(res),
            meta_bytes=snd["meta_bytes"],
            release_s=None,
            buckets=snd["buckets"],
            puts=snd["puts"],
            gbps=self.payloads[workload] / (got - t0) / 1e9,
        )
        for key in ("pool_wait_s", "fallbacks", "peak_pool_used", "ours_put_s",
                    "source_read_buckets", "reference_buckets"):
            if key in snd:
                sample[key] = snd[key]
        sample["ours_get_s"] = res.get("ours_get_s")
        self._check_sum(sample, v.name, workload, rep, upd, res, "in the receiver's weights")
        if res["into_targets"] is False:
            self.progress.note(f"warning: {v.name}/{workload} rep {rep}: buckets were not "
                               "fetched into the receiver's weights")
        return sample

    # -- one workload on one pair ----------------------------------------------------

    def _setup_workload(self, pair: Pair, workload: str) -> None:
        import ray

        spec = self.specs[workload]
        ray.get([pair.sender.build.remote(spec, self.cfg.seed),
                 pair.receiver.prepare.remote(spec)], timeout=self.cfg.timeout_s)

    def _teardown_workload(self, pair: Pair, workload: str) -> None:
        import ray

        if pair.variant.name == "nixl_pool" and workload in W.EXPERIENCE_WORKLOADS:
            try:  # context for the per-sample target, never a result: errors are noted
                self.tensor_floor[workload] = ray.get(pair.sender.tensor_floor.remote(),
                                                      timeout=self.cfg.timeout_s)
            except Exception as exc:
                self.tensor_floor[workload] = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            ray.get([pair.sender.drop.remote(), pair.receiver.drop.remote()],
                    timeout=self.cfg.timeout_s)
            if pair.variant.ours:
                stats = ray.get([pair.sender.stats.remote(), pair.receiver.stats.remote()],
                                timeout=self.cfg.timeout_s)
                for role, st in zip(("sender", "receiver"), stats):
                    self.variant_info[pair.variant.name].setdefault(
                        f"{role}_stats_after", {})[workload] = st
        except Exception as exc:
            pair.broken = True
            self._fail(f"variant={pair.variant.name} workload={workload}: teardown failed: "
                       f"{type(exc).__name__}: {exc}")

    def _kind(self, workload: str, i: int) -> str:
        if self.specs[workload].is_sync:
            return "cold" if i == 0 else "warm"
        return "warmup" if i < self.cfg.warmup else "measured"

    def _run_one(self, pair: Pair, workload: str, i: int) -> None:
        self.progress.label(f"{pair.variant.name}/{workload} {i + 1}/{self.n_transfers(workload)}")
        sample = self.transfer(pair, workload, i, self._kind(workload, i))
        self.samples.append(sample)
        if sample.get("error"):
            pair.broken = True
        self.progress.advance()

    def _new_pair(self, name: str) -> Pair | None:
        v = variant_by_name(name)
        try:
            if v.ours:
                self._register_ours_in_driver()
            pair = make_pair(v, self.cfg)
        except Exception as exc:
            self._fail(f"variant={name}: setup failed: {type(exc).__name__}: {exc}")
            self.variant_info[name]["setup_error"] = f"{type(exc).__name__}: {exc}"
            return None
        self.variant_info[name]["actors"] = pair.infos
        return pair

    def run(self, unavailable: dict[str, str]) -> None:
        names = [n for n in self.cfg.variants if n not in unavailable]
        for n in self.cfg.variants:
            v = variant_by_name(n)
            self.variant_info[n] = {"available": n not in unavailable,
                                    "reason": unavailable.get(n), "summary": v.summary,
                                    "transport": v.transport}
        if self.cfg.schedule == "sequential":
            for name in names:
                self._run_sequential(name)
        else:
            self._run_interleaved(names)

    def _measures_anything(self, name: str) -> bool:
        """False when every selected workload skips this variant: no actors are started
        for it (TransferQueue's start-up alone takes seconds)."""
        v = variant_by_name(name)
        return any(self.skip_reason(v, w) is None for w in self.workload_order)

    def _run_sequential(self, name: str) -> None:
        t_variant = time.monotonic()
        if not self._measures_anything(name):
            for workload in self.workload_order:
                reason = self.skip_reason(variant_by_name(name), workload)
                self.skipped.setdefault(workload, {})[name] = str(reason)
                self.progress.advance(self.n_transfers(workload))
            return
        pair = self._new_pair(name)
        self.variant_info[name]["actor_start_s"] = round(time.monotonic() - t_variant, 3)
        for workload in self.workload_order:
            skip = self.skip_reason(variant_by_name(name), workload)
            if skip:
                self.skipped.setdefault(workload, {})[name] = skip
            if pair is None or skip:
                self.progress.advance(self.n_transfers(workload))
                continue
            try:
                self._setup_workload(pair, workload)
            except Exception as exc:
                self._fail(f"variant={name} workload={workload}: setup failed: "
                           f"{type(exc).__name__}: {exc}")
                pair.broken = True
            done = 0
            while done < self.n_transfers(workload) and not pair.broken:
                self._run_one(pair, workload, done)
                done += 1
            self.progress.advance(self.n_transfers(workload) - done)
            if not pair.broken:
                self._teardown_workload(pair, workload)
            if pair.broken:  # start over with fresh actors for the next workload
                kill_pair(pair)
                pair = self._new_pair(name)
        if pair is not None:
            self.progress.label(f"{name} idle CPU")
            self.idle.update(measure_idle({name: pair.pids}, self.cfg.idle_s,
                                          self.cfg.idle_settle_s))
            kill_pair(pair)
        self.variant_info[name]["wall_s"] = round(time.monotonic() - t_variant, 3)

    def _run_interleaved(self, names: list[str]) -> None:
        pairs = {n: p for n in names
                 if self._measures_anything(n) and (p := self._new_pair(n)) is not None}
        for n in names:
            if n not in pairs and not self._measures_anything(n):
                for workload in self.workload_order:
                    self.skipped.setdefault(workload, {})[n] = str(
                        self.skip_reason(variant_by_name(n), workload))
                    self.progress.advance(self.n_transfers(workload))
        for workload in self.workload_order:
            active = {}
            for n, pair in pairs.items():
                skip = self.skip_reason(pair.variant, workload)
                if skip:
                    self.skipped.setdefault(workload, {})[n] = skip
                    self.progress.advance(self.n_transfers(workload))
                else:
                    active[n] = pair
            for n, pair in list(active.items()):
                try:
                    self._setup_workload(pair, workload)
                except Exception as exc:
                    self._fail(f"variant={n} workload={workload}: setup failed: {exc}")
                    pair.broken = True
            for i in range(self.n_transfers(workload)):
                for pair in active.values():
                    if pair.broken:
                        self.progress.advance()
                        continue
                    self._run_one(pair, workload, i)
            for n, pair in list(active.items()):
                if not pair.broken:
                    self._teardown_workload(pair, workload)
                if pair.broken:
                    kill_pair(pair)
                    fresh = self._new_pair(n)
                    if fresh is None:
                        del pairs[n]
                    else:
                        pairs[n] = fresh
        self.progress.label("idle CPU")
        self.idle.update(measure_idle({n: p.pids for n, p in pairs.items()}, self.cfg.idle_s,
                                       self.cfg.idle_settle_s))
        for pair in pairs.values():
            kill_pair(pair)


def _receiver_fields(res: dict[str, Any]) -> dict[str, Any]:
    """The fields of a sample that the receiver's result reports, whatever the workload."""
    return {"receiver_checksum_s": res["checksum_s"], "checksum_receiver": res["checksum"],
            "n_tensors_received": res["n_tensors"], "into_targets": res["into_targets"]}
