"""Claims on the side channel (no vLLM): a prefill request is read by one decode instance. The prefill grants the
first claim on a request and refuses the others, counts a done or release only with the granted claim's token (a
release also where no claim came, which then refuses later claims), answers claims from whichever thread pumps the
server and only once it knows the engine's secret; hostile claim messages close their connection alone. A decode
load reports loaded only once its read completed and its claim was granted."""
from __future__ import annotations

import queue
import socket
import time

import pytest

from gpuxfer.integrations.vllm import channel
from gpuxfer.integrations.vllm.channel import SideChannelClient, SideChannelServer, message
from gpuxfer.integrations.vllm.holds import ClaimBook, PrefillHolds, make_key
from gpuxfer.integrations.vllm.lease import now
from test_vllm_worker_polls import _in_flight, _worker

SECRET = b"s" * 16


class _Events:
    """A side channel server as the holds see it: the events a test puts."""

    def __init__(self):
        self.events = queue.SimpleQueue()

    def pump(self) -> None:
        return


def _holds(*reqs: str) -> tuple[PrefillHolds, _Events, dict, dict]:
    stats = {"sends_done": 0, "leases_expired": 0, "forged": 0}
    holds = PrefillHolds(engine_id="p", lease_s=120.0, stats=stats)
    holds.secret = SECRET
    keys = {r: make_key(SECRET, r) for r in reqs}
    holds.hold({r: (now() + 120, k) for r, k in keys.items()})
    return holds, _Events(), stats, keys


def _step(holds: PrefillHolds, srv: _Events) -> set:
    holds.drain(srv, time.monotonic())
    return holds.finished(now())


def test_the_first_claim_is_granted_and_every_other_refused():
    book = ClaimBook()
    key = make_key(SECRET, "r")
    assert book.claim("r", key, "t1") is None           # the secret not known yet: no answer
    book.secret = SECRET
    assert book.claim("r", key, "t1") is True
    assert book.claim("r", key, "t1") is True           # another rank of the same instance
    assert book.claim("r", key, "t2") is False          # another instance
    assert book.claim("r", make_key(SECRET, "other"), "t1") is False     # a key not made for the request
    assert book.claim("r", "0" * 24, "t1") is False and book.claim("r", None, "t1") is False
    book.end(["r"], time.monotonic())
    assert book.claim("r", key, "t1") is False          # its hold ended: the blocks may hold other KV now
    assert book.take_counts() == (2, 5) and book.take_counts() == (0, 0)


def test_a_done_or_release_counts_only_with_the_granted_token():
    """Decode D1 claimed the request; D2, handed the same params, sends a done and a release with its own token:
    both ignored (counted as forged), the hold stays until D1's done."""
    holds, srv, stats, keys = _holds("r")
    assert holds.claims.claim("r", keys["r"], "d1") is True
    srv.events.put(("done", "r", 1, keys["r"], "d2"))
    srv.events.put(("release", "r", 1, keys["r"], "d2"))
    srv.events.put(("done", "r", 1, keys["r"], None))
    assert _step(holds, srv) == set() and stats["forged"] == 3
    srv.events.put(("done", "r", 1, keys["r"], "d1"))
    assert _step(holds, srv) == {"r"} and stats["sends_done"] == 1
    assert holds.claims.claim("r", keys["r"], "d1") is False        # ended


def test_a_release_with_no_claim_frees_the_blocks_and_refuses_later_claims():
    """D2 had nothing to load and released the request before any claim: the prefill frees the blocks, and D1's
    claim that comes later is refused (D1 recomputes rather than read freed blocks). A done with no claim before it
    does not count."""
    holds, srv, stats, keys = _holds("r", "s")
    srv.events.put(("done", "s", 1, keys["s"], "d1"))
    srv.events.put(("release", "r", 1, keys["r"], "d2"))
    assert _step(holds, srv) == {"r"} and stats["forged"] == 1
    assert holds.claims.claim("r", keys["r"], "d1") is False
    assert holds.claims.claim("s", keys["s"], "d1") is True


def test_a_release_of_the_claims_owner_counts_and_of_its_other_ranks_too():
    """Several decode ranks of one instance (one token) share a prefill rank's heads: the blocks go once each
    released, whatever came first."""
    holds, srv, stats, keys = _holds("r")
    srv.events.put(("release", "r", 2, keys["r"], "d1"))
    assert _step(holds, srv) == set()
    assert holds.claims.claim("r", keys["r"], "d1") is True         # its own release: still its request
    srv.events.put(("release", "r", 2, keys["r"], "d1"))
    assert _step(holds, srv) == {"r"} and stats["forged"] == 0


def test_early_words_count_by_the_claims_decided_when_the_hold_comes():
    """Words that came before the hold are decided when it comes: D2's release before the hold, D1's claim granted
    meanwhile: the release does not count, D1's done does."""
    stats = {"sends_done": 0, "leases_expired": 0, "forged": 0}
    holds, srv = PrefillHolds(engine_id="p", lease_s=120.0, stats=stats), _Events()
    holds.secret = SECRET
    key = make_key(SECRET, "r")
    srv.events.put(("release", "r", 1, key, "d2"))
    assert _step(holds, srv) == set()
    assert holds.claims.claim("r", key, "d1") is True
    holds.hold({"r": (now() + 120, key)})
    assert _step(holds, srv) == set() and stats["forged"] == 1
    srv.events.put(("done", "r", 1, key, "d1"))
    assert _step(holds, srv) == {"r"}


