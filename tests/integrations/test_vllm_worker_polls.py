"""The vLLM connector's worker-side bookkeeping without an agent or vLLM: a poll asks only the oldest read in
flight (O(1) when nothing finished), reports reads in order with one done message per engine, fails a read seen
complete past its lease; the prefill's holds end on the decode side's word or at their lease, found without a
scan; a handle that raises fails its loads alone (a read of several refused by the device check goes again with
host IDs); a gone engine is forgotten once no load names it; the one-group ID check's shortcut for rising
block IDs (a fresh allocator's) against the reference; and a prefill on another host: its reads (the NIXL
route) reported in any order, a late one never given up before NIXL ends it, its lease deadlines read through
the clock bound its handshake carries."""
from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from gpuxfer.errors import BlockIdError, GpuxferError
from gpuxfer.integrations.vllm.lease import SAME_HOST, now
from gpuxfer.integrations.vllm.params import RemotePrefill, seal_key, seal_of
from gpuxfer.integrations.vllm.loads import Load, _LoadState, _Remote
from gpuxfer.integrations.vllm.worker import Settings, WorkerSide
from gpuxfer.kv.ids import _RouteIds


#: the seal key of the fake prefill engines here (their handshake's ``seal_key``, hex)
SEAL_KEY = seal_key(b"fake prefill engine secret")


def _sealed(rp: RemotePrefill, key: bytes = SEAL_KEY) -> RemotePrefill:
    """``rp`` with the seal its prefill engine (seal key ``key``) made for it."""
    import dataclasses
    return dataclasses.replace(rp, seal=seal_of(rp, key))


class _Handle:
    def __init__(self, error: Exception | None = None):
        self.finished, self.asked, self.error = False, 0, error

    def done(self) -> bool:
        self.asked += 1
        if self.finished and self.error is not None:
            raise self.error
        return self.finished


class _Granted(dict):
    """A prefill's answers to claims that grant every claim, asked for or not."""

    def pop(self, key, default=None):
        return super().pop(key, True)


class _Client:
    alive, closed_reason = True, None
    outbox, claimed = (), False          # (a real client's queue: nothing to flush)

    def __init__(self):
        self.sent = []
        self.answers = _Granted()

    def notify(self, op, reqs, keys=None, tokens=None) -> bool:
        self.sent.append((op, list(reqs)))
        return True

    def claim(self, reqs, keys, tokens) -> bool:
        return True

    def read_answers(self) -> None:
        return

    def flush_late(self, now) -> None:
        return

    def close(self) -> None:
        self.alive = False


class _Server:
    def __init__(self):
        self.events = queue.SimpleQueue()
        self.pumps = 0

    def pump(self) -> None:
        self.pumps += 1


def _worker() -> WorkerSide:
    return WorkerSide(engine_id="d", model="m", dtype="auto/float16", layout=None,
                      groups=[("FullAttentionSpec", 16, ["l0"])],
                      settings=Settings(lease_s=60, host="127.0.0.1", port=0, handshake_timeout_s=5, token_major=True))


def _in_flight(w: WorkerSide, n: int, deadline: float, *, clock=None, timeout_s: float = 60.0):
    """``n`` reads in flight from one prefill engine: on the IPC route (its deadlines on this clock), or with
    ``clock`` (its lease clock read on this one) on the NIXL route, whose reads end in any order."""
    import types
    nixl = clock is not None
    e = "q" if nixl else "p"
    w.decode.agent = types.SimpleNamespace(timeout_s=timeout_s)
    r = _Remote(("127.0.0.1", 2 if nixl else 1, e), state="ready", client=_Client(), ordered=not nixl,
                clock=clock or SAME_HOST, seal_key=SEAL_KEY)
    w.decode.remotes[r.key] = r
    sts = []
    for i in range(n):
        rp = RemotePrefill(e, "127.0.0.1", r.key[1], f"{e}{i}", (np.arange(1, 3),), (16,), deadline)
        # (posted: its seal checked out, as staging.pair_load does first)
        load = Load(f"{'n' if nixl else 'd'}{i}", rp, (np.arange(10 + 2 * i, 12 + 2 * i),), 0, 31, sealed=SEAL_KEY)
        st = _LoadState(load, 0.0, remote=r, handle=_Handle(), t_post=time.perf_counter())
        w.decode.pending[st.key] = st
        (w.decode.unordered if nixl else w.decode.inflight).append(st)
        r.inflight += 1
        r.loads += 1
        sts.append(st)
    return r, sts


