"""How a decode rank of the SGLang backend learns a request's KV landed without a message: notification words.

Each registration a decode rank sends a prefill rank gives it one notification slot of the decode's
:class:`~gpuxfer.kv.KVAgent` (:meth:`Landings.new_slot`; one writer per word keeps its count exact: the n-th
notification writes n). The prefill's last push of a request bumps that word on its stream after the copies,
and the request's metadata row names the value it writes (``b"slot:value"``, :func:`landing_frame`). Once
the row arrived (:meth:`Landings.expect`), the decode's poll asks :meth:`Landings.landed`. The decode's agent keeps
a copy of its words in host memory that a prefill rank on this host writes after each word
(:mod:`gpuxfer.kv.host_notify`): each poll reads it with a load, and once a slot's copy was seen to move nothing is
read of the decode's GPU while a request waits (a slot has one writer, the prefill rank of the one registration it
was handed out in: the rank that moved its copy writes it after every word it bumps); before that, and without a
copy, the word at most every ``READ_EVERY_S`` per slot (the polls in between reuse the last value read): a prefill
rank that does not write the copy is heard as soon. A request whose word's copy did not move still ends by its
prefill's Success message, which reads the device word (:meth:`Landings.reached_now`). No SGLang here: :mod:`.conn`
wires it into SGLang's classes.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from ...errors import BadInput, GpuxferError
from ...kv import NOTIFY_SLOTS
from ...platforms.base import RELEASE_VALUE

log = logging.getLogger("gpuxfer.sglang")

READ_EVERY_S = 20e-6            # a word is read from the device at most this often
#: where the agent keeps a host copy of its words (read with a load at every poll), how often the device word of a
#: slot whose copy was seen to move is read beside it: never (None; a device read queued behind the other process's
#: work on a shared GPU costs hundreds of microseconds of the poll that makes it). A slot whose copy never moved is
#: read every ``READ_EVERY_S`` (its prefill rank may not write the copy: another host's, an earlier gpuxfer, a
#: mapping that failed)
HOST_COPY_READ_EVERY_S: Optional[float] = None


def slot_frame(slot: Optional[int]) -> bytes:
    """A notification slot as a registration carries it (empty: none)."""
    return b"" if slot is None else str(int(slot)).encode("ascii")


def parse_slot(frame: bytes) -> Optional[int]:
    """Inverse of :func:`slot_frame`; ``BadInput`` for anything but an int in ``0..NOTIFY_SLOTS - 1``."""
    if not frame:
        return None
    if len(frame) > 4 or not frame.isdigit() or not 0 <= int(frame) < NOTIFY_SLOTS:
        raise BadInput(f"a notification slot must be an int in 0..{NOTIFY_SLOTS - 1}, got {frame[:16]!r}")
    return int(frame)


def landing_frame(landing: Optional[Tuple[int, int]]) -> bytes:
    """``(slot, value)`` as a metadata row's message carries it (empty: none)."""
    return b"" if landing is None else f"{int(landing[0])}:{int(landing[1])}".encode("ascii")


def parse_landing(frame: bytes) -> Optional[Tuple[int, int]]:
    """Inverse of :func:`landing_frame`; ``BadInput`` for anything but a slot and a value in
    ``1..RELEASE_VALUE - 1`` (the release value a failed agent writes never says a request landed)."""
    if not frame:
        return None
    slot, sep, value = frame.partition(b":")
    if not sep or not slot or not value.isdigit() or len(value) > 19 or not 0 < int(value) < RELEASE_VALUE:
        raise BadInput(f"a landing notification must be b'slot:value', got {frame[:40]!r}")
    return parse_slot(slot), int(value)


