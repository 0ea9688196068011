"""Shared-memory names as a process killed between creating and unlinking them leaves them, for the tests
of the sweep that removes them (:func:`gpuxfer.common.sweep_shm_orphans`)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

from gpuxfer.common import SHM_ORPHAN_AGE_S, map_shm, unlink_shm


def gone_pid() -> int:
    """The pid of a child that has exited and been reaped: it names no process."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert child.wait(timeout=60) == 0
    return child.pid


def backdate(path) -> None:
    """Make ``path`` older than the sweep's age limit (a younger one may be another PID namespace's)."""
    old = time.time() - SHM_ORPHAN_AGE_S - 60
    os.utime(path, (old, old))


@contextlib.contextmanager
def planted(names):
    """Segments ``names`` (``/name``) in /dev/shm, old enough to be swept; unlinked after."""
    try:
        for name in names:
            map_shm(name, 4096, create=True).close()
            backdate(f"/dev/shm{name}")
        yield
    finally:
        for name in names:
            unlink_shm(name)