def test_a_poll_asks_only_the_oldest_read_in_flight():
    w = _worker()
    r, sts = _in_flight(w, 64, now() + 60)
    for _ in range(3):
        assert w.poll() == (set(), set(), set())
    assert sts[0].handle.asked == 3 and not any(st.handle.asked for st in sts[1:])
    for st in sts[:10]:
        st.handle.finished = True
    sts[20].handle.finished = True              # done behind one that is not: reported once that one is
    assert w.poll() == (set(), {f"d{i}" for i in range(10)}, set())
    assert sts[10].handle.asked == 1 and sts[11].handle.asked == 0
    assert r.client.sent == [("done", [f"p{i}" for i in range(10)])]      # one message for the step's reads
    assert r.inflight == 54 and len(w.decode.pending) == 54 and w.decode.inflight[0] is sts[10]
    for st in sts[10:]:
        st.handle.finished = True
    assert w.poll()[1] == {f"d{i}" for i in range(10, 64)}
    assert not w.decode.pending and not w.decode.inflight and r.inflight == 0
    assert w.take_stats()["transfers"] == 64


def test_a_read_seen_complete_after_its_lease_fails():
    w = _worker()
    r, sts = _in_flight(w, 2, now() - 1)
    sts[0].handle.finished = True
    assert w.poll() == (set(), {"d0"}, {"d0"})
    assert r.client.sent == [("release", ["p0"])]
    assert w.take_load_errors() == {10, 11}
    assert list(w.decode.pending) == [("d1", 0)]


def test_holds_end_on_the_decode_sides_word_or_at_their_lease():
    w = _worker()
    w.server = srv = _Server()
    t = now()
    srv.events.put(("done", "early", 1, None, None))           # read before its hold reached this worker
    assert w.poll()[0] == set()
    w.hold({"early": (t + 60, None), "late": (t + 60, None), "short": (t - 1, None), "again": (t - 1, None)})
    w.hold({"again": (t + 60, None)})                 # held again: the first deadline no longer ends it
    assert w.poll()[0] == {"early", "short"}
    assert w.poll()[0] == set()
    srv.events.put(("release", "late", 1, None, None))
    srv.events.put(("done", "unknown", 1, None, None))
    assert w.poll()[0] == {"late"}
    assert w.prefill.held == {"again": t + 60} and "unknown" in w.prefill.early
    st = w.take_stats()
    assert st["sends_done"] == 2 and st["leases_expired"] == 1


def test_a_hold_read_by_several_decode_ranks_ends_once_every_one_said_so():
    """Two decode ranks read shares of this rank's heads (each message: "of" 2): a request goes at the second
    word, whether the words came before or after its hold, a release among them; a message naming more readers
    than another keeps the request for the most; the lease still ends a request whose readers went quiet."""
    w = _worker()
    w.server = srv = _Server()
    t = now()
    srv.events.put(("done", "early", 2, None, None))
    srv.events.put(("done", "early", 2, None, None))        # both readers, before the hold
    srv.events.put(("done", "half", 2, None, None))
    assert w.poll()[0] == set()
    w.hold({"early": (t + 60, None), "half": (t + 60, None), "split": (t + 60, None), "more": (t + 60, None),
            "quiet": (t - 1, None)})
    assert w.poll()[0] == {"early", "quiet"}
    srv.events.put(("release", "split", 2, None, None))
    srv.events.put(("done", "more", 2, None, None))
    srv.events.put(("done", "more", 4, None, None))
    assert w.poll()[0] == set()
    srv.events.put(("done", "half", 2, None, None))
    srv.events.put(("done", "split", 2, None, None))
    srv.events.put(("done", "more", 4, None, None))
    assert w.poll()[0] == {"half", "split"}
    srv.events.put(("done", "more", 4, None, None))
    assert w.poll()[0] == {"more"}
    assert not w.prefill.held and not w.prefill.heard
    st = w.take_stats()
    assert st["sends_done"] == 4 and st["leases_expired"] == 1


