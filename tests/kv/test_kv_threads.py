"""KVAgent's public calls raced from several threads: close against every call that may be in progress (posts,
prepare, add_peer, register_group, warm_up, close itself, the waits), remove_peer against post_many and a
handle's wait, register_group against prepare, KVPeer.notify from several threads, and handles dropped or used
after close. Every call ends in success or a typed gpuxfer error, never a signal (each case that could end in
one runs in a spawned child whose exit code is asserted), never a hang (every join is bounded), and nothing is
freed while queued work can touch it.

The interleavings are forced with events and hooks (a user mapping whose lookups wait, a wrapped step of the
agent), not with sleeps; a hook that a correct lock keeps out waits a bounded time and goes on.
"""
from __future__ import annotations

import gc
import threading
from collections.abc import Mapping

import pytest
import torch

from gpuxfer.errors import BadInput, GpuxferError, NotRegistered, TransferTimeout
from gpuxfer.kv.agent import KVAgent

from test_kv_lifetime import BLOCKS, BT, _Caches, _host, _pair, _run_child

#: how long a hook that a correct lock keeps out waits before it goes on (never reached without the lock)
HOOK_S = 3.0


class _Blocks(Mapping):
    """``{group: block IDs}`` whose ``in`` calls ``hook()`` first: a request mapping that lets a test run
    another call in the middle of the agent's reading of it."""

    def __init__(self, ids: dict, hook):
        self.ids, self.hook = ids, hook

    def __getitem__(self, k):
        return self.ids[k]

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)

    def __contains__(self, k):
        self.hook()
        return k in self.ids


class _Layers(Mapping):
    """``{layer name: tensor}`` whose ``items()`` calls ``hook()`` first."""

    def __init__(self, layers: dict, hook):
        self.layers, self.hook = layers, hook

    def __getitem__(self, k):
        return self.layers[k]

    def __iter__(self):
        return iter(self.layers)

    def __len__(self):
        return len(self.layers)

    def items(self):
        self.hook()
        return self.layers.items()


def _thread(fn, *args, **kw) -> tuple[threading.Thread, dict]:
    """``fn(*args, **kw)`` in a started daemon thread: (the thread, ``{"result": ...}`` or ``{"error": exception}``)."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args, **kw)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            out["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _joined(t: threading.Thread, timeout: float = 120.0) -> None:
    t.join(timeout)
    assert not t.is_alive(), "a thread did not finish: a hang"


def _typed_or_none(out: dict) -> None:
    """The thread ended in success or a typed gpuxfer error."""
    err = out.get("error")
    assert err is None or isinstance(err, GpuxferError), repr(err)


def _gate(plat, s, gate: threading.Event) -> None:
    """Hold ``s``'s later work until ``gate`` is set (or HOOK_S passed)."""
    plat.launch(s, lambda: gate.wait(HOOK_S))


# ----------------------------------------------------------------------------- close against other calls


def _close_twice():
    """Two closes at once: the second returns only once the agent is closed -- its posted work drained, its peers
    closed -- since its caller may then free the memory that work reads."""
    plat = _host()
    pre, dec, c0, c1, p_of_dec, _ = _pair(plat)
    s = plat.create_stream(1)
    gate = threading.Event()
    _gate(plat, s, gate)
    h = dec.prepare(p_of_dec, "pull", local_blocks={"g": [1]}, remote_blocks={"g": [2]}).post(s)
    draining = threading.Event()
    real = dec._lifetime.drained

    def drained():
        draining.set()
        return real()
    dec._lifetime.drained = drained
    first, out1 = _thread(dec.close)
    assert draining.wait(60)

    def second():
        dec.close()
        return plat.event_query(h.event), p_of_dec.closed
    t2, out2 = _thread(second)
    _joined(t2)
    _joined(first)
    gate.set()
    assert "error" not in out1 and "error" not in out2, (out1, out2)
    assert out2["result"] == (True, True), "the second close returned before the agent was closed"
    assert torch.equal(c1.t[1], c0.t[2])
    s.close()
    pre.close()
    plat.close()
    return True


