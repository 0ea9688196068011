"""The vLLM connector's side channel (no vLLM): its framing and the bounds on what a peer can make either end
hold, the handshake driven by the engine thread's pumps and the server's own thread, the decode's messages
(done, release; never sent twice, never waited for), and the holds' keys a message must carry."""
from __future__ import annotations

import queue
import socket
import struct
import threading

import pytest

from gpuxfer.integrations.vllm.channel import (MAX_FRAME, MAX_READERS, MAX_REQUEST_ID, ChannelClosed,
                                               SideChannelClient, SideChannelServer, frame, message)
from gpuxfer.integrations.vllm.params import parse_remote_prefill


def test_side_channel_limits():
    events = []
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"meta"), timeout_s=5.0)
    try:
        c = SideChannelClient("127.0.0.1", srv.port, 5.0)
        assert c.handshake() == (b"{}", b"meta")
        assert c.notify("done", ["r1"]) and c.notify("release", ["r2"])
        for _ in range(2):
            events.append(srv.events.get(timeout=5))
        assert events == [("done", "r1", 1, None, None), ("release", "r2", 1, None, None)]
        assert c.notify("done", ["a", "b", "c"])             # one message for a step's reads
        assert [srv.events.get(timeout=5) for _ in range(3)] == [("done", r, 1, None, None) for r in "abc"]
        c.readers = 2                                       # one of two decode ranks reading this prefill rank
        assert c.notify("done", ["h"]) and srv.events.get(timeout=5) == ("done", "h", 2, None, None)
        assert c.notify("done", ["k", "n"], ["abc", None])                  # each request's hold key, if any
        assert [srv.events.get(timeout=5) for _ in range(2)] == [("done", "k", 2, "abc", None), ("done", "n", 2, None, None)]
        for bad in ({"op": "done", "req": "r1"}, {"op": "done", "reqs": "r1"}, {"op": "done", "reqs": ["a", 7]},
                    {"op": "release", "reqs": ["x" * (MAX_REQUEST_ID + 1)]}, {"op": "done", "reqs": ["a"], "of": 0},
                    {"op": "done", "reqs": ["a"], "of": MAX_READERS + 1}, {"op": "done", "reqs": ["a"], "of": True},
                    {"op": "done", "reqs": ["a"], "of": 2.0}, {"op": "done", "reqs": ["a"], "keys": "k"},
                    {"op": "done", "reqs": ["a"], "keys": ["k", "l"]}, {"op": "done", "reqs": ["a"], "keys": [7]},
                    {"op": "done", "reqs": ["a"], "keys": ["x" * 65]}):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(message(bad))
            s.settimeout(5)
            assert s.recv(1) == b"", bad                    # that connection closed, no event
            s.close()
        assert srv.events.empty()
        # a hostile frame length closes that connection only
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(struct.pack(">I", MAX_FRAME + 1))
        s.settimeout(5)
        assert s.recv(1) == b""
        s.close()
        c2 = SideChannelClient("127.0.0.1", srv.port, 5.0)
        assert c2.handshake()[1] == b"meta"
        c2.close()
        c.close()
    finally:
        srv.close()
    # the decode side sees the prefill end go away
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), timeout_s=5.0)
    c = SideChannelClient("127.0.0.1", srv.port, 5.0)
    c.handshake()
    srv.close()
    done = threading.Event()
    for _ in range(100):
        if not c.alive:
            done.set()
            break
        threading.Event().wait(0.05)
    assert done.is_set()
    c.close()


