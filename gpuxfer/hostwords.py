"""Flag words in host memory shared by processes on one host: the owner's host reads them with a plain load, and
the processes' streams write and wait on them (:meth:`Platform.map_host_words`). Two users: a ``copy_engine``
pair of the stage hand-off (below), and a KV agent's notification words (:mod:`gpuxfer.kv.host_notify`).

A ``copy_engine`` sender keeps its ``empty[j]`` words (the slots its receiver gave back) here, so
``send()`` sees on the host whether slot j is free and queues its GPU wait only when it is not::

    sender S (owns the words)                        receiver R
    -------------------------                        ----------
    create gpuxfer-ppw-...: R words of 64 bytes
      (zero), map for S's device          --ref-->   open, map for R's device, check a stream write
                                                     and an 8-byte copy into a scratch word land
    step k, slot j:
      empty[j] >= k - R on the host? (a load)
        yes: the slot is free: no GPU wait           ... R's stream after the work on slot j:
        no:  queue the GPU wait as before    <------   publish empty[j] = k' (into host memory)

A word's value only grows and is written by R's stream after R's work on the slot completed, so a value
the host saw stays true: the slot is free for good. The sender's value words (the source of the 8-byte
copy that publishes a step from inside its copy graph) sit after the empty words in the same segment.

The words are a sealed memory file where the system has them (``memfd_create``, sealed against shrinking and
growing: no process can cut the file short under a mapping, whose next load or store would be a SIGBUS). Its
reference (:attr:`HostWords.ref`, ``memfd:<name>:<fd>:<inode hex>``) names the owner's descriptor, which a process of
the same user and PID namespace opens through ``/proc/<pid>/fd/<fd>``; a peer checks that what it opened is that
file (a regular file, the inode, the size, the name, the seals) before it maps it, and a peer elsewhere (another PID
namespace, ``/proc`` not showing the owner) cannot open it (``GpuxferError``: its callers keep the device words).
Where the system cannot make or so show one, the words are a POSIX shared-memory segment, its reference its name
``/gpuxfer-ppw-<pid>-<12 hex>``: a process that cuts it short makes the next access of a mapping a SIGBUS.

The owner drops the reference once the peer opened the words (:meth:`HostWords.unlink`: closes the descriptor, or
removes the name). A process killed between the create and that unlink leaves a segment's name behind; a later
create on the host removes every ``gpuxfer-ppw-<pid>-<12 hex>`` segment whose creator ``<pid>`` no longer exists
(and is ours: same user; at least an hour old, so a live creator's in another PID namespace is left) and that no
owner holds (a KV agent's words stay named for its life: its lock keeps them), and touches no other name (a memory
file goes with the last process that holds or maps it).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import secrets
import stat

from .common import hold_shm, map_shm, sweep_shm_orphans, unlink_shm
from .errors import GpuxferError
from .flaglink import FLAG_STRIDE

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

log = logging.getLogger("gpuxfer.pp")

PAGE = 4096
WORD_STRIDE = FLAG_STRIDE // 8     # int64 words per flag line: word i of loads() is at i * WORD_STRIDE
_PROBE_WRITE, _PROBE_COPY = 0, 1   # scratch lines after the n flag words (the peer's setup check)
PREFIX = "gpuxfer-ppw-"             # the stage hand-off's give-back words
KV_PREFIX = "gpuxfer-kvw-"          # a KV agent's notification words
_NAME = re.compile(PREFIX + r"([0-9a-f]{1,8})-[0-9a-f]{12}")     # as create() names them: creator pid, token
_NAMES = {PREFIX: _NAME, KV_PREFIX: re.compile(KV_PREFIX + r"([0-9a-f]{1,8})-[0-9a-f]{12}")}
#: a sealed memory file's reference: its name (group 1; creator pid: group 2), the owner's descriptor, its inode
_REFS = {p: re.compile(r"memfd:(" + p + r"([0-9a-f]{1,8})-[0-9a-f]{12}):([0-9]{1,10}):([0-9a-f]{1,16})")
         for p in (PREFIX, KV_PREFIX)}
#: the seals of the words' memory file: its size fixed for good
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(fcntl, "F_ADD_SEALS") else 0
_WRITE_SEALS = 0x08 | 0x10          # F_SEAL_WRITE, F_SEAL_FUTURE_WRITE: no process could write the words


def is_ref(ref, prefix: str = PREFIX) -> bool:
    """Whether ``ref`` is of the form :meth:`HostWords.create` gives words of ``prefix`` (a memory file's reference,
    or a segment's name)."""
    if not isinstance(ref, str):
        return False
    return bool(_REFS[prefix].fullmatch(ref) or (ref[:1] == "/" and _NAMES[prefix].fullmatch(ref[1:])))


def _sealed_memfd(name: str, nbytes: int) -> int | None:
    """A descriptor of a new memory file ``name`` of ``nbytes`` (zero, its pages taken now: a full memory is an
    ``OSError`` here, not a SIGBUS at a later store), sealed at that size, that ``/proc/<pid>/fd/<fd>`` shows to the
    processes of this user and PID namespace; None where this system cannot make or so show one."""
    if not _SEALS or not hasattr(os, "memfd_create"):
        return None
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return None
    try:
        os.ftruncate(fd, nbytes)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
    except BaseException:
        os.close(fd)
        raise
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        st, seen = os.fstat(fd), os.stat(f"/proc/{os.getpid()}/fd/{fd}")
        if (seen.st_dev, seen.st_ino) == (st.st_dev, st.st_ino):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _map_memfd(ref: str, m: re.Match, nbytes: int) -> mmap.mmap:
    """Map the memory file reference ``ref`` (``m``: its match) names, checked to be the one its owner made: a
    regular file (looked at before it is opened for reading or writing: a forged reference never opens a device, a
    pipe or a socket), of that inode, size and name, sealed at its size. ``GpuxferError`` otherwise."""
    name, pid, fd, ino = m.group(1), int(m.group(2), 16), int(m.group(3)), int(m.group(4), 16)
    what = f"flag words {ref!r:.120}"
    if not _SEALS or not hasattr(os, "O_PATH"):
        raise GpuxferError(f"{what}: this system has no sealed memory files")
    if pid <= 0:
        raise GpuxferError(f"{what}: no process has pid {pid}")
    link, other = f"/memfd:{name} (deleted)", f"{what}: the descriptor names another file"
    try:
        # the link /proc shows first (no call into the file's file system: a stat of a file of a FUSE or network
        # mount asks its server, which need never answer), then a handle on the path (opens nothing)
        if os.readlink(f"/proc/{pid}/fd/{fd}") != link:
            raise GpuxferError(other)
        at = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise GpuxferError(f"{what}: cannot be reached ({exc.strerror}; its owner closed it, or is of another "
                           f"PID namespace or user)") from None
    try:
        if os.readlink(f"/proc/self/fd/{at}") != link:     # (the descriptor changed since)
            raise GpuxferError(other)
        st = os.fstat(at)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != ino or st.st_size != nbytes:
            raise GpuxferError(other)
        rw = os.open(f"/proc/self/fd/{at}", os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise GpuxferError(f"{what}: cannot be opened ({exc.strerror})") from None
    finally:
        os.close(at)
    try:
        now = os.fstat(rw)
        seals = fcntl.fcntl(rw, fcntl.F_GET_SEALS)
        if (now.st_dev, now.st_ino, now.st_size) != (st.st_dev, st.st_ino, nbytes) or seals & _SEALS != _SEALS \
                or seals & _WRITE_SEALS:
            raise GpuxferError(f"{what}: not a memory file sealed at {nbytes} bytes")
        return mmap.mmap(rw, nbytes)
    except OSError as exc:
        raise GpuxferError(f"{what}: cannot be mapped ({exc.strerror})") from None
    finally:
        os.close(rw)


class HostWords:
    """``n`` 64-bit flag words, each on its own 64-byte line, in shared host memory (a sealed memory file, else a
    POSIX shared-memory segment) mapped for ``device``'s streams; ``create`` makes one (the owner), ``open`` maps a
    peer's by its :attr:`ref`."""

    def __init__(self, platform, device: int, name: str, n: int, create: bool, ref: re.Match | None = None,
                 sealed: bool = True):
        self.platform, self.device, self.name, self.n = platform, device, name, int(n)
        self.nbytes = -(-(self.n + 2) * FLAG_STRIDE // PAGE) * PAGE
        self.owner = self.linked = create
        self._fd = self._hold = self._mm = self._words = self.dptr = None
        try:
            if ref is not None:         # a peer's memory file
                self.ref = ref.string
                self._mm = _map_memfd(ref.string, ref, self.nbytes)
            elif create and sealed and (fd := _sealed_memfd(name[1:], self.nbytes)) is not None:
                self._fd = fd
                self.ref = f"memfd:{name[1:]}:{fd}:{os.fstat(fd).st_ino:x}"
                self._mm = mmap.mmap(fd, self.nbytes)
            else:
                self.ref = name
                self._mm = map_shm(name, self.nbytes, create=create, reserve=True)  # (a full /dev/shm: OSError)
                # the owner's lock while it lives: a sweep of another PID namespace, where its pid names no process,
                # leaves it
                self._hold = hold_shm(name) if create else None
            self._words = (ctypes.c_int64 * (self.nbytes // 8)).from_buffer(self._mm)
            self.host_ptr = ctypes.addressof(self._words)
            self.dptr = platform.map_host_words(self.host_ptr, self.nbytes, device)
            if self.dptr is None:
                raise GpuxferError(f"the {platform.name} platform cannot map host memory for its streams")
        except BaseException:
            if self._mm is None and self._fd is None:
                self.linked = False     # (a failed create left no name; the name may be another's)
            self.close()
            raise

    @classmethod
    def create(cls, platform, device: int, n: int, prefix: str = PREFIX) -> "HostWords":
        """New words named ``<prefix><pid hex>-<12 hex>``, after removing the segments of that prefix whose
        creator is gone (:func:`~gpuxfer.common.sweep_shm_orphans`)."""
        sweep_shm_orphans(_NAMES[prefix], "give-back" if prefix == PREFIX else "notification")
        def name() -> str:
            return f"/{prefix}{os.getpid():x}-{secrets.token_hex(6)}"
        try:
            return cls(platform, device, name(), n, True)
        except GpuxferError as exc:     # (e.g. a driver that does not register the memory file's pages)
            log.warning("host words: making them failed (%s); trying a named shared-memory segment", exc)
            return cls(platform, device, name(), n, True, sealed=False)

    @classmethod
    def open(cls, platform, device: int, ref: str, n: int, prefix: str = PREFIX) -> "HostWords":
        """A peer's words, by the :attr:`ref` its :meth:`create` gave them (``GpuxferError`` for anything else: a
        reference not of that form, a file not the words' memory file)."""
        m = _REFS[prefix].fullmatch(ref) if isinstance(ref, str) else None
        if m is not None:
            return cls(platform, device, "/" + m.group(1), n, False, m)
        if not is_ref(ref, prefix):
            raise GpuxferError(f"not a flag-word segment name: {ref!r:.80}")
        return cls(platform, device, ref, n, False)

    @property
    def sealed(self) -> bool:
        """Whether the words are a sealed memory file (no process can cut them short), not a named segment."""
        return self.ref != self.name

    def ptr(self, i: int) -> int:
        """The stream address of word ``i``."""
        return self.dptr + i * FLAG_STRIDE

    def loads(self):
        """A ctypes array over the words: ``a[i * WORD_STRIDE]`` loads word ``i`` (no copy, no caching)."""
        return self._words

    def read(self, i: int) -> int:
        """Word ``i`` (a load); 0 once closed."""
        words = self._words
        return 0 if words is None else words[i * WORD_STRIDE]

    def store(self, i: int, value: int) -> None:
        """Word ``i`` := ``value`` (a store); nothing once closed."""
        words = self._words
        if words is not None:
            words[i * WORD_STRIDE] = value

    def check_peer_writes(self, stream, copy, timeout_s: float) -> None:
        """A peer's check that its stream reaches these words: a flag write into one scratch line and an
        8-byte copy (from ``copy(stream, dst)``'s source) into another land, seen by a host load."""
        p = self.platform
        nonce = int.from_bytes(secrets.token_bytes(6), "little") | 1
        a, b = self.n + _PROBE_WRITE, self.n + _PROBE_COPY
        p.write_flag(stream, self.ptr(a), nonce)
        copy(stream, self.ptr(b), nonce + 1)
        if not p.synchronize(stream, timeout_s):
            raise GpuxferError(f"a stream write into host flag words did not finish in {timeout_s:g} s")
        got = (self.read(a), self.read(b))
        if got != (nonce, nonce + 1):
            raise GpuxferError(f"stream writes into host flag words did not land: read {got}, "
                               f"expected {(nonce, nonce + 1)}")

    def unlink(self) -> None:
        """Drop the reference (the owner's; idempotent): close the memory file's descriptor, or remove the
        segment's name. The mappings stay (Python's ``mmap`` keeps a descriptor of the memory file of its own)."""
        if self.linked:
            self.linked = False
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)
            else:
                unlink_shm(self.name)

    def close(self) -> None:
        """Unmap for the device and the process (after the streams using the words drained). Idempotent."""
        if self.dptr is not None:
            self.dptr = None
            try:
                self.platform.unmap_host_words(self.host_ptr, self.device)
            except Exception as exc:  # noqa: BLE001 - the process exit unmaps it
                log.warning("unmapping host flag words %s: %s", self.name, exc)
        self._words = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:     # a ctypes view still alive elsewhere: unmapped when it dies
                pass
            self._mm = None
        self.unlink()
        hold, self._hold = self._hold, None
        if hold is not None:
            os.close(hold)