def test_a_second_close_returns_once_the_agent_is_closed(spawner):
    assert _run_child(spawner, _close_twice)


def _add_peer_against_close():
    """add_peer while close runs: it raises BadInput, and the peer it made is closed (so the other agent of this
    process frees its flag words once closed, not kept by a peer nobody closes)."""
    plat = _host()
    c0, c1 = _Caches(plat, 0, 1), _Caches(plat, 1, 2)
    pre = KVAgent("prefill", platform=plat, device=0, timeout_s=30)
    dec = KVAgent("decode", platform=plat, device=1, timeout_s=30)
    pre.register_group("g", BT, [c0.t])
    dec.register_group("g", BT, [c1.t])
    blob = pre.metadata()
    inside, closed = threading.Event(), threading.Event()
    real = dec._peering.warm

    def warm(peer):
        inside.set()
        assert closed.wait(60)
        return real(peer)
    dec._peering.warm = warm
    t, out = _thread(dec.add_peer, blob)
    assert inside.wait(60)
    dec.close()
    closed.set()
    _joined(t)
    assert isinstance(out.get("error"), BadInput) and "closed" in str(out["error"]), out
    flags = pre.flags
    pre.close()
    assert flags.closed, "the other agent's flag words are held by a peer of a closed agent"
    plat.close()
    return True


def test_add_peer_racing_close_leaves_no_peer(spawner):
    assert _run_child(spawner, _add_peer_against_close)


def _prepare_against_close():
    """prepare while close runs (between its look at the groups and the route's build): a typed error."""
    plat = _host()
    pre, dec, c0, c1, p_of_dec, _ = _pair(plat)
    closed = threading.Event()
    local = _Blocks({"g": [0]}, lambda: closed.wait(60))
    t, out = _thread(lambda: dec.prepare(p_of_dec, "pull", local_blocks=local, remote_blocks={"g": [1]},
                                         layers=(0, 1)))
    dec.close()
    closed.set()
    _joined(t)
    assert isinstance(out.get("error"), GpuxferError), out
    pre.close()
    plat.close()
    return True


def test_prepare_racing_close_raises_a_typed_error(spawner):
    assert _run_child(spawner, _prepare_against_close)


def test_register_group_racing_close_is_refused():
    plat = _host()
    a = KVAgent("a", platform=plat, device=0, timeout_s=30)
    c = _Caches(plat, 0, 1)
    closed = threading.Event()
    try:
        t, out = _thread(a.register_group, "g", BT, _Layers({"l0": c.t}, lambda: closed.wait(60)))
        a.close()
        closed.set()
        _joined(t)
        assert isinstance(out.get("error"), BadInput) and "closed" in str(out["error"]), out
        assert a.groups == {}
    finally:
        a.close()
        plat.close()


def _waits_against_close():
    """close while other threads wait: a handle's wait (its transfer queued behind a gate), wait_notification
    (bounded by its timeout) and prepare/post in a loop; then the handle's wait() and done() on the closed
    agent. Every call ends in success or a typed error."""
    plat = _host()
    pre, dec, c0, c1, p_of_dec, _ = _pair(plat, timeout_s=10)
    s = plat.create_stream(1)
    gate = threading.Event()
    _gate(plat, s, gate)
    h = dec.prepare(p_of_dec, "pull", local_blocks={"g": [3]}, remote_blocks={"g": [4]}, notify_slot=2).post(s)
    waiter, w_out = _thread(h.wait, 30)
    notified, n_out = _thread(dec.wait_notification, 5, 1, 2.0)
    go = threading.Event()

    def posts():
        go.set()
        n = 0
        for i in range(200):
            try:
                dec.prepare(p_of_dec, "pull", local_blocks={"g": [5]}, remote_blocks={"g": [i % BLOCKS]}).post()
                n += 1
            except GpuxferError:
                return n
        return n
    poster, p_out = _thread(posts)
    assert go.wait(60)
    closer, c_out = _thread(dec.close)
    gate.set()
    for t in (closer, waiter, notified, poster):
        _joined(t)
    for out in (w_out, n_out, p_out, c_out):
        _typed_or_none(out)
    assert isinstance(n_out.get("error"), TransferTimeout), n_out
    assert torch.equal(c1.t[3], c0.t[4])
    h.wait(5)                            # on a closed agent: its transfer completed
    assert h.done()
    s.close()
    pre.close()
    plat.close()
    return True


