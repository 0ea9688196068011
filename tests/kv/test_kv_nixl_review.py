"""The NIXL route under hostile orders of calls and completions, over the fake NIXL (tests/fake_nixl.py): NIXL
orders no transfer after another, so a fake that completes the later-posted transfer first is NIXL as it may
behave. Two agents in this process, host emulation."""
from __future__ import annotations

import pytest
import torch

from gpuxfer.errors import NotRegistered
from gpuxfer.kv import nixl_ffi
from gpuxfer.kv.agent import KVAgent
from test_kv_nixl_route import need_nixl  # noqa: F401 - the fixture: real NIXL, UCX over loopback

BT, BLOCKS = 4, 8


def _agent(host, buf, r):
    a = KVAgent(f"r{r}", platform=host, device=r, timeout_s=5.0, remote="nixl")
    a.register_group("g", BT, {"l0": host.as_tensor(buf)[:BLOCKS * 256].view(BLOCKS, 256)})
    return a


@pytest.fixture
def pair(fake_nixl, host):
    """Two NIXL-route agents over the fake NIXL, each with the other as its peer; ``(fake, agents, peers, bufs)``:
    agent r's block i holds bytes ``16 * r + i`` (a block's bytes name it)."""
    bufs = [host.alloc(1 << 14, r) for r in (0, 1)]
    for r, b in enumerate(bufs):
        t = host.as_tensor(b)[:BLOCKS * 256].view(BLOCKS, 256)
        for i in range(BLOCKS):
            t[i].fill_(16 * r + i)
    agents = [_agent(host, b, r) for r, b in enumerate(bufs)]
    peers = [agents[0].add_peer(agents[1].metadata(), route="nixl"),
             agents[1].add_peer(agents[0].metadata(), route="nixl")]
    yield fake_nixl, agents, peers, bufs
    for a in agents:
        a.close()
    for b in bufs:
        b.close()
    nixl_ffi._KEPT.clear()


def _block(host, buf, i: int) -> set:
    return set(host.as_tensor(buf)[i * 256:(i + 1) * 256].unique().tolist())


def _later_first(fake, agent, monkeypatch) -> list:
    """NIXL completing transfers out of their post order: ``agent``'s NIXL agent holds each posted transfer's copy
    until one is polled, then runs every held copy, the last posted first. The list of held transfers."""
    nx = fake.agents[agent.nixl.name]
    real_transfer, held = nx.transfer, []

    def transfer(h, notif_msg=b""):
        held.append(h)
        h.state = "PROC"
        return "PROC"

    def check(h):
        while held:
            real_transfer(held.pop())       # the copy, then DONE
        return h.state

    monkeypatch.setattr(nx, "transfer", transfer)
    monkeypatch.setattr(nx, "check_xfer_state", check)
    return held


# ----------------------------------------------------------------------------- post_many writing one destination


@pytest.mark.parametrize("op", ["pull", "push"])
def test_post_many_writing_one_destination_twice_lands_in_order(pair, host, monkeypatch, op):
    """Two requests of one post_many writing the same destination block: as on the IPC route, they run in the
    batch's order -- the destination ends with the second one's bytes, whatever order NIXL completes them in
    (both handles report done: the first's bytes left there would be success over other bytes than asked)."""
    fake, (a, b), (p, _), bufs = pair
    _later_first(fake, a, monkeypatch)
    if op == "pull":                    # b's blocks 1 then 2 into a's block 0
        xs = [a.prepare(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [s]}) for s in (1, 2)]
        dst, want = (bufs[0], 0), {16 + 2}
    else:                               # a's blocks 1 then 2 into b's block 0
        xs = [a.prepare(p, "push", local_blocks={"g": [s]}, remote_blocks={"g": [0]}) for s in (1, 2)]
        dst, want = (bufs[1], 0), {2}
    hs = a.post_many(xs)
    for h in hs:
        h.wait(5)
    assert _block(host, *dst) == want


def test_post_many_of_distinct_destinations_is_not_serialized(pair, host, monkeypatch):
    """Requests of one post_many writing distinct blocks (or the same block number on the two sides) are all posted
    before any is waited for: no request of a batch waits for another it does not overwrite."""
    fake, (a, b), (p, _), bufs = pair
    held = _later_first(fake, a, monkeypatch)
    xs = [a.prepare(p, "pull", local_blocks={"g": [d]}, remote_blocks={"g": [s]}) for d, s in ((0, 1), (3, 2))]
    xs.append(a.prepare(p, "push", local_blocks={"g": [5]}, remote_blocks={"g": [0]}))    # the peer's block 0
    hs = a.post_many(xs)
    assert len(held) == 3               # none completed: nothing was waited for
    for h in hs:
        h.wait(5)
    assert _block(host, bufs[0], 0) == {17} and _block(host, bufs[0], 3) == {18} and _block(host, bufs[1], 0) == {5}


