"""The host emulation's reach into plain memory of another process: cross-memory attach ("cma", as UCX's
cma transport), ``process_vm_readv`` / ``process_vm_writev`` through ctypes.

Why: an engine allocates its KV caches itself (vLLM's CPU worker: plain ``torch.zeros``, per-layer strided
views of one buffer), not from :meth:`HostPlatform.alloc`'s shared memory, and another process must still
read and write them. Design:

* **Export** (:meth:`HostPlatform.export_range` on memory that is no shared-memory buffer of the platform):
  nothing is shared or pinned; the handle *names* the memory -- kind ``cma``, the exporter's identity (its
  pid, its start time from field 22 of ``/proc/<pid>/stat`` and the boot id, so a reused pid is told apart),
  the address and the size (a tensor's whole storage when the caller says which holds the range). The
  exporter keeps the memory alive (a KV agent holds its registered tensors until it closes).
* **Open** (:meth:`HostPlatform.open_handle` in another process): the identity is checked (same boot; the pid
  still names the process that exported), a pidfd is taken (a later exit is seen even once the pid is
  reused), one byte is read (is cross-memory attach allowed: ptrace access, which ``kernel.yama.ptrace_scope``
  or a seccomp profile may deny), and an address range of the handle's size is reserved with no access
  (``PROT_NONE``): the mapping's ``ptr``. Its bytes are **not addressable** here (``mapping.addressable`` is
  False): ``as_tensor`` refuses it, a kernel or memmove over it would fault at once rather than read this
  process's unrelated memory, and the KV agent moves such a peer's blocks with ``copy_engine`` only.
* **Copies**: ``copy_async`` / ``copy_batch_async`` with an end inside such a mapping become
  ``process_vm_readv`` (the source there: a pull) or ``process_vm_writev`` (the destination there: a push),
  iovec batches of at most ``IOV_MAX`` descriptors, run on the stream's worker in stream order. Every copy is
  checked on the host when enqueued, before any system call: both ends inside one mapping or plain memory
  (offset and size checked overflow-safe against the mapping's size), never both in such mappings; a fill or
  a flag on such a mapping is refused.
* **Failure**: one checker (:func:`_raise_for`) turns a call's result into a typed error: the process exited
  (``ESRCH``) -> :class:`~gpuxfer.errors.PeerLost`; ptrace access denied (``EPERM``) ->
  :class:`~gpuxfer.errors.BackendUnavailable` naming ``kernel.yama.ptrace_scope``; fewer bytes than asked
  (the exporter unmapped the memory, ``EFAULT``) -> :class:`~gpuxfer.errors.DriverError`. After a batch the
  pidfd is polled: an exporter that exited fails the batch (its pid may name another process by then) even
  where bytes moved. The error fails that transfer only: the stream skips what was queued after it up to its
  next event, which raises the error, and later work runs (:mod:`~gpuxfer.platforms.host_streams`).

::

    exporter (pid P, e.g. prefill)                   opener (e.g. decode)
    ------------------------------                   --------------------
    t = torch.zeros(...)   (plain memory)
    export_range(t) -> cma(P, start, boot, addr, size)
          ------- metadata bytes ------->            open_handle: boot id and /proc/P/stat start time match,
                                                       pidfd_open(P), readv of 1 byte (EPERM? ESRCH?),
                                                       mmap(PROT_NONE, size) -> mapping.ptr (not addressable)
                                                     copy_batch_async(s, dsts, srcs = ptr + offsets, sizes)
                                                       host: every offset + size inside [0, size)?  -> iovecs
                                                             at P's addresses (else BadInput, no system call)
                                                       stream worker, in order:
                                                         process_vm_readv(P, local, remote)  x ceil(n / IOV_MAX)
                                                         poll(pidfd): P still alive -> the bytes were P's
                                                       event: done, or PeerLost / BackendUnavailable /
                                                              DriverError (that transfer only)
    (t stays allocated while registered)
"""
from __future__ import annotations

import ctypes
import errno
import os
import select
import struct
import threading
import uuid
import weakref

import numpy as np

from ..errors import BackendUnavailable, BadInput, DriverError, GpuxferError, NotExportable, PeerLost

__all__ = ["CMA_MAGIC", "CmaMapping", "CmaSpace", "IOV_MAX", "encode_handle", "is_cma_payload", "open_cma"]

