"""The shared-memory metadata mailbox of a same-host pair (gpuxfer.pp.mailbox), in one process."""
from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
from _orphans import gone_pid, planted

from gpuxfer.errors import BadInput
from gpuxfer.pp import mailbox as mb
from gpuxfer.pp.selection import meta_channel_from_env

META_LEN = 13
MAGIC = 0x5A5A_0000_0100


def _name() -> str:
    return f"/gxtest-{uuid.uuid4().hex[:20]}"


def _segments(prefix: str) -> list[str]:
    """Shared-memory names starting with ``prefix`` that still exist (Linux lists them in /dev/shm)."""
    return [f for f in os.listdir("/dev/shm") if f.startswith(prefix)] if os.path.isdir("/dev/shm") else []


@pytest.fixture
def pair():
    name = _name()
    recv = mb.Mailbox.create(name, META_LEN, MAGIC)
    send = mb.Mailbox.open(name, META_LEN, MAGIC)
    recv.unlink()
    yield send, recv
    send.close()
    recv.close()


def _send(box, values):
    i = box.next_send_buffer(1.0)
    box.send_buffers[i][:] = values
    box.send(i)


def test_messages_arrive_in_order_around_the_ring(pair):
    send, recv = pair
    rng = np.random.default_rng(1)
    for m in range(1, 4 * mb.RING + 3):
        want = rng.integers(-2**62, 2**62, META_LEN)
        _send(send, want)
        assert np.array_equal(recv.recv(1.0), want), m


def test_the_sender_waits_for_a_free_slot_then_times_out(pair):
    send, recv = pair
    for _ in range(mb.RING):
        _send(send, np.arange(META_LEN))
    with pytest.raises(mb.MailboxTimeout, match=f"message {mb.RING + 1}: the receiver has taken 0") as info:
        send.next_send_buffer(0.05)
    from gpuxfer.errors import GpuxferError
    assert isinstance(info.value, GpuxferError) and isinstance(info.value, TimeoutError)
    recv.recv(1.0)
    _send(send, np.arange(META_LEN))          # one slot came free


def test_the_receiver_times_out_naming_what_it_saw(pair):
    _, recv = pair
    with pytest.raises(mb.MailboxTimeout, match="message 1: slot 0 holds message 0"):
        recv.recv(0.05)


def test_a_corrupted_payload_is_never_delivered(pair):
    send, recv = pair
    _send(send, np.arange(META_LEN))
    send.send_buffers[0][3] ^= 1                # a flipped bit after the check was written
    with pytest.raises(mb.MailboxTimeout):
        recv.recv(0.05)
    send.send_buffers[0][3] ^= 1                # restored: the message is whole again
    assert np.array_equal(recv.recv(1.0), np.arange(META_LEN))


def test_open_refuses_another_connections_box_and_a_wrong_size():
    name = _name()
    box = mb.Mailbox.create(name, META_LEN, MAGIC)
    try:
        with pytest.raises(ValueError, match="magic"):
            mb.Mailbox.open(name, META_LEN, MAGIC + 1)
        with pytest.raises(BadInput, match="bytes, expected"):
            mb.Mailbox.open(name, META_LEN + 64, MAGIC)
        with pytest.raises(FileExistsError):
            mb.Mailbox.create(name, META_LEN, MAGIC)
    finally:
        box.unlink()
        box.close()
        box.close()                              # idempotent
    assert _segments(name[1:]) == []
    with pytest.raises(FileNotFoundError):
        mb.Mailbox.open(name, META_LEN, MAGIC)


def test_send_checks_its_slot(pair):
    send, _ = pair
    send.next_send_buffer(1.0)
    with pytest.raises(ValueError, match="slot 1 is not message 1"):
        send.send(1)


def test_meta_channel_setting(monkeypatch):
    monkeypatch.delenv("GPUXFER_PP_META_CHANNEL", raising=False)
    assert meta_channel_from_env() == "auto" and meta_channel_from_env("GROUP") == "group"
    monkeypatch.setenv("GPUXFER_PP_META_CHANNEL", "group")
    assert meta_channel_from_env() == "group"
    with pytest.raises(BadInput, match="auto or group"):
        meta_channel_from_env("shm")


