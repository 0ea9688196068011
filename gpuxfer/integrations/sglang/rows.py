"""A request's metadata rows in the decode rank's host memory (:class:`AuxRows`, :class:`RowSegment`). A decode rank
keeps a row per SGLang metadata row index -- a 64-byte stamp, then the rows of every SGLang aux buffer back to
back -- in a POSIX shared-memory segment it names in its registration; a prefill rank on the same host opens it
and, before it posts a request's last push, writes the request's rows there, stamped with the decode's token for the
request and the value that push writes to the decode's notification word. The decode takes the rows once that
word reached the value: reads and writes of host memory (``pread``/``pwrite`` of the segment, never of a mapping a
peer's ``ftruncate`` would turn into a SIGBUS), no device copy on either side, nothing riding the push::

    prefill P (opens D's segment)                          decode D (owns the segment)
    ----------------------------                           ---------------------------
                                                           row r's stamp := 0 (before the row is named)
                                      <-- room, pages, row r, token t
    row r: stamp := 0, rows := the request's,
           stamp := (t, slot k, v)       (pwrites)
    agent's stream: post(last pages, word k := v,
                         then its host copy := v)    -->   poll: word k's host copy >= v, then row r's
                                                           stamp, its rows, its stamp again (preads): the same
                                                           whole stamp (t, k, <= v) -> the rows into SGLang's

The stamp names the request (the decode's token), the notification slot and the value, each beside its
complement: a zeroed stamp reads as no stamp, a stamp read while it is written (bytes of it still zero) fails the
complement check, and a stamp read the same before and after the rows says the rows read between were not being
rewritten (a writer zeroes the stamp before it writes rows; each of the three steps on either side goes through a
lock, whose release and acquire order the writes and the reads on any CPU). It also holds a digest of the rows it
was written with: two writers of one row (a request given up on the decode whose prefill still writes the row index
SGLang handed the next request) whose steps interleave leave one's rows under the other's stamp, read the same
before and after them, and the digest refuses those. The word reaching the value says the
push that was posted after the rows landed; a push that failed never writes the value (its slot is retired). No
SGLang here.
"""
from __future__ import annotations

import hashlib
import logging
import numbers
import os
import re
import secrets
import struct
import threading
from ctypes import memmove, string_at
from typing import Any, List, Optional, Tuple

from ...common import hold_shm, open_shm, sweep_shm_orphans, unlink_shm
from ...errors import BadInput, BadMetadata, GpuxferError
from .layout import _ints, read_aux_rows, write_aux_rows

STAMP_BYTES = 64
_MAGIC = 0x32574F5258475F  # b"_GXROW2" little-endian
_MASK = (1 << 64) - 1
_FMT = "<8Q"
_NO_STAMP = bytes(STAMP_BYTES)
_AUX_LISTS = ("aux_data_ptrs", "aux_data_lens", "aux_item_lens")

PREFIX = "gpuxfer-rows-"
_NAME = re.compile(PREFIX + r"([0-9a-f]{1,8})-[0-9a-f]{12}")
_TRAILER = "<5q"                # after the rows: magic, the owner's mark (two words), rows, row bytes
_TRAILER_BYTES = 64
_PAGE = 4096
#: a decode rank's rows whose creator is gone and that no process holds are swept by the next decode of the host once
#: this old (a creator holds its rows from the moment it makes them; SGLang's processes end without a teardown)
ORPHAN_AGE_S = 60.0

log = logging.getLogger("gpuxfer.sglang")


def token_number(token: Optional[bytes]) -> Optional[int]:
    """The decode's request token as the stamp carries it (an int of at most 18 digits); None for anything else
    (that request's rows go on the control socket)."""
    if not token or len(token) > 18 or not token.isdigit() or int(token) == 0:
        return None
    return int(token)