def test_connections_that_say_nothing_or_too_much_are_bounded(monkeypatch):
    """Past MAX_CONNECTIONS a new connection is closed at once; one that says no hello, or leaves a message half
    sent, goes after the timeout; a message longer than MAX_MESSAGE closes its connection; a done list longer
    than one message goes in several, every request arriving."""
    from gpuxfer.integrations.vllm import channel
    monkeypatch.setattr(channel, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(channel.SideChannelServer, "SWEEP_S", 0.05)
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"meta"), timeout_s=1.0)

    def closed(sock, wait_s: float) -> bool:
        sock.settimeout(wait_s)
        try:
            return sock.recv(1) == b""
        except socket.timeout:
            return False

    try:
        c = SideChannelClient("127.0.0.1", srv.port, 5.0)
        c.handshake()
        quiet = socket.create_connection(("127.0.0.1", srv.port), timeout=5)        # never says hello
        half = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        half.sendall(message({"op": "hello"})[:6])                                  # and never the rest
        big = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        extra = socket.create_connection(("127.0.0.1", srv.port), timeout=5)        # the fifth
        assert closed(extra, 5.0)
        assert not closed(quiet, 0.3) and not closed(half, 0.1)
        big.sendall(struct.pack(">I", channel.MAX_MESSAGE + 1))
        assert closed(big, 5.0)
        assert closed(quiet, 5.0) and closed(half, 5.0)
        ids = [f"r{i}" for i in range(2 * channel.MAX_IDS_PER_MESSAGE + 5)]
        assert c.notify("done", ids, ["k"] * len(ids))
        got = [srv.events.get(timeout=5)[1] for _ in ids]
        assert got == ids and c.alive                   # (the greeted client is kept)
        c2 = SideChannelClient("127.0.0.1", srv.port, 5.0)                          # room again
        assert c2.handshake()[1] == b"meta"
        for sock in (quiet, half, big, extra):
            sock.close()
        c2.close()
        c.close()
    finally:
        srv.close()


def test_one_address_cannot_take_every_connection(monkeypatch):
    """Past MAX_CONNECTIONS_PER_HOST open from one address, that address's next connection is closed at once,
    while another address's still gets its handshake; a connection that went makes room for its address."""
    from gpuxfer.integrations.vllm import channel
    monkeypatch.setattr(channel, "MAX_CONNECTIONS_PER_HOST", 2)
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"meta"), timeout_s=5.0)

    def connect(source: str) -> socket.socket:
        return socket.create_connection(("127.0.0.1", srv.port), timeout=5, source_address=(source, 0))

    def answered(sock) -> bool:         # a hello answered (three frames), or the connection closed unanswered
        try:
            sock.sendall(message({"op": "hello"}))
            return sock.recv(4) != b""
        except OSError:                 # (reset by the close)
            return False

    socks = []
    try:
        socks = [connect("127.0.0.2") for _ in range(3)]
        assert [answered(s) for s in socks] == [True, True, False]
        other = connect("127.0.0.3")
        socks.append(other)
        assert answered(other)
        socks[0].close()
        for _ in range(100):            # the server sees the close at its next pump
            again = connect("127.0.0.2")
            socks.append(again)
            if answered(again):
                break
            threading.Event().wait(0.05)
        else:
            raise AssertionError("a closed connection did not make room for its address")
    finally:
        for s in socks:
            s.close()
        srv.close()


def test_a_prefill_named_by_host_name_is_resolved_off_the_engine_thread(monkeypatch):
    """A name's lookup (seconds where DNS is slow) runs on a thread: making the client and each pump return at
    once; the handshake goes on once the name resolved; a name that does not resolve, or not within the
    timeout, fails the handshake with a typed error (never a hang)."""
    import time
    real = socket.getaddrinfo
    gate = threading.Event()

    def lookup(host, port, *a, **kw):
        if host.endswith(".slow"):
            if kw.get("flags", 0) & socket.AI_NUMERICHOST:
                raise socket.gaierror(socket.EAI_NONAME, "not numeric")
            gate.wait(10)
            if host == "bad.slow":
                raise socket.gaierror(socket.EAI_NONAME, "no such host")
            return real("127.0.0.1", port, *a, **kw)
        return real(host, port, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"meta"), timeout_s=5.0)
    try:
        t0 = time.monotonic()
        c = SideChannelClient("prefill.slow", srv.port, 5.0)
        bad = SideChannelClient("bad.slow", srv.port, 5.0)
        late = SideChannelClient("late.slow", srv.port, 0.2)
        assert c.pump() is None and bad.pump() is None and time.monotonic() - t0 < 5   # (the lookups wait 10 s)
        time.sleep(0.3)
        with pytest.raises(TimeoutError, match="not resolved"):
            late.pump()
        gate.set()
        assert c.handshake() == (b"{}", b"meta")
        with pytest.raises(ChannelClosed, match="resolving bad.slow"):
            bad.handshake()
        for x in (c, bad, late):
            x.close()
    finally:
        gate.set()
        srv.close()