def test_a_decode_rank_sharing_a_prefill_rank_says_so_in_each_message(monkeypatch):
    """Rank 1 of a decode of TP 2 handshakes with a prefill of TP 1 (four heads where it holds two): its client
    learns that two decode ranks read that prefill rank before any message, so the release that follows a
    failed mapping names both readers; the peer is added seen through heads 2 and 3."""
    import types
    from gpuxfer.integrations.vllm import engines as engines_mod
    from gpuxfer.integrations.vllm.handshake import encode_info, engine_info

    def group(heads):
        return {"kind": "FullAttentionSpec", "block_size": 16, "kernel_tokens": 16, "token_major": True,
                "layers": ["l0"], "bytes_per_token": heads * 256, "pieces": heads, "content": [heads, 128],
                "kv_heads": heads}

    remote = engine_info(engine_id="p", model="m", dtype="auto/float16", layout=None, groups=[group(4)], tp=(0, 1))
    remote["seal_key"] = SEAL_KEY.hex()

    class Client(_Client):
        readers = 1

        def __init__(self, *a):
            super().__init__()

        def pump(self):
            return encode_info(remote), b"meta"

        def notify(self, op, reqs, keys=None, tokens=None) -> bool:
            self.sent.append((op, list(reqs), self.readers))
            return True

    added = []

    def add_peer(meta, route=None, pieces=None, local_pieces=None):
        added.append(pieces)
        raise GpuxferError("no mapping here")

    monkeypatch.setattr(engines_mod, "SideChannelClient", Client)
    w = WorkerSide(engine_id="d", model="m", dtype="auto/float16", layout=None,
                   groups=[("FullAttentionSpec", 16, ["l0"])],
                   settings=Settings(lease_s=60, host="127.0.0.1", port=0, handshake_timeout_s=5, token_major=True),
                   tp=(1, 2))
    local = engine_info(engine_id="d", model="m", dtype="auto/float16", layout=None, groups=[group(2)], tp=(1, 2))
    w.decode.bind(types.SimpleNamespace(timeout_s=60.0, peers={}, add_peer=add_peer), local, [16], [512], None)
    rp = _sealed(RemotePrefill("p", "127.0.0.1", 1, "p0", (np.arange(1, 3),), (16,), now() + 60))
    w.start_loads([Load("d0", rp, (np.array([7, 8]),), 0, 31)])
    (r,) = w.decode.remotes.values()
    assert added == [{"g0": (2, 4)}] and r.state == "failed"
    assert r.client.sent == [("release", ["p0"], 2)]


def _two_part_load(ordered: bool):
    """A decode of TP 1 reading a prefill of TP 2: one load, a read in flight from each prefill rank (on one
    stream, reported in post order, or ``ordered`` False: in any order)."""
    import types
    w = _worker()
    w.decode.agent = types.SimpleNamespace(timeout_s=60.0)
    ranks = [_Remote(("127.0.0.1", port, "p"), state="ready", client=_Client(), ordered=ordered, seal_key=SEAL_KEY)
             for port in (1, 2)]
    for r in ranks:
        w.decode.remotes[r.key] = r
    rp = RemotePrefill("p", "127.0.0.1", 1, "p0", (np.arange(1, 3),), (16,), now() + 60,
                       (("127.0.0.1", 1), ("127.0.0.1", 2)))
    load = Load("d0", rp, (np.array([7, 8]),), 0, 31, sealed=SEAL_KEY)        # (posted: its seal checked out)
    w.decode._parts["d0"] = [2, False]
    sts = []
    for part, r in enumerate(ranks):
        st = _LoadState(load, 0.0, remote=r, handle=_Handle(), t_post=time.perf_counter(), part=part)
        w.decode.pending[st.key] = st
        (w.decode.inflight if ordered else w.decode.unordered).append(st)
        r.inflight += 1
        r.loads += 1
        sts.append(st)
    return w, ranks, sts