def _digest(token: int, slot: int, value: int, rows: bytes) -> int:
    """What binds a stamp to the rows written with it: a digest of both."""
    head = struct.pack("<3Q", token & _MASK, slot & _MASK, value & _MASK)
    return int.from_bytes(hashlib.blake2b(head + bytes(rows), digest_size=8, person=b"gpuxfer-row").digest(), "little")


def encode_stamp(token: int, slot: int, value: int, rows: bytes = b"") -> bytes:
    """The stamp of ``rows`` written for request ``token`` landing at ``value`` of notification ``slot``: the magic,
    a digest of the rows and the three numbers, then each number beside its complement."""
    words = [_MAGIC, _digest(token, slot, value, rows)]
    words += [w for v in (token, slot, value) for w in (v & _MASK, ~v & _MASK)]
    return struct.pack(_FMT, *words)


def decode_stamp(raw: bytes) -> Optional[Tuple[int, int, int]]:
    """``(token, slot, value)`` of ``raw``'s whole stamp (a row as :meth:`RowSegment.read` returns it: the stamp,
    then the rows it names); None for a zeroed, torn or foreign one, or one written with other rows (two writers'
    steps interleaved: one's rows under the other's stamp)."""
    w = struct.unpack(_FMT, raw[:STAMP_BYTES])
    if (w[0] != _MAGIC or w[2] != (~w[3] & _MASK) or w[4] != (~w[5] & _MASK)
            or w[6] != (~w[7] & _MASK)):
        return None
    if w[1] != _digest(w[2], w[4], w[6], raw[STAMP_BYTES:]):
        return None
    return w[2], w[4], w[6]