def test_a_deeply_nested_message_closes_only_its_connection():
    """A frame of JSON nested past the parser's recursion limit (a RecursionError, not a ValueError): the engine
    thread's pump and the server's own thread close that connection and go on serving."""
    import time
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), timeout_s=5.0)
    try:
        for engine_pumps in (True, False):
            srv.pump()
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(frame(b'{"op":"done","reqs":' + b"[" * 100_000))
            if engine_pumps:
                end = time.monotonic() + 1.0
                while time.monotonic() < end:
                    srv.pump()                          # the engine thread's steps: must not raise
                    time.sleep(0.01)
            else:
                time.sleep(3 * srv.IDLE_S)              # the server's thread serves it
            assert s.recv(1) == b""
            s.close()
            time.sleep(3 * srv.IDLE_S)
            c = SideChannelClient("127.0.0.1", srv.port, 5.0)
            assert c.handshake() == (b"{}", b"m")       # the server's thread still answers
            c.close()
    finally:
        srv.close()


def test_hellos_repeated_on_one_connection_do_not_pile_up_answers():
    """A peer that sends hello after hello and reads nothing: the server does not queue an answer (the agent's
    metadata, large) per hello; one connection cannot make it buffer without bound."""
    import time
    meta = b"m" * 50_000
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", meta), timeout_s=30.0)
    try:
        srv.pump()
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(message({"op": "hello"}) * 2000)      # 40 KB asking for 100 MB of answers
        time.sleep(0.1)
        for _ in range(5):
            srv.pump()
        buffered = sum(len(c.outbuf) for c in list(srv._conns.values()))
        assert buffered <= 2 * len(meta), buffered
        s.close()
    finally:
        srv.close()


def test_a_flood_of_releases_for_unknown_requests_is_bounded():
    """Done and release messages naming requests this prefill never held (forged, or for another instance): what
    the prefill keeps of them is bounded, however many arrive within the lease."""
    from gpuxfer.integrations.vllm.holds import PrefillHolds

    class Srv:
        events = queue.SimpleQueue()

        def pump(self):
            pass
    holds, srv = PrefillHolds(engine_id="p", lease_s=120.0, stats={"sends_done": 0, "leases_expired": 0}), Srv()
    for step in range(20):
        for i in range(20_000):
            srv.events.put(("release", f"s{step}-{i}", 1, None, None))
        holds.drain(srv, 1000.0 + step)
    assert len(holds.early) <= 100_000, len(holds.early)


def test_messages_queued_while_the_engine_is_idle_are_bounded():
    """An idle prefill engine takes no events (no steps) while the server's thread serves: a peer streaming
    release messages cannot make that thread queue them without bound."""
    import time
    from gpuxfer.integrations.vllm import channel
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), timeout_s=5.0)
    try:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        sent = 0
        try:
            for chunk in range(2 * channel.MAX_EVENTS // 10_000):
                s.sendall(message({"op": "release", "reqs": [f"r{chunk}-{i}" for i in range(10_000)]}))
                sent += 10_000
        except OSError:
            pass                                        # the server closed the connection
        time.sleep(1.0)
        assert srv.events.qsize() <= channel.MAX_EVENTS, (srv.events.qsize(), sent)
        s.close()
    finally:
        srv.close()


def test_handshake_by_pumps_alone_and_by_the_idle_thread():
    """The engine thread's pumps complete a handshake with the server's thread kept out (the engine is
    busy); an idle engine's server thread answers by itself."""
    import time
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"info", b"m" * 300_000), timeout_s=5.0)
    try:
        c = SideChannelClient("127.0.0.1", srv.port, 5.0)
        got, deadline = None, time.monotonic() + 5
        while got is None and time.monotonic() < deadline:
            srv.pump()                  # the engine thread's step; it also keeps the server's thread idle
            got = c.pump()
        assert got == (b"info", b"m" * 300_000)
        assert c.alive and c.notify("done", ["r9"])
        deadline = time.monotonic() + 5
        while srv.events.empty() and time.monotonic() < deadline:
            srv.pump()
        assert srv.events.get_nowait() == ("done", "r9", 1, None, None)
        c.close()
        time.sleep(2 * srv.IDLE_S)      # no pumps: the server's thread serves
        c2 = SideChannelClient("127.0.0.1", srv.port, 5.0)
        assert c2.handshake() == (b"info", b"m" * 300_000)
        c2.close()
    finally:
        srv.close()