@pytest.mark.parametrize("ordered", [True, False])
def test_a_load_read_from_two_prefill_ranks_ends_once_both_reads_did(ordered):
    """A decode of TP 1 reads a prefill of TP 2 (one read per prefill rank). One read failing is not reported
    while the other may still write the blocks: the load fails, its blocks reported as load errors, only once
    that read ended too (the failed one second in post order on one stream, or first where reads end in any
    order); each prefill rank hears of its own read (done, release)."""
    w, ranks, sts = _two_part_load(ordered)
    bad, good = (sts[1], sts[0]) if ordered else (sts[0], sts[1])
    bad.handle.error = BlockIdError("refused on the device") if ordered else GpuxferError("NIXL said no")
    bad.handle.finished = True
    assert w.poll() == (set(), set(), set())
    assert w.take_load_errors() == set()
    good.handle.finished = True
    assert w.poll() == (set(), {"d0"}, {"d0"})
    assert w.take_load_errors() == {7, 8}
    assert [r.client.sent for r in ranks] == ([[("done", ["p0"])], [("release", ["p0"])]] if ordered else
                                              [[("release", ["p0"])], [("done", ["p0"])]])
    assert not w.decode.pending and not w.decode._parts


def _reference_one(sort_by_dst: bool, s: np.ndarray, d: np.ndarray):
    if np.unique(d).size != d.size:
        raise AssertionError("repeated destination")
    order = np.argsort(d if sort_by_dst else s, kind="stable")
    return s[order], d[order]


