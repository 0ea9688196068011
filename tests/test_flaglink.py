"""The peer-flag link (gpuxfer.flaglink): the probe picks the path each side's signals take, either path
delivers, a forced path that cannot work fails every side with the reason, corrupted probes and hostile
peers are refused, an abort releases every wait. Two host-platform ends on two threads of one process:
opening a handle maps the exporter's buffer itself (one process cannot open its own IPC handles)."""
from __future__ import annotations

import threading

import pytest

from _spawn import on_threads
from gpuxfer import flaglink as FL
from gpuxfer.errors import BackendUnavailable, BadInput, DriverError, GpuxferError, TransferTimeout
from gpuxfer.platforms.base import RELEASE_VALUE, Memory
from gpuxfer.platforms.host import HostPlatform

WORDS = 4
_EXPORTED: dict = {}     # handle payload -> the buffer (every platform of the process)


class _Alias(Memory):
    """Another thread's buffer, mapped by pointer (same process)."""

    def __init__(self, buf):
        self.platform, self.device, self.ptr, self.nbytes = buf.platform, buf.device, buf.ptr, buf.nbytes

    def _release(self):
        pass


class _OneProcess(HostPlatform):
    """The host platform, opening the handles of buffers exported in this process."""

    def export_handle(self, buf):
        h = super().export_handle(buf)
        _EXPORTED[h.payload] = buf
        return h

    def open_handle(self, handle, device):
        return _Alias(_EXPORTED[handle.payload])


class _RefusesRemoteWrites(_OneProcess):
    """The host platform, refusing stream writes into peer mappings (as CUDA 13.1+ does)."""

    def open_handle(self, handle, device):
        m = super().open_handle(handle, device)
        self._mapped = [*getattr(self, "_mapped", []), (m.ptr, m.ptr + m.nbytes)]
        return m

    def _to_peer(self, ptr) -> bool:
        return any(a <= ptr < b for a, b in getattr(self, "_mapped", []))

    def write_flag(self, stream, ptr, value):
        if self._to_peer(ptr):
            raise DriverError("cuStreamWriteValue64", "CUDA_ERROR_NOT_SUPPORTED", 801, "a remote stream write")
        super().write_flag(stream, ptr, value)


class _LosesRemoteWrites(_RefusesRemoteWrites):
    """The host platform, taking stream writes into peer mappings without error and dropping them."""

    def write_flag(self, stream, ptr, value):
        if not self._to_peer(ptr):
            _OneProcess.write_flag(self, stream, ptr, value)


