"""Folded posts (gpuxfer.kv.triton_transfer._Slot): on the agent's stream a post writes its request into a free
slot's host words and launches the slot's folded graph (upload, kernels, the sequence number copied back); its
handle reads that word to learn it completed. A slot whose last folded post has not landed is posted the other
way (an upload of the request's own array), so no queued upload reads host words written again; a checked
post's status survives the slot's next post."""
from __future__ import annotations

import pytest
import torch

from gpuxfer.errors import BlockIdError

from _agent_arena import same_bytes, triton_pair


@pytest.fixture
def fpair(platform):
    with triton_pair(platform, 12) as (dec, peer, src, dst, a1):
        one = {"full": [0]}
        dec.transfer(peer, "pull", local_blocks=one, remote_blocks=one).wait(60)      # makes the route's slot
        yield dec, peer, src, dst, a1


def _slot(agent):
    (slot,) = {id(s): s for r in agent._routes.routes.values() for s in r.slots}.values()
    return slot


def _gate(agent):
    """Hold the agent's stream until the returned ``open()`` is called."""
    plat = agent.platform
    gate = plat.alloc(64, agent.device)
    plat.host_write_flag(gate.ptr, 0, agent.device)        # (zeroed before the wait is queued: no race with open)
    plat.wait_flag(agent.stream, gate.ptr, 1)
    return gate, lambda: plat.host_write_flag(gate.ptr, 1, agent.device)


def _queries(agent, monkeypatch) -> list:
    seen = []
    query = agent.platform.event_query
    monkeypatch.setattr(agent.platform, "event_query", lambda e: seen.append(e) or query(e))
    return seen


def test_a_post_behind_a_queued_folded_one_uploads_its_own_array(fpair, monkeypatch):
    dec, peer, src, dst, arena = fpair
    if _slot(dec).folded is None:
        pytest.skip("this platform captures no graph: nothing is folded")
    gate, open_gate = _gate(dec)
    try:
        a = dec.prepare(peer, "pull", local_blocks={"full": [1, 2]}, remote_blocks={"full": [3, 4]}, name="a")
        b = dec.prepare(peer, "pull", local_blocks={"full": [5]}, remote_blocks={"full": [6]}, name="b")
        ha = a.post()
        assert ha._landed is not None and not ha._landed.landed()
        copies = []
        copy = dec._poster.calls.copy
        monkeypatch.setattr(dec._poster.calls, "copy", lambda d, s, n: copies.append(n) or copy(d, s, n))
        hb = b.post()                   # the slot's host words still wait for a's upload
        assert hb._landed is None and copies == [b._array.nbytes]
        assert not ha.done() and not hb.done()
    finally:
        open_gate()
    ha.wait(60)
    hb.wait(60)
    for k in src:                       # a's request was not overwritten by b's before its upload ran
        for s, d in ((3, 1), (4, 2), (6, 5)):
            assert same_bytes(dst[k][:, d], src[k][:, s]), (k, s, d)
    queries = _queries(dec, monkeypatch)
    assert ha.done() and queries == []              # the landed word answers, not the event
    slot = _slot(dec)
    slot.host[slot.entries + 1] = 0                 # a word that has not landed: "not yet" for a while after the
    ha._landed.until = float("inf")                 # post, without the event ...
    assert not ha.done() and queries == []
    ha._landed.until = 0.0                          # ... then the event answers
    assert ha.done() and len(queries) == 1
    gate.close()


def test_a_checked_posts_status_survives_the_slots_next_post(fpair):
    dec, peer, src, dst, arena = fpair
    dev = dec._torch_device()
    ids = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)     # noqa: E731
    snap = {k: v.clone() for k, v in dst.items()}
    bad = dec.prepare(peer, "pull", local_blocks={"full": ids([1, 99])}, remote_blocks={"full": ids([3, 4])},
                      name="bad", device_ids=True)
    hb = bad.post()
    with pytest.raises(BlockIdError, match="'bad'.*out of range"):
        hb.wait(60)
    assert all(same_bytes(dst[k], snap[k]) for k in dst)            # nothing moved
    good = dec.prepare(peer, "pull", local_blocks={"full": ids([7])}, remote_blocks={"full": ids([8])},
                       name="good", device_ids=True)
    hg = good.post()
    hg.wait(60)
    assert hg.done()
    with pytest.raises(BlockIdError, match="'bad'"):                  # its own status, not the slot's latest
        hb.done()
    for k in src:
        assert same_bytes(dst[k][:, 7], src[k][:, 8])
    slot = _slot(dec)
    if slot.checked.folded is not None:
        assert hg._landed is not None and hb._status.live is False
        slot.host[slot.entries + 2] = 1                 # a status word corrupted: the live handle reads it
        with pytest.raises(BlockIdError, match="'good'"):
            hg.done()


def test_completed_folded_posts_are_dropped_by_their_landed_words(fpair, monkeypatch):
    dec, peer, src, dst, arena = fpair
    if _slot(dec).folded is None:
        pytest.skip("this platform captures no graph: nothing is folded")
    for s, d in ((3, 1), (4, 2)):       # (each waited for: the next finds the slot's host words free)
        dec.prepare(peer, "pull", local_blocks={"full": [d]}, remote_blocks={"full": [s]}).post().wait(60)
    poster = dec._poster
    assert poster.inflight
    queries = _queries(dec, monkeypatch)
    with poster.lock:
        poster.reap()
    assert not poster.inflight and queries == []


def test_a_post_failing_in_its_slot_retires_the_slot(fpair, monkeypatch):
    """A post that fails after taking a slot (its launch refused) leaves the slot out of the route's ring: no later
    post, on any stream, writes buffers work it queued may still use; the next post makes a slot and moves its
    bytes."""
    dec, peer, src, dst, arena = fpair
    route = next(iter(dec._routes.routes.values()))
    (before,) = route.slots
    calls = dec._poster.calls
    launch = calls.launch_graph

    def refused(graph):
        raise RuntimeError("launch refused")
    monkeypatch.setattr(calls, "launch_graph", refused)
    x = dec.prepare(peer, "pull", local_blocks={"full": [1]}, remote_blocks={"full": [3]}, name="refused")
    with pytest.raises(RuntimeError, match="launch refused"):
        x.post()
    assert all(s is not before for s in route.slots)
    monkeypatch.setattr(calls, "launch_graph", launch)
    dec.prepare(peer, "pull", local_blocks={"full": [2]}, remote_blocks={"full": [4]}).post().wait(60)
    assert len(route.slots) == 1 and route.slots[0] is not before
    for k in src:
        assert same_bytes(dst[k][:, 2], src[k][:, 4])
