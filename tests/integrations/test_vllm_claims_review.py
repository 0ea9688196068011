"""Claims on the side channel, reviewed (no vLLM): what a prefill that leaves claims unanswered, or a peer that sends
claims and never reads the answers, can make the other end keep."""
from __future__ import annotations

import socket
import time

from gpuxfer.integrations.vllm import channel, client
from gpuxfer.integrations.vllm.channel import SideChannelClient, SideChannelServer, message
from gpuxfer.integrations.vllm.holds import ClaimBook, make_key
from test_vllm_claims import fake_prefill

SECRET = b"s" * 16


def _until(cond, wait_s: float = 10.0) -> bool:
    end = time.monotonic() + wait_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_claims_a_prefill_leaves_unanswered_are_bounded(monkeypatch):
    """A prefill end that takes claim messages and answers none (hung, or hostile): the decode worker keeps each
    message's requests until its answer, so past MAX_ASKED unanswered the connection ends (its loads fail) rather
    than keep them without bound."""
    monkeypatch.setattr(client, "MAX_ASKED", 4)
    lst, c, conn = fake_prefill()
    try:
        for i in range(4):
            assert c.claim([f"r{i}"], ["k"], ["t"])
        assert _until(lambda: len(c._asked) == 4 and not c.outbox)
        assert c.alive
        c.claim(["r4"], ["k"], ["t"])
        assert _until(lambda: not c.alive)
        assert len(c._asked) <= 4 and "unanswered" in c.closed_reason
    finally:
        c.close()
        conn.close()
        lst.close()


def test_answers_to_claims_a_peer_never_reads_are_bounded():
    """A peer that sends claim messages (no key needed: each is answered, refused) and never reads the answers: once
    more than MAX_UNSENT bytes of them are waiting past what the socket takes, its connection closes, long before
    the answer timeout; another peer's claims are answered meanwhile."""
    book = ClaimBook()
    book.secret = SECRET
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), 120.0, claim=book.claim)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", srv.port))
    good = SideChannelClient("127.0.0.1", srv.port, 5.0)
    claims = b"".join(message({"op": "claim", "id": i, "reqs": [], "keys": [], "tokens": []}) for i in range(20000))
    most = [0]

    def biggest() -> int:
        most[0] = max([most[0]] + [len(c.outbuf) for c in list(srv._conns.values())])
        return most[0]
    try:
        good.handshake()
        s.sendall(message({"op": "hello"}))
        s.settimeout(60)
        closed = False
        for _ in range(50):         # up to a million claims, ~45 MB of answers
            try:
                s.sendall(claims)
            except OSError:
                closed = True
                break
            biggest()
        assert closed or _until(lambda: len(srv._conns) == 1, 30)
        assert biggest() <= channel.MAX_UNSENT + channel.MAX_MESSAGE
        key = make_key(SECRET, "r")
        good.claim(["r"], [key], ["d1"])
        assert _until(lambda: (good.read_answers(), good.answers.get(("r", "d1")))[1] is True) and good.alive
    finally:
        s.close()
        good.close()
        srv.close()


def test_a_request_held_again_refuses_claims_of_its_earlier_params():
    """A request ID held a second time (vLLM with its request ID randomization turned off): params of the first hold
    still within their lease carry a key as authentic as the new one's, and their blocks may hold other KV now, so a
    claim with them stays refused (the new hold's claims are refused too: its readers recompute)."""
    import queue

    from gpuxfer.integrations.vllm.holds import PrefillHolds
    from gpuxfer.integrations.vllm.lease import now

    class _Events:
        events = queue.SimpleQueue()

        def pump(self) -> None:
            return
    holds, srv = PrefillHolds(engine_id="p", lease_s=120.0, stats={"sends_done": 0, "leases_expired": 0,
                                                                     "forged": 0}), _Events()
    holds.secret = SECRET
    old = make_key(SECRET, "r")
    holds.hold({"r": (now() + 120, old)})
    assert holds.claims.claim("r", old, "a") is True
    srv.events.put(("done", "r", 1, old, "a"))
    holds.drain(srv, time.monotonic())
    assert holds.finished(now()) == {"r"}
    new = make_key(SECRET, "r")
    holds.hold({"r": (now() + 120, new)})
    assert holds.claims.claim("r", old, "b") is False
    assert holds.claims.claim("r", new, "c") is False
