"""The peer-flag link: 64-bit flag words in each process's memory, written by the peer, waited on locally.

Each process allocates a small buffer of flag words (:class:`FlagWords`), zeroes it and exports it; a
:class:`FlagLink` opens one peer's. A flag reaches the peer either by a *remote stream write* into the
peer's word (``write_flag`` on the peer mapping's address), where a set-up probe saw one arrive, or else
by a local stream write into a *stage* word followed, on the same stream, by an 8-byte copy-engine copy
of it into the peer's word (CUDA 13.1+ refuses remote stream writes). Every wait is a stream wait on a
word of the waiter's own memory (``wait_flag``, GEQ) or a bounded host poll of it: values only grow
(each word's writer resets it, where a protocol reuses it, once its waiter is past its last wait).
``GPUXFER_FLAG_PATH=remote|copy`` forces one path (``auto``: the probe decides).

Users: the ``copy_engine`` stage hand-off (:mod:`gpuxfer.pp.copy_engine`: ``full`` / ``empty`` per slot)
and the benchmark's ``pack`` KV engine (:mod:`gpuxfer.bench.kv.engines.pack`: ``GO`` / ``AVAIL`` / ``FREE``), each
end owning its words; and :class:`~gpuxfer.kv.agent.KVAgent` (its notification words and its ``pack``
transfers' words, :mod:`gpuxfer.kv.control`): the agent's one set of words, published in its metadata, is
shared by one link per peer, each link with stage words of its own. The owner lays its words out from
:data:`FIRST_WORD` on; words ``0 .. FIRST_WORD - 1`` are the probe's. Each word sits on its own 64-byte
line (:data:`FLAG_STRIDE`).

Set-up, two-sided (:meth:`FlagLink.connect`: every phase's result travels to the peer before the next)::

    A                                              B
    -                                              -
    FlagLink(): alloc, zero, wait for the zeroing  FlagLink(): alloc, zero, wait
    export() ------------- handles -------------> open(A's handle)      (and B's to A, alike)
    probe_send(n):
      write stage := n+1; copy 8 B -> B.COPY       (required: the copy path always works)
      remote write B.REMOTE := n+2  (not with path=copy; a refusal is reported, not raised)
      --------------------- {remote_sent, why not} ------------------->
                                                   probe_check: poll own COPY == n+1 (bounded),
                                                     a stream wait on it completes,
                                                     poll own REMOTE == n+2 (2 s)
      <----------------------- {remote_seen} -------------------------
    finish(): remote writes iff B saw A's          finish(): alike, for B's writes to A
              (path=remote and not seen: an error naming the rank)

Set-up, one-sided (:meth:`FlagLink.probe_one_sided`: the peer takes no part; an agent adding a peer from
its metadata bytes)::

    A                                              B (exported its words earlier)
    open(B's handle; in one process, B's FlagWords)
    path=auto: on a stream of its own, remote write B.REMOTE := nonce
               (refused: copies); synchronize, bounded (not done in time: copies, the stream kept)
               read B.REMOTE through the mapping: == nonce -> remote writes, else copies
    path=remote | copy: that path, unprobed

Per signal (``signal(stream, index, value, stage)``), after earlier work on ``stream``::

    remote path:  write_flag(stream, peer[index], value)
    copy path:    write_flag(stream, stage[stage], value); copy_async(stream, peer[index], stage[stage], 8)

A value decided on the device (``FlagQueue.signal_from``: an 8-byte word of this side's device memory)
goes by the 8-byte copy on either path. A stage word belongs to one stream (or one slot whose signals are ordered): it must hold its value
until the copy queued behind it has read it. A link owning its words stages in them; a link sharing
them stages in a buffer of its own. :meth:`FlagLink.queue` gives a stream's flag operations in batches
(:class:`FlagQueue`: writes and waits held until the next copy or launch, then one
:meth:`~gpuxfer.platforms.base.Platform.flag_ops` call, one graph node where captured).

Abort: :meth:`FlagWords.release` (:meth:`FlagLink.release_waits`) writes
:data:`~gpuxfer.platforms.base.RELEASE_VALUE` from the host into the given words (and the probe's), so no
stream waiting on them stays blocked.
"""
from __future__ import annotations

