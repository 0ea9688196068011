"""Bounded host-side waits that turn a hang into a :class:`TransferTimeout`.

Every host wait in ``pp/`` and ``kv/`` goes through one of these two helpers,
so a stuck protocol always ends in an error naming the rank, the step, the
flag, the value expected and the last value seen::

    ev = platform.record_event(stream)          # after wait_flag(stream, full_ptr, step)
    wait_event_or_raise(platform, ev, 10.0, rank=1, step=step, flag="full",
                        flag_ptr=full_ptr, expected=step, device=dev)
"""
from __future__ import annotations

import time

from .errors import BadInput, TransferTimeout
from .platforms.base import Event, Platform


def _seen(platform: Platform, flag_ptr: int | None, device: int) -> int | None:
    if flag_ptr is None:
        return None
    try:
        return platform.read_flag(flag_ptr, device)
    except Exception:  # reading the flag is best effort: the timeout is the error to report
        return None


def wait_event_or_raise(platform: Platform, event: Event, timeout_s: float, *, rank: int, step: int,
                        flag: str, expected: int, flag_ptr: int | None = None, device: int = 0,
                        what: str = "") -> None:
    """Wait on the host for ``event``; raise :class:`TransferTimeout` after ``timeout_s``.

    ``flag_ptr`` (read with ``platform.read_flag(flag_ptr, device)``) is the
    flag the stream is waiting on behind ``event``; its last value goes into
    the error. Errors from the stream itself (``DriverError``...) propagate.
    """
    if timeout_s <= 0:
        raise BadInput(f"timeout_s must be positive, got {timeout_s}")
    if not platform.event_wait(event, timeout_s):
        raise TransferTimeout(rank=rank, step=step, flag=flag, expected=expected,
                              seen=_seen(platform, flag_ptr, device), timeout_s=timeout_s, what=what)


def wait_flag_or_raise(platform: Platform, flag_ptr: int, expected: int, timeout_s: float, *, rank: int,
                       step: int, flag: str, device: int = 0, what: str = "") -> int:
    """Poll a flag from the host until it is ``>= expected``; return the value seen.

    For host-side handshakes (setup, teardown); stream-side waits use
    ``platform.wait_flag`` + :func:`wait_event_or_raise`.
    """
    if timeout_s <= 0:
        raise BadInput(f"timeout_s must be positive, got {timeout_s}")
    deadline = time.monotonic() + timeout_s
    delay = 1e-5
    while True:
        seen = platform.read_flag(flag_ptr, device)
        if seen >= expected:
            return seen
        if time.monotonic() > deadline:
            raise TransferTimeout(rank=rank, step=step, flag=flag, expected=expected, seen=seen,
                                  timeout_s=timeout_s, what=what)
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
