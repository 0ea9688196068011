"""One of the two processes of ``gpuxfer bench kv`` (the sweep is described in :mod:`.runner`).

:class:`Worker` sets up its side (device, CPU group, pool, engines usable on both sides), runs the
sweep (every point, batch, direction and engine: prepare, warm-up, timed bursts, verification) and
reports events (``start``, ``row``, ``shed``, ``note``, ``error``, ``done``) to a sink: rank 0 reports,
any rank reports its own error.
"""
from __future__ import annotations

import datetime as _dt
import logging
import os
import socket
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable

from ... import config
from ...common import run_versions
from ...errors import BackendUnavailable, BadInput, GpuxferError, PlatformUnavailable
from . import engines as E
from ..cpus import AUTO, current_cpu, fastest_cpu, pin, pin_auto, python_speed_us
from ..timing import now
from . import report as R
from .checks import _flip_byte, _moves_one_copy, _pool_fill, _pool_verify, _read8, _suite_fill, _sync, \
    fault_matches, stray_offset
from .group import _Group, _boot_id

if TYPE_CHECKING:
    from .runconfig import RunConfig

log = logging.getLogger("gpuxfer.bench.kv.worker")

TRACE_ENV = "GPUXFER_KV_TRACE"
#: a first warm-up burst slower than this skips the other warm-ups
SLOW_BURST_S = 1.0


