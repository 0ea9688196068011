"""The decode side's loads in a process of their own (``kv_connector_extra_config['loader']: "process"``).

Inside an engine step a load's host work runs cold (the step left other data in the CPU's caches) and costs the
engine's thread 3-12x what it costs run warm; a thread beside the engine's does not help, since a thread that
releases the GIL (every driver and socket call) waits up to the switch interval to take it back from the engine's
Python (docs/VLLM.md). So the worker starts a loader process at registration: it maps the worker's caches (CUDA
IPC; shared memory on the host emulation), registers them with an agent of its own (not exported: only ever the
local side of a read), loads its kernels by reading block 0 of every group from the worker's agent onto itself,
and runs :class:`~.loads.DecodeLoads` unchanged -- handshakes, reads, claims, lease checks. The engine's thread
only hands each step's loads over and reads what ended, through two rings in shared memory (:mod:`.ring`), with
no system call::

    engine thread (worker)                      loader process
    ----------------------                      --------------
    register: spawn; the spec (caches) on  ──►  map the caches, register them (export=False), warm up
              its stdin; wait for "ready"  ◄──  event ring: ("ready", s) or ("error", why)
    start_load_kv: pending[req] = load
              command ring: ("start", loads    ──►  every 100 us (1 ms once idle for a second): take the
              as plain values; a record the ring     commands; DecodeLoads.start (handshake, post, claim);
              has no room for is kept, put later)    DecodeLoads.finished, the side channels flushed
    get_finished: event ring empty -> nothing  ◄──  event ring: (done, failed, load errors, counters)
                  else its records; every 50 ms with loads pending: is the loader alive, is it stalled?
    shutdown: ("close",) -> the loader closes its side channels and agent (its reads drained) and exits;
              killed past CLOSE_S

A loader that dies, or that takes no command and reports nothing for longer than a load may last, is killed and
waited for, and only then are its pending loads reported failed (vLLM recomputes them): nothing it queued can
write the blocks after that. Later loads fail at once, logged. The loader exits when the worker does (the kernel
kills it: ``PR_SET_PDEATHSIG``, where the worker's main thread started it, since the kernel sends that signal when the
thread that started the process ends; and it checks its parent each second).
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import current_process
from multiprocessing.reduction import ForkingPickler
from typing import Any, Sequence

from ... import config
from ...errors import GpuxferError
from .loads import Load
from .params import RemotePrefill
from .ring import ShmRing, ring_fd
from .wire import decode_load, encode_loads

log = logging.getLogger("gpuxfer.vllm")

#: how often the engine side asks whether the loader lives while loads are pending (seconds)
LIVENESS_S = 0.05
#: the loader's poll period: while anything happened in the last second, and after (seconds)
BUSY_POLL_S, IDLE_POLL_S = 0.0001, 0.001
#: each ring's data bytes (a step's loads: ~9 KiB a 32k-token request of one group at 64-token blocks)
RING_BYTES = 8 << 20
#: longest a close waits for the loader to drain its reads and exit before killing it (seconds)
CLOSE_S = 30.0


def child_path(pythonpath: str) -> str:
    """The loader's ``PYTHONPATH``: this gpuxfer's folder first where the interpreter's site folders do not hold it
    (a source tree); not a site folder, whose packages would then come before the standard library's modules."""
    import site
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    parts = [p for p in pythonpath.split(os.pathsep) if p]
    sites = {os.path.abspath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    return os.pathsep.join(parts if root in sites else [root] + parts)


class LoaderClient:
    """The engine side of a loader process, in :class:`~.loads.DecodeLoads`'s place for the worker: ``start``,
    ``release``, ``finished``, ``take_load_errors``, ``pending``, ``remotes`` (none: the loader flushes its side
    channels) and ``close``. Starting it starts the process and waits for it to be ready (registration)."""

    remotes: dict = {}

    def __init__(self, worker, kv_caches):
        self.engine_id, self.stats = worker.engine_id, worker.stats
        self._single = len(worker.group_specs) == 1
        self._bs0 = worker.group_specs[0][1]
        s = worker.settings
        # longest a load may stay unreported while the loader reports nothing: its handshake, the lease, a margin
        self._stall_s = s.handshake_timeout_s + s.lease_s + 30.0
        self.pending: dict[str, Any] = {}
        self.load_errors: set[int] = set()
        self._done: set[str] = set()            # failed here, reported by the next finished
        self._failed: set[str] = set()
        self._out: list[bytes] = []             # commands the ring had no room for yet
        self._last_news = time.monotonic()
        self._check_at = 0.0
        self.dead: str | None = None            # why no command goes to the loader any more
        self._gone = False                      # the loader was waited for, its last reports read
        self._closed = False
        self._lock = threading.Lock()           # close (any thread) against itself and the commands put
        fds = [ring_fd(RING_BYTES, "gpuxfer-loader-cmd")]
        try:
            fds.append(ring_fd(RING_BYTES, "gpuxfer-loader-evt"))
            self._cmd, self._evt = ShmRing(fds[0]), ShmRing(fds[1])
            env = dict(os.environ)
            env["PYTHONPATH"] = child_path(env.get("PYTHONPATH", ""))
            main = str(int(threading.current_thread() is threading.main_thread()))
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(fds[0]), str(fds[1]), main], pass_fds=fds,
                                         env=env, stdin=subprocess.PIPE)
        except (OSError, ValueError) as exc:
            raise GpuxferError(f"the loader process of engine {self.engine_id} could not be started "
                               f"({type(exc).__name__}: {exc})") from exc
        finally:
            for fd in fds:
                os.close(fd)
        try:
            import torch.multiprocessing  # noqa: F401  (torch's reductions: CUDA tensors go by IPC handle)
            spec = {"authkey": bytes(current_process().authkey),  # (host tensors' fds go by its resource sharer)
                    "engine_id": worker.engine_id, "agent": worker.agent.name, "group_specs": worker.group_specs,
                    "settings": s, "tp": (worker.tp_rank, worker.tp_size), "kv_heads": worker.kv_heads,
                    "info": worker.info, "meta": worker.agent.metadata()}
            # (the authkey first: the caches' pickle needs it set to be read)
            timeout = config.get("GPUXFER_VLLM_LOADER_START_S")
            self._write_stdin(pickle.dumps(spec, 5) + bytes(ForkingPickler.dumps(dict(kv_caches))), timeout)
            self._ready(timeout)
        except GpuxferError:
            self._kill()
            raise
        except Exception as exc:        # (the caches' pickle: memory torch cannot share, on this platform)
            self._kill()
            raise GpuxferError(f"the loader process of engine {self.engine_id} could not be given the caches "
                               f"({type(exc).__name__}: {exc})") from exc
        except BaseException:
            self._kill()
            raise
        log.info("gpuxfer: engine %s: loader process %d ready", self.engine_id, self.proc.pid)

    # ------------------------------------------------------------------ startup

    def _write_stdin(self, data: bytes, timeout_s: float) -> None:
        """The spec on the loader's stdin, bounded: the loader reads it as it starts."""
        fd = self.proc.stdin.fileno()
        os.set_blocking(fd, False)
        view, end = memoryview(data), time.monotonic() + timeout_s
        try:
            while view:
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    if self.proc.poll() is not None or time.monotonic() > end:
                        raise GpuxferError(f"the loader process of engine {self.engine_id} took no start-up data "
                                           f"({self._exit()})") from None
                    select.select([], [fd], [], 0.1)
        except BrokenPipeError as exc:
            raise GpuxferError(f"the loader process of engine {self.engine_id} ended as it started "
                               f"({self._exit()})") from exc
        finally:
            self.proc.stdin.close()

    def _ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while (rec := self._evt.get()) is None:
            if self.proc.poll() is not None or time.monotonic() > end:
                raise GpuxferError(f"the loader process of engine {self.engine_id} did not start within "
                                   f"{timeout_s:.0f} s ({self._exit()}); see its log above")
            time.sleep(0.01)
        kind, what = pickle.loads(rec)
        if kind != "ready":
            raise GpuxferError(f"the loader process of engine {self.engine_id} failed to start: {what}")

    def _exit(self) -> str:
        rc = self.proc.poll()
        return "running" if rc is None else f"exit status {rc}"

    # ------------------------------------------------------------------ the engine thread's calls

    def start(self, loads: Sequence[Load]) -> None:
        """Hand these loads to the loader (one record a step, or as many as the ring needs; nothing waits)."""
        pending = self.pending
        if not pending:                         # (a stall is counted from the first load pending on)
            self._last_news = time.monotonic()
        fresh = []
        for load in loads:
            # a request named again before its load was reported here (replayed metadata): that load stands, as
            # in DecodeLoads.start (the loader may have ended it already: it would load the request again)
            if load.req_id in pending:
                log.error("gpuxfer: engine %s: request %s is named for a load while its load is not reported yet "
                          "(metadata replayed?); the second is dropped", self.engine_id, load.req_id)
                continue
            pending[load.req_id] = load
            fresh.append(load)
        if not fresh:
            return
        if self.dead is not None:
            self._lose(fresh)
            return
        self._send(fresh)

    def _send(self, loads: Sequence[Load]) -> None:
        """These loads' command, in parts where the ring could never hold it whole; a load that alone is larger
        than the ring fails."""
        rec = encode_loads(loads)
        if len(rec) <= self._cmd.room():
            if not self._put(rec):
                self._lose(loads)
        elif len(loads) > 1:
            half = len(loads) // 2
            self._send(loads[:half])
            self._send(loads[half:])
        else:
            log.error("gpuxfer: engine %s: the load of request %s (%d bytes) is larger than the loader's command "
                      "ring (%d bytes); it fails", self.engine_id, loads[0].req_id, len(rec), self._cmd.room())
            self._lose(loads)

    def release(self, releases: Sequence[RemotePrefill]) -> None:
        if self.dead is not None or not releases:
            return
        rec = pickle.dumps(("release", list(releases)), 5)
        if len(rec) <= self._cmd.room():
            self._put(rec)
        elif len(releases) > 1:
            half = len(releases) // 2
            self.release(releases[:half])
            self.release(releases[half:])
        else:                                   # (its prefill frees the blocks at its lease)
            log.error("gpuxfer: engine %s: a release of request %s is larger than the loader's command ring; not "
                      "sent", self.engine_id, releases[0].request_id)

    def _put(self, rec: bytes) -> bool:
        """One command to the loader, kept for later where the ring has no room now; False where the loader takes
        none any more (lost, or a close under way: the ring has one writer, and the engine thread never waits)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self.dead is not None:
                return False
            out = self._out
            if out:
                self._flush()
            if out or not self._cmd.put(rec):
                out.append(rec)
                self._check_at = 0.0            # (put at the next call)
            return True
        finally:
            self._lock.release()

    def _flush(self) -> None:
        """The commands kept, put as the ring takes them (the caller holds the lock)."""
        out, put = self._out, self._cmd.put
        while out and put(out[0]):
            out.pop(0)
            self._last_news = time.monotonic()

    def finished(self, now: float) -> tuple[set[str], set[str]]:
        """Loads done and failed since the last call (failed ones among the done, as :class:`~.loads.DecodeLoads`
        reports them)."""
        if not self._evt.pending() and now < self._check_at:
            return set(), set()
        if not self._gone:
            self._events(now)
        if now >= self._check_at:
            self._check(now)
        done, failed = self._done, self._failed
        self._done, self._failed = set(), set()
        if done:
            pending = self.pending
            for req in done:
                pending.pop(req, None)
        return done, failed

    def _events(self, now: float) -> None:
        """What the loader reported, into ``_done``, ``_failed``, the load errors and the stats."""
        evt, done, failed = self._evt, self._done, self._failed
        stats, errors = self.stats, self.load_errors
        while (rec := evt.get()) is not None:
            self._last_news = now
            msg = pickle.loads(rec)
            if len(msg) != 4:                   # ("error", why): the loader failed, and exits
                log.error("gpuxfer: engine %s: the loader process failed: %s", self.engine_id, msg[-1])
                self._check_at = 0.0
                continue
            d, f, e, st = msg
            done |= d
            failed |= f
            if e:
                errors.update(e)
            if st:
                for k, v in st.items():
                    if type(v) is list:
                        stats[k].extend(v)
                    else:
                        stats[k] += v

    def _check(self, now: float) -> None:
        """The slow path, every :data:`LIVENESS_S`: commands kept put, the loader alive and not stalled; a lost
        loader's pending loads failed once it was waited for."""
        self._check_at = now + LIVENESS_S
        if self.dead is None:
            if self._out and self._lock.acquire(blocking=False):
                try:
                    if self.dead is None:
                        self._flush()
                finally:
                    self._lock.release()
            rc = self.proc.poll()
            if rc is not None:
                self._died(f"it exited with status {rc}")
            elif self.pending and now - self._last_news > self._stall_s:
                self._died(f"it reported nothing for {now - self._last_news:.0f} s with {len(self.pending)} "
                           "load(s) pending; killed")
        if self.dead is not None and not self._gone and self.proc.poll() is not None:
            # (waited for: nothing it queued writes the blocks now, and all it reported is in the ring)
            self._gone = True
            self._events(now)
            done = self._done
            self._lose([ld for req, ld in self.pending.items() if req not in done])

    def _died(self, why: str) -> None:
        """The loader is lost (killed here first where it is not): no command goes to it any more, and its pending
        loads fail once it was waited for (:meth:`_check`, without waiting here)."""
        if self.dead is None:
            self.dead = why
            log.error("gpuxfer: engine %s: the loader process (pid %d) is lost: %s; its %d pending load(s) fail and "
                      "every later load fails (restart the instance)", self.engine_id, self.proc.pid, why,
                      len(self.pending))
            if self.proc.poll() is None:
                self.proc.kill()
            self._out.clear()
            self._check_at = 0.0

    def _lose(self, loads: Sequence[Load]) -> None:
        """These loads failed here (reported, and dropped from ``pending``, by the next :meth:`finished`)."""
        for load in loads:
            self._done.add(load.req_id)
            self._failed.add(load.req_id)
            self.stats["failed"] += 1
            if self._single:
                ids = load.local_ids[0][load.start // self._bs0:]
                self.load_errors.update(ids[ids != 0].tolist())
        self._check_at = 0.0                # (reported at the next call)

    def take_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out

    # ------------------------------------------------------------------ teardown

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(CLOSE_S)
        except subprocess.TimeoutExpired:
            log.error("gpuxfer: engine %s: the loader process (pid %d) outlived SIGKILL for %.0f s", self.engine_id,
                      self.proc.pid, CLOSE_S)

    def close(self) -> None:
        """Ask the loader to end (its reads drained, its agent closed) and wait for it; killed past
        :data:`CLOSE_S`. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            alive = self.dead is None
            # (no command from the engine thread from now on: one writer on the ring; later loads fail at once, and
            # those pending fail once the loader was waited for)
            self.dead = self.dead or "closed"
            if alive and self.proc.poll() is None:
                end = time.monotonic() + CLOSE_S
                recs = list(self._out) + [pickle.dumps(("close",), 5)]
                while recs and time.monotonic() < end and self.proc.poll() is None:
                    if self._cmd.put(recs[0]):
                        recs.pop(0)
                    else:
                        time.sleep(0.001)
                try:
                    self.proc.wait(max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.error("gpuxfer: engine %s: the loader process did not end within %.0f s; killed",
                              self.engine_id, CLOSE_S)
            self._kill()
            self._check_at = 0.0
            # (the rings stay mapped until this object goes: the engine thread may be reading them now)


# ---------------------------------------------------------------------- the loader process

class _Loader:
    """The loader process's state: an agent over the worker's caches and the decode role's loads."""

    def __init__(self, spec: dict):
        from ...kv import KVAgent
        from ...platforms import current
        from .loads import DecodeLoads
        from .registration import bind_loads, cache_device, new_stats, register_groups
        caches, settings = spec["caches"], spec["settings"]
        self.stats = new_stats()
        self.agent = KVAgent(spec["agent"] + "~loader", platform=current(), device=cache_device(caches),
                             engine=settings.engine, remote=settings.remote)
        _, kernel_tokens, bytes_per_block = register_groups(self.agent, spec["group_specs"], caches,
                                                            settings.token_major, spec["kv_heads"], export=False)
        self.decode = DecodeLoads(engine_id=spec["engine_id"], group_specs=spec["group_specs"], settings=settings,
                                  lock=threading.Lock(), stats=self.stats, tp=spec["tp"])
        staging = bind_loads(self.decode, self.agent, spec["info"], kernel_tokens, bytes_per_block, settings)
        self.caches = caches                    # (the mappings live as long as these)
        self.warm_s = 0.0
        try:
            self.warm_s = self._warm_up(spec["meta"], next(iter(caches.values())).device if staging else None)
        except GpuxferError as exc:             # (as the worker's own warm-up: the first request loads them)
            log.warning("gpuxfer: engine %s: loading the transfer kernels at startup failed (%s: %s); the first "
                        "request loads them", spec["engine_id"], type(exc).__name__, exc)

    def _warm_up(self, meta: bytes, device_ids) -> float:
        """Kernels loaded now: block 0 (vLLM's null block) of every group read from the worker's agent onto the
        same memory, with device IDs too where reads take them (as :meth:`KVAgent.warm_up` does in one process)."""
        import torch
        t0 = time.perf_counter()
        agent = self.agent
        peer = agent.add_peer(meta, route="ipc")
        try:
            for g in list(agent.groups):
                ids = {g: [0]}
                agent.prepare(peer, "pull", local_blocks=ids, remote_blocks=ids, name="warm-up").post().wait()
                if device_ids is not None:
                    ids = {g: torch.tensor([0], dtype=torch.int64, device=device_ids)}
                    agent.prepare(peer, "pull", local_blocks=ids, remote_blocks=ids, name="warm-up",
                                  device_ids=True).post().wait()
        finally:
            agent.remove_peer(peer)
        return time.perf_counter() - t0

    def run(self, cmd: ShmRing, evt: ShmRing) -> None:
        """Take commands and report what ended until told to close or the worker is gone."""
        d, stats = self.decode, self.stats
        outbox: list[bytes] = []                # events the ring had no room for yet
        parent, active, check_at = os.getppid(), time.monotonic(), 0.0
        while True:
            got = False
            while (rec := cmd.get()) is not None:
                got = True
                msg = pickle.loads(rec)
                kind = msg[0]
                if kind == "start":
                    d.start([decode_load(rec) for rec in msg[1]])
                elif kind == "release":
                    d.release(msg[1])
                elif kind == "close":
                    return
            now = time.monotonic()
            done, failed = d.finished(now) if d.pending else (set(), set())
            d.flush_late(now)
            errors = d.take_load_errors() if d.load_errors else ()
            counts = _take(stats)
            if done or failed or errors or counts:
                outbox.append(pickle.dumps((done, failed, errors, counts), 5))
            while outbox and evt.put(outbox[0]):
                outbox.pop(0)
            if got or d.pending or outbox:
                active = now
            if now >= check_at:
                check_at = now + 1.0
                if os.getppid() != parent:      # (the worker is gone)
                    return
            time.sleep(BUSY_POLL_S if now - active < 1.0 else IDLE_POLL_S)

    def close(self) -> None:
        self.decode.close()
        self.agent.close()


def _take(stats: dict) -> dict | None:
    """The counters since the last call, reset; None when nothing was counted."""
    if not any(stats.values()):
        return None
    out = {}
    for k, v in stats.items():
        if v:
            out[k] = v
            stats[k] = [] if type(v) is list else 0
    return out


def _main(argv: list[str]) -> int:
    if argv[2:3] == ["1"]:          # killed with the worker (started by its main thread, which ends with it)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gpuxfer-loader[%(process)d] %(message)s")
    cmd_fd, evt_fd = (int(a) for a in argv[:2])
    cmd, evt = ShmRing(cmd_fd), ShmRing(evt_fd)
    os.close(cmd_fd)
    os.close(evt_fd)
    loader = None
    try:
        stdin = sys.stdin.buffer
        spec = pickle.load(stdin)
        current_process().authkey = spec["authkey"]
        import torch.multiprocessing  # noqa: F401
        spec["caches"] = pickle.load(stdin)
        first = next(iter(spec["caches"].values()))
        if first.device.type == "cuda":
            import torch
            torch.cuda.set_device(first.device)
        loader = _Loader(spec)
        del spec, first
        evt.put(pickle.dumps(("ready", loader.warm_s), 5))
        loader.run(cmd, evt)
        return 0
    except BaseException as exc:                # (reported to the worker, which raises it at registration)
        log.exception("gpuxfer: the loader process failed")
        evt.put(pickle.dumps(("error", f"{type(exc).__name__}: {exc}"), 5))
        return 1
    finally:
        if loader is not None:
            loader.close()
            # (the caches' CUDA IPC references released now, while the worker waits for this process: torch's
            # producer side counts them, and finalizers at interpreter exit are not guaranteed to run)
            loader.caches = loader.agent = loader.decode = None
            loader = None
            import gc
            gc.collect()


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