def test_the_server_thread_sleeps_while_the_engine_serves():
    """With the engine thread pumping more often than ``IDLE_S``, the server's thread leaves a ready connection to
    it and sleeps between looks, not selecting again and again on what stays ready (a spin that takes the GIL from
    the engine thread: hundreds of thousands of selects)."""
    import time
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"info", b"m"), timeout_s=5.0)
    try:
        srv.pump()
        calls = []
        select = srv._sel.select

        def counted(timeout=None):
            if threading.current_thread() is srv._thread:
                calls.append(timeout)
            return select(timeout)
        srv._sel.select = counted
        c = SideChannelClient("127.0.0.1", srv.port, 5.0)
        c.pump()                        # the hello sent; the engine thread does not read it yet
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            srv._pumped = time.monotonic()      # the engine stepping (serving nothing: its data stays ready)
            time.sleep(srv.IDLE_S / 4)
        # a pass of the thread per IDLE_S at most while the engine steps (the hello it may serve once a sleep
        # outlasted IDLE_S on a loaded machine: then selects that wait)
        assert len(calls) <= 2 * 0.5 / srv.IDLE_S + 3, len(calls)
        srv.pump()
        assert c.handshake() == (b"info", b"m")
        c.close()
    finally:
        srv.close()


def test_notify_never_waits_for_the_socket():
    """A prefill end that stops reading: the engine thread's notify calls return at once however much is queued;
    the sender thread gives up after timeout_s and the client is then dead; close() is bounded."""
    import time
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), timeout_s=5.0)
    try:
        c = SideChannelClient("127.0.0.1", srv.port, 8.0)
        assert c.handshake() == (b"{}", b"m")
        srv._stop.set()             # the server stops reading: its thread and the pumps serve nothing
        with srv._lock:
            big = ["x" * MAX_REQUEST_ID] * 2000
            t0 = time.monotonic()
            n = 0
            while n < 24:
                assert c.notify("done", big)
                n += 1
            # 24 MB queued (more than the socket buffers take) without waiting for the socket, which takes none of
            # it until the sender thread gives up, 8 s on
            assert time.monotonic() - t0 < 6.0 and c.alive
            deadline = time.monotonic() + 20
            while c.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not c.alive and "not taken within" in c.closed_reason
            assert not c.notify("done", ["r"])
            t0 = time.monotonic()
            c.close()
            assert time.monotonic() - t0 < 30           # (bounded: a hang guard)
    finally:
        srv._stop.clear()
        srv.close()


def test_a_message_the_sender_thread_leaves_is_sent_by_the_engine_thread():
    """A sender thread that does not run (as one starved of the GIL by a busy engine thread): the engine
    thread's poll sends a message once it has waited LATE_S, not before."""
    import time
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), timeout_s=5.0)
    try:
        c = SideChannelClient("127.0.0.1", srv.port, 5.0)
        c._wake = _Starved()
        assert c.handshake() == (b"{}", b"m")
        assert c.notify("done", ["late"])
        c.flush_late(time.monotonic())
        time.sleep(0.2)
        srv.pump()
        assert srv.events.empty()
        time.sleep(c.LATE_S)
        c.flush_late(time.monotonic())
        deadline = time.monotonic() + 5
        while srv.events.empty() and time.monotonic() < deadline:
            srv.pump()
        assert srv.events.get_nowait() == ("done", "late", 1, None, None)
        c.close()
    finally:
        srv.close()


def test_a_claim_is_sent_by_the_engine_threads_next_poll():
    """A load's finish waits for its claim's answer: with the sender thread not running, the engine thread's next
    poll sends a queued claim at once (not after LATE_S), and both ends of the connection send each frame at once
    (TCP_NODELAY: else a claim after an unanswered done waits for the prefill's delayed ACK)."""
    import time
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), timeout_s=5.0)
    try:
        c = SideChannelClient("127.0.0.1", srv.port, 5.0)
        c._wake = _Starved()
        assert c.handshake() == (b"{}", b"m")
        assert c._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        with srv._lock:
            assert all(conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for conn in srv._conns.values())
        assert c.claim(["r"], ["k"], ["t"])
        c.flush_late(time.monotonic())          # at once: no LATE_S wait
        assert not c.outbox
        c.close()
    finally:
        srv.close()