#: the first bytes of a cma handle's payload (a shared-memory handle's payload is its name: "/...")
CMA_MAGIC = b"GXCMA\x00\x01\x00"
_PAYLOAD = struct.Struct("<8sQQQQ16s")        # magic, pid, start time, address, size, boot id
try:
    IOV_MAX = int(os.sysconf("SC_IOV_MAX"))
except (ValueError, OSError, AttributeError):
    IOV_MAX = 1024
if IOV_MAX <= 0:
    IOV_MAX = 1024

_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
_PROT_NONE, _MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_NORESERVE = 0, 0x02, 0x20, 0x4000


# --------------------------------------------------------------------------- libc


class _Libc:
    """``process_vm_readv``, ``process_vm_writev``, ``mmap`` and ``munmap`` of the C library (loaded once)."""

    _lock = threading.Lock()
    _loaded: "_Libc | None" = None

    def __init__(self):
        libc = ctypes.CDLL(None, use_errno=True)
        self.vm = []
        for name in ("process_vm_readv", "process_vm_writev"):
            f = getattr(libc, name)
            f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                          ctypes.c_ulong]
            f.restype = ctypes.c_ssize_t
            self.vm.append(f)
        self.mmap = libc.mmap
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        self.mmap.restype = ctypes.c_void_p
        self.munmap = libc.munmap
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.munmap.restype = ctypes.c_int

    @classmethod
    def get(cls) -> "_Libc":
        with cls._lock:
            if cls._loaded is None:
                cls._loaded = cls()
            return cls._loaded


def _vm_call(write: bool, pid: int, local, remote, count: int) -> tuple[int, int]:
    """``process_vm_writev`` (``write``) or ``process_vm_readv`` of ``count`` iovecs each side: ``(result,
    errno)``. The one place the system calls are made (tests replace it to inject results)."""
    f = _Libc.get().vm[1 if write else 0]
    ret = f(pid, local, count, remote, count, 0)
    return ret, (ctypes.get_errno() if ret < 0 else 0)


def _ptrace_hint() -> str:
    try:
        with open(_PTRACE_SCOPE) as fh:
            scope = f"kernel.yama.ptrace_scope is {fh.read().strip()}"
    except OSError:
        scope = "kernel.yama.ptrace_scope is not set (no Yama)"
    return (f"the kernel refused cross-memory attach (EPERM: ptrace access denied; {scope}: 0 allows a "
            "process of the same user, 1 too since the exporter declares any process of its user its ptracer "
            "(PR_SET_PTRACER), 2 needs CAP_SYS_PTRACE, 3 forbids it; a seccomp profile (containers) may also "
            "deny process_vm_readv/process_vm_writev; or register caches of Platform.alloc + as_tensor)")


def _raise_for(call: str, ret: int, err: int, want: int, target: "_Target", doing: str) -> None:
    """The one error checker of the cma calls: nothing when ``ret`` is the ``want`` bytes asked for, else the
    typed error of what happened."""
    if ret == want:
        return
    if err == errno.ESRCH or target.exited():
        raise PeerLost(rank=0, peer=target.pid, step=0, flag=doing, after_s=0.0,
                       why=f"process {target.pid} exited ({call}: {errno.errorcode.get(err, 'short copy')})")
    if err == errno.EPERM:
        raise BackendUnavailable("cma", {f"pid {target.pid}": f"{call} while {doing}: {_ptrace_hint()}"})
    if ret >= 0:
        raise DriverError(call, "SHORT_COPY", ret, doing,
                          f"moved {ret} of {want} bytes: process {target.pid} no longer maps the rest")
    raise DriverError(call, errno.errorcode.get(err, "OSError"), err, doing, os.strerror(err))


# --------------------------------------------------------------------------- identity


_boot_id: bytes | None = None


def boot_id() -> bytes:
    """This boot's id (16 bytes): a handle from another boot, or another machine, names no process here."""
    global _boot_id
    if _boot_id is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as fh:
                _boot_id = uuid.UUID(fh.read().strip()).bytes
        except (OSError, ValueError):
            _boot_id = bytes(16)
    return _boot_id