import logging
import numbers
import os
import threading
import time
from typing import Any, Callable, Iterable

from . import config
from .errors import BackendUnavailable, BadInput, GpuxferError, TransferTimeout
from .platforms.base import (FLAG_OP_WAIT, FLAG_OP_WRITE, RELEASE_VALUE, DeviceBuffer, Platform, Stream,
                             StreamCalls, flag_ops_array)
from .sync import wait_event_or_raise, wait_flag_or_raise

log = logging.getLogger("gpuxfer.flaglink")

ENV_FLAG_PATH = "GPUXFER_FLAG_PATH"
#: bytes between two flag words (each on its own line)
FLAG_STRIDE = 64
#: the probe's words: the peer's remote write lands in PROBE_REMOTE, its 8-byte copy in PROBE_COPY;
#: PROBE_STAGE is this side's source of its own probe copy
PROBE_REMOTE, PROBE_COPY, PROBE_STAGE = 0, 1, 2
#: the first word the owner lays out
FIRST_WORD = 3
#: bound of every set-up wait (zeroing, the probe's copy and stream wait)
SETUP_TIMEOUT_S = 10.0
#: how long the probe polls for the peer's remote write (one the sender saw complete lands in microseconds)
REMOTE_SEEN_S = 2.0

REMOTE, COPY = "remote stream writes", "8-byte copies"

#: streams a one-sided probe's write had not left when its bound passed, and flag words whose zeroing had not
#: completed in time: kept for the life of the process rather than destroyed or freed under the queued work
_KEPT: list = []


def flag_path_from_env(value: str | None = None) -> str:
    """How flags reach the peer: ``value``, else ``$GPUXFER_FLAG_PATH``, else ``auto`` (remote stream writes
    where the set-up probe saw them arrive, 8-byte copies otherwise); ``remote`` and ``copy`` force one."""
    return config.resolve(ENV_FLAG_PATH, value, option="flag_path")


def _word_in(mem, index, nbytes: int, what: str) -> int:
    """The address of word ``index`` of the ``nbytes`` of flag words at ``mem`` (None: not open), checked."""
    if mem is None or mem.closed:
        raise BadInput(f"{what} flag words are {'not open' if mem is None else 'closed'}")
    if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < nbytes // FLAG_STRIDE:
        raise BadInput(f"{what} flag words: no word {index!r} (there are {nbytes // FLAG_STRIDE})")
    return mem.ptr + int(index) * FLAG_STRIDE


