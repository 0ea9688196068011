"""Per-step metadata between the two ends of a pair on one host: a shared-memory mailbox.

A metadata message over the CPU (gloo) group costs tens of microseconds on every
step (52-73 us a step, measured on 2x H200), more than a small step's
whole transfer. When both ends of a pair run on the same host,
:func:`gpuxfer.pp.selection.connect` gives the pair this mailbox instead: a small
POSIX shared-memory segment that both processes map, created by the receiver
(registered with the resource tracker at once) and unlinked as soon as the sender
has opened it (nothing is left behind, even on a crash after setup; a receiver
killed before that: its tracker, or the surviving sender, unlinks it). Its name,
``/gpuxfer-pp-<receiver pid>-<nonce>-<tag>`` (hex; :func:`segment_name`), is built by
both ends from what connect exchanged; a name left by a receiver whose tracker died
with it goes at a later :meth:`Mailbox.create` on the host, which removes every
name of that pattern whose creator pid no longer exists (same user; at least an hour
old, so a live creator's in another PID namespace is left) and touches no other name.
``GPUXFER_PP_META_CHANNEL=group`` keeps the CPU group.

Layout (int64 words)::

    [0] magic (the connection's nonce)   [1] consumed: the last message the receiver took
    [2..7] spare (one cache line)
    slot j (j = 0..RING-1) at word 8 + j * stride:  [seq, check, payload x meta_len]

Timeline of message m (1, 2, ...; slot j = (m - 1) % RING)::

    sender (send(), refusals too)               receiver (recv())
    -----------------------------               -----------------
    wait consumed >= m - RING  (slot j free)
    write payload -> slot j
    write check(payload, m)
    write seq[j] = m  ------------------------> wait seq[j] == m
                                                copy the payload; recompute check
                                                (a mismatch is a torn read: read again)
                      consumed >= m  <-------   write consumed = m

Both waits poll with a backoff (spin 50 us, then yield for 2 ms, then sleep up to 1 ms) and give
up after the transport's timeout with :class:`MailboxTimeout` naming the word and the
value seen, which the transport turns into :class:`~gpuxfer.errors.TransferTimeout`.
Words are written in program order (payload, check, seq); the check guards readers
on hosts that reorder stores.
"""
from __future__ import annotations

import os
import re
import time
import zlib

import numpy as np

from ..common import map_shm, sweep_shm_orphans, unlink_shm
from ..errors import GpuxferError

RING = 16
HEADER_WORDS = 8
W_MAGIC, W_CONSUMED = 0, 1
PREFIX = "gpuxfer-pp-"
_NAME = re.compile(PREFIX + r"([0-9a-f]{1,8})-[0-9a-f]{1,16}-[0-9a-f]{1,16}")   # creator pid, nonce, tag


def segment_name(creator_pid: int, nonce: int, tag: int) -> str:
    """The name of a pair's mailbox: its creator's (the receiver's) pid, the connection's nonce, the pair's tag."""
    return f"/{PREFIX}{creator_pid:x}-{nonce:x}-{tag:x}"


class MailboxTimeout(GpuxferError, TimeoutError):
    """A mailbox wait ran past its deadline (the transport raises TransferTimeout for it)."""


def _check(payload, m: int) -> int:
    """CRC-32 of the payload's bytes (an array, or a byte view of one), seeded with the message number."""
    return zlib.crc32(payload, m & 0xFFFFFFFF)


SPIN_S = 50e-6       # _wait: busy-poll this long (a step's message is usually microseconds away),
YIELD_S = 2e-3       # then poll between sched_yield()s this long, then sleep in growing naps
MAX_NAP_S = 1e-3


def _wait(cond, timeout_s: float, what, cancelled=None) -> None:
    """Poll ``cond()`` until it holds; MailboxTimeout(what()) after ``timeout_s``, or as soon as
    ``cancelled()`` is true (checked between naps: the transport failed meanwhile).

    No sleep in the first milliseconds: on Linux even ``time.sleep(0)`` costs tens of
    microseconds (timer slack), longer than a small pp step, so a waiter that slept
    would wake a step late. ``os.sched_yield`` gives the core away without that cost.
    """
    now = time.perf_counter
    t0 = now()
    while now() - t0 < SPIN_S:
        if cond():
            return
    while now() - t0 < YIELD_S:
        if cond():
            return
        os.sched_yield()
    deadline = time.monotonic() + timeout_s
    nap = 50e-6
    while not cond():
        if time.monotonic() > deadline:
            raise MailboxTimeout(what())
        if cancelled is not None and cancelled():
            raise MailboxTimeout(what() + " (cancelled: the transport failed)")
        time.sleep(nap)
        nap = min(MAX_NAP_S, nap * 2)