# ----------------------------------------------------------------------------- the lists rebuilt while others post


def test_a_post_while_the_lists_are_rebuilt_stays_tracked(pair, host, monkeypatch):
    """A group registered after add_peer rebuilds the lists when a request names it, forgetting the completed
    transfers after; a post of another thread at that moment stays among the peer's transfers in flight (else
    remove_peer and close neither wait for it nor release it: its lists and NIXL agent dropped under it)."""
    import threading
    fake, (a, b), (p, _), bufs = pair
    fake.stuck = True                   # the posted transfer stays in flight
    lock, posted, threads = a._poster.lock, [], []

    def post():
        nonlocal p
        posted.append(a.transfer(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}, name="meanwhile"))

    class Over:                         # a completed transfer the rebuild forgets: another thread posts meanwhile
        def _settle(self, timeout_s):
            pass

        @property
        def _finished(self):
            if threads:                 # (the post's own reap reads it too)
                return True
            t = threading.Thread(target=post)
            t.start()
            threads.append(t)
            if not lock.locked():       # (else the post waits for the lock the rebuild holds)
                t.join(30)
            return True

    def group(r):
        return {"l1": host.as_tensor(bufs[r])[4096:4096 + BLOCKS * 256].view(BLOCKS, 256)}

    a.remove_peer(p)
    b.register_group("h", BT, group(1))
    p = a.add_peer(b.metadata(), route="nixl")
    a.register_group("h", BT, group(0))         # the lists hold "g" alone, the peer both
    p._inflight.append(Over())
    a.prepare(p, "pull", local_blocks={"h": [0]}, remote_blocks={"h": [1]})
    for t in threads:
        t.join(30)
    assert len(posted) == 1 and posted[0] in p._inflight
    monkeypatch.setattr(a, "timeout_s", 0.2)
    a.remove_peer(p)                    # waits for it (bounded), then releases it: its handle says so
    with pytest.raises(NotRegistered, match="'meanwhile': peer 'r1' was removed before it completed"):
        posted[0].wait(5)
    assert a.nixl.nixl._xfers == []


# ----------------------------------------------------------------------------- registrations racing metadata


def test_nixl_registering_while_a_group_is_registered_sees_whole_allocations(pair, host, monkeypatch):
    """NIXL's side registers the allocations listed so far while another thread's register_group lists a new one:
    it never sees the allocation without its base address (an IndexError out of metadata() or add_peer)."""
    fake, (a, b), _, bufs = pair
    reg, seen = a._registry, []

    class Allocs(list):
        def append(self, h):
            super().append(h)
            try:
                a.nixl.register()       # another thread's add_peer or metadata() at this point
                seen.append("ok")
            except Exception as exc:  # noqa: BLE001 - what the test looks for
                seen.append(exc)

    reg.allocs = Allocs(reg.allocs)
    extra = host.alloc(1 << 12, 0)
    try:
        a.register_group("h", BT, {"l1": host.as_tensor(extra)[:BLOCKS * 256].view(BLOCKS, 256)})
        assert seen == ["ok"]
        b.remove_peer(a.name)
        assert b.add_peer(a.metadata(), route="nixl") is not None
    finally:
        a.close()
        extra.close()


def test_metadata_taken_while_a_group_is_registered_is_metadata_a_peer_accepts(pair, host, monkeypatch):
    """register_group running while metadata() is taken: the NIXL section lists one base per allocation the
    metadata lists (never one more: a peer would refuse the agent's own metadata)."""
    from gpuxfer.kv.nixl_route import NixlSide
    fake, (a, b), _, bufs = pair
    extra = host.alloc(1 << 12, 0)
    real = NixlSide.metadata

    def metadata(self, *args):
        monkeypatch.setattr(NixlSide, "metadata", real)
        a.register_group("h", BT, {"l1": host.as_tensor(extra)[:BLOCKS * 256].view(BLOCKS, 256)})
        return real(self, *args)

    monkeypatch.setattr(NixlSide, "metadata", metadata)
    try:
        blob = a.metadata()
        b.remove_peer(a.name)
        assert b.add_peer(blob, route="nixl") is not None
    finally:
        a.close()
        extra.close()


# ----------------------------------------------------------------------------- remove_peer racing a lists rebuild


def _dlist_releases(fake, agent, monkeypatch) -> list:
    """Every prepped list ``agent``'s NIXL agent is asked to release, in order (a list released twice is
    listed twice: real NIXL frees it twice)."""
    nx = fake.agents[agent.nixl.name]
    real, asked = nx.release_dlist_handle, []

    def release(h):
        asked.append(h)
        real(h)

    monkeypatch.setattr(nx, "release_dlist_handle", release)
    return asked