def start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot): with the pid, names one process of a boot."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            raw = fh.read()
        return int(raw[raw.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def encode_handle(pid: int, addr: int, nbytes: int) -> bytes:
    """The payload of a cma handle to ``[addr, addr + nbytes)`` of process ``pid`` (this one), published in
    the process's registry first (:class:`_Registry`)."""
    start = start_time(pid)
    if start is None:
        raise NotExportable(f"host memory [0x{addr:x}, +{nbytes})", f"/proc/{pid}/stat is unreadable: the "
                            "process cannot be named for cross-memory attach")
    _Registry.publish(pid, start, addr, nbytes)
    return _PAYLOAD.pack(CMA_MAGIC, pid, start, addr, nbytes, boot_id())


def _allow_ptracers() -> None:
    """Let any process of this user attach (Yama's ``kernel.yama.ptrace_scope`` 1 otherwise limits it to
    ancestors, and a prefill and a decode instance are siblings): ``prctl(PR_SET_PTRACER,
    PR_SET_PTRACER_ANY)``, what a process that exports memory for cross-memory attach declares. The user check
    and scopes 2 and 3 still apply. A kernel without Yama refuses the call (EINVAL): nothing to do."""
    PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1).value
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)


class _Registry:
    """The ranges a process exported as cma handles, in a shared-memory segment of its own (mode 0600, named
    after its pid and start time): what an opener checks a handle against, so forged metadata (a range the
    process never exported, another process's memory) is refused before any byte is read or written. Only the
    process's user can write it; the opener also checks the segment's owner is the process's user. Entries
    stay for the life of the process (a registered tensor is the exporter's to keep alive)."""

    HEADER = struct.Struct("<8sQQQ")        # magic, pid, start time, entries
    ENTRY = struct.Struct("<QQ")            # address, size
    BYTES = 1 << 16
    CAPACITY = (BYTES - HEADER.size) // ENTRY.size
    _lock = threading.Lock()
    _mine: "tuple[int, object, set] | None" = None     # (pid, the mapped segment, the ranges in it)

    @staticmethod
    def name(pid: int, start: int) -> str:
        return f"/gxcma_{pid}_{start}"

    @classmethod
    def publish(cls, pid: int, start: int, addr: int, nbytes: int) -> None:
        from ..common import map_shm
        with cls._lock:
            if cls._mine is None or cls._mine[0] != pid:            # a forked child publishes its own
                name = cls.name(pid, start)
                try:
                    mm = map_shm(name, cls.BYTES, create=True)
                except OSError as exc:
                    raise NotExportable(f"host memory [0x{addr:x}, +{nbytes})",
                                        f"its cma registry {name} cannot be created: {exc}") from exc
                from multiprocessing import resource_tracker
                resource_tracker.register(name, "shared_memory")   # unlinked by the tracker if killed
                cls.HEADER.pack_into(mm, 0, CMA_MAGIC, pid, start, 0)
                cls._mine = (pid, mm, set())
                _allow_ptracers()
                import atexit
                atexit.register(cls._unlink, name)
            _, mm, ranges = cls._mine
            if (addr, nbytes) in ranges:
                return
            if len(ranges) >= cls.CAPACITY:
                raise NotExportable(f"host memory [0x{addr:x}, +{nbytes})", f"this process already exported "
                                    f"{cls.CAPACITY} ranges as cma handles")
            cls.ENTRY.pack_into(mm, cls.HEADER.size + len(ranges) * cls.ENTRY.size, addr, nbytes)
            ranges.add((addr, nbytes))
            cls.HEADER.pack_into(mm, 0, CMA_MAGIC, pid, start, len(ranges))   # the count after the entry

    @staticmethod
    def _unlink(name: str) -> None:
        from multiprocessing import resource_tracker

        from ..common import unlink_shm
        unlink_shm(name)
        resource_tracker.unregister(name, "shared_memory")

    @classmethod
    def check(cls, pid: int, start: int, addr: int, nbytes: int) -> None:
        """BadInput unless process ``pid`` (started at ``start``) published ``[addr, +nbytes)``."""
        import _posixshmem
        what = f"a cma handle of [0x{addr:x}, +{nbytes}) of process {pid}"
        try:
            fd = _posixshmem.shm_open(cls.name(pid, start), os.O_RDONLY, mode=0)
        except OSError:
            raise BadInput(f"{what}: the process published no cma registry (it exported nothing)") from None
        try:
            owner = os.fstat(fd).st_uid
            data = os.pread(fd, cls.BYTES, 0)
        finally:
            os.close(fd)
        try:
            user = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            user = None
        if owner != user or len(data) < cls.HEADER.size:
            raise BadInput(f"{what}: its registry belongs to user {owner}, the process to {user}")
        magic, rpid, rstart, count = cls.HEADER.unpack_from(data)
        if magic != CMA_MAGIC or (rpid, rstart) != (pid, start) or count > cls.CAPACITY:
            raise BadInput(f"{what}: its registry is malformed")
        entries = data[cls.HEADER.size:cls.HEADER.size + count * cls.ENTRY.size]
        if len(entries) != count * cls.ENTRY.size:
            raise BadInput(f"{what}: its registry holds fewer than the {count} entries it counts")
        if (addr, nbytes) not in set(cls.ENTRY.iter_unpack(entries)):
            raise BadInput(f"{what}: the process never exported that range (forged or stale metadata)")


