"""The peer-flag link: 64-bit flag words in each process's memory, written by the peer, waited on locally.

Two processes each allocate a small flag buffer, zero it, export it and open the peer's. A flag
reaches the peer either by a *remote stream write* into the peer's word (``write_flag`` on the peer
mapping's address), where a set-up probe saw one arrive, or else by a local stream write into a
*stage* word of the sender's own followed, on the same stream, by an 8-byte copy-engine copy of it
into the peer's word (CUDA 13.1+ refuses remote stream writes). Every wait is a stream wait on a word
of the waiter's own memory (``wait_flag``, GEQ): values only grow. ``GPUXFER_FLAG_PATH=remote|copy``
forces one path (``auto``: the probe decides).

Used by the ``copy_engine`` stage hand-off (:mod:`gpuxfer.pp.copy_engine`: ``full`` / ``empty`` per
slot) and the ``pack`` KV engine (:mod:`gpuxfer.kv.engines.pack`: ``GO`` / ``AVAIL`` / ``FREE``). The
owner lays its words out from :data:`FIRST_WORD` on; words ``0 .. FIRST_WORD - 1`` are the probe's.
Each word sits on its own 64-byte line (:data:`FLAG_STRIDE`).

Set-up, collective (every phase's result travels to the peer before the next phase)::

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

Per signal (``signal(stream, index, value, stage)``), after earlier work on ``stream``::

    remote path:  write_flag(stream, peer[index], value)
    copy path:    write_flag(stream, own[stage], value); copy_async(stream, peer[index], own[stage], 8)

A stage word belongs to one stream (or one slot whose signals are ordered): it must hold its value
until the copy queued behind it has read it.

Abort: :meth:`release_waits` writes :data:`~gpuxfer.platforms.base.RELEASE_VALUE` from the host into
the given words (and the probe's), so no stream waiting on them stays blocked.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from . import config
from .errors import BackendUnavailable, BadInput, GpuxferError
from .platforms.base import RELEASE_VALUE, DeviceBuffer, Platform, Stream
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


def flag_path_from_env(value: str | None = None) -> str:
    """How flags reach the peer: ``value``, else ``$GPUXFER_FLAG_PATH``, else ``auto`` (remote stream writes
    where the set-up probe saw them arrive, 8-byte copies otherwise); ``remote`` and ``copy`` force one."""
    return config.resolve(ENV_FLAG_PATH, value, option="flag_path")


class FlagLink:
    """This process's end of a peer-flag link (see the module docstring for the protocol).

    ``words`` is the number of words the owner uses (indices ``FIRST_WORD .. FIRST_WORD + words - 1``);
    ``alloc(nbytes)`` allocates the flag buffer (default ``platform.alloc`` on ``device``: a platform
    with uncached flag memory passes its own), ``copy(stream, dst, src, nbytes)`` is the 8-byte copy
    (default ``platform.copy_async``). ``name`` names the link's user in errors. The link creates one
    stream for its set-up and closes it in :meth:`finish`; signals and waits go on the caller's streams.
    """

    def __init__(self, platform: Platform, device: int, words: int, *, path: str | None = None, rank: int = 0,
                 peer: int = 1, name: str = "flags", alloc: Callable[[int], DeviceBuffer] | None = None,
                 copy: Callable[[Stream, int, int, int], None] | None = None):
        if int(words) < 1:
            raise BadInput(f"a flag link needs at least one word, got {words}")
        self.path_wanted = flag_path_from_env(path)      # bad input fails here, on every side alike
        self.platform, self.device, self.rank, self.peer, self.name = platform, device, rank, peer, name
        self.nbytes = (FIRST_WORD + int(words)) * FLAG_STRIDE
        self._copy = copy or platform.copy_async
        self.remote = False
        self.peer_mem = None
        self._nonce = 0
        self._sent_error: str | None = None
        self._stream = None
        self.local = (alloc or (lambda n: platform.alloc(n, device)))(self.nbytes)
        try:
            self._stream = platform.create_stream(device)
            platform.memset_async(self._stream, self.local.ptr, 0, self.nbytes)
            if not platform.synchronize(self._stream, SETUP_TIMEOUT_S):
                raise GpuxferError(f"rank {rank}: zeroing the {name} flag words did not finish in "
                                   f"{SETUP_TIMEOUT_S:g} s")
        except BaseException:
            self.close()
            raise

    # ---- addresses ----
    def word(self, index: int) -> int:
        """The address of this side's word ``index``."""
        return self.local.ptr + index * FLAG_STRIDE

    def peer_word(self, index: int) -> int:
        """The address of the peer's word ``index`` in this process (after :meth:`open`)."""
        return self.peer_mem.ptr + index * FLAG_STRIDE

    @property
    def path(self) -> str:
        """How this side's signals reach the peer, in words (after :meth:`finish`)."""
        return REMOTE if self.remote else COPY

    # ---- set-up phases (collective: every side calls each, in this order) ----
    def export(self) -> Any:
        return self.local.export()

    def open(self, handle) -> None:
        """Open the peer's flag buffer (its :meth:`export`)."""
        self.peer_mem = self.platform.open_handle(handle, self.device)
        if self.peer_mem.nbytes < self.nbytes:
            raise BadInput(f"rank {self.peer}'s {self.name} flag buffer holds {self.peer_mem.nbytes} B, "
                           f"expected {self.nbytes}")

    def probe_send(self, nonce: int) -> dict:
        """Write ``nonce + 1`` into the peer's copy probe word by an 8-byte copy (required) and ``nonce + 2``
        into its remote probe word by a remote stream write (unless the path is forced to copies); a
        refused remote write is reported, not raised. Returns the report :meth:`probe_check` takes."""
        p, s = self.platform, self._stream
        self._nonce = nonce
        p.write_flag(s, self.word(PROBE_STAGE), nonce + 1)
        self._copy(s, self.peer_word(PROBE_COPY), self.word(PROBE_STAGE), 8)
        wait_event_or_raise(p, p.record_event(s), SETUP_TIMEOUT_S, rank=self.rank, step=0, flag="probe (copy)",
                            expected=nonce + 1, device=self.device,
                            what=f"setup probe: 8-byte {self.name} flag copy to rank {self.peer}")
        if self.path_wanted == "copy":
            self._sent_error = f"{ENV_FLAG_PATH}=copy"
            return {"remote_sent": False, "remote_error": self._sent_error}
        try:
            p.write_flag(s, self.peer_word(PROBE_REMOTE), nonce + 2)
            if not p.synchronize(s, SETUP_TIMEOUT_S):
                raise GpuxferError(f"a remote stream write did not finish in {SETUP_TIMEOUT_S:g} s")
        except Exception as exc:  # noqa: BLE001 - the remote path is optional: the probe says so
            self._sent_error = f"{type(exc).__name__}: {exc}"
            log.info("rank %d: remote stream write to rank %d refused (%s); %s flags go by 8-byte copies",
                     self.rank, self.peer, exc, self.name)
            self._renew_stream()     # a failed stream op may leave the stream unusable
            return {"remote_sent": False, "remote_error": self._sent_error}
        return {"remote_sent": True, "remote_error": None}

    def probe_check(self, peer_report: dict) -> dict:
        """Check the peer's probe writes arrived here (the copy: required, bounded; the remote write: within
        :data:`REMOTE_SEEN_S`) and that a stream wait on the copied word completes."""
        p, dev, nonce = self.platform, self.device, self._nonce
        word_copy = self.word(PROBE_COPY)
        seen = wait_flag_or_raise(p, word_copy, nonce + 1, SETUP_TIMEOUT_S, rank=self.rank, step=0,
                                  flag="probe (copy)", device=dev,
                                  what=f"setup probe: rank {self.peer}'s 8-byte {self.name} flag copy never arrived")
        if seen != nonce + 1:
            raise GpuxferError(f"setup probe: rank {self.peer}'s 8-byte {self.name} flag copy wrote {seen}, "
                               f"expected {nonce + 1}")
        p.wait_flag(self._stream, word_copy, nonce + 1)
        if not p.event_wait(p.record_event(self._stream), SETUP_TIMEOUT_S):
            p.host_write_flag(word_copy, RELEASE_VALUE, dev)
            raise GpuxferError(f"a stream wait on a flag already set did not complete in {SETUP_TIMEOUT_S:g} s")
        remote_seen = False
        if peer_report.get("remote_sent"):
            deadline = time.monotonic() + REMOTE_SEEN_S
            while True:
                v = p.read_flag(self.word(PROBE_REMOTE), dev)
                if v == nonce + 2:
                    remote_seen = True
                    break
                if time.monotonic() > deadline:
                    log.info("rank %d: rank %d's remote stream write did not arrive (value %d); its %s flags go "
                             "by 8-byte copies", self.rank, self.peer, v, self.name)
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
        return (f"{ENV_FLAG_PATH}=remote, but rank {self.rank}'s remote stream write did not reach rank {self.peer}"
                + (f" ({why})" if why else ""))

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

    # ---- per signal ----
    def signal(self, stream: Stream, index: int, value: int, stage: int) -> None:
        """Make the peer's word ``index`` hold ``value`` once earlier work on ``stream`` is done (``stage``:
        this side's word the copy path sends from; it belongs to ``stream``)."""
        if self.remote:
            self.platform.write_flag(stream, self.peer_word(index), value)
        else:
            src = self.word(stage)
            self.platform.write_flag(stream, src, value)
            self._copy(stream, self.peer_word(index), src, 8)

    def wait(self, stream: Stream, index: int, value: int) -> None:
        """Later work on ``stream`` waits until this side's word ``index`` is ``>= value``."""
        self.platform.wait_flag(stream, self.word(index), value)

    def read(self, index: int) -> int:
        return self.platform.read_flag(self.word(index), self.device)

    def release_waits(self, indices: Iterable[int]) -> None:
        """Abort path: write the release value into words ``indices`` and the probe's (best effort, never raises)."""
        if self.local is None or self.local.closed:
            return
        for i in (*indices, PROBE_COPY):
            try:
                self.platform.host_write_flag(self.word(i), RELEASE_VALUE, self.device)
            except Exception as exc:  # noqa: BLE001 - best effort on the abort path
                log.debug("releasing %s flag word %d: %s", self.name, i, exc)

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
        if m is not None:
            m.close()

    def close(self) -> None:
        """Close the set-up stream, the peer's mapping and this side's flag buffer (idempotent)."""
        self._close_stream()
        self.close_peer()
        if self.local is not None:
            self.local.close()