def test_remove_peer_racing_a_lists_rebuild_releases_each_list_once(pair, host, monkeypatch):
    """remove_peer releasing the peer's lists while another thread's prepare rebuilds them (a group registered
    since): every prepped list is released exactly once -- never twice (a double free in NIXL), never left
    behind -- and the prepare ends in a typed error or moves nothing the removed peer would."""
    from gpuxfer.errors import GpuxferError
    from gpuxfer.kv.nixl_peer import NixlPeer
    fake, (a, b), (p, _), bufs = pair

    def group(r):
        return {"l1": host.as_tensor(bufs[r])[4096:4096 + BLOCKS * 256].view(BLOCKS, 256)}

    a.remove_peer(p)
    b.register_group("h", BT, group(1))
    p = a.add_peer(b.metadata(), route="nixl")
    a.register_group("h", BT, group(0))
    asked = _dlist_releases(fake, a, monkeypatch)
    real_drop, got, once = NixlPeer._drop_lists, [], []

    def drop(self, lists):
        if not once:                    # remove_peer's release of the lists: another thread rebuilds them now
            once.append(True)
            try:
                got.append(self.lists(("h",)))
            except GpuxferError as exc:
                got.append(exc)
        real_drop(self, lists)

    monkeypatch.setattr(NixlPeer, "_drop_lists", drop)
    a.remove_peer(p)
    assert len(got) == 1
    assert len(asked) == len({id(h) for h in asked}), "a prepped list was released twice"
    assert a.nixl.nixl._dlists == [], "a prepped list was left behind"



# ----------------------------------------------------------------------------- handles never waited on


def test_transfers_never_waited_on_are_released_as_they_complete(pair, host):
    """A caller that posts and never waits (the peer learns of the data by its notification): the route keeps
    a bounded number of transfers -- NIXL's handles of completed ones released as later posts find them done, as
    the IPC route drops completed posts -- not one NIXL transfer per post until remove_peer."""
    from gpuxfer.kv.posting import INFLIGHT_KEEP
    fake, (a, b), (p, _), bufs = pair
    for i in range(10 * INFLIGHT_KEEP):
        a.transfer(p, "pull", local_blocks={"g": [i % BLOCKS]}, remote_blocks={"g": [(i + 1) % BLOCKS]},
                   notify_slot=1)
    assert len(p._inflight) <= INFLIGHT_KEEP
    assert len(a.nixl.nixl._xfers) <= INFLIGHT_KEEP
    b.wait_notification(1, 10 * INFLIGHT_KEEP, timeout_s=5)


# ----------------------------------------------------------------------------- real NIXL: a peer dead before add_peer


def _published_then_dead(to_parent, from_parent):
    """Publish an agent's metadata, then, once it arrived, die without closing anything."""
    import os
    from test_kv_nixl_route import _setup
    plat, buf, agent, _ = _setup(0, "host")
    to_parent.put(agent.metadata())
    from_parent.get(timeout=120)
    os._exit(0)


def test_adding_a_peer_that_died_after_publishing_never_hangs(need_nixl, spawner, host):
    """Real NIXL over loopback: metadata of an agent whose process died before add_peer: add_peer and the first
    transfer each end within the agent's timeout -- done, or a typed error -- never a hang."""
    import threading
    from gpuxfer.errors import GpuxferError
    from test_kv_nixl_route import _caches
    q, back = spawner.queue(), spawner.queue()
    child = spawner.start(_published_then_dead, q, back, name="dead")
    blob = q.get(timeout=120)
    back.put("die")
    child.proc.join(60)
    assert child.proc.exitcode == 0
    buf = host.alloc(1 << 16, 1)
    agent = KVAgent("survivor", platform=host, device=1, timeout_s=5.0, remote="nixl")
    outcome = []

    def run():
        try:
            agent.register_group("full", 4, _caches(1, host.as_tensor(buf))["full"])
            peer = agent.add_peer(blob, route="nixl")
            outcome.append("added")
            agent.transfer(peer, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [1]}).wait(5)
            outcome.append("moved")
        except GpuxferError as exc:
            outcome.append(type(exc).__name__)
        except BaseException as exc:  # noqa: BLE001 - an untyped error is what the test looks for
            outcome.append(repr(exc))

    t = threading.Thread(target=run, daemon=True)
    try:
        t.start()
        t.join(120)
        assert not t.is_alive(), f"a dead peer hung the agent: {outcome}"
        assert outcome[-1] in ("NixlError", "TransferTimeout", "BadMetadata"), outcome
    finally:
        agent.close()
        buf.close()