def test_close_against_waits_and_posts(spawner):
    assert _run_child(spawner, _waits_against_close)


def _warm_up_against_close():
    """warm_up from one thread while another closes the agent: warm_up ends in success or a typed error, and its
    mirror agent is closed either way."""
    from gpuxfer.kv.peers import _LOCAL_AGENTS
    plat = _host()
    a = KVAgent("a", platform=plat, device=0, timeout_s=30)
    c = _Caches(plat, 0, 1)
    a.register_group("g", BT, [c.t])
    first = threading.Event()

    def warm():
        n = 0
        while True:
            try:
                a.warm_up(0)
            except GpuxferError:
                return n
            n += 1
            first.set()
    t, out = _thread(warm)
    assert first.wait(120)
    a.close()
    _joined(t)
    _typed_or_none(out)
    assert out["result"] >= 1
    assert not [r for r in _LOCAL_AGENTS.values() if r.name.endswith("~warm")], "a mirror agent stayed open"
    plat.close()
    return True


def test_warm_up_racing_close(spawner):
    assert _run_child(spawner, _warm_up_against_close)


# ----------------------------------------------------------------------------- registration against requests


def _register_against_prepare():
    """register_group in the middle of a prepare's look at the registered groups: the prepare succeeds (and its
    transfer moves the right bytes), the group is registered."""
    plat = _host()
    pre, dec, c0, c1, p_of_dec, _ = _pair(plat)
    extra = _Caches(plat, 1, 3)
    inside, registered = threading.Event(), threading.Event()

    def hook():
        inside.set()
        assert registered.wait(60)
    local = _Blocks({"g": [6]}, hook)
    t, out = _thread(lambda: dec.prepare(p_of_dec, "pull", local_blocks=local, remote_blocks={"g": [0]},
                                         layers=(0, 1)))
    assert inside.wait(60)
    dec.register_group("h", BT, [extra.t])
    registered.set()
    _joined(t)
    assert "error" not in out, out
    out["result"].post().wait(30)
    assert torch.equal(c1.t[6], c0.t[0])
    assert set(dec.groups) == {"g", "h"}
    dec.close()
    pre.close()
    plat.close()
    return True


def test_register_group_racing_prepare(spawner):
    assert _run_child(spawner, _register_against_prepare)


def test_add_peer_of_the_same_metadata_from_two_threads():
    """Two add_peers of one metadata, both past the first check at once: one peer is added, the other call raises
    BadInput and its peer is closed."""
    plat = _host()
    pre, dec, c0, c1, _, p_of_pre = _pair(plat)
    try:
        dec.remove_peer("prefill")
        both = threading.Barrier(2, timeout=60)
        real = dec._peering.warm

        def warm(peer):
            both.wait()
            return real(peer)
        dec._peering.warm = warm
        blob = pre.metadata()
        (t1, o1), (t2, o2) = _thread(dec.add_peer, blob), _thread(dec.add_peer, blob)
        _joined(t1)
        _joined(t2)
        won = [o["result"] for o in (o1, o2) if "result" in o]
        lost = [o["error"] for o in (o1, o2) if "error" in o]
        assert len(won) == 1 and len(lost) == 1 and isinstance(lost[0], BadInput), (o1, o2)
        assert dec.peer("prefill") is won[0]
        del dec._peering.warm
        dec.prepare(won[0], "pull", local_blocks={"g": [2]}, remote_blocks={"g": [3]}).post().wait(30)
        assert torch.equal(c1.t[2], c0.t[3])
    finally:
        dec.close()
        pre.close()
        plat.close()


