"""Bounded host-side waits that turn a hang into a :class:`TransferTimeout`.

Every host wait in ``pp/`` and ``kv/`` goes through one of these two helpers,
so a stuck protocol always ends in an error naming the rank, the step, the
flag, the value expected and the last value seen::

    ev = platform.record_event(stream)          # after wait_flag(stream, full_ptr, step)
    wait_event_or_raise(platform, ev, 10.0, rank=1, step=step, flag="full",
                        flag_ptr=full_ptr, expected=step, device=dev)
"""
from __future__ import annotations

import math
import numbers
import time

import numpy as np

from .errors import BadInput, TransferTimeout
from .platforms.base import Event, Platform

#: how long a wait for work that usually ends soon (a KV burst) spins on a device before blocking
SPIN_S = 0.25
#: the longest bound a wait takes (one week): a longer one is a mistake (every wait is bounded), and past
#: about 1e9 s the platforms' waits cannot take it (``OverflowError`` from the operating system's clock)
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def check_timeout(timeout_s, what: str = "the timeout") -> float:
    """``timeout_s`` as a float: a finite number of seconds, > 0 and at most :data:`MAX_TIMEOUT_S`, else
    :class:`BadInput` naming ``what`` (the one check of every caller-given bound: ``pp.connect``'s,
    ``KVAgent``'s and its waits')."""
    if isinstance(timeout_s, (bool, np.bool_)) or not isinstance(timeout_s, numbers.Real):
        # (a string of digits, a flag or None is no number of seconds, though float() may take it)
        raise BadInput(f"{what} must be a number of seconds, got {timeout_s!r}")
    try:
        value = float(timeout_s)
    except (TypeError, ValueError, OverflowError):
        raise BadInput(f"{what} must be a number of seconds, got {timeout_s!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise BadInput(f"{what} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r} "
                       f"(every wait is bounded: pick the longest a step may take)")
    return value


def _seen(platform: Platform, flag_ptr: int | None, device: int) -> int | None:
    if flag_ptr is None:
        return None
    try:
        return platform.read_flag(flag_ptr, device)
    except Exception:  # reading the flag is best effort: the timeout is the error to report
        return None


def wait_event_or_raise(platform: Platform, event: Event, timeout_s: float, *, rank: int, step: int = 0,
                        flag: str | None = None, expected: int = 1, flag_ptr: int | None = None, device: int = 0,
                        what: str = "", spin_s: float = 0.0) -> None:
    """Wait on the host for ``event``; raise :class:`TransferTimeout` after ``timeout_s`` (0: query it once).

    ``spin_s``: on a device platform, query the event in a loop this long before
    the blocking wait (a sleeping wait inflates short waits); host memory never
    spins (its streams are CPU threads a spin would slow). ``flag`` names what
    the stream waits on behind ``event`` (default ``"event: <what>"``);
    ``flag_ptr`` (read with ``platform.read_flag(flag_ptr, device)``) is that
    flag, its last value goes into the error. Errors from the stream itself
    (``DriverError``...) propagate.
    """
    if not timeout_s >= 0:
        raise BadInput(f"timeout_s must be >= 0, got {timeout_s}")
    start = time.perf_counter()
    if spin_s > 0 and not platform.host_memory:
        spin_until = start + min(spin_s, timeout_s)
        while True:
            if platform.event_query(event):
                return
            if time.perf_counter() > spin_until:
                break
    left = timeout_s - (time.perf_counter() - start)
    if platform.event_wait(event, left) if left > 0 else platform.event_query(event):
        return
    raise TransferTimeout(rank=rank, step=step, flag=f"event: {what}" if flag is None else flag,
                          expected=expected, seen=_seen(platform, flag_ptr, device), timeout_s=timeout_s, what=what)


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