def is_cma_payload(payload) -> bool:
    """Whether a handle's payload is a cma handle's (the payload comes from another process: any object)."""
    return isinstance(payload, (bytes, bytearray)) and bytes(payload[:len(CMA_MAGIC)]) == CMA_MAGIC


# --------------------------------------------------------------------------- a process reached


class _Target:
    """A process reached by cross-memory attach: its pid and a pidfd (closed when the last mapping and the
    last queued copy that name it are gone)."""

    def __init__(self, pid: int, start: int):
        self.pid, self.start = pid, start
        self.pidfd: int | None = None
        try:
            self.pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise self._lost("it has exited") from None
        except (AttributeError, OSError):
            self.pidfd = None               # no pidfd here: the start time is read again instead
        if self.pidfd is not None:
            weakref.finalize(self, os.close, self.pidfd)
        if start_time(pid) != start:        # read after the pidfd: the fd names the process the handle does
            raise self._lost("its pid now names another process (the exporter exited)")

    def _lost(self, why: str) -> PeerLost:
        return PeerLost(rank=0, peer=self.pid, step=0, flag="opening a cma handle", after_s=0.0,
                        why=f"process {self.pid} is gone: {why}")

    def exited(self) -> bool:
        """Whether the process exited (a pid reused since reads as exited)."""
        if self.pidfd is not None:
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            return bool(poller.poll(0))
        return start_time(self.pid) != self.start


class CmaMapping:
    """The ``impl`` of a :class:`~gpuxfer.platforms.base.PeerMapping` of a cma handle: the exporter's address
    and size, and the no-access reservation standing for it here."""

    def __init__(self, target: _Target, remote: int, nbytes: int, local: int, reserved: int):
        self.target, self.remote, self.nbytes, self.local, self.reserved = target, remote, nbytes, local, reserved

    def release(self) -> None:
        if self.reserved:
            _Libc.get().munmap(self.local, self.reserved)
            self.reserved = 0


def _decode(payload: bytes, owner_pid: int, nbytes: int) -> tuple[int, int, int, int]:
    if len(payload) != _PAYLOAD.size:
        raise BadInput(f"a cma handle's payload holds {_PAYLOAD.size} bytes, this one {len(payload)}")
    _, pid, start, addr, size, boot = _PAYLOAD.unpack(payload)
    if not 0 < pid < 1 << 31:                   # pid_t: what the pidfd and /proc calls take
        raise BadInput(f"a cma handle names process {pid}: a pid that names no process")
    if pid != owner_pid:
        raise BadInput(f"a cma handle names process {pid} but comes from process {owner_pid}")
    if pid == os.getpid():
        raise BadInput("cannot open a cma handle in the process that exported it: use the memory itself")
    if boot != boot_id():
        raise BadInput(f"a cma handle of process {pid} comes from another boot or machine: cross-memory attach "
                       "reaches processes of this host only")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or size != nbytes or not 0 < size < 1 << 62 or not 0 < addr < 1 << 63 or size > (1 << 63) - addr:
        raise BadInput(f"a cma handle of process {pid} claims [0x{addr:x}, +{size}) ({nbytes} bytes said)")
    return pid, start, addr, size