# ---- connect's set-up of the mailboxes, two ranks as two threads over a fake all_gather ----

class _FakeExchange:
    """all_gather_object for two threads: every call blocks until both ranks have called."""

    def __init__(self):
        import threading
        self.barrier = threading.Barrier(2, timeout=10)
        self.slots = {}

    def __call__(self, obj, keys=()):
        self.slots[obj["rank"]] = obj
        self.barrier.wait()
        out = dict(self.slots)
        self.barrier.wait()
        return out


def _setup_two(hosts=("a", "a"), modes=("auto", "auto"), monkeypatch=None, open_fails=False):
    import threading
    import types
    from gpuxfer.pp import setup
    if open_fails:
        def bad_open(*a, **k):
            raise OSError("no such mailbox here")
        monkeypatch.setattr(mb.Mailbox, "open", staticmethod(bad_open))
    ex = _FakeExchange()
    nonce = int(uuid.uuid4().int & ((1 << 40) - 1)) << 8
    infos = {0: {"host": hosts[0], "pid": os.getpid()}, 1: {"host": hosts[1], "pid": os.getpid()}}
    tag_of = {(0, 1): 0x100000}
    sentinel = ("channel 0", "channel 1")
    ends = {0: types.SimpleNamespace(role="send", peer=1, metadata=True, specs=types.SimpleNamespace(meta_len=META_LEN),
                                     meta=sentinel[0]),
            1: types.SimpleNamespace(role="recv", peer=0, metadata=True, specs=types.SimpleNamespace(meta_len=META_LEN),
                                     meta=sentinel[1])}
    errors = []

    def run(rank):
        try:
            setup.setup_mailboxes(ex, infos, [ends[rank]], tag_of, nonce, rank, modes[rank])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert _segments(mb.segment_name(os.getpid(), nonce, tag_of[(0, 1)])[1:]) == []   # never outlives set-up
    return ends[0].meta, ends[1].meta, sentinel


def test_setup_gives_a_same_host_pair_a_working_mailbox():
    send, recv, _ = _setup_two()
    try:
        assert isinstance(send, mb.Mailbox) and isinstance(recv, mb.Mailbox)
        _send(send, np.arange(META_LEN) * 3)
        assert np.array_equal(recv.recv(1.0), np.arange(META_LEN) * 3)
    finally:
        send.close()
        recv.close()


@pytest.mark.parametrize("case", ["other host", "receiver asks for the group", "sender asks for the group",
                                  "sender cannot open"])
def test_setup_keeps_the_cpu_group_when_either_end_cannot(case, monkeypatch):
    kw = {"other host": {"hosts": ("a", "b")},
          "receiver asks for the group": {"modes": ("auto", "group")},
          "sender asks for the group": {"modes": ("group", "auto")},
          "sender cannot open": {"open_fails": True, "monkeypatch": monkeypatch}}[case]
    send, recv, sentinel = _setup_two(**kw)
    assert (send, recv) == sentinel


def test_create_removes_mailboxes_of_creators_gone_and_no_other():
    """A receiver SIGKILLed between create and unlink (its tracker with it) leaves its name: the next create
    removes names of the mailbox pattern whose pid no longer exists, and leaves a live creator's, and any
    other name, alone."""
    pid = gone_pid()
    nonce, tag = int(uuid.uuid4().int & ((1 << 40) - 1)) << 8, 0x100000
    dead = mb.segment_name(pid, nonce, tag)
    live = mb.segment_name(os.getppid(), nonce, tag)
    other = [dead + "x", f"/{mb.PREFIX}{pid:x}-{nonce:x}", f"/gpuxfer-ppw-{pid:x}-{nonce:x}-{tag:x}",
             f"/{mb.PREFIX}{pid:x}-{nonce:x}-{tag:x}-1"]
    with planted([dead, live, *other]):
        box = mb.Mailbox.create(_name(), META_LEN, MAGIC)
        box.unlink()
        box.close()
        assert not os.path.exists(f"/dev/shm{dead}")
        assert all(os.path.exists(f"/dev/shm{name}") for name in [live, *other])