class FlagWords:
    """This process's flag words: ``FIRST_WORD + words`` of them (the probe's, then the owner's), each on its
    own line, allocated (``alloc(nbytes)``, default ``platform.alloc`` on ``device``), zeroed (bounded:
    ``timeout_s``, :class:`TransferTimeout`) and exportable. Streams write (:meth:`write`) and wait on them
    (:meth:`wait`), the host
    reads them (:meth:`read`, :meth:`wait_host`), the abort path releases them (:meth:`release`).
    ``name`` names them in errors."""

    def __init__(self, platform: Platform, device: int, words: int, *, rank: int = 0, name: str = "flags",
                 alloc: Callable[[int], DeviceBuffer] | None = None, timeout_s: float = SETUP_TIMEOUT_S):
        if int(words) < 1:
            raise BadInput(f"flag words: at least one, got {words}")
        self.platform, self.device, self.rank, self.name = platform, device, rank, name
        self.nbytes = (FIRST_WORD + int(words)) * FLAG_STRIDE
        self._release_lock = threading.Lock()   # a release (any thread: a watchdog's) never meets the free
        self.buf = (alloc or (lambda n: platform.alloc(n, device)))(self.nbytes)
        s, queued = None, False
        try:
            s = platform.create_stream(device)
            platform.memset_async(s, self.buf.ptr, 0, self.nbytes)
            queued = True
            if not platform.synchronize(s, timeout_s):
                raise TransferTimeout(rank=rank, step=0, flag=f"{name} flag words (zeroing)", expected=1, seen=0,
                                      timeout_s=timeout_s)
            queued = False
        except BaseException as exc:
            if queued and (isinstance(exc, TransferTimeout) or not isinstance(exc, GpuxferError)):
                # the fill may still run (an error of the stream's own would have stopped it): the words stay
                # allocated for the life of the process
                log.warning("%s: zeroing the flag words did not complete (%s); they are kept for the life of the "
                            "process", name, exc)
                _KEPT.append(self.buf)
            else:
                self.buf.close()
            raise
        finally:
            if s is not None:
                s.close()

    @property
    def closed(self) -> bool:
        return self.buf.closed

    def word(self, index: int) -> int:
        """The address of word ``index``: :class:`BadInput` once the words are closed, or for an index outside
        them (an address past the buffer, or into freed memory, would fault the stream or the host reading it)."""
        return _word_in(self.buf, index, self.nbytes, self.name)

    def export(self) -> Any:
        return self.buf.export()

    def read(self, index: int) -> int:
        return self.platform.read_flag(self.word(index), self.device)

    def wait(self, stream: Stream, index: int, value: int) -> None:
        """Later work on ``stream`` waits until word ``index`` is ``>= value``."""
        self.platform.wait_flag(stream, self.word(index), value)

    def write(self, stream: Stream, index: int, value: int) -> None:
        """Word ``index`` := ``value`` once earlier work on ``stream`` is done (a word of this process's)."""
        self.platform.write_flag(stream, self.word(index), value)

    def wait_host(self, index: int, value: int, timeout_s: float, *, step: int = 0, flag: str = "",
                  what: str = "") -> int:
        """Poll word ``index`` from the host until it is ``>= value`` and return what it holds;
        :class:`TransferTimeout` (naming ``flag``) past ``timeout_s``."""
        return wait_flag_or_raise(self.platform, self.word(index), int(value), timeout_s, rank=self.rank, step=step,
                                  flag=flag or f"{self.name} flag word {index}", device=self.device, what=what)

    def release(self, indices: Iterable[int]) -> None:
        """Abort path: write the release value into words ``indices`` and the probe's copy word (best effort,
        never raises)."""
        with self._release_lock:
            if self.buf.closed:
                return
            for i in (*indices, PROBE_COPY):
                try:
                    self.platform.host_write_flag(self.word(i), RELEASE_VALUE, self.device)
                except Exception as exc:  # noqa: BLE001 - best effort on the abort path
                    log.warning("releasing %s flag word %d: %s", self.name, i, exc)

    def close(self) -> None:
        """Free the words (idempotent; after a release under way in another thread)."""
        with self._release_lock:
            self.buf.close()

    def __repr__(self) -> str:
        return f"FlagWords({self.name!r}, {self.nbytes} B{', closed' if self.closed else ''})"


