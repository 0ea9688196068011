"""The watchdog of the stage hand-off, and teardown.

:data:`WATCHDOG` is one daemon thread per process, off the transfer path, that
polls what each open transport's streams wait on (flag words, NCCL work objects)
and turns a wait older than ``timeout_s`` (or a wait on a peer that left a
"gone" note) into :class:`~gpuxfer.errors.TransferTimeout` /
:class:`~gpuxfer.errors.PeerLost`. :func:`exit_process` ends the process for
``on_timeout="exit"``. :func:`close_all` tears any set of transports down in a
safe order (see its docstring and :mod:`gpuxfer.pp.transport`).
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from ..errors import EXIT_CODE, BadInput, PeerLost
from .timeouts import resolve_timeout

log = logging.getLogger("gpuxfer.pp")

FAILED_TEARDOWN_S = 1.0     # drain / barrier limit of a failed transport at teardown (its peer is likely gone)
GONE_POLL_S = 0.25          # how often the watchdog reads a waiting transport's peer "gone" note
_TEARDOWN = threading.Lock()   # a transport leaves "open" once: close_all and abort from any thread


class Watched(Protocol):
    """What the watchdog and teardown use of a transport (:class:`gpuxfer.pp.transport.Transport` has it all)."""

    rank: int
    peer: int
    name: str
    role: str
    step: int
    timeout_s: float
    signals: Any                # PairSignals, or None
    meta: Any                   # the metadata channel (drained at teardown)
    channel: Any
    watch_after_error: bool
    release_again: bool
    _state: str
    _error: BaseException | None
    _waiting_since: float | None
    _gone_checked: float
    _wd: Any                    # pending GPU-side waits, oldest first
    _wd_lock: Any
    _call_lock: Any
    _fail_lock: Any

    def _watch(self, now: float) -> BaseException | None: ...
    def _fail(self, err: BaseException) -> BaseException: ...
    def _release_waits(self) -> None: ...
    def _wait_label(self, wait) -> str: ...
    def _drain(self, timeout_s: float) -> bool: ...
    def _close_mappings(self) -> None: ...
    def _free(self) -> None: ...
    def _free_local(self) -> None: ...
    def _close_meta(self) -> None: ...


# --------------------------------------------------------------------------- watchdog


class _Watchdog:
    """One daemon thread per process polling every open transport's pending waits (off the transfer path)."""

    BUSY_S = 0.02
    IDLE_S = 0.2

    def __init__(self):
        # held until closed or aborted: a transport its caller dropped unclosed is still watched, so a wait it
        # queued on the caller's stream is still released at its timeout (else it could block that stream
        # for good)
        self._transports: "set[Watched]" = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._at_exit = False

    def register(self, t: Watched) -> None:
        with self._lock:
            self._transports.add(t)
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="gpuxfer-pp-watchdog", daemon=True)
                self._thread.start()
                if not self._at_exit:
                    self._at_exit = True
                    atexit.register(self.stop)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (at interpreter exit). A daemon thread still inside a C++ call (a store read,
        a driver query) when the interpreter finalizes is unwound by ``pthread_exit`` through C++ frames,
        and the process aborts ("terminate called without an active exception")."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def open_transports(self) -> list:
        with self._lock:
            return [t for t in self._transports if t._state in ("open", "closing")]

    def _run(self) -> None:
        released = 0.0
        while not self._stop.is_set():
            with self._lock:
                self._transports -= {t for t in self._transports if t._state in ("closed", "aborted")}
                live = [t for t in self._transports
                        if t._state == "open" and (t._error is None or t.watch_after_error)]
                failed = [t for t in self._transports if t._state == "open" and t._error is not None
                          and t.release_again and not t.watch_after_error]
            busy = False
            now = time.monotonic()
            if failed and now - released > 2 * GONE_POLL_S:
                released = now
                for t in failed:
                    try:
                        t._release_waits()
                    except Exception as exc:  # noqa: BLE001
                        log.debug("re-release of a failed %s transport: %s", t.name, exc)
            for t in live:
                waiting = t._waiting_since
                if not t._wd and waiting is None:
                    continue
                busy = True
                err = None
                if t._wd:
                    try:
                        with t._wd_lock:
                            if t._state != "open":
                                continue
                            err = t._watch(now)
                    except Exception as exc:  # noqa: BLE001 - a stream error found while polling
                        err = exc
                try:
                    since = waiting if waiting is not None else t._wd[0][2]
                except (IndexError, TypeError):   # popped meanwhile, or an entry without a start time
                    since = now
                if (err is None and t._error is None and t.signals is not None and now - since > GONE_POLL_S
                        and now - t._gone_checked > GONE_POLL_S):   # a wait that lasts: is the peer gone?
                    t._gone_checked = now
                    gone = t.signals.peer_gone()
                    if gone is not None:
                        err = PeerLost(rank=t.rank, peer=t.peer, step=t.step + 1,
                                       flag="metadata" if waiting is not None else "peer", after_s=now - since,
                                       why=f"rank {t.peer} {gone}", detail=f"{t.name} {t.role}")
                if err is not None:
                    try:
                        t._fail(err)
                    except Exception as exc:  # noqa: BLE001 - the watchdog must outlive any one transport
                        log.error("rank %d: failing the %s transport: %s", t.rank, t.name, exc)
            self._stop.wait(self.BUSY_S if busy else self.IDLE_S)