class _Starved:
    """A sender thread's wake-ups that never come (a thread starved of the GIL)."""

    def put(self, x):
        pass

    def get(self, timeout):
        import time
        time.sleep(timeout)
        raise queue.Empty


def _slow_peer(read: int, go: threading.Event | None = None):
    """A listener whose one connection answers the hello, then reads nothing until ``go`` is set (at most 60 s)
    and then ``read`` bytes at a time: ``(port, what it received, stop)``."""
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    lst.bind(("127.0.0.1", 0))
    lst.listen()
    got, stop = bytearray(), threading.Event()

    def serve():
        s, _ = lst.accept()
        s.recv(100)
        s.sendall(frame(b"{}") + frame(b"m") + frame(struct.pack(">d", 1.0)))
        if go is not None:
            go.wait(60)
        s.settimeout(0.05)
        while not stop.is_set():
            try:
                d = s.recv(read)
            except socket.timeout:
                continue
            if not d:
                break
            got.extend(d)
        s.close()
        lst.close()
    threading.Thread(target=serve, daemon=True).start()
    return lst.getsockname()[1], got, stop


def _messages(op: str, ids: list[str]) -> bytes:
    """What a client sends for ``notify(op, ids)``: messages of at most MAX_IDS_PER_MESSAGE requests, in order."""
    from gpuxfer.integrations.vllm.channel import MAX_IDS_PER_MESSAGE as n
    return b"".join(message({"op": op, "reqs": ids[i:i + n]}) for i in range(0, len(ids), n))


def test_close_never_sends_a_message_twice():
    """close() while a long message is half sent to a slow reader: what the prefill end receives is a prefix of
    the messages in order, never a message begun again (a corrupt stream)."""
    import time
    from gpuxfer.integrations.vllm.channel import message
    port, got, stop = _slow_peer(1)
    c = SideChannelClient("127.0.0.1", port, 30.0)
    c._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    assert c.handshake() == (b"{}", b"m")
    big = ["x" * 500] * 16000
    c.notify("done", big)
    for i in range(200):
        c.notify("release", [f"r{i}"])
    time.sleep(0.2)
    t0 = time.monotonic()
    c.close()
    assert time.monotonic() - t0 < 30                   # (bounded: about 2 s at most, besides the machine)
    time.sleep(0.3)
    stop.set()
    sent = _messages("done", big) + b"".join(message({"op": "release", "reqs": [f"r{i}"]}) for i in range(200))
    assert len(got) > 12 and bytes(got) == sent[:len(got)]


def test_a_late_flush_does_not_wait_for_a_full_socket():
    """The engine thread's flush of a message a starved sender left sends what the socket takes and returns; the
    rest goes later, whole and once."""
    import time
    go = threading.Event()
    port, got, stop = _slow_peer(1 << 16, go)
    c = SideChannelClient("127.0.0.1", port, 30.0)
    c._wake = _Starved()
    c._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    assert c.handshake() == (b"{}", b"m")
    big = ["y" * 500] * 40000                            # 20 MB
    c.notify("done", big)
    time.sleep(c.LATE_S)
    c.flush_late(time.monotonic())
    assert not got          # it returned with the reader reading nothing yet: a blocking send would wait for it
    go.set()
    deadline = time.monotonic() + 60
    m = _messages("done", big)
    while len(got) < len(m) and time.monotonic() < deadline:
        c.flush_late(time.monotonic())
        time.sleep(0.001)
    stop.set()
    assert bytes(got) == m
    c.close()


