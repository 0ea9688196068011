"""HostWords as a sealed memory file (:mod:`gpuxfer.hostwords`): no process can cut the words short under a mapping
(whose next load or store would be a SIGBUS), a peer in another process opens them by their reference through
``/proc``, and a forged reference is a ``GpuxferError`` that opens nothing but the words' own file. Where the system
has no sealed memory files the words are a named segment (the fallback, forced here by a monkeypatch)."""
from __future__ import annotations

import fcntl
import os
import tempfile

import pytest
from _orphans import gone_pid

import gpuxfer.hostwords as hostwords
from gpuxfer.errors import GpuxferError
from gpuxfer.hostwords import KV_PREFIX, PREFIX, HostWords

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create") or not hasattr(fcntl, "F_ADD_SEALS"),
                                reason="no sealed memory files on this system")


def _fd(words: HostWords) -> int:
    """The owner's descriptor its reference names."""
    return int(words.ref.split(":")[2])


def _ref(name: str, pid: int, fd: int, ino: int) -> str:
    return f"memfd:{name}{pid:x}-{'0' * 12}:{fd}:{ino:x}"


def _peer_cuts_short(ref: str, owner: int, fd: int, n: int) -> dict:
    """(A spawned peer.) Map the owner's words, try to shrink and to grow them through the owner's descriptor (as
    any process of the user can), then store into and load from the mapping: a SIGBUS would end this process."""
    from gpuxfer.platforms.host import HostPlatform
    plat = HostPlatform()
    words = HostWords.open(plat, 0, ref, n, KV_PREFIX)
    refused = []
    rw = os.open(f"/proc/{owner}/fd/{fd}", os.O_RDWR)
    try:
        for size in (words.nbytes * 2, words.nbytes // 2, 0):
            try:
                os.ftruncate(rw, size)
            except PermissionError:
                refused.append(size)
        words.store(1, 77)
        got = words.read(0), words.read(1), os.fstat(rw).st_size
    finally:
        os.close(rw)
        words.close()
        plat.close()
    return {"refused": refused, "got": got}


def test_a_peer_process_cannot_cut_the_words_short(host, spawner):
    """A spawned peer maps the words by their reference; its ftruncate through the owner's descriptor (smaller,
    larger) is refused, and the stores and loads on both sides go on, no signal."""
    words = HostWords.create(host, 0, 4, KV_PREFIX)
    try:
        assert words.sealed and words.ref.startswith(f"memfd:{KV_PREFIX}{os.getpid():x}-")
        assert not os.path.exists("/dev/shm" + words.name)
        words.store(0, 5)
        child = spawner.start(_peer_cuts_short, words.ref, os.getpid(), _fd(words), 4, name="peer")
        out = child.result(120)
        child.join(30)
        assert out == {"refused": [words.nbytes * 2, words.nbytes // 2, 0], "got": (5, 77, words.nbytes)}
        assert words.read(1) == 77
    finally:
        words.close()


def test_the_owner_drops_the_reference_at_unlink_and_close(host):
    """unlink() closes the owner's descriptor (the mappings stay; no peer opens the words after it); close()
    unlinks too; a second close is nothing."""
    a = HostWords.create(host, 0, 2, PREFIX)
    b = HostWords.open(host, 0, a.ref, 2)
    try:
        b.store(1, 9)
        fd = _fd(a)
        a.unlink()
        with pytest.raises(OSError):
            os.fstat(fd)
        with pytest.raises(GpuxferError, match="cannot be reached|another file"):
            HostWords.open(host, 0, a.ref, 2)
        assert a.read(1) == 9
    finally:
        b.close()
        a.close()
        a.close()


def _sealed_file(n: int, seals: int, name: str) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, n)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_forged_references_are_typed_errors_that_open_no_other_file(host):
    """References that name another process, a closed descriptor, a regular file, a pipe, an unsealed or
    write-sealed memory file of the right name and size, words of another size or another prefix: each is a
    ``GpuxferError`` (the add_peer of a KV agent logs it and keeps the device words), never a crash."""
    me, words = os.getpid(), HostWords.create(host, 0, 2, KV_PREFIX)
    nbytes, ino = words.nbytes, os.fstat(_fd(words)).st_ino
    name = words.name[1:]
    tmp = tempfile.TemporaryFile()
    tmp.truncate(nbytes)
    r, w = os.pipe()
    unsealed = _sealed_file(nbytes, 0, name)
    grows = _sealed_file(nbytes, fcntl.F_SEAL_SHRINK, name)
    readonly = _sealed_file(nbytes, hostwords._SEALS | fcntl.F_SEAL_WRITE, name)
    forged = [
        _ref(KV_PREFIX, gone_pid(), _fd(words), ino),                       # a process gone
        _ref(KV_PREFIX, 0, _fd(words), ino),                                # no process
        words.ref.replace(f":{_fd(words)}:", ":999999999:"),                # a descriptor not open
        words.ref.replace(f":{ino:x}", f":{ino + 1:x}"),                    # another inode
        f"memfd:{name}:{tmp.fileno()}:{os.fstat(tmp.fileno()).st_ino:x}",   # a regular file of the size
        f"memfd:{name}:{r}:{os.fstat(r).st_ino:x}",                         # a pipe: never opened
        f"memfd:{name}:{unsealed}:{os.fstat(unsealed).st_ino:x}",           # a memory file anyone can shrink
        f"memfd:{name}:{grows}:{os.fstat(grows).st_ino:x}",                 # ... or grow and reseal
        f"memfd:{name}:{readonly}:{os.fstat(readonly).st_ino:x}",           # ... or that no one can write
        words.ref.replace(name, f"{KV_PREFIX}{me:x}-{'f' * 12}"),           # another name
    ]
    try:
        for ref in forged:
            with pytest.raises(GpuxferError):
                HostWords.open(host, 0, ref, 2, KV_PREFIX)
        with pytest.raises(GpuxferError, match="another file"):
            HostWords.open(host, 0, words.ref, 200, KV_PREFIX)              # words of another size
        with pytest.raises(GpuxferError, match="not a flag-word"):
            HostWords.open(host, 0, words.ref, 2, PREFIX)                   # the other prefix's
        for bad in ["memfd:", words.ref + ":1", words.ref.replace("memfd:", "memfd:/"), None, 7, [words.ref]]:
            with pytest.raises(GpuxferError, match="not a flag-word"):
                HostWords.open(host, 0, bad, 2, KV_PREFIX)
        peer = HostWords.open(host, 0, words.ref, 2, KV_PREFIX)             # the words' own reference still maps
        peer.close()
    finally:
        for fd in (r, w, unsealed, grows, readonly):
            os.close(fd)
        tmp.close()
        words.close()


def test_where_no_sealed_file_can_be_made_the_words_are_a_named_segment(host, monkeypatch):
    """The fallback: a segment of /dev/shm, its reference its name, opened by name."""
    monkeypatch.setattr(hostwords, "_sealed_memfd", lambda name, nbytes: None)
    a = HostWords.create(host, 0, 2, KV_PREFIX)
    try:
        assert not a.sealed and a.ref == a.name and os.path.exists("/dev/shm" + a.name)
        b = HostWords.open(host, 0, a.ref, 2, KV_PREFIX)
        b.store(0, 3)
        assert a.read(0) == 3
        b.close()
    finally:
        a.close()
    assert not os.path.exists("/dev/shm" + a.name)


def test_a_sealed_file_proc_does_not_show_is_not_used(host, monkeypatch):
    """Where ``/proc/<pid>/fd`` does not show the owner's descriptor (no /proc, another PID namespace's /proc), no
    peer could open the memory file: the words are a named segment, no descriptor left open."""
    real_stat = os.stat

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(2, "No such file or directory", path)
        return real_stat(path, *args, **kwargs)
    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "stat", no_proc)
    a = HostWords.create(host, 0, 2)
    monkeypatch.undo()
    try:
        assert not a.sealed and os.path.exists("/dev/shm" + a.name)
    finally:
        a.close()
    assert set(os.listdir("/proc/self/fd")) <= before


def test_a_reference_to_another_file_is_refused_before_anything_opens_or_stats_it(host, monkeypatch):
    """A forged reference naming a descriptor of another file (here a regular file, as one of a FUSE or network
    mount would be: a stat of it asks the file's server, which need never answer) is refused from the link
    ``/proc`` shows alone: no open of it (not even ``O_PATH``) and no stat, so no call into its file system."""
    words = HostWords.create(host, 0, 2, KV_PREFIX)
    tmp = tempfile.TemporaryFile()
    tmp.truncate(words.nbytes)
    fd, me = tmp.fileno(), os.getpid()
    ref = f"memfd:{words.name[1:]}:{fd}:{os.fstat(fd).st_ino:x}"
    touched = []
    real_open, real_fstat, real_stat = os.open, os.fstat, os.stat

    def spy_open(path, *a, **kw):
        touched.append(("open", str(path)))
        return real_open(path, *a, **kw)

    def spy_fstat(f):
        touched.append(("fstat", os.readlink(f"/proc/self/fd/{f}")))
        return real_fstat(f)

    def spy_stat(path, *a, **kw):
        touched.append(("stat", str(path)))
        return real_stat(path, *a, **kw)
    try:
        monkeypatch.setattr(os, "open", spy_open)
        monkeypatch.setattr(os, "fstat", spy_fstat)
        monkeypatch.setattr(os, "stat", spy_stat)
        with pytest.raises(GpuxferError, match="another file"):
            HostWords.open(host, 0, ref, 2, KV_PREFIX)
        monkeypatch.undo()
        target = os.readlink(f"/proc/self/fd/{fd}")
        assert [t for t in touched if t[1] in (f"/proc/{me}/fd/{fd}", target)] == []
        assert not [t for t in touched if t[0] == "fstat"]
    finally:
        monkeypatch.undo()
        tmp.close()
        words.close()


@pytest.mark.xfail(strict=True, reason="Python's mmap (before 3.13's trackfd=False) keeps a descriptor of its own of "
                   "the file it maps: after unlink() /proc/<pid>/fd still shows the owner's words under that number")
def test_after_unlink_no_descriptor_of_the_owner_names_the_words(host):
    """unlink() drops the reference: no descriptor of the owner's then names the memory file, so no reference
    (the one it gave, or one forged with another descriptor number and the same name and inode) opens it."""
    a = HostWords.create(host, 0, 2)
    try:
        a.unlink()
        link = f"/memfd:{a.name[1:]} (deleted)"
        fds = []
        for f in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{f}") == link:
                    fds.append(int(f))
            except OSError:
                pass
        opened = []
        for f in fds:
            _, name, _, ino = a.ref.split(":")
            try:
                HostWords.open(host, 0, f"memfd:{name}:{f}:{ino}", 2).close()
                opened.append(f)
            except GpuxferError:
                pass
        assert not opened, f"descriptors {opened} still open the words after unlink"
    finally:
        a.close()


def test_words_whose_memory_file_the_platform_cannot_map_are_a_named_segment(host, monkeypatch):
    """A platform that refuses to map the sealed memory file's pages for its streams (a driver that does not
    register them): ``create`` makes the words a named segment instead, and leaves no descriptor behind."""
    made, real = [], host.map_host_words

    def refuse_memory_files(ptr, nbytes, device):
        made.append(ptr)
        if len(made) == 1:
            raise GpuxferError("registering host memory: refused")
        return real(ptr, nbytes, device)
    monkeypatch.setattr(host, "map_host_words", refuse_memory_files)
    before = set(os.listdir("/proc/self/fd"))
    words = HostWords.create(host, 0, 4, KV_PREFIX)
    try:
        assert len(made) == 2 and not words.sealed and os.path.exists("/dev/shm" + words.name)
        words.store(1, 5)
        assert words.read(1) == 5
    finally:
        words.close()
    assert set(os.listdir("/proc/self/fd")) <= before