WATCHDOG = _Watchdog()


def exit_process(failed: Watched, err: BaseException) -> None:
    """``on_timeout="exit"``: log the error and every transport of this process, then end it."""
    try:
        log.critical("rank %d: the %s transport with rank %d failed and on_timeout='exit': ending the process "
                     "with code %d: %s", failed.rank, failed.name, failed.peer, EXIT_CODE, err)
        for t in WATCHDOG.open_transports():
            waits = ", ".join(f"step {w[0]} ({t._wait_label(w)}) for {time.monotonic() - w[2]:.1f} s"
                              for w in list(t._wd)[:4]) or "none"
            log.critical("rank %d: %s %s with rank %d: step %d, %s, pending waits: %s", t.rank, t.name, t.role,
                         t.peer, t.step, f"failed: {t._error}" if t._error is not None else "healthy", waits)
        for h in logging.getLogger().handlers + log.handlers:
            h.flush()
    finally:
        os._exit(EXIT_CODE)


# --------------------------------------------------------------------------- teardown


_TEARDOWN_PARTS = ("_state", "_call_lock", "_drain", "_close_mappings", "_free")


def _transports_of(transports) -> list:
    """``close_all``'s argument as a list of transports, or BadInput naming what it holds instead (checked whole,
    before any end is touched)."""
    if isinstance(transports, (str, bytes)) or any(hasattr(transports, a) for a in ("_state", "transports")):
        items = None             # one transport or a connection: not a collection of transports
    else:
        try:
            items = list(transports)
        except TypeError:
            items = None
    if items is None or not all(all(hasattr(t, a) for a in _TEARDOWN_PARTS) for t in items):
        raise BadInput(f"close_all() takes a list of transports (conn.transports; conn.close() closes a "
                       f"connection), got {transports!r:.120}")
    return items


def close_all(transports: Sequence[Watched], timeout_s: float | None = None) -> None:
    """Tear transports down together in a safe order (idempotent), in at most the largest
    ``timeout_s`` + a few seconds whatever the peers do; the caller's process group is never used.

    1. release the GPU waits of every failed end first (a healthy end's drain may sit on the
       same stream behind them);
    2. drain each end's own streams (one deadline for all; a failed end gets
       :data:`FAILED_TEARDOWN_S`; an end that does not drain is released and drained briefly),
       then leave the peer a "closed" note (its waits for steps never sent fail at once);
    3. pair barrier with each peer in the store (all posted before any is waited, so a middle
       stage closing both of its transports cannot deadlock);
    4. close peer mappings;  5. pair barrier again;  6. free buffers.
    A barrier that times out (a peer gone or late) is logged; that end then frees only what no
    peer maps (as :meth:`~gpuxfer.pp.transport.Transport.abort`), and the rest goes at process exit.
    An end whose streams still hold work once its waits were released (work queued before its steps
    on the caller's stream that does not finish) unmaps and frees nothing and posts no barrier: that
    work may still reach its buffers and the peer's; everything goes at process exit.

    Any thread may close: an end turns "closing" at once (later calls are refused; a call's host
    wait gives up), and teardown takes each end's call lock, so nothing is freed under a call of
    another thread. A call still inside after :data:`FAILED_TEARDOWN_S` has the end failed
    ("closed by another thread") and its waits released; an end whose call never returns keeps
    its buffers to process exit. A second ``close`` while one runs returns at once.
    """
    if timeout_s is not None:
        timeout_s = resolve_timeout(timeout_s)
    transports = _transports_of(transports)
    todo = []
    with _TEARDOWN:
        for t in transports:
            if t._state == "open":      # (an end named twice is "closing" at its second entry: taken once)
                t._state = "closing"
                todo.append(t)
    if not todo:
        return
    limit = max(t.timeout_s if timeout_s is None else timeout_s for t in todo)
    deadline = time.monotonic() + limit
    busy = [t for t in todo if not quiesce(t, deadline)]
    if busy:
        for t in busy:
            log.warning("rank %d: %s transport with rank %d: a call of another thread did not return; its "
                        "buffers are left to process exit", t.rank, t.name, t.peer)
            t._state = "closed"
        todo = [t for t in todo if t not in busy]
    try:
        _teardown(todo, deadline)
    finally:
        for t in todo:
            t._call_lock.release()


