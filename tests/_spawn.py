"""Multi-process test helpers that cannot hang: spawn only, timeouts everywhere, exit codes asserted.

A child runs ``fn(*args)`` and sends back ``("ok", result)`` or ``("error", traceback)``;
the parent's :meth:`Child.result` turns an error, a silent death or a timeout into an
AssertionError naming the child's pid. Used through the ``spawner`` fixture (conftest.py).
"""
from __future__ import annotations

import multiprocessing as mp
import queue as _queue
import time
import traceback


def _entry(fn, args, result_q) -> None:
    try:
        out = fn(*args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        result_q.put(("error", traceback.format_exc()))
        raise SystemExit(1)
    result_q.put(("ok", out))


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

    def start(self, fn, *args, name: str | None = None) -> Child:
        q = self.ctx.Queue()
        proc = self.ctx.Process(target=_entry, args=(fn, args, q), daemon=True)
        proc.start()
        child = Child(proc, q, name or f"child {len(self.children)}")
        self.children.append(child)
        return child

    def cleanup(self) -> None:
        for c in self.children:
            if c.proc.is_alive():
                c.proc.kill()
            c.proc.join(5)
