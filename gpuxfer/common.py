"""Small helpers: size parsing, the versions a run reports, POSIX shared memory.

Nothing here touches a device; importing it imports no GPU library.
"""
from __future__ import annotations

import logging
import mmap
import os
import platform as _pyplatform
import re
import socket
import stat
import time

from . import __version__
from .errors import BadInput

try:  # POSIX only
    import _posixshmem
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None
try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

#: why :func:`map_shm` cannot work here, or None
SHM_UNAVAILABLE = None if _posixshmem is not None else "POSIX shared memory (_posixshmem) is not available on this OS"

_BINARY = {"": 1, "k": 1 << 10, "ki": 1 << 10, "m": 1 << 20, "mi": 1 << 20, "g": 1 << 30, "gi": 1 << 30,
           "t": 1 << 40, "ti": 1 << 40}
_DECIMAL_BYTES = {"kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def open_shm(name: str, nbytes: int, *, create: bool, exact: bool = False, reserve: bool = False) -> int:
    """A descriptor (read and write) of the POSIX shared-memory segment ``name``: a new one of ``nbytes``
    (``create``; it must not exist), or an existing one of at least (``exact``: exactly) ``nbytes``. ``reserve``: a
    new segment's pages taken now (``posix_fallocate``), so that a full ``/dev/shm`` fails the create
    (``OSError``), not a later store into a mapping of it (a SIGBUS). A failed create leaves nothing."""
    if SHM_UNAVAILABLE:
        raise OSError(SHM_UNAVAILABLE)
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = _posixshmem.shm_open(name, flags, mode=0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
            if reserve and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, nbytes)
        else:
            size = os.fstat(fd).st_size
            if size < nbytes or (exact and size != nbytes):
                raise BadInput(f"shared memory {name!r} holds {size} bytes, expected {nbytes}")
        return fd
    except BaseException:
        os.close(fd)
        if create:
            _posixshmem.shm_unlink(name)
        raise


def map_shm(name: str, nbytes: int, *, create: bool, exact: bool = False, reserve: bool = False) -> mmap.mmap:
    """Map the POSIX shared-memory segment ``name`` (:func:`open_shm`'s). A failed create leaves nothing."""
    fd = open_shm(name, nbytes, create=create, exact=exact, reserve=reserve)
    try:
        return mmap.mmap(fd, nbytes)
    except BaseException:
        if create:
            _posixshmem.shm_unlink(name)
        raise
    finally:
        os.close(fd)


def hold_shm(name: str) -> int | None:
    """A shared lock on segment ``name``, held by the returned descriptor until it is closed (None where it cannot be
    taken): while held, :func:`sweep_shm_orphans` leaves the segment, whatever its creator's pid names there."""
    if fcntl is None or _posixshmem is None:
        return None
    try:
        fd = _posixshmem.shm_open(name, os.O_RDONLY, mode=0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _held(path: str) -> bool:
    """Whether a process holds a lock on the segment at ``path`` (:func:`hold_shm`: its owner lives, maybe in
    another PID namespace); a file that cannot be opened or locked counts as held (not ours to judge)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def unlink_shm(name: str) -> None:
    """Remove the shared-memory segment ``name`` (mappings stay valid); a missing one is fine."""
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass


_PROCESS_NAMESPACE: dict[int, str | None] = {}      # pid -> its namespace (a forked child reads its own)


def process_namespace() -> str | None:
    """Which PID space this process's pid counts in: the boot (``/proc/sys/kernel/random/boot_id``) and the PID
    namespace (``/proc/self/ns/pid``'s device and inode), as text; ``None`` where ``/proc`` does not say. Two
    processes with the same pid are the same process only if this is the same too (two containers sharing
    IPC but not PIDs each have a pid 1)."""
    pid = os.getpid()
    if pid not in _PROCESS_NAMESPACE:
        try:
            st = os.stat("/proc/self/ns/pid")
        except OSError:
            _PROCESS_NAMESPACE[pid] = None
        else:
            try:
                with open("/proc/sys/kernel/random/boot_id") as f:
                    boot = f.read().strip()
            except OSError:
                boot = ""
            _PROCESS_NAMESPACE[pid] = f"{boot}/{st.st_dev}:{st.st_ino}"
    return _PROCESS_NAMESPACE[pid]


def exported_here(owner_pid: int, owner_namespace: str | None) -> bool:
    """Whether the process that exported an IPC handle (its pid and :func:`process_namespace`; ``None``: not
    said) is this one: the same pid counted in the same PID namespace."""
    if owner_pid != os.getpid():
        return False
    return owner_namespace is None or owner_namespace == process_namespace()


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):    # exists, another user's (EPERM), or cannot tell (past pid_t): not ours
        return True                     # to judge dead
    return True


#: a segment younger than this (by its modification time) is never swept: a pid that names no process here may
#: be a live creator's in another PID namespace sharing /dev/shm (containers sharing IPC, not PIDs), whose
#: segment is opened and unlinked within its connect's setup
SHM_ORPHAN_AGE_S = 3600


def sweep_shm_orphans(pattern: re.Pattern, what: str, shm_dir: str = "/dev/shm",
                      min_age_s: float = SHM_ORPHAN_AGE_S) -> list[str]:
    """Unlink the shared-memory segments left by processes that no longer exist (killed between creating
    a segment and unlinking it): names in ``shm_dir`` that ``pattern`` matches whole, whose group 1 is the
    creator's pid in hex, regular files (a symbolic link is never followed nor removed) owned by this user, at least
    ``min_age_s`` old (:data:`SHM_ORPHAN_AGE_S`; less for segments their creators hold from the moment they make
    them, so that only a creator of another PID namespace between the two is to be spared), whose creator is gone
    (``kill(pid, 0)`` finds no process) and that no process holds (:func:`hold_shm`). Returns the names removed
    (logged as ``what`` segments). Best effort: a directory that cannot be read removes nothing, a name that cannot
    be unlinked is skipped."""
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return []
    me, uid, removed = os.getpid(), os.getuid(), []
    for entry in entries:
        m = pattern.fullmatch(entry)
        if m is None:
            continue
        pid = int(m.group(1), 16)
        if pid <= 0 or pid == me or _pid_exists(pid):
            continue
        try:
            st = os.lstat(os.path.join(shm_dir, entry))     # a link is judged as itself, never followed
        except OSError:
            continue
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != uid
                or time.time() - st.st_mtime < min_age_s or _held(os.path.join(shm_dir, entry))):
            continue
        try:
            unlink_shm("/" + entry)
        except OSError:                     # another user's (sticky /dev/shm), or gone meanwhile: not ours
            continue
        removed.append(entry)
    if removed:
        logging.getLogger("gpuxfer").info("removed %d %s segment(s) left by processes gone: %s", len(removed),
                                          what, ", ".join(removed))
    return removed


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def package_version(*dists: str) -> str | None:
    """The version of the first of ``dists`` that is installed (read from its metadata; nothing is imported)."""
    from importlib import metadata
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def parse_size(text: str, *, option: str, kind: str = "count") -> int:
    """Parse ``32k``, ``512K``, ``64GiB``, ``1.5G``, ``100GB``, ``4096`` into a positive integer.

    k/M/G/T (with or without ``i``) are binary: 32k tokens = 32,768. For ``kind="bytes"`` a
    trailing ``B`` is allowed: ``64GiB`` (binary) or ``64GB`` (decimal, 64e9). Raises
    :class:`BadInput` naming ``option``.
    """
    if not isinstance(text, str):
        text = str(text)
    m = _SIZE_RE.match(text)
    if not m:
        raise BadInput(f"{option}: cannot read {text!r} as a number of {kind}; use e.g. "
                       f"{'64GiB, 512MiB or 1073741824' if kind == 'bytes' else '32k, 512k or 4096'}")
    number, suffix = m.group(1), m.group(2).lower()
    if kind == "bytes" and suffix in _DECIMAL_BYTES:
        scale = _DECIMAL_BYTES[suffix]
    else:
        if kind == "bytes" and suffix.endswith("b"):
            suffix = suffix[:-1]
        if suffix not in _BINARY:
            raise BadInput(f"{option}: unknown unit {m.group(2)!r} in {text!r}; use k, M, G, T"
                           f"{' (binary) or kB, MB, GB, TB (decimal), with an optional B' if kind == 'bytes' else ''}")
        scale = _BINARY[suffix]
    if "." in number:
        whole, frac = number.split(".")
        value_num = int(whole + frac) * scale
        den = 10 ** len(frac)
        if value_num % den:
            raise BadInput(f"{option}: {text!r} is not a whole number of {kind}")
        value = value_num // den
    else:
        value = int(number) * scale
    if value <= 0:
        raise BadInput(f"{option}: {text!r} must be positive")
    return value


def run_versions(platform) -> dict[str, str]:
    """What a benchmark run reports it ran with: gpuxfer, Python, numpy, torch, Triton and the platform's own
    libraries/driver. Informative only: a library that cannot be imported or a failing ``versions()`` is said,
    never raised."""
    v = {"gpuxfer": __version__, "python": _pyplatform.python_version()}
    for mod in ("numpy", "torch", "triton"):
        try:
            v[mod] = str(__import__(mod).__version__)
        except Exception as exc:  # noqa: BLE001
            v[mod] = f"not importable ({type(exc).__name__})"
    try:
        v.update({str(k): str(x) for k, x in platform.versions().items()})
    except Exception as exc:  # noqa: BLE001
        v["platform versions"] = f"unavailable ({type(exc).__name__}: {exc})"
    return v