class FlagLink:
    """This process's end of a peer-flag link (see the module docstring for the protocol).

    ``words`` is the number of words the owner uses (indices ``FIRST_WORD .. FIRST_WORD + words - 1``);
    ``alloc(nbytes)`` allocates the flag buffer (default ``platform.alloc`` on ``device``: a platform
    with uncached flag memory passes its own), ``copy(stream, dst, src, nbytes)`` is the 8-byte copy
    (default ``platform.copy_async``). ``name`` names the link's user in errors; ``peer`` the peer (a
    rank, or a name). ``shared``: this process's words, owned by the caller and shared with its other links
    (the link then stages its copy-path signals in a buffer of its own); by default the link owns its
    words. The two-sided set-up creates one stream and closes it in :meth:`finish`; signals and waits go
    on the caller's streams.
    """

    def __init__(self, platform: Platform, device: int, words: int, *, path: str | None = None, rank: int = 0,
                 peer: int | str = 1, name: str = "flags", alloc: Callable[[int], DeviceBuffer] | None = None,
                 copy: Callable[[Stream, int, int, int], None] | None = None, shared: FlagWords | None = None):
        if int(words) < 1:
            raise BadInput(f"a flag link needs at least one word, got {words}")
        self.path_wanted = flag_path_from_env(path)      # bad input fails here, on every side alike
        self._closed = False
        self.platform, self.device, self.rank, self.peer, self.name = platform, device, rank, peer, name
        self._copy_fn = copy
        self.remote = False
        self.peer_mem = None
        self._owns_peer = False
        self._nonce = 0
        self._sent_error: str | None = None
        self._stream = None
        self.stage_mem = None
        if shared is None:
            self.words = FlagWords(platform, device, words, rank=rank, name=name, alloc=alloc)
        else:
            if shared.nbytes < (FIRST_WORD + int(words)) * FLAG_STRIDE:
                raise BadInput(f"{name}: the shared flag words hold {shared.nbytes} B, fewer than {words} words")
            self.words = shared
        self._owns_words = shared is None
        self.local = self.words.buf
        self.nbytes = self.words.nbytes
        try:
            self.stage_mem = self.local if shared is None else (alloc or (lambda n: platform.alloc(n, device)))(
                self.nbytes)
            if shared is None:
                self._stream = platform.create_stream(device)
        except BaseException:
            self.close()
            raise

    # ---- addresses ----
    def word(self, index: int) -> int:
        """The address of this side's word ``index``."""
        return self.words.word(index)

    def stage_word(self, index: int) -> int:
        """The address of stage word ``index`` (a copy-path signal's source)."""
        return _word_in(self.stage_mem, index, self.nbytes, f"{self.name} stage")

    def peer_word(self, index: int) -> int:
        """The address of the peer's word ``index`` in this process (after :meth:`open`)."""
        return _word_in(self.peer_mem, index, self.nbytes, f"{self._peer_label()}'s {self.name}")

    def _copy(self, stream: Stream, dst: int, src: int, nbytes: int) -> None:
        (self._copy_fn or self.platform.copy_async)(stream, dst, src, nbytes)

    @property
    def path(self) -> str:
        """How this side's signals reach the peer, in words (after the set-up)."""
        return REMOTE if self.remote else COPY

    def _peer_label(self) -> str:
        return f"rank {self.peer}" if isinstance(self.peer, int) else f"peer {self.peer!r}"

    # ---- set-up phases (two-sided: every side calls each, in this order) ----
    def export(self) -> Any:
        return self.words.export()

    def open(self, handle) -> None:
        """Open the peer's flag words: its :meth:`export` or, for a peer in this process, its :class:`FlagWords`
        (used as they are, not closed by this link)."""
        if self.peer_mem is not None:
            raise BadInput(f"{self._peer_label()}'s {self.name} flag words are open already")
        if isinstance(handle, FlagWords):
            mem, owns = handle.buf, False
        else:
            mem, owns = self.platform.open_handle(handle, self.device), True
        if mem.nbytes < self.nbytes:
            if owns:
                mem.close()
            raise BadInput(f"{self._peer_label()}'s {self.name} flag buffer holds {mem.nbytes} B, "
                           f"expected {self.nbytes}")
        self.peer_mem, self._owns_peer = mem, owns

    def probe_send(self, nonce: int) -> dict:
        """Write ``nonce + 1`` into the peer's copy probe word by an 8-byte copy (required) and ``nonce + 2``
        into its remote probe word by a remote stream write (unless the path is forced to copies); a
        refused remote write is reported, not raised. Returns the report :meth:`probe_check` takes."""
        p, s = self.platform, self._stream
        self._nonce = nonce
        p.write_flag(s, self.stage_word(PROBE_STAGE), nonce + 1)
        self._copy(s, self.peer_word(PROBE_COPY), self.stage_word(PROBE_STAGE), 8)
        wait_event_or_raise(p, p.record_event(s), SETUP_TIMEOUT_S, rank=self.rank, step=0, flag="probe (copy)",
                            expected=nonce + 1, device=self.device,
                            what=f"setup probe: 8-byte {self.name} flag copy to {self._peer_label()}")
        if self.path_wanted == "copy":
            self._sent_error = f"{ENV_FLAG_PATH}=copy"
            return {"remote_sent": False, "remote_error": self._sent_error}
        try:
            p.write_flag(s, self.peer_word(PROBE_REMOTE), nonce + 2)
            if not p.synchronize(s, SETUP_TIMEOUT_S):
                raise GpuxferError(f"a remote stream write did not finish in {SETUP_TIMEOUT_S:g} s")
        except Exception as exc:  # noqa: BLE001 - the remote path is optional: the probe says so
            self._sent_error = f"{type(exc).__name__}: {exc}"
            log.info("rank %d: remote stream write to %s refused (%s); %s flags go by 8-byte copies",
                     self.rank, self._peer_label(), exc, self.name)
            self._renew_stream()     # a failed stream op may leave the stream unusable
            return {"remote_sent": False, "remote_error": self._sent_error}
        return {"remote_sent": True, "remote_error": None}

    def probe_check(self, peer_report: dict) -> dict:
        """Check the peer's probe writes arrived here (the copy: required, bounded; the remote write: within
        :data:`REMOTE_SEEN_S`) and that a stream wait on the copied word completes."""
        p, dev, nonce = self.platform, self.device, self._nonce
        word_copy = self.word(PROBE_COPY)
        seen = self.words.wait_host(PROBE_COPY, nonce + 1, SETUP_TIMEOUT_S, flag="probe (copy)",
                                    what=f"setup probe: {self._peer_label()}'s 8-byte {self.name} flag copy never "
                                         "arrived")
        if seen != nonce + 1:
            raise GpuxferError(f"setup probe: {self._peer_label()}'s 8-byte {self.name} flag copy wrote {seen}, "
                               f"expected {nonce + 1}")
        p.wait_flag(self._stream, word_copy, nonce + 1)
        if not p.event_wait(p.record_event(self._stream), SETUP_TIMEOUT_S):
            p.host_write_flag(word_copy, RELEASE_VALUE, dev)
            raise GpuxferError(f"a stream wait on a flag already set did not complete in {SETUP_TIMEOUT_S:g} s")
        remote_seen = False
        if peer_report.get("remote_sent"):
            deadline = time.monotonic() + REMOTE_SEEN_S
            while True:
                v = self.words.read(PROBE_REMOTE)
                if v == nonce + 2:
                    remote_seen = True
                    break
                if time.monotonic() > deadline:
                    log.info("rank %d: %s's remote stream write did not arrive (value %d); its %s flags go "
                             "by 8-byte copies", self.rank, self._peer_label(), v, self.name)
                    break
                time.sleep(1e-3)
        return {"remote_seen": remote_seen, "writer": self.peer, "reader": self.rank}

    def finish(self, peer_check: dict) -> None:
        """Take the remote path where the peer saw this side's remote write; close the set-up stream.
        ``path=remote`` and the peer did not see it: :class:`GpuxferError`."""
        self.remote = bool(peer_check.get("remote_seen"))
        self._close_stream()
        if self.path_wanted == "remote" and not self.remote:
            raise GpuxferError(self._remote_refused(self._sent_error))

    def _remote_refused(self, why: str | None) -> str:
        return (f"{ENV_FLAG_PATH}=remote, but rank {self.rank}'s remote stream write did not reach "
                f"{self._peer_label()}" + (f" ({why})" if why else ""))

    def connect(self, exchange: Callable[[Any], list], nonce: int = 0x5EED) -> None:
        """Every set-up phase over ``exchange`` (an all-gather of one object per rank, index = rank).
        With ``path=remote``, a remote write not seen fails every side together:
        :class:`BackendUnavailable` naming each writer and why."""
        self.open(exchange(self.export())[self.peer])
        sent = exchange(self.probe_send(nonce))
        checks = exchange(self.probe_check(sent[self.peer]))
        if self.path_wanted == "remote":
            failed = {c["writer"]: (f"{ENV_FLAG_PATH}=remote, but its remote stream write did not reach rank "
                                    f"{c['reader']}" + (f" ({sent[c['writer']]['remote_error']})"
                                                        if sent[c["writer"]]["remote_error"] else ""))
                      for c in checks if not c["remote_seen"]}
            if failed:
                self._close_stream()
                raise BackendUnavailable(self.name, failed)
        self.finish(checks[self.peer])

    # ---- set-up, one-sided ----
    def probe_one_sided(self, timeout_s: float = SETUP_TIMEOUT_S) -> bool:
        """Decide the path after :meth:`open` without the peer taking part (see the module docstring): under
        ``auto``, a remote stream write of a fresh value into the peer's probe word, on a stream of its own,
        read back through the mapping; the forced paths are taken unprobed. At most ``timeout_s`` (and the
        set-up bound): a write not done by then leaves its stream kept for the life of the process, and the
        path is copies. Sets and returns :attr:`remote`."""
        if self.path_wanted != "auto":
            self.remote = self.path_wanted == "remote"
            return self.remote
        p = self.platform
        word = self.peer_word(PROBE_REMOTE)
        nonce = int.from_bytes(os.urandom(6), "little") + 1
        timeout = min(float(timeout_s), SETUP_TIMEOUT_S)
        s = p.create_stream(self.device)
        pending, ok = False, False
        try:
            p.write_flag(s, word, nonce)
            pending = not p.synchronize(s, timeout)
            ok = not pending and p.read_flag(word, self.device) == nonce
        except Exception as exc:  # noqa: BLE001 - the remote path is optional (CUDA 13.1+ refuses it): logged
            log.info("%s: a remote stream write to %s failed (%s: %s)", self.name, self._peer_label(),
                     type(exc).__name__, exc)
        if pending:
            log.warning("%s: the probe's stream write to %s did not complete within %g s; its stream is kept for "
                        "the life of the process", self.name, self._peer_label(), timeout)
            _KEPT.append(s)
        else:
            try:
                s.close()
            except Exception as exc:  # noqa: BLE001 - a stream a refused operation left unusable: logged
                log.warning("%s: closing the probe's stream failed (%s: %s)", self.name, type(exc).__name__, exc)
        if not ok:
            log.info("%s: signals to %s go by 8-byte copies", self.name, self._peer_label())
        self.remote = ok
        return ok

    # ---- per signal ----
    def signal(self, stream: Stream, index: int, value: int, stage: int, calls: StreamCalls | None = None) -> None:
        """Make the peer's word ``index`` hold ``value`` once earlier work on ``stream`` is done (``stage``:
        the stage word the copy path sends from; it belongs to ``stream``). ``calls``: ``stream``'s bound
        calls (:meth:`Platform.stream_calls`), where the caller holds them, for the write."""
        dst = self.peer_word(index)
        src = dst if self.remote else self.stage_word(stage)
        if calls is not None:
            calls.write_flag(src, value)
        else:
            self.platform.write_flag(stream, src, value)
        if not self.remote:
            self._copy(stream, dst, src, 8)

    def wait(self, stream: Stream, index: int, value: int) -> None:
        """Later work on ``stream`` waits until this side's word ``index`` is ``>= value``."""
        self.words.wait(stream, index, value)

    def read(self, index: int) -> int:
        return self.words.read(index)

    def queue(self, stream: Stream, batch: bool = False) -> "FlagQueue":
        """A :class:`FlagQueue` of this link on ``stream``."""
        return FlagQueue(self, stream, batch)

    def release_waits(self, indices: Iterable[int]) -> None:
        """Abort path: write the release value into words ``indices`` and the probe's (best effort, never raises)."""
        self.words.release(indices)

    # ---- teardown ----
    def _renew_stream(self) -> None:
        old, self._stream = self._stream, self.platform.create_stream(self.device)
        try:
            old.close()
        except Exception as exc:  # noqa: BLE001 - the stream is dropped either way
            log.debug("closing the refused probe's stream: %s", exc)

    def _close_stream(self) -> None:
        s, self._stream = self._stream, None
        if s is not None:
            s.close()

    def close_peer(self) -> None:
        """Close the peer's mapping (idempotent)."""
        m, self.peer_mem = self.peer_mem, None
        if m is not None and self._owns_peer:
            m.close()

    def close(self) -> None:
        """Close the set-up stream, the peer's mapping, the stage buffer and, where the link owns them, this side's
        flag words (idempotent)."""
        self._closed = True
        self._close_stream()
        self.close_peer()
        if self.stage_mem is not None and self.stage_mem is not self.local:
            self.stage_mem.close()
        if self._owns_words:
            self.words.close()

    @property
    def closed(self) -> bool:
        return self._closed