# ----------------------------------------------------------------------------- remove_peer against posts and waits


def _remove_against_post_many_and_wait():
    """remove_peer while post_many runs (the post lock keeps it out until the batch is queued) and while another
    thread waits on a handle: the batch's bytes land, the waiter returns, the removal waits for both."""
    plat = _host()
    pre, dec, c0, c1, p_of_dec, _ = _pair(plat)
    s = plat.create_stream(1)
    gate = threading.Event()
    _gate(plat, s, gate)
    xs = [dec.prepare(p_of_dec, "pull", local_blocks={"g": [d]}, remote_blocks={"g": [d + 4]}) for d in range(3)]
    waiting = threading.Event()
    real = dec._poster.check_usable
    calls = []

    def check(peer):
        calls.append(peer)
        if len(calls) == 1:
            waiting.set()
            gate.wait(HOOK_S)           # remove_peer would take the peer out here without the post lock
        return real(peer)
    dec._poster.check_usable = check
    poster, p_out = _thread(dec.post_many, xs, s)
    assert waiting.wait(60)
    remover, r_out = _thread(dec.remove_peer, "prefill")
    gate.set()
    _joined(poster)
    handles = p_out.get("result") or getattr(p_out.get("error"), "handles", [])
    waiters = [_thread(h.wait, 30) for h in handles if h is not None]
    _joined(remover)
    for t, out in waiters:
        _joined(t)
        _typed_or_none(out)
    _typed_or_none(p_out)
    assert "error" not in r_out, r_out
    for d, h in enumerate(handles):
        if h is not None:
            assert plat.event_query(h.event) and torch.equal(c1.t[d], c0.t[d + 4])
    del dec._poster.check_usable
    try:
        xs[0].post()
    except NotRegistered:
        pass
    else:
        raise AssertionError("a post to a removed peer was queued")
    s.close()
    dec.close()
    pre.close()
    plat.close()
    return True


def test_remove_peer_racing_post_many_and_wait(spawner):
    assert _run_child(spawner, _remove_against_post_many_and_wait)


def _dropped_handle():
    """A handle and its transfer dropped (collected) while the post is queued: the request array is not given
    back for another request to overwrite before the post ran; both requests move their own blocks."""
    plat = _host()
    pre, dec, c0, c1, p_of_dec, _ = _pair(plat, engine="triton")
    s = plat.create_stream(1)
    gate = threading.Event()
    _gate(plat, s, gate)
    dec.prepare(p_of_dec, "pull", local_blocks={"g": [1]}, remote_blocks={"g": [2]}).post(s)
    gc.collect()
    other = dec.prepare(p_of_dec, "pull", local_blocks={"g": [5]}, remote_blocks={"g": [7]})
    gate.set()
    assert plat.synchronize(s, 60)
    other.post(s).wait(60)
    assert torch.equal(c1.t[1], c0.t[2]) and torch.equal(c1.t[5], c0.t[7])
    s.close()
    dec.close()
    pre.close()
    plat.close()
    return True


def test_a_dropped_handle_keeps_its_request_until_it_ran(spawner):
    assert _run_child(spawner, _dropped_handle)


# ----------------------------------------------------------------------------- KVPeer.notify from threads