def _mark(uid: str) -> Tuple[int, int]:
    """The two int64 words that name agent ``uid`` as a segment's owner (a digest: any string a metadata holds)."""
    d = hashlib.blake2b(b"gpuxfer-rows\0" + uid.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return int.from_bytes(d[:8], "little", signed=True), int.from_bytes(d[8:], "little", signed=True)


class RowSegment:
    """``rows`` rows of ``row_bytes`` in a POSIX shared-memory segment, then a trailer naming the agent that owns
    them (``uid``): :meth:`create` makes one (a decode rank), :meth:`open` opens a peer's by name (a prefill rank of
    the same host). Every access is a ``pread``/``pwrite`` of the segment's descriptor, never a load or store of a
    mapping: a segment another process cut short (``ftruncate``) reads short, a typed error, where a mapping's
    access past its end would be a SIGBUS; a closed one reads and writes nothing."""

    def __init__(self, name: str, rows: int, row_bytes: int, create: bool):
        self.name, self.rows, self.row_bytes = name, int(rows), int(row_bytes)
        self.nbytes = -(-(self.rows * self.row_bytes + _TRAILER_BYTES) // _PAGE) * _PAGE
        self._lock = threading.Lock()
        # (its pages taken now: a full /dev/shm refuses the rows here, not a request's write later)
        self._fd: Optional[int] = open_shm(name, self.nbytes, create=create, exact=True, reserve=True)
        self.owner = self.linked = create
        # the owner's from the start: a sweep leaves the segment while it lives
        self._hold: Optional[int] = hold_shm(name) if create else None

    @classmethod
    def create(cls, uid: str, rows: int, row_bytes: int) -> "RowSegment":
        """New rows named ``/gpuxfer-rows-<pid hex>-<12 hex>``, marked as agent ``uid``'s, after removing the
        segments of that prefix whose creator is gone (:func:`~gpuxfer.common.sweep_shm_orphans`)."""
        sweep_shm_orphans(_NAME, "metadata rows", min_age_s=ORPHAN_AGE_S)
        seg = cls(f"/{PREFIX}{os.getpid():x}-{secrets.token_hex(6)}", rows, row_bytes, True)
        try:
            seg._set(seg.rows * seg.row_bytes, struct.pack(_TRAILER, _MAGIC, *_mark(uid), seg.rows, seg.row_bytes))
        except BaseException:
            seg.close()
            raise
        return seg

    @classmethod
    def open(cls, name: Any, uid: str, rows: Any, row_bytes: int) -> "RowSegment":
        """Agent ``uid``'s rows as its registration names them: ``BadMetadata`` for a name :meth:`create` does not
        give, a row count that is no positive int, or a segment of another size or owner; ``OSError`` where none
        of that name exists here (another host)."""
        if not isinstance(name, str) or name[:1] != "/" or not _NAME.fullmatch(name[1:]):
            raise BadMetadata(f"registration rows_shm: not a name of metadata rows: {name!r:.80}")
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 < rows <= 1 << 24:
            raise BadMetadata(f"registration rows: not a count of metadata rows: {rows!r:.40}")
        try:
            seg = cls(name, rows, row_bytes, False)
        except BadInput as exc:         # (open_shm: a segment of another size)
            raise BadMetadata(f"registration rows_shm {name!r}: {exc}") from None
        try:
            got = struct.unpack(_TRAILER, seg._get(seg.rows * seg.row_bytes, struct.calcsize(_TRAILER)))
        except BaseException:
            seg.close()
            raise
        if got != (_MAGIC, *_mark(uid), seg.rows, seg.row_bytes):
            seg.close()
            raise BadMetadata(f"registration rows_shm {name!r}: another agent's rows, or rows of another shape")
        return seg

    def _span(self, index: int) -> int:
        if type(index) is int and 0 <= index < self.rows:
            return index * self.row_bytes
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= int(index) < self.rows:
            raise BadInput(f"metadata row {index!r:.40} is no int of the {self.rows} rows here")
        return int(index) * self.row_bytes

    def _set(self, at: int, data: bytes) -> None:
        """``data`` written at byte ``at`` (one ``pwrite``: past a segment cut short, it grows the segment again)."""
        with self._lock:
            if self._fd is None:
                raise GpuxferError(f"metadata rows {self.name} are closed")
            try:
                done = os.pwrite(self._fd, data, at)
            except OSError as exc:
                raise GpuxferError(f"metadata rows {self.name}: writing {len(data)} bytes at {at}: {exc}") from None
        if done != len(data):
            raise GpuxferError(f"metadata rows {self.name}: {done} of {len(data)} bytes written at {at}")

    def _get(self, at: int, n: int) -> bytes:
        """``n`` bytes read at byte ``at`` (one ``pread``): fewer, where the segment was cut short, a typed error."""
        with self._lock:
            if self._fd is None:
                raise GpuxferError(f"metadata rows {self.name} are closed")
            try:
                out = os.pread(self._fd, n, at)
            except OSError as exc:
                raise GpuxferError(f"metadata rows {self.name}: reading {n} bytes at {at}: {exc}") from None
        if len(out) != n:
            raise GpuxferError(f"metadata rows {self.name} hold {len(out)} of {n} bytes at {at}: the segment was "
                               "cut short")
        return out

    def write(self, index: int, stamp: bytes, rows: bytes) -> None:
        """Row ``index`` := ``rows`` stamped ``stamp``: the stamp zeroed and the rows (one store, the stamp's bytes
        first), then the stamp (a second store, each through the lock): a reader that finds the same stamp before
        and after the rows read whole ones, and the stamp's digest refuses rows it was not written with."""
        at = self._span(index)
        if len(stamp) != STAMP_BYTES or len(rows) != self.row_bytes - STAMP_BYTES:
            raise BadInput(f"metadata row {index}: {len(rows)} bytes of rows for a {self.row_bytes - STAMP_BYTES}-byte "
                           "row")
        self._set(at, _NO_STAMP + rows)
        self._set(at, stamp)

    def read(self, index: int) -> bytes:
        """Row ``index``, its stamp then its rows (``row_bytes``, one read), then the stamp again (a second): zeros
        in the stamp's place where the two differ (the row was being written)."""
        at = self._span(index)
        raw = self._get(at, self.row_bytes)
        return raw if self._get(at, STAMP_BYTES) == raw[:STAMP_BYTES] else _NO_STAMP + raw[STAMP_BYTES:]

    def clear(self, index: int) -> None:
        """Zero row ``index``'s stamp."""
        self._set(self._span(index), _NO_STAMP)

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        """Close (and, the owner's, drop the name). Idempotent."""
        with self._lock:        # (no read or write holds the descriptor past this: its number is never reused)
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        if self.linked:
            self.linked = False
            unlink_shm(self.name)
        if self._hold is not None:
            os.close(self._hold)
            self._hold = None


def advertised(rows: Optional["AuxRows"]) -> dict:
    """What a decode's registration carries of its ``rows`` (for its geometry; {} without rows or a segment)."""
    if rows is None or rows.segment is None:
        return {}
    return {"rows_shm": rows.segment.name, "rows": rows.rows, "row_bytes": rows.row_bytes}


class AuxRows:
    """This rank's metadata rows: the shape of SGLang's aux buffers of ``kv_args`` (``rows`` rows of ``row_bytes``,
    stamp included) and, on a decode rank (``uid``: its agent's), the segment a prefill of its host writes them into.
    :meth:`create` returns None where ``kv_args`` has no aux buffers."""

    def __init__(self, kv_args: Any, uid: Optional[str] = None):
        self.kv_args = kv_args
        self.items = _ints(kv_args, "aux_item_lens")
        lens = _ints(kv_args, "aux_data_lens")
        self.rows = min(n // i for n, i in zip(lens, self.items))
        self.row_bytes = STAMP_BYTES + sum(self.items)
        # SGLang's aux lists as the rows were made from them, and each buffer's (pointer, row size): every row read
        # or written goes through these while the lists are the same (:meth:`_buffers`)
        self._lists = tuple(_ints(kv_args, n) for n in _AUX_LISTS)
        self._bufs = list(zip(self._lists[0], self.items))
        self.segment = None if uid is None else RowSegment.create(uid, self.rows, self.row_bytes)
        self._opened: List[RowSegment] = []     # peers' segments opened here (a prefill's), closed with this

    @classmethod
    def create(cls, kv_args: Any, uid: Optional[str] = None) -> Optional["AuxRows"]:
        """The rows of ``kv_args``' aux buffers (with a decode's segment where ``uid`` is given); None where it has
        none, or where the segment cannot be made (logged): its requests' rows then go in messages."""
        items, lens = _ints(kv_args, "aux_item_lens"), _ints(kv_args, "aux_data_lens")
        if (not items or not len(items) == len(lens) == len(_ints(kv_args, "aux_data_ptrs")) or min(items) <= 0
                or min(n // i for n, i in zip(lens, items)) < 1):
            return None     # (lists of different lengths: a row read from some buffers would not fill its row)
        try:
            return cls(kv_args, uid)
        except (GpuxferError, OSError) as exc:
            log.warning("gpuxfer: no shared memory for the metadata rows (%s: %s); they go on the control socket",
                        type(exc).__name__, exc)
            return None

    def _buffers(self) -> Optional[List[Tuple[int, int]]]:
        """Each aux buffer's (pointer, row size), where SGLang's aux lists are still those the rows were made from
        (None: they changed; the rows are then read and written by :mod:`.layout`'s checked calls)."""
        a, (ptrs, lens, items) = self.kv_args, self._lists
        try:
            same = a.aux_data_ptrs == ptrs and a.aux_data_lens == lens and a.aux_item_lens == items
        except (AttributeError, TypeError, ValueError):     # (lists SGLang no longer holds, or arrays)
            return None
        return self._bufs if same is True else None

    def open_peer(self, registration: dict, uid: str) -> Optional[RowSegment]:
        """A decode rank's segment as its registration names it (``uid``: its agent's), for a prefill rank: None
        where it names none, has rows of another size, or cannot be opened here (another host; logged);
        ``BadMetadata`` where the name or the segment is not that agent's rows."""
        name = registration.get("rows_shm")
        if name is None or registration.get("row_bytes") != self.row_bytes:
            return None
        try:
            seg = RowSegment.open(name, uid, registration.get("rows"), self.row_bytes)
        except OSError as exc:
            log.info("gpuxfer: the decode's metadata rows %s are not opened here (%s); its rows go in messages",
                     name, exc)
            return None
        self._opened = [s for s in self._opened if not s.closed] + [seg]
        return seg

    def _check(self, index: int) -> int:
        """``index`` as an int of the rows: ``BadInput`` for anything else (a bool, a float, which truncated would
        name another row, an int outside them)."""
        if type(index) is int and 0 <= index < self.rows:
            return index
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= int(index) < self.rows:
            raise BadInput(f"metadata row {index!r:.40} is no int of the {self.rows} rows registered")
        return int(index)

    # -- prefill

    def write(self, segment: RowSegment, dst: int, index: int, token: int, slot: int, value: int) -> None:
        """Row ``index`` of SGLang's aux buffers here into row ``dst`` of a decode's ``segment``, stamped for the
        decode's request ``token`` landing at ``value`` of notification ``slot`` (before the push that writes it
        is posted)."""
        index = self._check(index)
        bufs = self._buffers()
        data = (b"".join([string_at(p + index * n, n) for p, n in bufs]) if bufs is not None
                else b"".join(read_aux_rows(self.kv_args, index)))
        if len(data) != self.row_bytes - STAMP_BYTES:     # SGLang's aux lists changed since the rows were made
            raise BadInput(f"metadata row {index}: {len(data)} bytes of rows read for a "
                           f"{self.row_bytes - STAMP_BYTES}-byte row")
        segment.write(dst, encode_stamp(token, slot, value, data), data)

    # -- decode

    def _segment(self) -> RowSegment:
        if self.segment is None:
            raise GpuxferError("this rank keeps no metadata rows")
        return self.segment

    def clear(self, index: int) -> None:
        """Zero row ``index``'s stamp (before a request names the row: what an earlier request left is no stamp)."""
        self._segment().clear(self._check(index))

    def stamp(self, index: int) -> Optional[Tuple[int, int, int]]:
        """Row ``index``'s stamp, ``(token, slot, value)``, or None (none whole)."""
        return decode_stamp(self.row(index))

    def row(self, index: int) -> bytes:
        """Row ``index`` as it is now, its stamp and rows (:meth:`RowSegment.read`): :func:`decode_stamp` reads its
        stamp, :meth:`take` its rows."""
        return self._segment().read(self._check(index))

    def take(self, index: int, token: int, raw: Optional[bytes] = None,
             stamp: Optional[Tuple[int, int, int]] = None) -> None:
        """Row ``index``'s rows into SGLang's aux buffers, where its stamp is request ``token``'s (read with the
        rows: ``raw``, the row as :meth:`row` read it, or read here; ``stamp``: ``decode_stamp(raw)``, where the
        caller decoded it); ``BadInput`` otherwise, nothing written."""
        index = self._check(index)
        if raw is None or len(raw) != self.row_bytes:
            raw, stamp = self.row(index), None
        got = decode_stamp(raw) if stamp is None else stamp
        if got is None or got[0] != token:
            raise BadInput(f"metadata row {index} holds no row of this request (stamp {got!r})")
        bufs = self._buffers()
        if bufs is None:
            rows: List[bytes] = []
            at = STAMP_BYTES
            for item in self.items:
                rows.append(raw[at:at + item])
                at += item
            write_aux_rows(self.kv_args, index, rows)
            return
        at = STAMP_BYTES        # (the lists the rows were made from: every row fits its buffer at ``index``)
        for p, n in bufs:
            memmove(p + index * n, raw[at:at + n], n)
            at += n

    def close(self) -> None:
        """Close this rank's segment and the peers' it opened (from any thread: each segment's lock keeps a read
        or write from meeting its close). Idempotent."""
        for seg in ([self.segment] if self.segment is not None else []) + self._opened:
            seg.close()