class Worker:
    """One of the two processes."""

    def __init__(self, rank: int, cfg: RunConfig, sink: Callable[[str, dict], None], *, init_method: str,
                 launcher: str, local_rank: int | None = None):
        self.rank, self.cfg, self.sink = rank, cfg, sink
        self.init_method, self.launcher = init_method, launcher
        self.local_rank = rank if local_rank is None else local_rank
        self.role = E.Role.SOURCE if rank == 0 else E.Role.DESTINATION
        self.platform = None
        self.group: _Group | None = None
        self.pool = None
        self.peer_pool = None
        self.engines: dict[str, E.Engine] = {}
        self.stream = None
        self.ceilings: dict[tuple, tuple] = {}     # (p50 GB/s, fastest burst's GB/s) of each ceiling row
        self.cross_host = False         # the ranks are on different hosts (or --cross-host): no peer mapping
        self.cpu_part: tuple[int, ...] | None = None     # --cpus auto: this rank's cores, the fastest picked per row

    # -- emit (rank 0 reports; any rank reports its own error)
    def emit(self, kind: str, payload: dict) -> None:
        if self.rank == 0 or kind == "error":
            self.sink(kind, payload)

    def run(self) -> int:
        try:
            self._setup()
            self._sweep()
            if self.rank == 0:
                self.emit("done", {})
            self.group.barrier()
        except BaseException as exc:  # noqa: BLE001 - reported, then the process fails
            text = f"rank {self.rank} ({self.role.serving_name}): {type(exc).__name__}: {exc}"
            if not isinstance(exc, GpuxferError):
                text += "\n" + traceback.format_exc()
            try:
                self.sink("error", {"text": text, "rank": self.rank})
            except Exception:  # noqa: BLE001
                print(text, file=sys.stderr)
            self._abort()
            self._teardown(failed=True)
            return 1
        self._teardown(failed=False)
        return 0

    # -- setup
    def _setup(self) -> None:
        from ...platforms import get_platform
        cfg = self.cfg
        if cfg.cpus is not None and cfg.cpus != AUTO:
            pin(cfg.cpus[self.rank])
        # Streams blocked in flag waits must not share a hardware queue with the streams that
        # release them: give every stream its own (CUDA reads this when it initialises).
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
        self.platform = plat = get_platform(cfg.platform)
        n = plat.device_count()
        if n < 1:
            raise PlatformUnavailable(cfg.platform, "no device")
        if cfg.devices:
            dev = cfg.devices[self.rank]
        else:
            dev = self.local_rank if n >= 2 else 0
        if dev >= n:
            raise BadInput(f"rank {self.rank}: device {dev} does not exist ({n} device(s))")
        self.device = dev
        plat.set_device(dev)
        if not plat.host_memory:
            import torch
            torch.cuda.set_device(dev)
        self.group = _Group(self.rank, self.init_method, cfg.timeout_s)
        info = plat.device_info(dev)
        pick = None
        if cfg.cpus == AUTO:    # this rank's part of the cores near its GPU, the fastest picked again per row
            self.cpu_part, pick = pin_auto(self.rank, 2, None if plat.is_emulation else info.pci_bus_id)
        mine = {"rank": self.rank, "role": f"{self.role.serving_name} ({self.role.value})", "pid": os.getpid(),
                "device": dev, "info": info.as_dict(), "free_bytes": info.free_bytes,
                "engines": {name: E.engine_unavailable_reason(name, plat) for name in cfg.engines},
                "host": socket.gethostname(), "boot_id": _boot_id(), "cross_host_forced": cfg.cross_host,
                "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "cpu_pick": pick}
        both = self.group.gather(mine)
        # Cross-host mode (docs/MULTINODE.md): the peer's pool cannot be mapped over IPC, so it never is;
        # engines that need the mapping are unusable, and nixl-bulk is the ceiling.
        self.cross_host = (any(b["cross_host_forced"] for b in both) or both[0]["host"] != both[1]["host"]
                           or both[0]["boot_id"] != both[1]["boot_id"])
        same_device = both[0]["device"] == both[1]["device"] and not self.cross_host
        frees = [b["free_bytes"] for b in both if b["free_bytes"] is not None]
        grid = self._grid(min(frees) if frees else None, 2 if same_device else 1)
        self.grid = grid

        # engines usable on both sides
        usable, unusable = [], {}
        for name in E.measurement_order(cfg.engines, cross_host=self.cross_host):
            reasons = {b["rank"]: b["engines"][name] for b in both if b["engines"][name] is not None}
            why_not_across = E.engine_class(name).cross_host_reason() if self.cross_host else None
            if why_not_across:
                unusable[name] = why_not_across
            elif reasons:
                unusable[name] = "; ".join(f"rank {r}: {why}" for r, why in reasons.items())
            else:
                usable.append(name)
        env = self._environment(both, same_device)

        # pools
        nbytes = grid.max_pool_bytes
        if nbytes <= 0:
            raise BadInput("nothing to measure: every batch of every point was shed (see --plan-only)")
        self.pool = plat.alloc(nbytes, dev)
        if not self.cross_host:
            handles = self.group.gather(self.pool.export())
            self.peer_pool = plat.open_handle(handles[1 - self.rank], dev)
        self.stream = plat.create_stream(dev)
        from .model.blocktable import derive_seed
        self.src_seed = derive_seed(cfg.seed, "pattern", "src") & ((1 << 62) - 1)
        self.dst_seed = derive_seed(cfg.seed, "pattern", "dst") & ((1 << 62) - 1)
        _pool_fill(plat, self.stream, self.pool, self.src_seed if self.role is E.Role.SOURCE else self.dst_seed)
        _sync(plat, self.stream, cfg.timeout_s, self.rank, "pattern fill")

        # pack: slots big enough that the largest burst is about pack_max_chunks chunks (an armed
        # burst must fit in the queues of its blocked streams; big chunks also copy faster)
        opts = cfg.engine_options
        biggest = max((p.burst_bytes(p.max_batch) for p in grid.points if p.batches), default=0)
        want = -(-biggest // opts.pack_max_chunks)
        if want > opts.pack_chunk_bytes and not cfg.pack_chunk_fixed:
            opts.pack_chunk_bytes = -(-want // (1 << 20)) << 20
        side = E.Side(platform=plat, device=dev, rank=self.rank, role=self.role, pool=self.pool,
                      peer_pool=self.peer_pool, exchange=self.group.gather, timeout_s=cfg.timeout_s,
                      options=cfg.engine_options, armed=cfg.armed)
        self.side = side
        side.open_streams()
        for name in usable:
            try:
                self.engines[name] = E.engine_class(name)(side)
            except BackendUnavailable as exc:   # an optional library failed its set-up: both sides raise together
                unusable[name] = str(exc)        # (the engine shares each side's error over the exchange)

        params = cfg.params()
        params["grid"] = grid.as_dict()
        shed, expected = self._shed_and_count(unusable)
        self.group.barrier()
        self.emit("start", {"env": env, "params": params, "shed": shed, "expected_rows": expected})
        if not self.engines:
            where = "with the ranks on different hosts" if self.cross_host else "here"
            raise BadInput(f"nothing could run: no engine of --engine is usable {where} (the shed lines say why)")
        if self.cross_host:
            ceiling = next((n for n, e in self.engines.items() if e.ceiling_across_hosts), None)
            self.emit("note", {"text": "cross-host mode: the peer pool is not mapped; % of ceiling is of "
                                       + (f"the {ceiling} row" if ceiling else "nothing (no ceiling engine runs)")})

    def _cpu_now(self) -> dict:
        """Before a row: with ``--cpus auto`` this rank moves to the fastest core of its part again (a virtual
        machine's CPUs change speed within seconds); the CPU it runs on and a Python yardstick's us there."""
        if self.cpu_part is not None:
            cpu, us, _ = fastest_cpu(self.cpu_part, passes=2)
            pin((cpu,))
        else:
            us = python_speed_us()
        return {"cpu": current_cpu(), "python_us": us}

    def _grid(self, free_bytes: int | None, pools_per_device: int):
        """The grid of the options, capped by this device's free memory (less what the engines reserve)."""
        free = None
        if free_bytes is not None:
            reserve = (self.cfg.engine_options.pack_chunk_bytes * self.cfg.engine_options.pack_slots
                       + (0 if self.platform.host_memory else (2 << 30)))
            free = max(0, int(free_bytes * 0.9) - reserve)
        return self.cfg.grid.build(free_memory_bytes=free, pools_per_device=pools_per_device)

    def _environment(self, both: list[dict], same_device: bool) -> dict:
        plat = self.platform
        if self.cross_host:
            link = {"src": both[0]["device"], "dst": both[1]["device"], "kind": "cross-host",
                    "detail": f"ranks on hosts {both[0]['host']} and {both[1]['host']}"
                              + (" (forced by --cross-host)" if any(b["cross_host_forced"] for b in both) else ""),
                    "peer_access": False}
        else:
            try:
                link = plat.link(both[0]["device"], both[1]["device"]).as_dict()
            except Exception as exc:  # noqa: BLE001
                link = {"src": both[0]["device"], "dst": both[1]["device"], "kind": "unknown", "detail": str(exc)}
        env = {
            "cpus_spec": self.cfg.cpus, "cpus_by_rank": [b["cpus"] for b in both],
            "cpu_pick_by_rank": [b["cpu_pick"] for b in both],
            "platform": plat.name, "platform_label": plat.label, "is_emulation": plat.is_emulation,
            "versions": run_versions(plat), "hostname": socket.gethostname(), "launcher": self.launcher,
            "pids": ",".join(str(b["pid"]) for b in both),
            "devices": [{k: b[k] for k in ("rank", "role", "pid", "device", "info")} for b in both],
            "same_device": same_device, "link": link,
            "engines": E.engine_report(plat),
            "engine_descriptions": {n: E.engine_class(n).description for n in self.cfg.engines},
            "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        if self.cross_host:
            env["cross_host"] = True
            env["hostnames"] = [b["host"] for b in both]
        return env

    def _shed_and_count(self, unusable: dict[str, str]) -> tuple[list[dict], int]:
        cfg = self.cfg
        shed: list[dict] = []
        expected = 0
        for name, why in unusable.items():
            shed.append({"engine": name, "reason": f"engine unusable here: {why}", "rows": 0})
        for p in self.grid.points:
            for s in p.shed:
                shed.append({"workload": p.workload.name, "page_tokens": p.page_tokens, "isl_tokens": p.isl_tokens,
                             "batch": s.batch, "reason": f"{s.reason}: {s.detail}", "rows": 0})
            for b in p.batches:
                for d in cfg.directions:
                    for name, eng in self.engines.items():
                        why = eng.shed_reason(E.BurstShape(b, p.burst_descriptors(b), p.burst_bytes(b)))
                        if why:
                            shed.append({"workload": p.workload.name, "page_tokens": p.page_tokens,
                                         "isl_tokens": p.isl_tokens, "batch": b, "engine": name, "direction": d,
                                         "reason": why, "rows": 0})
                        else:
                            expected += 1
        if cfg.suite:
            from . import collectivex as CX
            for bp in CX.bulk_points(self.grid):
                shape = E.BurstShape(1, 1, bp.request_bytes)
                expected += sum(1 for _ in cfg.directions for eng in self.engines.values()
                                if not eng.shed_reason(shape))
        return shed, expected

    # -- the sweep
    def _sweep(self) -> None:
        cfg = self.cfg
        for point in self.grid.points:
            if not point.batches:
                continue
            layout = point.layout()
            for batch in point.batches:
                pb = None
                for direction in cfg.directions:
                    if pb is None or cfg.suite:     # the suite's tables depend on the direction
                        pb = point.burst(batch, seed=cfg.seed, layout=layout,
                                         **({"direction": direction} if cfg.suite else {}))
                        # the block tables ride along: the engines through KVAgent move blocks by ID
                        burst = E.DescriptorBurst.from_plan(pb)
                        shape = E.BurstShape(batch, pb.descriptors, pb.total_bytes)
                    for name, eng in self.engines.items():
                        if eng.shed_reason(shape):
                            continue
                        row = self._row(eng, burst, pb, point, batch, direction)
                        if self.rank == 0:
                            key = (point.workload.name, point.isl_tokens, point.page_tokens, batch, direction)
                            if eng.ceiling_across_hosts if self.cross_host else eng.ceiling:
                                self.ceilings[key] = (row.get("p50_gbps"), row.get("max_gbps"))
                            R.apply_ceiling(row, *self.ceilings.get(key, (None, None)),
                                            judged=not self.platform.is_emulation)
                            self.emit("row", row)
        if cfg.suite:
            self._suite_bulk_rows()

    def _suite_bulk_rows(self) -> None:
        """The suite's bulk rows: per ISL and direction, every engine moves one descriptor (batch 1); the
        ceiling engine's row comes first and is the others' ceiling."""
        from . import collectivex as CX
        ceiling_first = sorted(self.engines.values(), key=lambda e: not (
            e.ceiling_across_hosts if self.cross_host else e.ceiling))
        for point in CX.bulk_points(self.grid):
            pb = point.burst(1)
            # one descriptor, no block tables: the KVAgent engines run it on their descriptor-table twins
            burst = E.DescriptorBurst(pb.requests, plan=pb.plan)
            for direction in self.cfg.directions:
                ceiling = None
                for eng in ceiling_first:
                    if eng.shed_reason(burst.shape):
                        continue
                    row = self._row(eng, burst, pb, point, 1, direction)
                    if self.rank == 0:
                        if ceiling is None and (eng.ceiling_across_hosts if self.cross_host else eng.ceiling):
                            ceiling = (row.get("p50_gbps"), row.get("max_gbps"))
                        R.apply_ceiling(row, *(ceiling or (None, None)), judged=not self.platform.is_emulation)
                        self.emit("row", row)

    def _load_burst(self, eng: E.Engine, p: E.Prepared) -> None:
        """An untimed first burst with no stream waiting on anything this process's host does later.

        NOTE [lazy kernel loading]: CUDA loads a kernel's module on its first launch, and
        loading waits for the device's queue to drain. If a stream of ours is then blocked on a
        flag that only a later host action releases (the gate, or a flag the peer sets after the
        barrier), the launch never returns: a deadlock. This burst makes every kernel (every
        Triton specialisation) the row launches load with nothing armed: the passive side posts
        after the barrier and the initiator enqueues directly.
        """
        p.gate = None
        self.group.barrier()
        eng.post(p)                     # both sides: enqueue now, no gate
        eng.wait(p)

    def _burst_once(self, eng: E.Engine, p: E.Prepared, arms: list[float],
                    posts: list[float] | None = None) -> float | None:
        """One burst: both sides arm (untimed), a barrier, then the initiator times post + wait
        (and, into ``posts``, the host time of post alone)."""
        t0 = now()
        eng.arm(p)                      # flag-gated: nothing runs before the initiator posts
        arms.append(now() - t0)
        self.group.barrier()
        if p.initiator:
            t0 = now()
            eng.post(p)
            t1 = now()
            eng.wait(p)
            t2 = now()
            if posts is not None:
                posts.append(t1 - t0)
            return t2 - t0
        eng.wait(p)
        return None

    def _trace_start(self):
        """``$GPUXFER_KV_TRACE`` (a directory, GPUs only): a torch.profiler timeline of each row's timed
        bursts, one file per rank (a tuning aid; the profiler's cost lands in the row's times)."""
        out = config.get(TRACE_ENV)
        if not out or self.platform.host_memory:
            return None
        import torch
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
        prof.start()
        return prof

    def _trace_stop(self, prof, name: str) -> None:
        prof.stop()
        out = config.get(TRACE_ENV)
        os.makedirs(out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out, f"{name}-rank{self.rank}.json"))

    def _row(self, eng: E.Engine, burst: E.DescriptorBurst, pb, point, batch: int, direction: str) -> dict:
        cfg = self.cfg
        ini_rank = 0 if eng.initiator(direction) is E.Role.SOURCE else 1
        row: dict[str, Any] = {
            "workload": point.workload.name, "page_tokens": point.page_tokens, "isl_tokens": point.isl_tokens,
            "batch": batch, "engine": eng.name, "direction": direction,
            "initiator": E.Role.SOURCE.serving_name if ini_rank == 0 else E.Role.DESTINATION.serving_name,
            "burst_bytes": pb.total_bytes, "descriptors": 1 if eng.ceiling else pb.descriptors,
            "plan_descriptors": pb.descriptors, "request_bytes": point.request_bytes,
            "request_descriptors": point.request_descriptors, "error": None,
        }
        if self.rank == 0:              # the progress bar names the row now running
            self.emit("running", {k: row[k] for k in ("engine", "direction", "page_tokens", "batch")})
        # 1. prepare, on both sides (on this rank's fastest core, with --cpus auto)
        cpu = self._cpu_now()
        p = None
        err = None
        t0 = now()
        try:
            p = eng.prepare(burst, direction)
        except (BadInput, BackendUnavailable) as exc:
            err = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        prep_s = now() - t0
        st = self.group.gather((err, prep_s))
        errs = [e for e, _ in st if e]
        if errs:
            if p is not None:
                eng.release(p)
            row.update(error="; ".join(errs), valid=False, verified=False, wrong_bytes=None)
            return R.finish_row(row, [])
        row["prep_ms"] = max(s for _, s in st) * 1e3
        row["prep_ms_by_side"] = {"prefill": st[0][1] * 1e3, "decode": st[1][1] * 1e3}

        # 2. a load burst (kernels only), warm-up, then timed bursts
        if eng.launches_kernels:
            self._load_burst(eng, p)
        arms: list[float] = []
        posts: list[float] = []         # host time of the initiator's post call, per timed burst
        if cfg.suite:
            samples, warm = self._suite_timing(eng, p, arms, posts)
        else:
            samples, warm = self._timed_bursts(eng, p, arms, ini_rank,
                                               f"{point.workload.name}-p{point.page_tokens}-b{batch}-{eng.name}-"
                                               f"{direction}", posts)
        extra = eng.row_extra() if p.initiator else None
        cpu["cpu_after"] = current_cpu()
        suite_verdict = self._suite_verify(eng, p, pb, point) if cfg.suite else None

        # 3. verification: scrub the destination, one more burst, check every byte
        plat = self.platform
        dst = self.role is E.Role.DESTINATION
        if dst:
            _pool_fill(plat, self.stream, self.pool, self.dst_seed)
            _sync(plat, self.stream, cfg.timeout_s, self.rank, "scrub of the destination pool")
        self._burst_once(eng, p, [])
        self.group.barrier()            # the initiator has seen the transfer land
        verdict = None
        if dst:
            vdesc = eng.verify_descriptors(burst)
            inject = fault_matches(cfg.inject_fault, eng.name, direction)
            at = (int(vdesc[0, 1]) if vdesc.shape[0] else None) if inject == "byte" else \
                stray_offset(vdesc, self.pool.nbytes) if inject == "stray" else None
            if at is not None:
                _flip_byte(plat, self.stream, self.pool, at)
            wrong, first, stray, first_stray = _pool_verify(plat, self.stream, self.pool, vdesc, self.src_seed,
                                                            cfg.timeout_s, self.rank, guard_seed=self.dst_seed)
            where = None
            if first >= 0:
                where = (pb.describe_row(first) if not eng.ceiling else
                         f"bytes [{int(vdesc[first, 1])}, {int(vdesc[first, 1] + vdesc[first, 2])}) of the bulk copy")
            elif stray:
                where = f"byte {first_stray} of the destination pool, outside every descriptor (a stray write)"
            verdict = {"wrong": wrong, "first": first, "where": where, "injected": at is not None, "stray": stray}
        eng.release(p)

        # 4. assemble on rank 0; an engine's own telemetry (e.g. NIXL's, unit-suffixed keys) comes from
        #    the initiator, taken right after the timed bursts
        got = self.group.gather({"samples": samples, "warm": warm, "verdict": verdict, "arms": arms,
                                 "posts": posts, "extra": extra or {}, "suite_verdict": suite_verdict,
                                 "cpu": cpu})
        timing = got[ini_rank]
        row.update(timing.get("extra") or {})
        v = got[1]["verdict"]
        row["post"] = "armed" if (cfg.armed and eng.armable) else "host"
        row["arm_p50_ms"] = R.sample_stats(timing["arms"])["p50_ms"]
        post_ms = R.sample_stats(timing["posts"])["p50_ms"]
        # host costs per request: the post call (the trigger alone when armed), and the setup (the
        # engine's own per-request figure, else the initiator's prep of the burst)
        row["post_p50_us"] = None if post_ms is None else post_ms * 1e3 / batch
        # where the initiator measured them: its CPU before the prepare and after the timed bursts, and a Python
        # yardstick's us there (a slow CPU makes slow host costs)
        row["initiator_cpus"] = [timing["cpu"]["cpu"], timing["cpu"]["cpu_after"]]
        row["initiator_python_us"] = timing["cpu"]["python_us"]
        if row.get("setup_us") is None:
            row["setup_us"] = row["prep_ms_by_side"][row["initiator"]] * 1e3 / batch
        row["arm_passive_p50_ms"] = R.sample_stats(got[1 - ini_rank]["arms"])["p50_ms"]
        row["warmup"] = len(timing["warm"])
        row["warmup_ms"] = [round(w * 1e3, 6) for w in timing["warm"]]
        R.finish_row(row, timing["samples"])
        row["wrong_bytes"] = v["wrong"] + v["stray"]     # inside the descriptors and outside (stray)
        row["stray_bytes"] = v["stray"]
        row["first_wrong_descriptor"] = v["first"] if v["first"] >= 0 else None
        row["first_wrong"] = v["where"]
        row["fault_injected"] = v["injected"]
        row["verified"] = True
        row["valid"] = row["wrong_bytes"] == 0
        if cfg.suite:
            row["suite"] = cfg.suite
            kind = getattr(point, "kind", "paged")
            row["kind"] = "ceiling" if kind == "paged" and _moves_one_copy(eng) else kind
            row["suite_verify"] = got[1]["suite_verdict"]
            row["valid"] = row["valid"] and row["suite_verify"]["passed"]
        return row

    def _timed_bursts(self, eng: E.Engine, p: E.Prepared, arms: list[float], ini_rank: int,
                      trace_name: str, posts: list[float]) -> tuple[list, list]:
        """Warm-up bursts (a slow first one skips the rest), then up to ``--trials`` timed ones (fewer when
        slow: a row aims at ``row_budget_s``). Returns (timed, warm-up) samples; ``arms`` gets the timed
        bursts' arm times, ``posts`` the host times of their post calls."""
        cfg = self.cfg
        warm: list = []
        for i in range(cfg.warmup):
            warm.append(self._burst_once(eng, p, arms))
            if i == 0 and cfg.warmup > 1:
                first = self.group.gather(warm[-1])[ini_rank]
                if first > SLOW_BURST_S:
                    break
        if warm:
            est = self.group.gather(warm[-1])[ini_rank]
            n_trials = int(min(cfg.trials, max(min(cfg.min_trials, cfg.trials), cfg.row_budget_s // max(est, 1e-9))))
        else:
            n_trials = cfg.trials
        arms.clear()                    # arm times of the timed bursts only
        trace = self._trace_start()
        samples = [self._burst_once(eng, p, arms, posts) for _ in range(n_trials)]
        if trace is not None:
            self._trace_stop(trace, trace_name)
        return samples, warm

    # -- the CollectiveX suite (--suite collectivex)
    def _suite_timing(self, eng: E.Engine, p: E.Prepared, arms: list[float],
                      posts: list[float]) -> tuple[list, list]:
        """The suite's sampling: 3 trials, each 2 warm-up bursts (dropped) then 8 timed ones."""
        from . import collectivex as CX
        samples, warm = [], []
        for _ in range(CX.TRIALS):
            for i in range(CX.WARMUP_PER_TRIAL + CX.REPS_PER_TRIAL):
                t = self._burst_once(eng, p, arms, posts if i >= CX.WARMUP_PER_TRIAL else None)
                (warm if i < CX.WARMUP_PER_TRIAL else samples).append(t)
        return samples, warm

    def _suite_verify(self, eng: E.Engine, p: E.Prepared, pb, point) -> dict | None:
        """The suite's sampled check of one more burst: both pools painted with its offset pattern, 16 x 8 B
        per request read back on the destination. Then the source gets gpuxfer's pattern back for the full
        check. Bulk rows have no verifying side in the suite: they pass by construction. Returns the
        destination's verdict (None on the source)."""
        from . import collectivex as CX
        plat, cfg = self.platform, self.cfg
        # the suite's bulk rows have no verifying side; gpuxfer's ceiling engine moves one contiguous descriptor,
        # not the paged ones the samples are drawn from
        bulk = getattr(point, "kind", "paged") == "bulk" or _moves_one_copy(eng)
        if not bulk:
            _suite_fill(plat, self.stream, self.pool)
            _sync(plat, self.stream, cfg.timeout_s, self.rank, "the suite's pattern fill")
            self._burst_once(eng, p, [])
            self.group.barrier()            # the initiator has seen the transfer land
        verdict = None
        if self.role is E.Role.DESTINATION:
            if _moves_one_copy(eng) and getattr(point, "kind", "paged") == "paged":
                verdict = {"passed": True, "detail": "not sampled: the ceiling engine moves one contiguous descriptor"}
            elif bulk:
                verdict = {"passed": True, "detail": ""}
            else:
                passed, detail = CX.sampled_verify(lambda offs: _read8(plat, self.pool, offs), pb)
                verdict = {"passed": passed, "detail": detail}
        elif not bulk:
            _pool_fill(plat, self.stream, self.pool, self.src_seed)
            _sync(plat, self.stream, cfg.timeout_s, self.rank, "pattern fill")
        return verdict

    # -- teardown
    def _abort(self) -> None:
        side = getattr(self, "side", None)
        if side is not None:
            side.release_waits()
        for eng in self.engines.values():
            abort = getattr(eng, "abort", None)
            if abort is not None:
                try:
                    abort()
                except Exception:  # noqa: BLE001
                    pass

    def _teardown(self, failed: bool) -> None:
        """Release everything. After a failure on a GPU, device memory is left to the process exit:
        freeing it may wait for device work stuck in a flag wait."""
        gpu_failed = failed and self.platform is not None and not self.platform.host_memory
        if not gpu_failed:
            for eng in reversed(list(self.engines.values())):
                try:
                    eng.close()
                except Exception as exc:  # noqa: BLE001
                    log.warning("closing engine %s: %s", eng.name, exc)
            side = getattr(self, "side", None)
            if side is not None:
                side.close()
            if self.platform is not None and self.stream is not None:
                try:
                    self.platform.synchronize(self.stream, 5.0)
                    self.stream.close()
                except Exception:  # noqa: BLE001
                    pass
            for m in (self.peer_pool, self.pool):
                if m is not None:
                    try:
                        m.close()
                    except Exception as exc:  # noqa: BLE001
                        log.warning("closing %r: %s", m, exc)
        self.engines = {}
        self.peer_pool = self.pool = None
        if self.group is not None:
            self.group.close()
        if self.platform is not None and not gpu_failed:
            try:
                self.platform.close()
            except Exception:  # noqa: BLE001
                pass
