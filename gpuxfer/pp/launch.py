"""Run a function on N ranks in spawned processes (for ``gpuxfer bench pp``, the example and tests).

No fork, a file rendezvous (no port to pick), a timeout on every join, and
exit codes checked: a rank that fails, dies or hangs becomes an error naming it.
Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) :func:`init_cpu_group` joins
the existing rendezvous instead.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as _queue
import tempfile
import time
import traceback

from ..errors import GpuxferError


def init_cpu_group(rank: int, world: int, init_method: str, timeout_s: float = 120.0) -> None:
    """Initialise torch.distributed with gloo (the CPU group connect() uses)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))


def _entry(fn, rank, world, init_method, env, args, q) -> None:
    os.environ.update(env)
    try:
        init_cpu_group(rank, world, init_method)
        out = fn(rank, world, *args)
        q.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        try:
            import torch.distributed as dist

            from .transport import WATCHDOG
            WATCHDOG.stop()          # before the group and the interpreter go: see _Watchdog.stop
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(fn, world: int, args: tuple = (), *, timeout_s: float = 600.0, env: dict | None = None) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes; return the results by rank.

    ``fn`` must be importable (a module-level function) and return plain picklable data (no torch
    tensors: torch shares them by file descriptor, which dies with the child). Raises
    :class:`GpuxferError` with every failing rank's traceback, or naming the
    ranks that hung past ``timeout_s`` (they are killed).
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gpuxfer-pp-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        q = ctx.Queue()
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init_method, dict(env or {}), args, q), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(results) < world and time.monotonic() < deadline:
                try:
                    rank, status, value = q.get(timeout=0.2)
                    results[rank] = (status, value)
                    if status == "error":   # a failed rank: give the others a moment, then stop
                        deadline = min(deadline, time.monotonic() + 30.0)
                except _queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                    if dead:
                        time.sleep(0.5)
                        while True:
                            try:
                                rank, status, value = q.get_nowait()
                                results[rank] = (status, value)
                            except _queue.Empty:
                                break
                        for r in dead:
                            if r not in results:
                                results[r] = ("error", f"rank {r} died with exit code {procs[r].exitcode}")
                        deadline = min(deadline, time.monotonic() + 30.0)
        finally:
            for p in procs:
                p.join(max(0.1, min(30.0, deadline - time.monotonic() + 5)))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        errors = {r: v for r, (s, v) in results.items() if s == "error"}
        hung = [r for r in range(world) if r not in results]
        bad_exit = [r for r, p in enumerate(procs) if p.exitcode != 0 and r not in errors]
        if errors or hung or bad_exit:
            msg = [f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())]
            if hung:
                msg.append(f"ranks {hung} sent no result within {timeout_s:g} s (killed)")
            if bad_exit:
                msg.append(f"ranks {bad_exit} exited with codes {[procs[r].exitcode for r in bad_exit]}")
            raise GpuxferError("\n".join(msg))
        return [results[r][1] for r in range(world)]