def _answer(c: SideChannelClient, req: str, wait_s: float = 5.0):
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        c.read_answers()
        hit = [claim for claim in c.answers if claim[0] == req]     # (request, token)
        if hit:
            return c.answers.pop(hit[0])
        time.sleep(0.01)
    return None


def test_claims_are_answered_by_the_server_thread_while_the_engine_is_idle():
    """Nobody pumps the server (an idle prefill engine): its own thread answers the claims, granted to the first
    instance and refused to the second."""
    book = ClaimBook()
    book.secret = SECRET
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), 5.0, claim=book.claim)
    c1, c2 = SideChannelClient("127.0.0.1", srv.port, 5.0), SideChannelClient("127.0.0.1", srv.port, 5.0)
    try:
        c1.handshake()
        c2.handshake()
        key = make_key(SECRET, "r")
        assert c1.claim(["r"], [key], ["d1"])
        assert _answer(c1, "r") is True
        assert c2.claim(["r", "x"], [key, key], ["d2", "d2"])
        assert _answer(c2, "r") is False and _answer(c2, "x") is False
        assert c1.alive and c2.alive
    finally:
        c1.close()
        c2.close()
        srv.close()


def test_a_claim_before_the_secret_is_answered_once_it_is_known():
    book = ClaimBook()
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), 5.0, claim=book.claim)
    c = SideChannelClient("127.0.0.1", srv.port, 5.0)
    try:
        c.handshake()
        key = make_key(SECRET, "r")
        c.claim(["r"], [key], ["d1"])
        for _ in range(20):
            srv.pump()
            time.sleep(0.01)
        assert _answer(c, "r", 0.3) is None              # not granted without the key checked
        book.secret = SECRET
        assert _answer(c, "r") is True
    finally:
        c.close()
        srv.close()


def _closed(s: socket.socket, wait_s: float = 5.0) -> bool:
    s.settimeout(wait_s)
    try:
        while True:
            data = s.recv(1 << 16)
            if not data:
                return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("claim", [
    {"id": 1, "reqs": ["r"], "keys": ["k"], "tokens": ["t" * (channel.MAX_TOKEN + 1)]},     # a token too long
    {"id": 1, "reqs": ["r"], "keys": ["k"], "tokens": [""]},
    {"id": 1, "reqs": ["r"], "keys": ["k"], "tokens": ["\u00e9"]},
    {"id": 1, "reqs": ["r"], "keys": ["k"]},                                                # no token
    {"id": 1, "reqs": ["r"], "tokens": ["t"]},                                              # no key
    {"id": 1, "reqs": ["r", "s"], "keys": ["k"], "tokens": ["t", "t"]},
    {"id": -1, "reqs": ["r"], "keys": ["k"], "tokens": ["t"]},
    {"id": 1 << 60, "reqs": ["r"], "keys": ["k"], "tokens": ["t"]},
    {"id": "1", "reqs": ["r"], "keys": ["k"], "tokens": ["t"]},
    {"id": 1, "reqs": ["r"], "keys": ["k"], "tokens": ["t"], "of": 2},                      # a field it has not
    {"id": 1, "reqs": ["r" * (channel.MAX_REQUEST_ID + 1)], "keys": ["k"], "tokens": ["t"]},
    {"id": 1, "reqs": [f"r{i}" for i in range(channel.MAX_IDS_PER_MESSAGE + 1)],
     "keys": ["k"] * (channel.MAX_IDS_PER_MESSAGE + 1), "tokens": ["t"] * (channel.MAX_IDS_PER_MESSAGE + 1)},
    None,                                                                                   # a claim before hello
])
def test_a_hostile_claim_closes_its_connection_alone(claim):
    book = ClaimBook()
    book.secret = SECRET
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), 5.0, claim=book.claim)
    good = SideChannelClient("127.0.0.1", srv.port, 5.0)
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    try:
        good.handshake()
        if claim is None:
            s.sendall(message({"op": "claim", "id": 1, "reqs": ["r"], "keys": ["k"], "tokens": ["t"]}))
        else:
            s.sendall(message({"op": "hello"}) + message(dict(claim, op="claim")))
        assert _closed(s)
        key = make_key(SECRET, "r")
        good.claim(["r"], [key], ["d1"])
        assert _answer(good, "r") is True and good.alive
    finally:
        s.close()
        good.close()
        srv.close()


