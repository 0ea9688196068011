"""A byte ring in shared memory between two processes, one writer and one reader: records go in and come out with
no system call (the engine thread's side of the loader, :mod:`.loader`).

Layout: one page of header -- the writer's position (bytes written ever, u64 at 0) and the reader's (bytes taken
ever, u64 at 64: another cache line) -- then ``size`` bytes of data. A record is its length (u32), the CRC-32 of
its payload (u32) and the payload, written at ``position % size`` (wrapping) before the writer's position moves
past it::

    writer                                   reader
    ------                                   ------
    free = size - (w - r) >= 8 + n ?         w == r: nothing
      payload at w + 8, header at w          header at r: length, CRC; payload read out
      w += 8 + n  (one aligned 8-byte store) CRC matches: r += 8 + n; else read again at the next call

The CRC covers CPUs that may make the position visible before the payload (weakly ordered memory, Python having
no fences): a record read early fails its check and is read again later. It is seeded with the record's position,
so that the record a previous lap left at that place (header and payload whole) fails it too. x86 makes a core's
stores visible in their order (TSO), so there the CRC is 0 and not checked. Nothing blocks: a full ring makes
:meth:`ShmRing.put` return False, and the caller keeps the record for later.
"""
from __future__ import annotations

import mmap
import os
import platform
import struct
import zlib

_HDR = struct.Struct("<II")
_POS = struct.Struct("<Q")
#: stores become visible to other cores in program order (x86's TSO): no CRC needed
ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
HEADER = mmap.PAGESIZE


def ring_fd(size: int, name: str = "gpuxfer-ring") -> int:
    """A memory file (inherited by no other program: close-on-exec) sized for a ring of ``size`` data bytes."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, HEADER + size)
    except BaseException:
        os.close(fd)
        raise
    return fd


class ShmRing:
    """One end of a ring in the memory file ``fd`` (mapped here; the caller may close ``fd`` after)."""

    def __init__(self, fd: int):
        total = os.fstat(fd).st_size
        if total <= HEADER + _HDR.size:
            raise ValueError(f"a ring's memory file must hold more than {HEADER + _HDR.size} bytes, not {total}")
        # (its pages mapped now: a record written to a page not touched yet would pay its fault in the caller)
        self._mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.size = total - HEADER
        self.ordered = ORDERED
        mv = memoryview(self._mm)
        self._pos = mv[:HEADER].cast("Q")          # [0]: written, [8]: taken (64 bytes apart)
        self._data = mv[HEADER:]

    def put(self, payload: bytes) -> bool:
        """Append one record; False (nothing written) where the ring has no room for it now."""
        n = len(payload)
        pos = self._pos
        w = pos[0]
        need = _HDR.size + n
        if need > self.size - (w - pos[8]):
            return False
        self._write(w + _HDR.size, payload)
        self._write(w, _HDR.pack(n, 0 if self.ordered else _crc(w, payload)))
        pos[0] = w + need
        return True

    def _write(self, at: int, b: bytes) -> None:
        size, data = self.size, self._data
        i = at % size
        k = min(len(b), size - i)
        data[i:i + k] = b[:k]
        if k < len(b):
            data[:len(b) - k] = b[k:]

    def _read(self, at: int, n: int) -> bytes:
        size, data = self.size, self._data
        i = at % size
        k = min(n, size - i)
        if k == n:
            return bytes(data[i:i + n])
        return bytes(data[i:]) + bytes(data[:n - k])

    def pending(self) -> bool:
        """Whether a record may be waiting (no system call)."""
        pos = self._pos
        return pos[0] != pos[8]

    def get(self) -> bytes | None:
        """The next record's payload, or None where none is there whole yet."""
        pos = self._pos
        r = pos[8]
        avail = pos[0] - r
        if avail < _HDR.size:
            return None
        n, crc = _HDR.unpack(self._read(r, _HDR.size))
        if _HDR.size + n > avail:          # (not whole yet, or a header read before it was written)
            return None
        payload = self._read(r + _HDR.size, n)
        if not self.ordered and _crc(r, payload) != crc:
            return None
        pos[8] = r + _HDR.size + n
        return payload

    def room(self) -> int:
        """The largest payload a record may have (one that fills the ring)."""
        return self.size - _HDR.size

    def close(self) -> None:
        try:
            self._pos.release()
            self._data.release()
            self._mm.close()
        except BufferError:             # (a view still exported: the mapping goes with the object)
            pass


def _crc(at: int, payload: bytes) -> int:
    """The check of the record at position ``at``: its payload's CRC-32 seeded with the position's."""
    return zlib.crc32(payload, zlib.crc32(_POS.pack(at)))
