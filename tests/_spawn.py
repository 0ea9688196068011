"""Multi-process (and multi-thread) test helpers that cannot hang: spawn only, timeouts everywhere, exit codes asserted.

A child runs ``fn(*args)`` and sends back ``("ok", result)`` or ``("error", traceback)``;
the parent's :meth:`Child.result` turns an error, a silent death or a timeout into an
AssertionError naming the child's pid. Used through the ``spawner`` fixture (conftest.py).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as _queue
import tempfile
import time
import traceback


def _entry(fn, args, result_q, hard_exit: bool = False) -> None:
    try:
        out = fn(*args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        result_q.put(("error", traceback.format_exc()))
        raise SystemExit(1)
    result_q.put(("ok", out))
    if hard_exit:
        # A rank that finished can still abort in interpreter teardown if a daemon thread is
        # inside a C++ call when the interpreter finalizes ("terminate called without an active
        # exception", exit -6; the pp watchdog stops at exit for this reason, other libraries'
        # threads may not). Its result is in; flush it and leave without the teardown, so the
        # exit code says whether the *test* passed. Tests of exit codes use hard_exit=False.
        result_q.close()
        result_q.join_thread()
        os._exit(0)


class Child:
    def __init__(self, proc, result_q, name: str):
        self.proc, self._q, self.name = proc, result_q, name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def result(self, timeout: float):
        """The child's return value; AssertionError if it failed, died or took longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, value = self._q.get(timeout=0.2)
                break
            except _queue.Empty:
                if not self.proc.is_alive():
                    try:  # it may have sent just before exiting
                        status, value = self._q.get(timeout=1.0)
                        break
                    except _queue.Empty:
                        raise AssertionError(f"{self.name} (pid {self.pid}) died with exit code "
                                             f"{self.proc.exitcode} without a result") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"{self.name} (pid {self.pid}) sent no result within {timeout:g} s")
        if status == "error":
            raise AssertionError(f"{self.name} (pid {self.pid}) failed:\n{value}")
        return value

    def join(self, timeout: float) -> None:
        """Join with a timeout (killing the child past it) and assert a zero exit code."""
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
            raise AssertionError(f"{self.name} (pid {self.pid}) did not exit within {timeout:g} s; killed")
        assert self.proc.exitcode == 0, f"{self.name} (pid {self.pid}) exited with code {self.proc.exitcode}"


class Spawner:
    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.children: list[Child] = []

    def queue(self):
        return self.ctx.Queue()

    def start(self, fn, *args, name: str | None = None, hard_exit: bool = False) -> Child:
        q = self.ctx.Queue()
        proc = self.ctx.Process(target=_entry, args=(fn, args, q, hard_exit), daemon=True)
        proc.start()
        child = Child(proc, q, name or f"child {len(self.children)}")
        self.children.append(child)
        return child

    def run_ranks(self, fn, world: int, *args, timeout: float, join_s: float = 30.0) -> list:
        """Start ``fn(rank, world, init_method, *args)`` for every rank (a ``file://`` rendezvous in a temporary
        folder), wait up to ``timeout`` s for each result, join each with ``join_s``; results in rank order."""
        with tempfile.TemporaryDirectory() as tmp:
            init = f"file://{os.path.join(tmp, 'rdv')}"
            kids = [self.start(fn, r, world, init, *args, name=f"rank {r}", hard_exit=True) for r in range(world)]
            deadline = time.monotonic() + timeout
            results, errors = [], []
            for k in kids:
                left = max(1.0, deadline - time.monotonic())
                try:
                    results.append(k.result(min(left, 15.0) if errors else left))
                except AssertionError as exc:       # every rank's error: the first is often the echo of another's
                    results.append(None)
                    errors.append(str(exc))
            if errors:
                raise AssertionError("\n\n".join(errors))
            for k in kids:
                k.join(join_s)
        return results

    def cleanup(self) -> None:
        for c in self.children:
            if c.proc.is_alive():
                c.proc.kill()
            c.proc.join(5)


def on_threads(fns, timeout: float = 60.0) -> list:
    """Run each callable on its own thread; their results, or the first error raised (a thread still
    running after ``timeout`` fails the test)."""
    import threading
    errors, results = [None] * len(fns), [None] * len(fns)

    def run(i):
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[i] = exc
    ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
        assert not t.is_alive(), "a side did not finish in time"
    for e in errors:
        if e is not None:
            raise e
    return results
