"""Run a function on N spawned processes and watch them: the one multi-process harness of the
benchmarks and the examples.

No fork (the ``spawn`` context: a child inherits no device state), a file rendezvous in a
fresh temporary directory (no port to pick), events streamed to the parent while the ranks
run, and every wait bounded::

    parent (spawn)                               rank r (spawned)
    tmp/rendezvous ------- init_method -------->  target(RankContext, *args)
    on_event(r, kind, payload) <---------------   ctx.emit(kind, payload)        any number
    results[r] <-------------------------------   the return value (or its traceback)
    a rank fails or dies: the others get grace_s to finish, then are killed
    no message from any rank for idle_s: every rank is killed
    join(join_s) each; exit codes checked: a non-zero code, a kill or a missing result is an
    error naming the rank

A target that raises ``SystemExit(code)`` has already said why (through its events): its
process leaves with ``code`` at once, skipping the interpreter's teardown (a failed device
may hang it), and the parent reports the exit code alone.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue as _queue
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from . import config
from .errors import GpuxferError

#: the note :func:`spawn` adds to its errors when Ctrl-C stopped it
INTERRUPTED = "interrupted"
#: how long ranks get to unwind after Ctrl-C before they are killed (seconds)
INTERRUPT_GRACE_S = 5.0


@dataclass
class RankContext:
    """What a spawned rank gets: its rank, the world size, the rendezvous, and a way to report."""

    rank: int
    world: int
    init_method: str
    _queue: Any = field(repr=False, default=None)

    def emit(self, kind: str, payload: Any) -> None:
        """Send ``(kind, payload)`` to the parent's ``on_event`` (picklable payloads only)."""
        self._queue.put(("event", self.rank, (kind, payload)))


@dataclass
class Outcome:
    """The ranks' return values by rank (None where a rank returned none) and every error, by rank."""

    results: list
    errors: list[str]

    @property
    def ok(self) -> bool:
        return not self.errors


def _interrupt_once(signum, frame) -> None:
    """A rank's first SIGINT raises KeyboardInterrupt and later ones are ignored: Ctrl-C at a terminal
    reaches the rank and the parent, which passes it on (:func:`_let_ranks_stop`), and that second signal
    must not cut short the unwinding the first one started (freeing shared memory, joining threads)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _child(target, rank: int, world: int, init_method: str, env: dict, args: tuple, q) -> None:
    os.environ.update(env)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt_once)
    code = 0
    try:
        logging.basicConfig(level=config.get("GPUXFER_LOG_LEVEL").upper(),
                            format=f"rank {rank} %(levelname)s %(name)s: %(message)s")
        q.put(("result", rank, target(RankContext(rank, world, init_method, q), *args)))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put(("error", rank, traceback.format_exc()))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    q.close()
    q.join_thread()             # every message reaches the parent before the process goes
    if code:
        os._exit(code)


def spawn(target: Callable, world: int, args: tuple = (), *, idle_s: float,
          on_event: Callable[[int, str, Any], None] | None = None, env: dict | None = None,
          grace_s: float = 20.0, join_s: float = 10.0, names: Sequence[str] | None = None,
          prefix: str = "gpuxfer-") -> Outcome:
    """Run ``target(RankContext, *args)`` on ``world`` spawned processes until every one has exited.

    ``target`` must be importable (a module-level function) and return plain picklable data.
    Never raises for a rank's failure: :attr:`Outcome.errors` names every failing, killed or
    silent rank (with its traceback where it raised).
    """
    ctx = mp.get_context("spawn")
    names = list(names or [f"{prefix}rank{r}" for r in range(world)])
    results: dict[int, Any] = {}
    failed: dict[int, str] = {}          # rank -> why (a traceback, a kill)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        q = ctx.Queue()
        procs = [ctx.Process(target=_child, args=(target, r, world, init_method, dict(env or {}), args, q),
                             daemon=True, name=names[r]) for r in range(world)]

        def take(msg) -> None:
            kind, rank, value = msg
            if kind == "event":
                if on_event is not None:
                    on_event(rank, *value)
            elif kind == "result":
                results[rank] = value
            else:
                failed[rank] = f"rank {rank} ({names[rank]}) failed:\n{value.rstrip()}"

        try:
            for p in procs:
                p.start()
            last = time.monotonic()
            first_failure: float | None = None
            while True:
                try:
                    take(q.get(timeout=0.2))
                    last = time.monotonic()
                    continue
                except _queue.Empty:
                    pass
                codes = [p.exitcode for p in procs]
                if all(c is not None for c in codes):
                    break
                now = time.monotonic()
                if failed or any(c not in (None, 0) for c in codes):
                    first_failure = first_failure or now
                    if now - first_failure > grace_s:
                        for r, p in enumerate(procs):
                            if p.exitcode is None:
                                p.kill()
                                failed.setdefault(r, f"rank {r} ({names[r]}, pid {p.pid}) was killed {grace_s:g} s "
                                                     "after a peer failed")
                if now - last > idle_s:
                    for r, p in enumerate(procs):
                        if p.exitcode is None:
                            p.kill()
                            failed.setdefault(r, f"rank {r} ({names[r]}, pid {p.pid}) was killed: no word from any "
                                                 f"rank for {idle_s:g} s")
                    break
            for p in procs:
                p.join(join_s)
            while True:                 # messages sent just before the processes exited
                try:
                    take(q.get(timeout=0.5))
                except _queue.Empty:
                    break
        except KeyboardInterrupt:
            notes.append(INTERRUPTED)
            _let_ranks_stop(procs)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        for r, p in enumerate(procs):
            if r in failed:
                continue
            if p.exitcode != 0:
                failed[r] = f"rank {r} ({names[r]}, pid {p.pid}) exited with code {p.exitcode}"
            elif r not in results:
                failed[r] = f"rank {r} ({names[r]}, pid {p.pid}) exited without a result"
    return Outcome([results.get(r) for r in range(world)], [failed[r] for r in sorted(failed)] + notes)


def _let_ranks_stop(procs, grace_s: float = INTERRUPT_GRACE_S) -> None:
    """After Ctrl-C: every rank still running gets SIGINT (a terminal sends it to them too; ``kill -INT``
    of the parent alone does not) and up to ``grace_s`` to unwind, so that it frees its shared memory and
    other resources itself; what is still running then is killed by the caller. A second Ctrl-C stops
    the wait."""
    deadline = time.monotonic() + grace_s
    try:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                try:
                    os.kill(p.pid, signal.SIGINT)
                except OSError:
                    pass
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        pass


def _in_cpu_group(ctx: RankContext, fn: Callable, *args):
    from .pp.launch import close_cpu_group, init_cpu_group
    init_cpu_group(ctx.rank, ctx.world, ctx.init_method)
    try:
        return fn(ctx.rank, ctx.world, *args)
    finally:
        close_cpu_group()


def run_ranks(fn: Callable, world: int, args: tuple = (), *, timeout_s: float = 600.0,
              env: dict | None = None) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes in one gloo CPU group (the group
    :func:`gpuxfer.pp.connect` uses); return the results by rank.

    ``fn`` must be importable and return plain picklable data (no torch tensors: torch shares them
    by file descriptor, which dies with the child). Raises :class:`GpuxferError` naming every
    failing rank (with its traceback) and every rank silent past ``timeout_s`` (killed).
    """
    out = spawn(_in_cpu_group, world, (fn, *args), idle_s=timeout_s, env=env, grace_s=30.0, join_s=30.0,
                prefix="gpuxfer-ranks-")
    if not out.ok:
        raise GpuxferError("\n".join(out.errors))
    return out.results