class Mailbox:
    """One direction of a pair's metadata: :meth:`create` on the receiver, :meth:`open` on the sender.

    Sender: ``i = next_send_buffer(timeout_s)``, fill ``send_buffers[i]``, ``send(i)``.
    Receiver: ``recv(timeout_s)`` -> the payload (valid until the next ``recv``).
    """

    what = "the shared-memory mailbox"

    def __init__(self, name: str, meta_len: int, magic: int, *, create: bool):
        if meta_len < 1:
            raise ValueError(f"meta_len must be >= 1, got {meta_len}")
        self.name, self.meta_len, self.magic = name, int(meta_len), int(magic)
        self.stride = -(-(2 + self.meta_len) // 8) * 8
        self._mm = map_shm(name, 8 * (HEADER_WORDS + RING * self.stride), create=create, exact=True, reserve=True)
        self._linked = create
        if create:   # the resource tracker unlinks it if this process dies before unlink()
            from multiprocessing import resource_tracker
            resource_tracker.register(name, "shared_memory")
        self._words = np.frombuffer(self._mm, dtype=np.int64)
        if create:
            self._words[W_MAGIC] = self.magic
        elif int(self._words[W_MAGIC]) != self.magic:
            self.close()
            raise ValueError(f"mailbox {name} belongs to another connection (magic differs)")
        base = HEADER_WORDS + np.arange(RING) * self.stride
        self._seq = [int(b) for b in base]
        self.send_buffers = [self._words[b + 2:b + 2 + self.meta_len] for b in base]
        self._recv_copy = np.zeros(self.meta_len, dtype=np.int64)
        # the per-message path reads and writes words and bytes through memoryviews (a numpy element or
        # slice access costs several times more)
        self._mv = memoryview(self._mm)
        self._q = self._mv.cast("q")
        self._payload = [self._mv[8 * (b + 2):8 * (b + 2 + self.meta_len)] for b in self._seq]
        self._copy_bytes = memoryview(self._recv_copy).cast("B")
        self._sent = self._taken = 0

    @classmethod
    def create(cls, name: str, meta_len: int, magic: int) -> "Mailbox":
        """A new mailbox ``name``, after removing the mailboxes whose creator is gone
        (:func:`~gpuxfer.common.sweep_shm_orphans`)."""
        sweep_shm_orphans(_NAME, "mailbox")
        return cls(name, meta_len, magic, create=True)

    @classmethod
    def open(cls, name: str, meta_len: int, magic: int) -> "Mailbox":
        return cls(name, meta_len, magic, create=False)

    def unlink(self) -> None:
        """Remove the segment's name (the mappings stay valid); idempotent."""
        unlink_shm(self.name)
        if self._linked:
            from multiprocessing import resource_tracker
            self._linked = False
            resource_tracker.unregister(self.name, "shared_memory")

    # ---- sender ----
    def next_send_buffer(self, timeout_s: float, cancelled=None) -> int:
        m = self._sent + 1
        q = self._q
        if q[W_CONSUMED] < m - RING:
            _wait(lambda: q[W_CONSUMED] >= m - RING, timeout_s,
                  lambda: f"message {m}: the receiver has taken {q[W_CONSUMED]} of {m - 1} "
                          f"after {timeout_s:g} s (the mailbox holds {RING})", cancelled)
        return (m - 1) % RING

    def send(self, i: int) -> None:
        m = self._sent + 1
        if i != (m - 1) % RING:
            raise ValueError(f"mailbox slot {i} is not message {m}'s")
        seq, q = self._seq[i], self._q
        q[seq + 1] = _check(self._payload[i], m)
        q[seq] = m
        self._sent = m

    # ---- receiver ----
    def recv(self, timeout_s: float, cancelled=None) -> np.ndarray:
        m = self._taken + 1
        j = (m - 1) % RING
        if not self._arrived(j, m):
            seq, q = self._seq[j], self._q
            _wait(lambda: self._arrived(j, m), timeout_s,
                  lambda: f"message {m}: slot {j} holds message {q[seq]} after {timeout_s:g} s", cancelled)
        self._taken = m
        self._q[W_CONSUMED] = m
        return self._recv_copy

    def _arrived(self, j: int, m: int) -> bool:
        """Whether slot j holds message m whole: copied out, its checksum matched, not overwritten meanwhile."""
        seq, q = self._seq[j], self._q
        if q[seq] != m:
            return False
        out = self._copy_bytes
        out[:] = self._payload[j]
        return q[seq + 1] == _check(out, m) and q[seq] == m

    # ---- the channel interface the transport also gets from CpuChannel ----
    def drain(self, timeout_s: float) -> None:
        """Nothing is in flight once send() returns."""

    def close(self) -> None:
        """Unmap (idempotent); the segment was unlinked at setup."""
        if self._mm is None:
            return
        self.send_buffers = []
        self._words = None
        for v in (*getattr(self, "_payload", ()), getattr(self, "_q", None), getattr(self, "_mv", None)):
            if v is not None:
                v.release()
        self._payload, self._q, self._mv = [], None, None
        try:
            self._mm.close()
        except BufferError:             # a view is still held somewhere: the mapping goes with it
            pass
        self._mm = None
