"""HostWords: flag words in shared host memory that the host loads and the platform's streams write and wait on
(the copy_engine sender's give-back words). Event-driven and bounded; nothing here is timed."""
from __future__ import annotations

import os
import time

import pytest
from _orphans import gone_pid, planted

from gpuxfer.errors import GpuxferError
from gpuxfer.hostwords import HostWords


def reachable(platform, ref: str) -> bool:
    """Whether a peer can open the words ``ref`` refers to (their owner has not dropped the reference)."""
    try:
        HostWords.open(platform, 0, ref, 2).close()
    except (GpuxferError, OSError):
        return False
    return True


def test_streams_write_copy_and_wait_on_host_words(platform):
    w = HostWords.create(platform, 0, 4)
    s = platform.create_stream(0)
    stage = platform.alloc(64, 0)
    try:
        assert all(w.read(i) == 0 for i in range(4))
        assert reachable(platform, w.ref)
        platform.write_flag(s, w.ptr(0), 7)                 # a stream write lands, seen by a host load
        assert platform.synchronize(s, 30.0) and w.read(0) == 7

        def copy(stream, dst, value):                       # a stage write + an 8-byte copy, as a publish
            platform.write_flag(stream, stage.ptr, value)
            platform.copy_async(stream, dst, stage.ptr, 8)
        w.check_peer_writes(s, copy, 30.0)
        platform.wait_flag(s, w.ptr(1), 5)                   # a stream wait holds until a host store
        held = platform.record_event(s)
        time.sleep(0.02)
        assert not platform.event_query(held)
        w.store(1, 5)
        assert platform.event_wait(held, 30.0)
        w.unlink()
        assert not reachable(platform, w.ref) and w.read(0) == 7   # the mapping outlives the reference
    finally:
        platform.synchronize(s, 10.0)
        s.close()
        stage.close()
        w.close()
        w.close()                                            # idempotent
    assert not reachable(platform, w.ref) and not os.path.exists(f"/dev/shm{w.name}")


@pytest.mark.parametrize("sealed", [True, False])
def test_a_peer_opens_the_words_by_their_reference(host, monkeypatch, sealed):
    """Two mappings of one memory file (here in one process; the pp tests open it from the peer's): a store through
    one is a load through the other. Also for the named segment, where no sealed memory file can be made."""
    import gpuxfer.hostwords as hostwords
    if not sealed:
        monkeypatch.setattr(hostwords, "_sealed_memfd", lambda name, nbytes: None)
    a = HostWords.create(host, 0, 2)
    assert a.sealed == sealed
    b = HostWords.open(host, 1, a.ref, 2)
    try:
        b.store(1, 42)
        assert a.read(1) == 42 and a.loads()[8] == 42
        assert a.ptr(1) - a.ptr(0) == 64
    finally:
        b.close()
        a.close()
    with pytest.raises(GpuxferError, match="not a flag-word segment"):
        HostWords.open(host, 0, "/not-ours", 2)
    with pytest.raises(GpuxferError if sealed else FileNotFoundError):
        HostWords.open(host, 0, a.ref, 2)                    # dropped with its owner's close


def test_a_platform_that_cannot_map_host_memory_is_refused(host, monkeypatch):
    monkeypatch.setattr(type(host), "map_host_words", lambda self, ptr, nbytes, device: None)
    with pytest.raises(GpuxferError, match="cannot map host memory"):
        HostWords.create(host, 0, 2)


def test_a_sender_discarded_after_a_failed_setup_drops_the_give_back_name():
    """A setup that fails before the probe (a rank gone: discard(), which frees only what no peer maps) still
    drops the give-back words' reference: nothing is left to open, nothing in /dev/shm."""
    import torch

    from gpuxfer.platforms.host import HostPlatform
    from gpuxfer.pp.copy_engine import CopyEngineTransport
    from gpuxfer.pp.setup import discard
    from gpuxfer.pp.spec import SpecTable

    plat = HostPlatform()
    snd = CopyEngineTransport(role="send", rank=0, peer=1, device=0, platform=plat, timeout_s=20.0,
                              specs=SpecTable({"h": ((64,), torch.float32)}), metadata=False, group=None,
                              tag_base=0, torch_device=torch.device("cpu"), recv_slots=2)
    before = set(os.listdir("/dev/shm"))
    try:
        payload = snd.setup_prepare()
        ref = payload["give_back"]
        assert ref and reachable(plat, ref)
        discard([snd])
        assert not reachable(plat, ref) and set(os.listdir("/dev/shm")) - before == set()
    finally:
        snd._free()
        plat.close()


def test_create_removes_segments_of_creators_gone_and_no_other(host):
    """A creator SIGKILLed between create and unlink leaves its name: the next create removes names of the
    give-back pattern whose pid no longer exists, and leaves a live creator's, and any other name, alone."""
    import secrets

    from gpuxfer.hostwords import PREFIX

    pid, token = gone_pid(), secrets.token_hex(6)
    dead = f"/{PREFIX}{pid:x}-{token}"
    live = f"/{PREFIX}{os.getppid():x}-{token}"
    other = [f"/{PREFIX}{pid:x}-{token}x", f"/{PREFIX}{pid:x}", f"/gpuxfer-pp-{pid:x}-{token}"]
    with planted([dead, live, *other]):
        HostWords.create(host, 0, 2).close()
        assert not os.path.exists(f"/dev/shm{dead}")
        assert all(os.path.exists(f"/dev/shm{name}") for name in [live, *other])


def test_words_a_full_dev_shm_cannot_hold_fail_at_create_leaving_nothing(host, monkeypatch):
    """A memory (or, for the named segment, a /dev/shm) too full for the words' pages: the create fails (``OSError``;
    its callers keep the words on the device), nothing left behind (no name, no descriptor), instead of a SIGBUS at
    the first store into a page the mapping could not get."""
    import errno
    made = []

    def full(fd, offset, length):
        made.append(fd)
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    monkeypatch.setattr(os, "posix_fallocate", full)
    before, fds = set(os.listdir("/dev/shm")), set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        HostWords.create(host, 0, 4)
    assert made and set(os.listdir("/dev/shm")) - before == set() and set(os.listdir("/proc/self/fd")) <= fds