def test_handshake_times_out_and_refused_connect_fails():
    """A prefill that accepts and never answers: the pumps raise TimeoutError after timeout_s; a port with
    no listener fails the handshake (a ConnectionError), never a hang."""
    import time
    mute = socket.create_server(("127.0.0.1", 0))
    shut = socket.socket()
    shut.bind(("127.0.0.1", 0))                          # bound, never listening: a connect is refused
    try:
        c = SideChannelClient("127.0.0.1", mute.getsockname()[1], 0.3)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            while time.monotonic() - t0 < 30:
                c.pump()
                time.sleep(0.01)
        assert time.monotonic() - t0 >= 0.3 and not c.alive
        c.close()
        c = SideChannelClient("127.0.0.1", shut.getsockname()[1], 5.0)
        with pytest.raises(ConnectionError):
            c.handshake()
        c.close()
    finally:
        mute.close()
        shut.close()


def test_a_stranger_cannot_end_a_hold():
    """A connection that is no decode instance (it never said hello, and could not have read the params) sends a
    done naming a held request, without the hold's key or with another one: the prefill keeps the blocks, which
    a real reader may still be reading, and counts it; the reader's done, carrying the key from the params and the
    token of its granted claim, ends the hold, also where it came before the hold."""
    import time
    from gpuxfer.integrations.vllm import lease
    from gpuxfer.integrations.vllm.holds import PrefillHolds, make_key
    from gpuxfer.integrations.vllm.scheduler import SchedulerSide
    stats = {"sends_done": 0, "leases_expired": 0, "forged": 0}
    holds = PrefillHolds(engine_id="p", lease_s=120.0, stats=stats)
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), timeout_s=5.0, claim=holds.claims.claim)

    def drive(want: set, wait_s: float) -> set:
        freed, end = set(), time.monotonic() + wait_s
        while time.monotonic() < end and freed != want:
            holds.drain(srv, time.monotonic())
            freed |= holds.finished(lease.now())
            time.sleep(0.01)
        return freed

    try:
        import types
        side = SchedulerSide(engine_id="p", block_sizes=[16], lease_s=120.0, endpoints=[("127.0.0.1", srv.port)])
        req = types.SimpleNamespace(request_id="cmpl-1", kv_transfer_params={"do_remote_decode": True},
                                    status=types.SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
        held, params = side.request_finished(req, ([3, 4],))
        holds.secret = side.secret
        key = parse_remote_prefill(params, [16]).key
        assert held and len(key) == 24 and side.build_payload()["holds"]["cmpl-1"][1] == key
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(message({"op": "done", "reqs": ["early"], "keys": ["0" * 16]}))
        holds.hold({"cmpl-1": side_hold(side, params), "early": (lease.now() + 120, key)})
        s.sendall(message({"op": "done", "reqs": ["cmpl-1"]}) +
                  message({"op": "release", "reqs": ["cmpl-1"], "keys": ["f" * 16]}))
        assert drive({"cmpl-1"}, 1.0) == set() and stats["forged"] == 3
        c = SideChannelClient("127.0.0.1", srv.port, 5.0)
        c.handshake()
        c.claim(["cmpl-1"], [key], ["t1"])
        c.notify("done", ["cmpl-1"], [key], ["t1"])
        assert drive({"cmpl-1"}, 5.0) == {"cmpl-1"}
        late = make_key(side.secret, "late")
        c.claim(["late"], [late], ["t1"])
        c.notify("done", ["late"], [late], ["t1"])
        assert drive({"late"}, 0.3) == set()
        holds.hold({"late": (lease.now() + 120, late)})     # its word came before the hold, with its key
        assert drive({"late"}, 5.0) == {"late"}
        s.close()
        c.close()
    finally:
        srv.close()


def test_forged_words_before_a_hold_cannot_crowd_out_the_readers():
    """Many done messages with keys of their own (each a kind of word the prefill would keep) name a request before
    its hold reaches the worker, then its reader's done, with the key from the params: once the worker has the
    engine's secret, each forged word is refused as it comes, so the reader's is kept and ends the hold as it
    comes; words of another request's key, or with none, are refused too."""
    import types
    from gpuxfer.integrations.vllm import lease
    from gpuxfer.integrations.vllm.holds import EARLY_KINDS, PrefillHolds
    from gpuxfer.integrations.vllm.scheduler import SchedulerSide

    class Srv:
        events = queue.SimpleQueue()

        def pump(self):
            pass

    side = SchedulerSide(engine_id="p", block_sizes=[16], lease_s=120.0, endpoints=[("127.0.0.1", 1)])
    keys = {}
    for rid in ("cmpl-1", "cmpl-2"):
        req = types.SimpleNamespace(request_id=rid, kv_transfer_params={"do_remote_decode": True},
                                    status=types.SimpleNamespace(name="FINISHED_STOPPED"))
        keys[rid] = parse_remote_prefill(side.request_finished(req, ([3, 4],))[1], [16]).key
    payload = side.build_payload()
    stats = {"sends_done": 0, "leases_expired": 0, "forged": 0}
    holds, srv = PrefillHolds(engine_id="p", lease_s=120.0, stats=stats), Srv()
    holds.secret = payload["secret"]
    forged = [f"{i:08x}" + "0" * 16 for i in range(4 * EARLY_KINDS)] + [keys["cmpl-2"], None, keys["cmpl-1"][:-1]]
    for k in forged:
        srv.events.put(("done", "cmpl-1", 1, k, None))
    assert holds.claims.claim("cmpl-1", keys["cmpl-1"], "t1") is True
    srv.events.put(("done", "cmpl-1", 1, keys["cmpl-1"], "t1"))
    holds.drain(srv, 1.0)
    assert stats["forged"] == len(forged)
    holds.hold({"cmpl-1": payload["holds"]["cmpl-1"]})
    assert holds.finished(lease.now()) == {"cmpl-1"} and stats["sends_done"] == 1


def side_hold(side, params) -> tuple:
    """The ``(deadline, key)`` a prefill worker holds a request's blocks by, as the scheduler side made it."""
    return params["lease_deadline"], params["remote_key"]


def test_words_of_hostile_requests_and_keys_are_refused_on_the_engine_thread():
    """Done messages naming a request ID with a lone surrogate (valid JSON off the side channel) or carrying keys
    of the wrong length, non-ASCII or huge, for requests not held once the worker has the engine's secret: each is
    counted as forged and nothing raises out of ``drain``; a reader's word with its key is still kept."""
    import json
    from gpuxfer.integrations.vllm import lease
    from gpuxfer.integrations.vllm.holds import PrefillHolds, make_key

    class Srv:
        events = queue.SimpleQueue()

        def pump(self):
            pass

    stats = {"sends_done": 0, "leases_expired": 0, "forged": 0}
    holds, srv = PrefillHolds(engine_id="p", lease_s=120.0, stats=stats), Srv()
    holds.secret = b"s" * 16
    lone = json.loads('"cmpl-\\ud800"')
    hostile = [(lone, "0" * 24), ("cmpl-1", "\u00e9" * 24), ("cmpl-1", "0" * 23), ("cmpl-1", "0" * 64),
               ("cmpl-1", None), ("cmpl-1", "0" * 24)]
    for req, k in hostile:
        srv.events.put(("done", req, 1, k, None))
    key = make_key(holds.secret, lone)
    assert holds.claims.claim(lone, key, "t1") is True
    srv.events.put(("done", lone, 1, key, "t1"))
    holds.drain(srv, 1.0)
    assert stats["forged"] == len(hostile)
    holds.hold({lone: (lease.now() + 120, key)})
    assert holds.finished(lease.now()) == {lone} and stats["sends_done"] == 1


def test_a_message_naming_no_request_goes_on_the_wire_and_the_prefill_ignores_it():
    """``notify`` of no request sends one message naming none (a decode worker probes a connection with it: a dead
    one fails the send); a prefill takes it as nothing to do and keeps the connection."""
    import time
    port, got, stop = _slow_peer(1 << 16)
    c = SideChannelClient("127.0.0.1", port, 5.0)
    assert c.handshake() == (b"{}", b"m")
    assert c.notify("release", []) and c.notify("done", ["a"])
    want = message({"op": "release", "reqs": []}) + message({"op": "done", "reqs": ["a"]})
    for _ in range(500):
        if len(got) >= len(want):
            break
        time.sleep(0.01)
    stop.set()
    c.close()
    assert bytes(got) == want
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"meta"), timeout_s=5.0)
    try:
        c = SideChannelClient("127.0.0.1", srv.port, 5.0)
        c.handshake()
        assert c.notify("release", []) and c.notify("done", ["b"])
        assert srv.events.get(timeout=5) == ("done", "b", 1, None, None) and srv.events.empty() and c.alive
        c.close()
    finally:
        srv.close()