def open_cma(payload: bytes, owner_pid: int, nbytes: int, targets: dict) -> CmaMapping:
    """Check a cma handle, reach its process (``targets``: the platform's, per (pid, start time)), probe one
    byte and reserve the local range that stands for the memory."""
    pid, start, addr, size = _decode(bytes(payload), owner_pid, nbytes)
    key = (pid, start)
    target = targets.get(key)
    if target is None or target.exited():
        target = targets[key] = _Target(pid, start)
    _Registry.check(pid, start, addr, size)
    probe = ctypes.create_string_buffer(1)
    liov = np.array([ctypes.addressof(probe), 1], dtype=np.uint64)
    riov = np.array([addr, 1], dtype=np.uint64)
    ret, err = _vm_call(False, pid, liov.ctypes.data, riov.ctypes.data, 1)
    _raise_for("process_vm_readv", ret, err, 1, target, f"probing [0x{addr:x}, +{size}) of process {pid}")
    page = os.sysconf("SC_PAGE_SIZE")
    reserved = -(-size // page) * page
    libc = _Libc.get()
    local = libc.mmap(None, reserved, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if local is None or local == ctypes.c_void_p(-1).value:
        raise BadInput(f"cannot reserve {size} bytes of address space for a cma mapping of process {pid} "
                       f"({os.strerror(ctypes.get_errno())})")
    return CmaMapping(target, addr, size, int(local), reserved)


# --------------------------------------------------------------------------- copies


class CmaSpace:
    """A platform's open cma mappings by local address, and the plans of copies touching them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._maps: list = []                       # PeerMappings sorted by ptr
        self._starts = np.zeros(0, dtype=np.int64)
        self._ends = np.zeros(0, dtype=np.int64)

    def __bool__(self) -> bool:
        return bool(self._maps)

    def _rebuild(self) -> None:
        self._maps.sort(key=lambda m: m.ptr)
        self._starts = np.array([m.ptr for m in self._maps], dtype=np.int64)
        self._ends = np.array([m.ptr + m.nbytes for m in self._maps], dtype=np.int64)

    def add(self, mapping) -> None:
        with self._lock:
            self._maps.append(mapping)
            self._rebuild()

    def remove(self, mapping) -> None:
        with self._lock:
            self._maps = [m for m in self._maps if m is not mapping]
            self._rebuild()

    def _snapshot(self):
        with self._lock:
            return list(self._maps), self._starts, self._ends

    def refuse(self, ptr: int, nbytes: int, what: str) -> None:
        """BadInput if ``[ptr, ptr + nbytes)`` touches a cma mapping (memory this process cannot address)."""
        maps, starts, ends = self._snapshot()
        ptr, n = int(ptr), max(int(nbytes), 1)
        for m, s, e in zip(maps, starts.tolist(), ends.tolist()):
            if ptr < e and s - ptr < n:
                raise BadInput(f"{what} at 0x{ptr:x} touches {m!r}: another process's memory reached by "
                               "cross-memory attach is not addressable here (copies only)")

    def plan(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray):
        """The worker's function for copies of which some touch a cma mapping, or None where none does. Every
        copy is checked here, before any system call."""
        maps, starts, ends = self._snapshot()
        if not maps:
            return None
        live = sizes > 0
        d, s, n = dsts[live], srcs[live], sizes[live]
        if (d < 0).any() or (s < 0).any():
            raise BadInput("a copy address is negative")
        si, di = _inside(s, starts, ends), _inside(d, starts, ends)
        if not (si >= 0).any() and not (di >= 0).any():
            _refuse_touching(maps, starts, ends, d, n, "copy destination")
            _refuse_touching(maps, starts, ends, s, n, "copy source")
            return None
        both = (si >= 0) & (di >= 0)
        if both.any():
            k = int(np.flatnonzero(both)[0])
            raise BadInput(f"copy {k}: both ends lie in other processes' memory ({maps[si[k]]!r} and "
                           f"{maps[di[k]]!r}); cross-memory attach copies between this process and one other")
        _check_inside(maps, starts, ends, si, s, n, "source")
        _check_inside(maps, starts, ends, di, d, n, "destination")
        _refuse_touching(maps, starts, ends, d[si >= 0], n[si >= 0], "copy destination")
        _refuse_touching(maps, starts, ends, s[di >= 0], n[di >= 0], "copy source")
        plain = (si < 0) & (di < 0)
        _refuse_touching(maps, starts, ends, d[plain], n[plain], "copy destination")
        _refuse_touching(maps, starts, ends, s[plain], n[plain], "copy source")
        local_copies = list(zip(d[plain].tolist(), s[plain].tolist(), n[plain].tolist()))
        batches = []                                # (write?, target, local iovecs, remote iovecs)
        for write, idx, local, far in ((False, si, d, s), (True, di, s, d)):
            rows = idx >= 0
            if not rows.any():
                continue
            mi, loc, rem, cnt = idx[rows], local[rows], far[rows], n[rows]
            remote_base = np.array([m.impl.remote for m in maps], dtype=np.int64)
            rem = rem - starts[mi] + remote_base[mi]
            tid = np.array([id(maps[i].impl.target) for i in mi.tolist()], dtype=np.int64)
            for t in np.unique(tid).tolist():
                sel = tid == t
                target = maps[int(mi[np.flatnonzero(sel)[0]])].impl.target
                lo, re, cn = _coalesce(loc[sel], rem[sel], cnt[sel])
                liov = np.ascontiguousarray(np.stack([lo, cn], axis=1)).astype(np.uint64)
                riov = np.ascontiguousarray(np.stack([re, cn], axis=1)).astype(np.uint64)
                batches.append((write, target, liov, riov))

        def run() -> None:
            for dd, ss, nn in local_copies:
                ctypes.memmove(dd, ss, nn)
            for write, target, liov, riov in batches:
                call = "process_vm_writev" if write else "process_vm_readv"
                doing = f"{'writing' if write else 'reading'} {int(liov[:, 1].sum())} bytes " \
                        f"{'into' if write else 'of'} process {target.pid} ({len(liov)} copies)"
                for a in range(0, len(liov), IOV_MAX):
                    if target.exited():         # never a call on a pid the exporter no longer holds
                        _raise_for(call, -1, errno.ESRCH, 0, target, doing)
                    lv, rv = liov[a:a + IOV_MAX], riov[a:a + IOV_MAX]
                    want = int(lv[:, 1].sum())
                    ret, err = _vm_call(write, target.pid, lv.ctypes.data, rv.ctypes.data, len(lv))
                    _raise_for(call, ret, err, want, target, doing)
                if target.exited():             # it exited during the calls: its pid may name another process
                    _raise_for(call, -1, errno.ESRCH, 0, target, doing)

        return run


def _coalesce(loc: np.ndarray, rem: np.ndarray, cnt: np.ndarray):
    """Copies contiguous on both sides with the copy before merged into it: one iovec each side."""
    if loc.size < 2:
        return loc, rem, cnt
    joined = (loc[1:] == loc[:-1] + cnt[:-1]) & (rem[1:] == rem[:-1] + cnt[:-1])
    first = np.flatnonzero(np.concatenate(([True], ~joined)))
    return loc[first], rem[first], np.add.reduceat(cnt, first)


def _inside(addrs: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per address: the index of the mapping whose range holds it, or -1."""
    i = np.searchsorted(starts, addrs, side="right") - 1
    ok = (i >= 0) & (addrs < ends[np.maximum(i, 0)])
    return np.where(ok, i, -1)


def _check_inside(maps, starts, ends, idx, addrs, sizes, end: str) -> None:
    """Each copy whose ``end`` starts in a mapping stays inside it (``size <= end - address``: no overflow)."""
    rows = np.flatnonzero(idx >= 0)
    if rows.size == 0:
        return
    room = ends[idx[rows]] - addrs[rows]
    bad = rows[sizes[rows] > room]
    if bad.size:
        k = int(bad[0])
        m = maps[int(idx[k])]
        raise BadInput(f"copy {k}: {int(sizes[k])} bytes at offset {int(addrs[k]) - m.ptr} of {m!r} run past "
                       f"its {m.nbytes} bytes")


def _refuse_touching(maps, starts, ends, addrs, sizes, what: str) -> None:
    """BadInput where a plain-memory range reaches into a mapping (it would be dereferenced here)."""
    if addrs.size == 0:
        return
    j = np.searchsorted(ends, addrs, side="right")          # the first mapping ending past the address
    has = j < len(starts)
    jj = np.minimum(j, len(starts) - 1)
    bad = np.flatnonzero(has & (starts[jj] - addrs < sizes))   # it starts before the range ends
    if bad.size:
        k = int(bad[0])
        raise BadInput(f"{what} [0x{int(addrs[k]):x}, +{int(sizes[k])}) reaches into {maps[int(jj[k])]!r}: another "
                       "process's memory reached by cross-memory attach is not addressable here")


def wrap_scoped(fn):
    """``fn`` for a stream worker, its typed errors failing that transfer only
    (:class:`~gpuxfer.platforms.host_streams.TransferFailed`)."""
    from .host_streams import TransferFailed

    def run() -> None:
        try:
            fn()
        except GpuxferError as exc:
            raise TransferFailed(exc) from exc
    return run