class FlagQueue:
    """One stream's operations, in order, on a :class:`FlagLink`'s words: flag writes and waits are held until
    the next copy or launch (or :meth:`flush`) and then go as one :meth:`Platform.flag_ops` batch when
    ``batch`` (one graph node where captured), else one call each. Words are named by index: :meth:`wait`
    and :meth:`write` this side's, :meth:`signal` the peer's (the link's path)."""

    __slots__ = ("link", "plat", "s", "batch", "native", "ops")

    def __init__(self, link: FlagLink, s: Stream, batch: bool):
        self.link, self.plat, self.s, self.batch = link, link.platform, s, batch
        self.native = self.plat.native_stream(s)
        self.ops: list[tuple[int, int, int]] = []

    def wait(self, index: int, value: int) -> None:
        """Wait until this side's word ``index`` is ``>= value``."""
        self.ops.append((FLAG_OP_WAIT, self.link.word(index), value))

    def write(self, index: int, value: int) -> None:
        """This side's word ``index`` := ``value`` (a word this side's own streams wait on)."""
        self.ops.append((FLAG_OP_WRITE, self.link.word(index), value))

    def signal(self, index: int, value: int, stage: int | None = None) -> None:
        """The peer's word ``index`` := ``value`` (:meth:`FlagLink.signal`; ``stage`` defaults to ``index``): a
        remote write joins the batch, the copy path's write into the stage word then its 8-byte copy."""
        link = self.link
        if link.remote:
            self.ops.append((FLAG_OP_WRITE, link.peer_word(index), value))
            return
        src = link.stage_word(index if stage is None else stage)
        self.ops.append((FLAG_OP_WRITE, src, value))
        self.flush()
        link._copy(self.s, link.peer_word(index), src, 8)

    def signal_from(self, index: int, src: int) -> None:
        """The peer's word ``index`` := the 8 bytes at ``src`` (device memory of this side's, written by earlier
        work on the stream): an 8-byte copy on either path, for a value decided on the device."""
        self.flush()
        self.link._copy(self.s, self.link.peer_word(index), src, 8)

    def flush(self) -> None:
        ops, self.ops = self.ops, []
        if self.batch and len(ops) > 1:
            self.plat.flag_ops(self.s, flag_ops_array(ops))
            return
        for op, ptr, value in ops:
            if op == FLAG_OP_WAIT:
                self.plat.wait_flag(self.s, ptr, value)
            else:
                self.plat.write_flag(self.s, ptr, value)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """A data copy on the stream (after the operations before it)."""
        self.flush()
        self.plat.copy_async(self.s, dst, src, nbytes)

    def launch(self, fn) -> None:
        """A kernel's launch: straight on the stream's driver handle where the platform gives one."""
        self.flush()
        if self.native is None:
            self.plat.launch(self.s, fn)
        else:
            fn(self.native)