def _notify_from_two_threads():
    """Two threads call KVPeer.notify on one slot at once (forced into the same step): each value is written once,
    the word ends at the number of notifications."""
    plat = _host()
    pre, dec, c0, c1, p_of_dec, _ = _pair(plat)
    both = threading.Barrier(2, timeout=HOOK_S)
    real = p_of_dec.flags.signal

    def signal(*a, **kw):
        try:
            both.wait()                  # a second notify inside at the same time: only without the post lock
        except threading.BrokenBarrierError:
            pass
        return real(*a, **kw)
    p_of_dec.flags.signal = signal
    streams = [plat.create_stream(1) for _ in range(2)]
    runs = [_thread(p_of_dec.notify, st, 0) for st in streams]
    for t, out in runs:
        _joined(t)
        assert "error" not in out, out
    values = sorted(out["result"][0] for _, out in runs)
    for _, out in runs:
        assert plat.event_wait(out["result"][1], 30)
    assert values == [1, 2], values
    assert pre.wait_notification(0, 2, timeout_s=30) == 2
    for st in streams:
        st.close()
    dec.close()
    pre.close()
    plat.close()
    return True


def test_peer_notify_from_two_threads_writes_each_value_once(spawner):
    assert _run_child(spawner, _notify_from_two_threads)


def _notify_then_close():
    """A notification queued by KVPeer.notify on the caller's stream is drained by close before the peer's flag
    link is closed; after close and after remove_peer, notify raises a typed error having queued nothing."""
    plat = _host()
    pre, dec, c0, c1, p_of_dec, p_of_pre = _pair(plat)
    s = plat.create_stream(1)
    gate = threading.Event()
    _gate(plat, s, gate)
    value, event = p_of_dec.notify(s, 4)
    dec.close()
    assert plat.event_query(event), "close returned before a queued notification ran"
    assert pre.notification(4) == value == 1
    gate.set()
    for what, peer, st in (("closed", p_of_dec, s), ("removed", p_of_pre, plat.create_stream(0))):
        if what == "removed":
            pre.remove_peer(peer)
        try:
            peer.notify(st, 0)
        except (NotRegistered, BadInput):
            pass
        else:
            raise AssertionError(f"notify to a {what} peer did not raise")
        st.close()
    for bad in ("stream", None):
        try:
            p_of_dec.notify(bad, 0)
        except BadInput:
            pass
        else:
            raise AssertionError("notify on something other than a stream did not raise BadInput")
    pre.close()
    plat.close()
    return True


def test_close_drains_a_peer_notify(spawner):
    assert _run_child(spawner, _notify_then_close)


# ----------------------------------------------------------------------------- the NIXL route (the fake NIXL)


def _nixl_agent(host, buf, r):
    a = KVAgent(f"n{r}", platform=host, device=r, timeout_s=5.0, remote="nixl")
    a.register_group("g", BT, {"l0": host.as_tensor(buf)[:BLOCKS * 256].view(BLOCKS, 256)})
    return a


def test_nixl_add_peer_racing_close_and_notify_raise_typed_errors(fake_nixl, host, monkeypatch):
    """add_peer over the NIXL route overtaken by close (past its choice of route) and KVPeer.notify to a NIXL peer
    (notified by its transfers' notify_slot): typed errors."""
    from gpuxfer.kv import nixl_route
    bufs = [host.alloc(1 << 14, r) for r in (0, 1)]
    agents = [_nixl_agent(host, b, r) for r, b in enumerate(bufs)]
    s = host.create_stream(0)
    try:
        peer = agents[0].add_peer(agents[1].metadata(), route="nixl")
        with pytest.raises(BadInput, match="notify_slot"):
            peer.notify(s, 0)
        agents[0].remove_peer(peer)
        inside, closed = threading.Event(), threading.Event()
        real = nixl_route.choose_route

        def choose(*a):
            route = real(*a)
            inside.set()
            assert closed.wait(60)
            return route
        monkeypatch.setattr(nixl_route, "choose_route", choose)
        t, out = _thread(agents[0].add_peer, agents[1].metadata(), route="nixl")
        assert inside.wait(60)
        agents[0].close()
        closed.set()
        _joined(t)
        assert isinstance(out.get("error"), GpuxferError), out
    finally:
        s.close()
        for a in agents:
            a.close()
        for b in bufs:
            b.close()