@pytest.mark.parametrize("sort_by_dst", [False, True])
@pytest.mark.parametrize("push", [False, True])
def test_rising_block_ids_order_and_refuse_as_the_reference(sort_by_dst, push):
    ids = _RouteIds(("g0",), [(1 << 16, 1 << 16)], [(1, 1)], [[0]], sort_by_dst)
    rng = np.random.default_rng(5)
    for case in range(120):
        n = int(rng.integers(2, 600))
        rising = np.sort(rng.choice(1 << 16, n, replace=False)).astype(np.int64)
        other = rng.permutation(1 << 16)[:n].astype(np.int64)
        mine, theirs = [(rising, rising + 0), (rising, other), (other, rising), (rising[::-1].copy(), rising)][case % 4]
        s, d = (mine, theirs) if push else (theirs, mine)
        if case % 8 >= 4:                       # a repeated destination: rising no more, refused
            d[n // 2] = d[n // 2 - 1]
        checked = None
        try:
            want_s, want_d = _reference_one(sort_by_dst, s, d)
        except AssertionError:
            with pytest.raises(BlockIdError, match="appears more than once"):
                ids.check("r", push, {"g0": mine}, {"g0": theirs})
            continue
        checked = ids.check("r", push, {"g0": mine}, {"g0": theirs})
        out_s, out_d = np.empty(n, np.int64), np.empty(n, np.int64)
        ids.write(checked[3], out_s, out_d)
        assert np.array_equal(out_s, want_s) and np.array_equal(out_d, want_d)


def test_a_read_whose_handle_raises_fails_its_loads_alone():
    """A handle raising (a failed copy, the device check of a read of one load) fails that load; the poll goes on to
    the next."""
    from gpuxfer.errors import GpuxferError
    w = _worker()
    r, sts = _in_flight(w, 3, now() + 60)
    sts[0].handle = _Handle(GpuxferError("the copy failed"))
    sts[1].handle = _Handle(BlockIdError("request 'd1': a destination block named twice"))
    for st in sts:
        st.handle.finished = True
    assert w.poll() == (set(), {"d0", "d1", "d2"}, {"d0", "d1"})
    assert w.take_load_errors() == {10, 11, 12, 13}
    assert r.client.sent == [("release", ["p0"]), ("release", ["p1"]), ("done", ["p2"])]
    assert r.loads == 0 and r.inflight == 0


def test_a_read_of_several_refused_on_the_device_goes_again_with_host_ids():
    """The loads of a read that failed the device check are not failed: each is posted again alone, with host IDs
    (the host check then names the one at fault)."""
    w = _worker()
    r, sts = _in_flight(w, 3, now() + 60)
    shared = _Handle(BlockIdError("request 'd0 and 1 more': checked on the device"))
    for st in sts[:2]:
        st.handle, st.together, st.device_ids = shared, 2, True
    shared.finished = sts[2].handle.finished = True
    posted = []
    w.decode._post = lambda ready, blocking: posted.append([st.load.req_id for st in ready])
    assert w.poll() == (set(), {"d2"}, set())
    assert posted == [["d0", "d1"]] and all(st.host_ids and st.together == 1 for st in sts[:2])
    assert set(w.decode.waiting) == {("d0", 0), ("d1", 0)} and r.inflight == 0 and r.loads == 2


def test_a_poll_asks_the_handle_of_a_read_of_several_loads_once():
    """The loads posted in one read share its handle: a poll asks it once for all of them (the engine thread's
    calls), and reports every one of them; a read not done yet holds them, and the loads after them, back."""
    w = _worker()
    r, sts = _in_flight(w, 5, now() + 60)
    shared = _Handle()
    for st in sts[:4]:
        st.handle, st.together, st.device_ids = shared, 4, True
    assert w.poll() == (set(), set(), set())
    assert shared.asked == 1 and sts[4].handle.asked == 0
    shared.finished = sts[4].handle.finished = True
    assert w.poll() == (set(), {f"d{i}" for i in range(5)}, set())
    assert shared.asked == 2 and sts[4].handle.asked == 1


def test_a_gone_engine_is_forgotten_once_no_load_names_it():
    """The reap counts an engine's loads (no scan of the loads in flight): a gone engine with a load not reported
    stays; once that load is reported, it goes."""
    w = _worker()
    r, sts = _in_flight(w, 2, now() + 60)
    r.client.alive = False
    sts[0].handle.finished = True
    w.poll()
    assert r.key in w.decode.remotes and r.loads == 1
    sts[1].handle.finished = True
    w.poll()
    assert r.key not in w.decode.remotes and r.loads == 0


def test_the_engine_thread_serves_the_side_channel_only_while_it_holds_requests():
    """A worker holding nothing (a decode instance) leaves the side channel to the server's thread: its polls make
    no socket call, yet take what that thread queued; while requests are held, each poll serves the channel."""
    w = _worker()
    w.server = srv = _Server()
    srv.events.put(("done", "early", 1, None, None))
    for _ in range(3):
        w.poll()
    assert srv.pumps == 0 and w.prefill.early.keys() == {"early"}
    w.hold({"held": (now() + 60, None)})
    w.poll()
    w.poll()
    assert srv.pumps == 2
    srv.events.put(("done", "held", 1, None, None))
    assert w.poll()[0] == {"held"}
    w.poll()
    assert srv.pumps == 3


def test_nixl_reads_end_in_any_order_and_a_late_one_is_never_given_up(caplog):
    """A NIXL read cannot be recalled: one past the agent's timeout is logged once and stays in flight until NIXL
    ends it; then it is reported (done, or failed when NIXL says so)."""
    from gpuxfer.errors import GpuxferError
    w = _worker()
    r, sts = _in_flight(w, 4, now() + 60, clock=SAME_HOST, timeout_s=0.2)
    sts[2].handle.finished = True               # the third ends first: reported at once
    assert w.poll() == (set(), {"n2"}, set())
    assert [st.load.req_id for st in w.decode.unordered] == ["n0", "n1", "n3"]
    sts[0].handle.finished = sts[3].handle.finished = True
    time.sleep(0.25)                            # n1 is past the agent's timeout
    with caplog.at_level("WARNING", logger="gpuxfer.vllm"):
        assert w.poll() == (set(), {"n0", "n3"}, set())
        assert w.poll() == (set(), set(), set())
    assert w.decode.unordered == [sts[1]] and r.inflight == 1
    assert sum("still running" in m for m in caplog.messages) == 1        # logged once
    sts[1].handle.finished, sts[1].handle.error = True, GpuxferError("NIXL: ERR")
    assert w.poll() == (set(), {"n1"}, {"n1"})  # failed once NIXL said so
    assert not w.decode.unordered and r.inflight == 0
    assert w.take_load_errors() == {12, 13}


def test_a_lease_on_another_hosts_clock_is_read_through_the_handshake_bound():
    """The prefill's clock runs 5000 s ahead of this one: its deadlines compared as they are would never run out.
    Through :class:`PeerClock` a read seen complete before the deadline loads and one after it fails."""
    import math
    from gpuxfer.integrations.vllm.lease import MARGIN, RATE_BOUND, PeerClock
    t = now()
    clock = PeerClock(sent=t - 0.01, peer=t + 5000.0, same=False)       # answered 10 ms after the hello left
    assert clock.deadline(t + 5060.0) == pytest.approx(t - 0.01 + 60.0 - RATE_BOUND * 60.0 - MARGIN)
    assert PeerClock().deadline(123.0) == 123.0
    assert math.isnan(PeerClock(sent=t, peer=-1.7e308, same=False).deadline(1.7e308))   # counts as run out
    w = _worker()
    _, live = _in_flight(w, 1, t + 5060.0, clock=clock)           # 60 s left on the prefill's clock
    live[0].handle.finished = True
    assert w.poll() == (set(), {"n0"}, set())
    w = _worker()
    _, late = _in_flight(w, 1, t + 4999.0, clock=clock)           # ran out a second ago there
    late[0].handle.finished = True
    assert w.poll() == (set(), {"n0"}, {"n0"})
    w = _worker()
    _, forged = _in_flight(w, 1, 1.7e308, clock=PeerClock(sent=t, peer=-1.7e308, same=False))   # a forged clock frame
    forged[0].handle.finished = True
    assert w.poll() == (set(), {"n0"}, {"n0"})


def test_the_handshake_carries_the_prefills_clock_and_refuses_a_bad_one():
    import socket
    import struct
    import threading
    from gpuxfer.integrations.vllm.channel import ChannelClosed, SideChannelClient, SideChannelServer, frame
    from gpuxfer.integrations.vllm.lease import now
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), 5.0)
    try:
        before = now()
        c = SideChannelClient("127.0.0.1", srv.port, 5.0)
        assert c.handshake() == (b"{}", b"m")
        pc = c.peer_clock
        assert not pc.same and before <= pc.sent <= pc.peer <= now()     # one host: the same clock
        c.close()
    finally:
        srv.close()
    for clock in (struct.pack(">d", float("nan")), b"1234"):
        lst = socket.create_server(("127.0.0.1", 0))

        def answer(lst=lst, clock=clock):
            s, _ = lst.accept()
            s.recv(100)
            s.sendall(frame(b"{}") + frame(b"m") + frame(clock))
            time.sleep(0.5)
            s.close()
        threading.Thread(target=answer, daemon=True).start()
        c = SideChannelClient("127.0.0.1", lst.getsockname()[1], 5.0)
        with pytest.raises(ChannelClosed, match="clock"):
            c.handshake()
        assert not c.alive and c.peer_clock is None
        c.close()
        lst.close()