def test_claims_waiting_for_the_secret_are_bounded():
    """Claim messages before the secret is known wait, at most MAX_DEFERRED of them across the server's connections:
    the connection sending one more closes; those of a closed connection no longer count."""
    book = ClaimBook()
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), 5.0, claim=book.claim)
    a, b = (socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(2))
    claim = [message({"op": "claim", "id": i, "reqs": ["r"], "keys": ["k"], "tokens": ["t"]})
             for i in range(channel.MAX_DEFERRED)]
    try:
        a.sendall(message({"op": "hello"}) + b"".join(claim))
        assert not _closed(a, 0.5)
        b.sendall(message({"op": "hello"}) + claim[0])
        assert _closed(b)
        a.close()
        end = time.monotonic() + 5
        while len(srv._conns) > 0 and time.monotonic() < end:     # (the server saw a and b end)
            time.sleep(0.01)
        c = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        c.sendall(message({"op": "hello"}) + b"".join(claim))
        assert not _closed(c, 0.5)
        c.close()
    finally:
        a.close()
        b.close()
        srv.close()


def fake_prefill():
    """A listener standing in for a prefill worker and a client handshaken with it: ``(listener, client, the
    prefill end's socket)``, the test's to send answers on."""
    lst = socket.create_server(("127.0.0.1", 0))
    c = SideChannelClient("127.0.0.1", lst.getsockname()[1], 5.0)
    conn, _ = lst.accept()
    conn.sendall(channel.frame(b"{}") + channel.frame(b"m") + channel.frame(b"\0" * 8))
    c.handshake()
    return lst, c, conn


def test_a_client_given_what_is_not_an_answer_to_its_claims_closes():
    """A prefill end that sends an answer to no claim this end sent, or of another length: the connection ends
    (its loads fail) rather than take it."""
    lst, c, conn = fake_prefill()
    try:
        conn.sendall(message({"op": "claimed", "id": 7, "granted": "1"}))
        end = time.monotonic() + 5
        while c.alive and time.monotonic() < end:
            c.read_answers()
            time.sleep(0.01)
        assert not c.alive and not c.answers
    finally:
        c.close()
        conn.close()
        lst.close()


def test_a_load_reports_loaded_only_once_its_claim_is_granted():
    """The read completed first: the load waits for the grant; then it is reported and its done carries its
    token."""
    w = _worker()
    r, sts = _in_flight(w, 2, now() + 60)
    r.client.answers = {}
    for st in sts:
        st.handle.finished = True
    assert w.poll() == (set(), set(), set()) and r.client.sent == []
    r.client.answers[("p0", None)] = True
    assert w.poll() == (set(), {"d0"}, set())
    assert r.client.sent == [("done", ["p0"])]
    r.client.answers[("p1", None)] = True
    assert w.poll() == (set(), {"d1"}, set())


def test_a_refused_or_unanswered_claim_fails_its_load_and_sends_nothing():
    """A refused claim (another decode instance reads the request, or released it): the load fails, its blocks are
    load errors (vLLM recomputes), and neither a done nor a release goes (neither would count). A claim with no answer
    within the timeout fails the load too."""
    w = _worker()
    r, sts = _in_flight(w, 2, now() + 60)
    r.client.answers = {("p0", None): False}
    for st in sts:
        st.handle.finished = True
    assert w.poll() == (set(), {"d0"}, {"d0"})
    assert r.client.sent == [] and w.take_load_errors() == {10, 11}
    sts[1].t_post = time.perf_counter() - w.settings.handshake_timeout_s - 1
    assert w.poll() == (set(), {"d1"}, {"d1"})
    assert w.take_load_errors() == {12, 13}
    assert [op for op, _ in r.client.sent] == ["release"]      # (it may have been granted: it reads no more)


def test_a_load_whose_connection_died_before_the_answer_fails():
    w = _worker()
    r, sts = _in_flight(w, 1, now() + 60)
    r.client.answers = {}
    sts[0].handle.finished = True
    assert w.poll() == (set(), set(), set())
    r.client.alive, r.client.closed_reason = False, "closed"
    assert w.poll() == (set(), {"d0"}, {"d0"})


def test_an_answer_a_failed_load_left_is_not_taken_by_a_later_load_of_the_request():
    """A claim on request "r" with token "old" is granted, but its load failed before taking the answer (it timed
    out), so the answer stays with the client. A later load of a request with the same ID (vLLM's request-ID
    randomization off) and its own token must wait for its own claim's answer: the old grant is another claim's."""
    import dataclasses
    book = ClaimBook()
    book.secret = SECRET
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), 5.0, claim=book.claim)
    c = SideChannelClient("127.0.0.1", srv.port, 5.0)
    try:
        c.handshake()
        assert c.claim(["r"], [make_key(SECRET, "r")], ["old"])
        end = time.monotonic() + 5
        while not c.answers and time.monotonic() < end:
            c.read_answers()
            time.sleep(0.01)
        assert list(c.answers.values()) == [True]           # granted, left behind
        w = _worker()
        r, sts = _in_flight(w, 1, now() + 60)
        r.client = c
        st = sts[0]
        st.load = dataclasses.replace(st.load, remote=dataclasses.replace(st.load.remote, request_id="r",
                                                                          token="new"))
        st.handle.finished = True
        assert w.poll() == (set(), set(), set())           # its own claim not answered yet: not reported loaded
        assert not st.granted
    finally:
        c.close()
        srv.close()