def quiesce(t: Watched, deadline: float) -> bool:
    """Take ``t``'s call lock for teardown (``t`` is no longer open: a call of another thread inside it gives
    up its host waits). A call that holds it past :data:`FAILED_TEARDOWN_S` fails the end and has its GPU
    waits released (it then raises that error, never a released step's data); False if it still holds it
    at ``deadline``."""
    lock = t._call_lock
    if lock.acquire(timeout=max(0.0, min(FAILED_TEARDOWN_S, deadline - time.monotonic()))):
        return True
    from ..errors import GpuxferError
    with t._fail_lock:
        if t._error is None:
            t._error = GpuxferError(f"rank {t.rank}: the {t.name} transport with rank {t.peer} was closed by "
                                    f"another thread while a call on it waited")
    try:
        t._release_waits()
    except Exception as exc:  # noqa: BLE001
        log.debug("release for a waiting call: %s", exc)
    return lock.acquire(timeout=max(0.05, deadline - time.monotonic()))


def _teardown(todo: list, deadline: float) -> None:
    """close_all's steps over ends whose call locks it holds."""
    stuck: set[int] = set()     # ends whose streams still hold work after their waits were released
    for t in todo:
        if t._error is not None:
            try:
                t._release_waits()
            except Exception as exc:  # noqa: BLE001
                log.debug("release of a failed end: %s", exc)
    for t in todo:
        budget = deadline - time.monotonic()
        if t._error is not None:
            budget = min(budget, FAILED_TEARDOWN_S)
        drained = False
        try:
            drained = t._drain(max(0.05, budget))
        except Exception as exc:  # noqa: BLE001 - a failed stream: release and carry on
            log.warning("rank %d: %s transport with rank %d: drain failed: %s", t.rank, t.name, t.peer, exc)
        if not drained:
            log.warning("rank %d: %s transport with rank %d did not drain in %.3g s; releasing its GPU waits",
                        t.rank, t.name, t.peer, max(0.05, budget))
            try:
                t._release_waits()
                drained = t._drain(FAILED_TEARDOWN_S)
            except Exception as exc:  # noqa: BLE001
                log.debug("release after a failed drain: %s", exc)
            if not drained:     # that work may still copy into the peer's slots or out of this end's buffers
                stuck.add(id(t))
                log.warning("rank %d: %s transport with rank %d still has work queued on its streams; its "
                            "mappings and buffers are left to process exit", t.rank, t.name, t.peer)
        try:
            t.meta.drain(min(FAILED_TEARDOWN_S, max(0.05, deadline - time.monotonic())))
            t.channel.drain(min(FAILED_TEARDOWN_S, max(0.05, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001
            pass
        with t._wd_lock:
            t._wd.clear()
        if t.signals is not None:    # after the drain: everything this end published has landed
            t.signals.leave("closed its end" if t._error is None else
                            f"closed its end after {type(t._error).__name__}: {t._error}")

    met = {id(t): id(t) not in stuck for t in todo}

    def barrier(label: str) -> None:
        # posted even where an earlier barrier failed (a late peer is not held up); never by a stuck end, whose
        # peer then frees only what no peer maps
        posted = [t for t in todo if id(t) not in stuck and t.signals is not None and t.signals.post(label)]
        for t in todo:
            if t not in posted:
                met[id(t)] = False
        for t in posted:
            if not met[id(t)]:
                continue
            end = deadline if t._error is None else time.monotonic() + FAILED_TEARDOWN_S
            end = max(end, time.monotonic() + 1.0)      # a peer a moment behind still meets us
            if not t.signals.finish(label, end):
                met[id(t)] = False
                log.warning("rank %d: %s barrier with rank %d not met in time (the peer is gone or late); "
                            "tearing down without it", t.rank, label, t.peer)

    barrier("teardown-unmap")
    for t in todo:
        if id(t) in stuck:
            continue
        try:
            t._close_mappings()
        except Exception as exc:  # noqa: BLE001
            log.warning("rank %d: closing %s mappings: %s", t.rank, t.name, exc)
    barrier("teardown-free")
    for t in todo:
        with t._wd_lock:
            try:
                if met[id(t)]:
                    t._free()
                elif id(t) not in stuck:   # the peer may still map (and write) this end's buffers: free only
                    t._free_local()        # what is ours alone
            except Exception as exc:  # noqa: BLE001
                log.warning("rank %d: freeing %s buffers: %s", t.rank, t.name, exc)
            t._close_meta()
            t._state = "closed"