def test_a_decode_rank_talks_to_its_own_prefill_rank_and_a_load_naming_no_such_rank_fails_alone(caplog):
    """Rank 1 of 2: a release goes to the prefill's rank 1 (its endpoint in the params), or to rank 0 of a prefill
    of one rank (both decode ranks read shares of its heads); a load whose params name three ranks (a prefill
    size neither dividing this one's nor a multiple of it) fails at once, its blocks reported as load errors, the
    reason logged."""
    import types
    w = WorkerSide(engine_id="d", model="m", dtype="auto/float16", layout=None,
                   groups=[("FullAttentionSpec", 16, ["l0"])],
                   settings=Settings(lease_s=60, host="127.0.0.1", port=0, handshake_timeout_s=5, token_major=True),
                   tp=(1, 2))
    w.decode.agent = types.SimpleNamespace(timeout_s=60.0)
    ranks = [_Remote(("127.0.0.1", port, "p"), state="ready", client=_Client(), seal_key=SEAL_KEY)
             for port in (1, 2)]
    for r in ranks:
        w.decode.remotes[r.key] = r
    two = (("127.0.0.1", 1), ("127.0.0.1", 2))
    ids = (np.arange(1, 3),)
    w.release([_sealed(RemotePrefill("p", "127.0.0.1", 1, "p0", ids, (16,), now() + 60, two)),
               _sealed(RemotePrefill("p", "127.0.0.1", 1, "p1", ids, (16,), now() + 60))])
    assert ranks[0].client.sent == [("release", ["p1"])] and ranks[1].client.sent == [("release", ["p0"])]
    three = RemotePrefill("p", "127.0.0.1", 1, "p2", ids, (16,), now() + 60, two + (("127.0.0.1", 3),))
    w.start_loads([Load("d2", three, (np.array([7, 8]),), 0, 31)])
    _, recving, failed = w.poll()
    assert recving == failed == {"d2"}
    assert w.take_load_errors() == {7, 8}
    assert any("has no rank for decode rank 1 of 2" in m for m in caplog.messages)
    assert ranks[0].client.sent == [("release", ["p1"])] and ranks[1].client.sent == [("release", ["p0"])]