class Landings:
    """A decode rank's notification slots and the requests waiting on them. ``read(slot)``: the word's value
    now (:meth:`KVAgent.notification <gpuxfer.kv.KVAgent.notification>`, a device read); ``host_read(slot)``:
    its host copy (:meth:`KVAgent.host_notification <gpuxfer.kv.KVAgent.host_notification>`, a load), or None
    where the agent has none."""

    def __init__(self, read: Callable[[int], int], host_read: Optional[Callable[[int], int]] = None):
        self._read, self._host_read = read, host_read
        self._read_every = HOST_COPY_READ_EVERY_S        # (a slot whose host copy moved; READ_EVERY_S otherwise)
        self._copy_moved = [False] * NOTIFY_SLOTS
        self._lock = threading.Lock()
        self._handed = 0                                    # slots given to prefill ranks, in order
        self._waiting: Dict[int, Tuple[int, int]] = {}      # room -> (slot, value)
        self._seen = [0] * NOTIFY_SLOTS                     # the highest value read of each slot
        self._announced = [0] * NOTIFY_SLOTS                # the highest value a row named of each slot
        self._read_at = [0.0] * NOTIFY_SLOTS

    def new_slot(self) -> Optional[int]:
        """A slot no prefill rank was given before; None once all ``NOTIFY_SLOTS`` were handed out (that
        rank's requests then end by their Success message)."""
        with self._lock:
            if self._handed >= NOTIFY_SLOTS:
                if self._handed == NOTIFY_SLOTS:
                    log.warning("gpuxfer: all %d notification slots were handed out; requests of prefill ranks "
                                "registered from now on end by their Success message", NOTIFY_SLOTS)
                    self._handed += 1
                return None
            self._handed += 1
            return self._handed - 1

    def _handed_out(self, slot: int) -> bool:
        return 0 <= slot < min(self._handed, NOTIFY_SLOTS)

    def check(self, landing: Tuple[int, int]) -> None:
        """``BadInput`` where ``landing`` names a value of a slot this rank handed out that is not past every
        value named on it before: the one prefill rank writing a word names each request's value once, in
        order (its rows travel in order on one socket), so a value named again, or a lower one, says nothing
        of the request's pages (the word may already hold it)."""
        slot, value = landing
        if self._handed_out(slot) and value <= self._announced[slot]:
            raise BadInput(f"notification {slot} was named value {self._announced[slot]} before; {value} is not "
                           "past it")

    def expect(self, room: int, landing: Tuple[int, int]) -> bool:
        """``room`` landed once word ``landing[0]`` holds ``landing[1]`` (:meth:`check` ed): kept where the slot
        was handed out by this rank (else ignored: False)."""
        slot, value = landing
        if not self._handed_out(slot):
            return False
        self._announced[slot] = max(self._announced[slot], value)
        self._waiting[room] = landing
        return True

    def forget(self, room: int) -> None:
        self._waiting.pop(room, None)

    def waiting(self, room: int) -> bool:
        return room in self._waiting

    def landed(self, room: int) -> bool:
        """Whether ``room``'s word reached its value (False while none is expected; then forgotten)."""
        landing = self._waiting.get(room)
        if landing is None or not self.reached(*landing):
            return False
        self._waiting.pop(room, None)
        return True

    def seen(self, slot: int) -> Optional[int]:
        """The highest value read of word ``slot`` so far (no read now); None for a slot this rank did not hand out."""
        return self._seen[slot] if self._handed_out(slot) else None

    def reached(self, slot: int, value: int) -> bool:
        """Whether word ``slot``, one this rank handed out, holds ``value`` or more (:meth:`word`; a value already
        seen needs no read)."""
        return self._handed_out(slot) and (self._seen[slot] >= value or self.word(slot) >= value)

    def reached_now(self, slot: int, value: int) -> bool:
        """:meth:`reached`, the device word read now, by this call, where no value seen holds ``value`` (no read
        spacing: a status message's check, once per request). The read is this thread's own: another thread's
        :meth:`word` may be reading the word at this moment, its value not in yet."""
        if self.reached(slot, value):
            return True
        if not self._handed_out(slot):
            return False
        seen = self._read_device(slot, time.monotonic())
        return value <= seen < RELEASE_VALUE or self._seen[slot] >= value     # (its own read, whatever another wrote)

    def word(self, slot: int) -> int:
        """The highest value seen on word ``slot`` (0: not handed out by this rank): its host copy read at every
        call where the agent keeps one, the device word where ``READ_EVERY_S`` passed since its last read (beside a
        copy seen to move, ``HOST_COPY_READ_EVERY_S``: None, never; the release value a failed agent writes is not a
        count)."""
        if not self._handed_out(slot):
            return 0
        if self._host_read is not None:
            try:
                seen = self._host_read(slot)
            except GpuxferError:        # the agent closed: the request ends by its status (or its timeout)
                seen = 0
            if 0 < seen < RELEASE_VALUE:
                self._copy_moved[slot] = True
                if seen > self._seen[slot]:
                    self._seen[slot] = seen
        every = self._read_every if self._copy_moved[slot] else READ_EVERY_S
        if every is None:
            return self._seen[slot]
        now = time.monotonic()
        if now - self._read_at[slot] >= every:
            self._read_device(slot, now)
        return self._seen[slot]

    def _read_device(self, slot: int, now: float) -> int:
        """Word ``slot`` read from the device now (0 where the agent failed: the request ends by its status or its
        timeout), kept as seen unless it is the release value a failed agent writes (not a count of pushes)."""
        self._read_at[slot] = now
        try:
            seen = self._read(slot)
        except GpuxferError:
            seen = 0
        if seen < RELEASE_VALUE:
            self._seen[slot] = max(self._seen[slot], seen)
        return seen