class _Exchange:
    """An all-gather between the threads (index = rank)."""

    def __init__(self, n=2):
        self.slots = [None] * n
        self.barrier = threading.Barrier(n, timeout=30)

    def __call__(self, rank):
        def exchange(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return exchange


def _pair(path=None, refusing=(), losing=()):
    """Two connected ends (or each end's error), and their platforms."""
    plats = [(_RefusesRemoteWrites if r in refusing else _LosesRemoteWrites if r in losing else _OneProcess)(devices=2)
             for r in range(2)]
    ex = _Exchange()

    def end(rank):
        def run():
            link = FL.FlagLink(plats[rank], rank, WORDS, path=path, rank=rank, peer=1 - rank, name="test")
            try:
                link.connect(ex(rank))
            except BackendUnavailable as exc:
                link.close()
                return exc
            return link
        return run
    return on_threads([end(0), end(1)]), plats


def _close(links, plats):
    for x in links:
        if isinstance(x, FL.FlagLink):
            x.close()
    for p in plats:
        p.close()


@pytest.mark.parametrize("path, refusing, losing, paths", [
    (None, (), (), (FL.REMOTE, FL.REMOTE)),
    ("auto", (0,), (), (FL.COPY, FL.REMOTE)),
    ("auto", (), (1,), (FL.REMOTE, FL.COPY)),     # sent, never seen: the peer's poll gives up
    ("copy", (), (), (FL.COPY, FL.COPY)),
    ("remote", (), (), (FL.REMOTE, FL.REMOTE)),
])
def test_each_side_signals_by_the_path_its_peer_saw_and_signals_arrive(path, refusing, losing, paths):
    links, plats = _pair(path, refusing, losing)
    try:
        assert tuple(x.path for x in links) == paths
        for rank, link in enumerate(links):          # a signal lands in the peer's word, by either path
            s = plats[rank].create_stream(rank)
            link.signal(s, FL.FIRST_WORD + 1, 40 + rank, stage=FL.FIRST_WORD + 2)
            assert plats[rank].synchronize(s, 10.0)
            s.close()
        assert [x.read(FL.FIRST_WORD + 1) for x in links] == [41, 40]
        s = plats[1].create_stream(1)                # a stream wait on a word the peer set completes
        links[1].wait(s, FL.FIRST_WORD + 1, 40)
        assert plats[1].synchronize(s, 10.0)
        s.close()
    finally:
        _close(links, plats)


def test_forced_remote_flags_fail_on_both_sides_with_the_reason():
    res, plats = _pair("remote", refusing=(1,))
    try:
        for r in res:
            assert isinstance(r, BackendUnavailable), r
            assert set(r.reasons) == {1}, r.reasons
            assert "did not reach rank 0" in r.reasons[1] and "CUDA_ERROR_NOT_SUPPORTED" in r.reasons[1]
    finally:
        _close(res, plats)


def test_bad_flag_path_names_the_variable(monkeypatch):
    monkeypatch.setenv(FL.ENV_FLAG_PATH, "bogus")
    plat = HostPlatform()
    try:
        with pytest.raises(BadInput, match="GPUXFER_FLAG_PATH must be auto, remote or copy, got 'bogus'"):
            FL.FlagLink(plat, 0, WORDS)
        with pytest.raises(BadInput, match="at least one word"):
            FL.FlagLink(plat, 0, 0, path="auto")
    finally:
        plat.close()


def test_a_peer_buffer_too_small_is_refused_and_a_second_open_too():
    """A peer buffer too small is refused and its mapping closed (the link stays unopened); a link opened once
    refuses a second open instead of dropping its first mapping unclosed."""
    plat = _OneProcess(devices=2)
    small, big = FL.FlagLink(plat, 0, 1, path="auto"), FL.FlagLink(plat, 1, WORDS, path="auto", rank=1, peer=0)
    other = FL.FlagLink(plat, 0, WORDS, path="auto")
    try:
        with pytest.raises(BadInput, match="rank 0's flags flag buffer holds .* expected"):
            big.open(small.export())
        assert big.peer_mem is None
        big.open(other.export())
        first = big.peer_mem
        with pytest.raises(BadInput, match="open already"):
            big.open(other.export())
        assert big.peer_mem is first
    finally:
        other.close()
        big.close()
        small.close()
        plat.close()


def test_a_corrupted_or_missing_probe_copy_is_an_error(monkeypatch):
    plat = _OneProcess(devices=2)
    a, b = FL.FlagLink(plat, 0, WORDS, path="copy"), FL.FlagLink(plat, 1, WORDS, path="copy", rank=1, peer=0)
    try:
        a.open(b.export())
        b.open(a.export())
        a.probe_send(100)
        b._nonce = 100
        plat.host_write_flag(b.word(FL.PROBE_COPY), 107, 1)     # the peer's copy arrived as another value
        with pytest.raises(GpuxferError, match="flag copy wrote 107, expected 101"):
            b.probe_check({"remote_sent": False})
        monkeypatch.setattr(FL, "SETUP_TIMEOUT_S", 0.2)
        a._nonce = 200                                          # nothing was sent to a: it never arrives
        with pytest.raises(TransferTimeout, match="never arrived"):
            a.probe_check({"remote_sent": False})
    finally:
        a.close()
        b.close()
        plat.close()


def test_release_waits_frees_a_blocked_stream_and_close_is_idempotent():
    links, plats = _pair("copy")
    try:
        s = plats[0].create_stream(0)
        links[0].wait(s, FL.FIRST_WORD, 10)              # nothing will ever signal it
        ev = plats[0].record_event(s)
        assert not plats[0].event_wait(ev, 0.05)
        links[0].release_waits([FL.FIRST_WORD])
        assert plats[0].event_wait(ev, 10.0)
        s.close()
    finally:
        _close(links, plats)
    for x in links:
        x.close()                                        # again: nothing happens
        x.release_waits([FL.FIRST_WORD])                 # after close: a no-op


class _CorruptsRemoteWrites(_RefusesRemoteWrites):
    """The host platform, landing stream writes into peer mappings with another value."""

    def write_flag(self, stream, ptr, value):
        _OneProcess.write_flag(self, stream, ptr, value + 1 if self._to_peer(ptr) else value)


def _shared_pair(cls=_OneProcess, path="auto"):
    """One process's words shared by its link to a peer's words (an agent's layout): (platform, own words, peer
    words, link)."""
    plat = cls(devices=2)
    mine, theirs = FL.FlagWords(plat, 0, WORDS, name="mine"), FL.FlagWords(plat, 1, WORDS, rank=1, name="theirs")
    link = FL.FlagLink(plat, 0, WORDS, path=path, peer="theirs", name="test", shared=mine)
    link.open(theirs.export())
    return plat, mine, theirs, link


@pytest.mark.parametrize("cls, path, remote", [
    (_OneProcess, "auto", True), (_RefusesRemoteWrites, "auto", False), (_LosesRemoteWrites, "auto", False),
    (_CorruptsRemoteWrites, "auto", False), (_OneProcess, "copy", False), (_RefusesRemoteWrites, "remote", True),
])
def test_one_sided_probe_picks_the_path_and_signals_arrive_through_own_stage_words(cls, path, remote):
    """The one-sided probe takes remote writes only where its fresh value read back through the mapping (a
    refused, lost or corrupted write: copies; a forced path: unprobed); a copy-path signal goes through the
    link's own stage words, never the shared words; closing the link leaves both sides' words open."""
    plat, mine, theirs, link = _shared_pair(cls, path)
    try:
        assert link.probe_one_sided(5.0) is remote and link.path == (FL.REMOTE if remote else FL.COPY)
        assert link.stage_mem is not link.local and link.local is mine.buf
        if path == "copy":
            assert theirs.read(FL.PROBE_REMOTE) == 0                 # forced: nothing written
        if not (remote and cls is _RefusesRemoteWrites):             # (a forced remote path the platform refuses)
            s = plat.create_stream(0)
            link.signal(s, FL.FIRST_WORD + 1, 7, stage=FL.FIRST_WORD + 1)
            q = link.queue(s, batch=True)
            q.signal(FL.FIRST_WORD + 2, 9)
            q.write(FL.FIRST_WORD, 3)
            q.flush()
            assert plat.synchronize(s, 10.0)
            s.close()
            assert [theirs.read(FL.FIRST_WORD + i) for i in (1, 2)] == [7, 9] and mine.read(FL.FIRST_WORD) == 3
            assert mine.read(FL.FIRST_WORD + 1) == mine.read(FL.FIRST_WORD + 2) == 0
    finally:
        link.close()
        assert link.closed and not mine.closed and not theirs.closed
        link.close()
        mine.close()
        theirs.close()
        plat.close()


def test_a_word_the_peer_never_signals_or_signals_stale_ends_in_a_timeout_naming_it():
    """A host wait on a word the peer never signals, or signals with a stale (lower) value, raises the typed
    timeout naming the flag and the value seen; a stream wait on it is freed by the release."""
    plat, mine, theirs, link = _shared_pair()
    try:
        with pytest.raises(TransferTimeout, match=r"'notification 4' >= 1 \(last value seen: 0\)"):
            mine.wait_host(FL.FIRST_WORD + 3, 1, 0.1, flag="notification 4")
        s = plat.create_stream(1)
        peer_link = FL.FlagLink(plat, 1, WORDS, path="copy", peer="mine", shared=theirs)
        peer_link.open(mine)                                         # in one process: the words as they are
        peer_link.signal(s, FL.FIRST_WORD, 5, stage=FL.FIRST_WORD)    # the peer is one behind
        assert plat.synchronize(s, 10.0)
        with pytest.raises(TransferTimeout, match=r">= 6 \(last value seen: 5\)"):
            link.words.wait_host(FL.FIRST_WORD, 6, 0.1)
        w = plat.create_stream(0)
        link.wait(w, FL.FIRST_WORD, 6)
        ev = plat.record_event(w)
        assert not plat.event_wait(ev, 0.05)
        link.release_waits([FL.FIRST_WORD])
        assert plat.event_wait(ev, 10.0) and mine.read(FL.FIRST_WORD) == RELEASE_VALUE
        peer_link.close()
        assert not mine.closed                                       # a peer's words in one process: not closed
        s.close()
        w.close()
    finally:
        link.close()
        mine.close()
        theirs.close()
        plat.close()
    mine.release([FL.FIRST_WORD])                                    # after close: a no-op


def _use_closed_words() -> list:
    """Every way to reach flag words after their close, and an index outside them: each a BadInput (the
    address would be freed memory or past the buffer: a stream or host access there faults)."""
    plat = HostPlatform()
    s = plat.create_stream(0)
    words = FL.FlagWords(plat, 0, WORDS)
    link = FL.FlagLink(plat, 0, WORDS)
    calls = {
        "past the words": lambda: words.read(FL.FIRST_WORD + WORDS),
        "negative index": lambda: words.write(s, -1, 1),
        "bool index": lambda: words.read(True),
        "peer word before open": lambda: link.signal(s, FL.FIRST_WORD, 1, FL.FIRST_WORD),
    }
    refused = []
    for what, call in calls.items():
        with pytest.raises(BadInput):
            call()
        refused.append(what)
    words.close()
    link.close()
    calls = {
        "read": lambda: words.read(FL.FIRST_WORD),
        "host wait": lambda: words.wait_host(FL.FIRST_WORD, 1, 0.5),
        "stream write": lambda: words.write(s, FL.FIRST_WORD, 1),
        "stream wait": lambda: words.wait(s, FL.FIRST_WORD, 1),
        "link read": lambda: link.read(FL.FIRST_WORD),
        "link wait": lambda: link.wait(s, FL.FIRST_WORD, 1),
        "link stage word": lambda: link.stage_word(FL.FIRST_WORD),
        "queued write": lambda: link.queue(s).write(FL.FIRST_WORD, 1),
    }
    for what, call in calls.items():
        with pytest.raises(BadInput, match="closed"):
            call()
        refused.append(what)
    assert plat.synchronize(s, 10.0)          # nothing reached the stream
    words.release([FL.FIRST_WORD])            # the abort path stays a no-op
    plat.close()
    return refused


def test_closed_words_and_indices_outside_them_are_refused_not_touched(spawner):
    # in a child: reaching freed words would end the process with a signal
    assert len(spawner.start(_use_closed_words).result(60)) == 12


def _release_meets_close() -> bool:
    """A release under way on one thread (a watchdog's) while another closes the words: the close waits for it
    (a free in between would have the release's next write land in unmapped memory)."""
    plat = HostPlatform()
    words = FL.FlagWords(plat, 0, WORDS)
    real, inside, go = plat.host_write_flag, threading.Event(), threading.Event()

    def held_write(ptr, value, device):
        inside.set()
        assert go.wait(30)
        real(ptr, value, device)
    plat.host_write_flag = held_write
    releaser = threading.Thread(target=words.release, args=([FL.FIRST_WORD, FL.FIRST_WORD + 1],))
    releaser.start()
    assert inside.wait(30)
    closer = threading.Thread(target=words.close)
    closer.start()
    closer.join(0.2)        # (the close either waits for the release or, unguarded, frees under it)
    go.set()
    releaser.join(30)
    closer.join(30)
    assert not releaser.is_alive() and not closer.is_alive() and words.closed
    plat.close()
    return True


def test_a_release_on_another_thread_is_never_met_by_the_free(spawner):
    # in a child: a release writing into freed words ends the process with a signal
    assert spawner.start(_release_meets_close).result(60)
