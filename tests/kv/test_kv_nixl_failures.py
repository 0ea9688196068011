"""The NIXL route's failure paths, over the fake NIXL (tests/fake_nixl.py): what real NIXL does not produce on one
machine -- a transfer that ends in ERR, a release NIXL refuses, a step of ``add_peer`` failing after NIXL added
the peer's agent -- and hostile metadata reaching NIXL. Two agents in this process, host emulation."""
from __future__ import annotations

import pytest
import torch

from gpuxfer.errors import BadInput, BadMetadata, NotRegistered, TransferTimeout
from gpuxfer.kv import nixl_ffi
from gpuxfer.kv.agent import KVAgent

BT, BLOCKS = 4, 8


def _agent(host, buf, r):
    a = KVAgent(f"f{r}", platform=host, device=r, timeout_s=5.0, remote="nixl")
    a.register_group("g", BT, {"l0": host.as_tensor(buf)[:BLOCKS * 256].view(BLOCKS, 256)})
    return a


@pytest.fixture
def pair(fake_nixl, host):
    """Two NIXL-route agents over the fake NIXL, agent 0 with agent 1 as its peer; ``(fake, agents, peer, bufs)``."""
    bufs = [host.alloc(1 << 14, r) for r in (0, 1)]
    for r, b in enumerate(bufs):
        host.as_tensor(b)[:BLOCKS * 256].copy_(torch.arange(BLOCKS * 256, dtype=torch.int64).to(torch.uint8) + r)
    agents = [_agent(host, b, r) for r, b in enumerate(bufs)]
    peer = agents[0].add_peer(agents[1].metadata(), route="nixl")
    yield fake_nixl, agents, peer, bufs
    for a in agents:
        a.close()
    for b in bufs:
        b.close()
    nixl_ffi._KEPT.clear()


def _remotes(fake, agent):
    return fake.agents[agent.nixl.name].remotes


# ----------------------------------------------------------------------------- add_peer after NIXL added the agent


def test_add_peer_failing_after_nixl_added_the_agent_removes_it(fake_nixl, host, monkeypatch):
    """A descriptor list NIXL refuses (here: the peer's prep) fails add_peer with a typed error and takes back the
    remote agent NIXL added; a retry then adds the peer once, over a working route."""
    bufs = [host.alloc(1 << 14, r) for r in (0, 1)]
    a, b = (_agent(host, buf, r) for r, buf in enumerate(bufs))
    try:
        blob = b.metadata()
        real = nixl_ffi.NixlAgent.prep

        def refuse_remote(self, remote, rows):
            if remote is not None:
                raise nixl_ffi.NixlError("prep_xfer_dlist", "prepping", "refused")
            return real(self, remote, rows)

        monkeypatch.setattr(nixl_ffi.NixlAgent, "prep", refuse_remote)
        with pytest.raises(nixl_ffi.NixlError, match="refused"):
            a.add_peer(blob, route="nixl")
        assert _remotes(fake_nixl, a) == set() and a.nixl.nixl._remotes == []
        assert a.nixl.nixl._dlists == []                 # the local list prepped before it was released
        assert dict(a.peers) == {}
        monkeypatch.setattr(nixl_ffi.NixlAgent, "prep", real)
        p = a.add_peer(blob, route="nixl")
        a.transfer(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}).wait(5)
        assert torch.equal(host.as_tensor(bufs[0])[:256], host.as_tensor(bufs[1])[256:512])
        assert a.nixl.nixl._remotes == [b.nixl.name]
    finally:
        a.close()
        b.close()
        for buf in bufs:
            buf.close()


def _forged(blob: bytes, **changes) -> bytes:
    """``blob`` with top-level fields of its body replaced."""
    import json
    from gpuxfer.kv.metadata import _HEADER, METADATA_MAGIC, METADATA_VERSION
    body = json.loads(blob[_HEADER.size:])
    body.update(changes)
    raw = json.dumps(body).encode()
    return _HEADER.pack(METADATA_MAGIC, METADATA_VERSION, 0, len(raw)) + raw


def test_a_peer_naming_a_nixl_agent_already_reached_is_refused_and_the_first_peer_keeps_it(pair):
    """Metadata of another name replaying a peer's NIXL section (NIXL loads an agent twice silently): refused, and
    the refusal does not remove the NIXL agent from the peer that holds it."""
    import uuid
    fake, (a, b), p, bufs = pair
    with pytest.raises(BadMetadata, match="reaches already"):
        a.add_peer(_forged(b.metadata(), agent="replayed", uid=uuid.uuid4().hex), route="nixl")
    assert _remotes(fake, a) == {b.nixl.name} and list(a.peers) == [b.name]
    a.transfer(p, "pull", local_blocks={"g": [2]}, remote_blocks={"g": [3]}).wait(5)


def test_a_peer_renaming_a_nixl_agent_already_reached_is_refused_as_a_replay(pair):
    """A NIXL section naming a new agent over the metadata of one already reached: the same BadMetadata as a replay
    under its own name (NIXL's name for it is what counts), and the first peer keeps the agent."""
    import json
    import uuid
    from gpuxfer.kv.metadata import _HEADER
    fake, (a, b), p, bufs = pair
    blob = b.metadata()
    nx = json.loads(blob[_HEADER.size:])["nixl"]
    with pytest.raises(BadMetadata, match=f"its NIXL agent '{b.nixl.name}' is one agent 'f0' reaches already"):
        a.add_peer(_forged(blob, agent="renamed", uid=uuid.uuid4().hex, nixl=dict(nx, agent="another")),
                   route="nixl")
    assert _remotes(fake, a) == {b.nixl.name} and list(a.peers) == [b.name]
    a.transfer(p, "pull", local_blocks={"g": [2]}, remote_blocks={"g": [3]}).wait(5)


def _claiming(blob: bytes, *, blocks: int, block_tokens: int = BT, piece: int = 256) -> bytes:
    """``blob`` whose layer claims ``blocks`` blocks of ``block_tokens`` tokens, ``piece`` bytes each (its allocation
    and extent grown to hold them)."""
    import json
    from gpuxfer.kv.metadata import _HEADER
    body = json.loads(blob[_HEADER.size:])
    body["groups"][0]["block_tokens"] = block_tokens
    lay = body["groups"][0]["layers"][0]
    lay["num_blocks"], lay["block_stride"], lay["extent"], lay["pieces"] = blocks, piece, blocks * piece, [[0, piece]]
    alloc = body["allocations"][lay["alloc"]]
    alloc["nbytes"] = max(alloc["nbytes"], lay["offset"] + blocks * piece)
    return _forged(blob, **{k: body[k] for k in ("allocations", "groups")})


def _no_lists(monkeypatch):
    def segments(*args):
        raise AssertionError(f"a list was built: {args}")
    monkeypatch.setattr("gpuxfer.kv.nixl_peer._segments", segments)


def test_hostile_block_counts_are_refused_before_any_list_is_built(pair, host, monkeypatch):
    """A peer whose metadata claims more blocks than this agent's lists hold (4x its own blocks x pieces, or
    GPUXFER_KV_NIXL_MAX_DESCRIPTORS if more; below NIXL's int32 indices): BadMetadata, no row built (hundreds of MiB
    to 48 GiB of host lists otherwise), NIXL's agent taken back, the agent usable."""
    fake, (a, b), p, bufs = pair
    a.remove_peer(p)
    blob = b.metadata()
    with monkeypatch.context() as m:
        _no_lists(m)
        for nb in ((1 << 22) + 1, 1 << 31, 1 << 53):
            with pytest.raises(BadMetadata, match=f"make {nb:,} NIXL descriptors; this agent's lists hold at most "
                                                  "4,194,304"):
                a.add_peer(_claiming(blob, blocks=nb), route="nixl")
            assert _remotes(fake, a) == set() and dict(a.peers) == {}
        for cap, bound in (("16", 32), ("48", 48)):         # this agent's own: 8 blocks x 1 piece
            m.setenv("GPUXFER_KV_NIXL_MAX_DESCRIPTORS", cap)
            with pytest.raises(BadMetadata, match=f"make {bound + 1} NIXL descriptors; this agent's lists hold at "
                                                  f"most {bound} "):
                a.add_peer(_claiming(blob, blocks=bound + 1), route="nixl")
            assert _remotes(fake, a) == set() and dict(a.peers) == {}
    monkeypatch.setenv("GPUXFER_KV_NIXL_MAX_DESCRIPTORS", "16")
    p = a.add_peer(_claiming(blob, blocks=32), route="nixl")     # at the bound: taken, and moves
    a.transfer(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [31]}).wait(5)
    assert torch.equal(host.as_tensor(bufs[0])[:256], host.as_tensor(bufs[1])[31 * 256:32 * 256])


def test_a_peer_block_size_multiplying_this_agents_list_is_refused_before_it_is_built(fake_nixl, host, monkeypatch):
    """A peer of 1-token blocks cuts each of this agent's 16-token blocks into 16 descriptors: past the bound,
    BadInput naming the count, nothing built, the agent usable."""
    bufs = [host.alloc(1 << 14, r) for r in (0, 1)]
    agents = [KVAgent(f"bs{r}", platform=host, device=r, timeout_s=5.0, remote="nixl") for r in (0, 1)]
    try:
        for buf, ag in zip(bufs, agents):
            ag.register_group("g", 16, {"l0": host.as_tensor(buf)[:BLOCKS * 256].view(BLOCKS, 256)})
        host.as_tensor(bufs[1])[:4096].copy_(torch.arange(4096, dtype=torch.int64).to(torch.uint8))
        a, b = agents
        blob = _claiming(b.metadata(), blocks=16, block_tokens=1, piece=16)
        monkeypatch.setenv("GPUXFER_KV_NIXL_MAX_DESCRIPTORS", "16")
        with monkeypatch.context() as m:
            _no_lists(m)
            with pytest.raises(BadInput, match="block size makes 128 NIXL descriptors here; this agent's lists "
                                               "hold at most 32 "):
                a.add_peer(blob, route="nixl")
        assert _remotes(fake_nixl, a) == set() and dict(a.peers) == {}
        monkeypatch.setenv("GPUXFER_KV_NIXL_MAX_DESCRIPTORS", "128")
        p = a.add_peer(blob, route="nixl")
        a.transfer(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": list(range(16))}).wait(5)
        assert torch.equal(host.as_tensor(bufs[0])[:256], host.as_tensor(bufs[1])[:256])
    finally:
        for ag in agents:
            ag.close()
        for buf in bufs:
            buf.close()
        nixl_ffi._KEPT.clear()


# ----------------------------------------------------------------------------- a transfer that ends in ERR


def _err(fake, agent, monkeypatch):
    monkeypatch.setattr(fake.agents[agent.nixl.name], "check_xfer_state", lambda h: "ERR")


def test_a_transfer_ending_in_err_fails_every_wait_after_nixl_released_it(pair, monkeypatch):
    """ERR: the handle's wait raises NixlError naming the request once NIXL released the transfer -- and so does
    every later done() or wait(): a failed transfer never reads as complete."""
    fake, (a, b), p, bufs = pair
    h = a.transfer(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}, name="doomed")
    xfer = h._xfer
    _err(fake, a, monkeypatch)
    with pytest.raises(nixl_ffi.NixlError, match="doomed"):
        h.wait(5)
    assert xfer.released and a.nixl.nixl._xfers == []
    for call in (h.done, lambda: h.wait(5), lambda: h.stream_wait(a.stream)):
        with pytest.raises(nixl_ffi.NixlError, match="doomed"):
            call()


def test_a_failed_transfer_nixl_refuses_to_release_stays_pending_until_it_does(pair, monkeypatch):
    """ERR, and NIXL refuses the release (an active transfer it cannot cancel): the handle is not over -- done() is
    False, wait() times out naming the request -- until NIXL releases it; then it fails."""
    fake, (a, b), p, bufs = pair
    h = a.transfer(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}, name="held")
    _err(fake, a, monkeypatch)
    agent = fake.agents[a.nixl.name]
    real = agent.release_xfer_handle
    refuse = [True]

    def release(x):
        if refuse[0]:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        real(x)

    monkeypatch.setattr(agent, "release_xfer_handle", release)
    assert h.done() is False and h.done() is False
    with pytest.raises(TransferTimeout, match="held"):
        h.wait(0.2)
    assert h._xfer in a.nixl.nixl._xfers
    refuse[0] = False
    with pytest.raises(nixl_ffi.NixlError, match="held"):
        h.wait(5)
    assert a.nixl.nixl._xfers == []


def _deregistered(fake, nixl_name: str) -> bool:
    return any(c[0] == nixl_name and c[1] == "deregister_memory" for c in fake.calls)


@pytest.mark.parametrize("refuse", [False, True], ids=["released", "release-refused"])
def test_close_after_a_failed_transfer_keeps_the_memory_nixl_may_still_touch(pair, monkeypatch, refuse):
    """A transfer ended in ERR (NIXL cannot say when the operations it started stop), or one NIXL refuses to
    release: close deregisters none of the agent's memory -- its NIXL agent is kept for the life of the process --
    and the handle raises a typed error; an agent without such a transfer deregisters at close."""
    fake, (a, b), p, bufs = pair
    names = a.nixl.name, b.nixl.name
    h = a.transfer(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}, name="last")
    _err(fake, a, monkeypatch)
    if refuse:
        monkeypatch.setattr(a, "timeout_s", 0.2)        # close's bounded wait for it
        monkeypatch.setattr(fake.agents[names[0]], "release_xfer_handle", lambda x: 1 / 0)
        assert not h.done()
    else:
        with pytest.raises(nixl_ffi.NixlError):
            h.wait(5)
    kept = a.nixl.nixl
    a.close()
    b.close()
    assert not _deregistered(fake, names[0]) and _deregistered(fake, names[1])
    assert kept in nixl_ffi._KEPT
    with pytest.raises((NotRegistered, nixl_ffi.NixlError), match="last"):
        h.wait(1)


def test_a_failed_transfer_does_not_fail_the_rebuild_of_the_lists_for_another_request(fake_nixl, host, monkeypatch):
    """A group registered after add_peer rebuilds the lists when a request first names it, after the transfers made
    from the old lists are over: one that ended in ERR is over -- the new request goes through, the failed one's
    handle alone raises."""
    bufs = [host.alloc(1 << 14, r) for r in (0, 1)]
    a, b = (_agent(host, buf, r) for r, buf in enumerate(bufs))
    second = {"l1": None}
    try:
        second["l1"] = host.as_tensor(bufs[1])[4096:4096 + BLOCKS * 256].view(BLOCKS, 256)
        b.register_group("h", BT, second)
        p = a.add_peer(b.metadata(), route="nixl")
        h = a.transfer(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}, name="failed-first")
        agent, failed = fake_nixl.agents[a.nixl.name], h._xfer
        real = agent.check_xfer_state
        monkeypatch.setattr(agent, "check_xfer_state", lambda x: "ERR" if x is failed else real(x))
        a.register_group("h", BT, {"l1": host.as_tensor(bufs[0])[4096:4096 + BLOCKS * 256].view(BLOCKS, 256)})
        a.transfer(p, "pull", local_blocks={"h": [2]}, remote_blocks={"h": [3]}, name="next").wait(5)
        assert torch.equal(host.as_tensor(bufs[0])[4096 + 512:4096 + 768], second["l1"][3])
        with pytest.raises(nixl_ffi.NixlError, match="failed-first"):
            h.wait(5)
    finally:
        a.close()
        b.close()
        for buf in bufs:
            buf.close()
        nixl_ffi._KEPT.clear()


@pytest.mark.parametrize("meanwhile", ["ipc add_peer", "close"])
def test_add_peer_over_nixl_racing_another_add_or_close_leaves_nothing_behind(fake_nixl, host, monkeypatch, meanwhile):
    """While a NIXL peer is built, the same peer is added over IPC, or the agent closed: the NIXL add_peer then
    raises BadInput, takes back its NIXL agent and leaves the other add's peer in place."""
    from gpuxfer.kv.nixl_peer import NixlPeer
    bufs = [host.alloc(1 << 14, r) for r in (0, 1)]
    a, b = (_agent(host, buf, r) for r, buf in enumerate(bufs))
    try:
        blob, fake_a = b.metadata(), fake_nixl.agents[a.nixl.name]
        real = NixlPeer.lists

        def lists(self, want=()):
            out = real(self, want)
            if want == ():              # add_peer's own build, once
                monkeypatch.setattr(NixlPeer, "lists", real)
                a.add_peer(blob, route="ipc") if meanwhile == "ipc add_peer" else a.close()
            return out

        monkeypatch.setattr(NixlPeer, "lists", lists)
        with pytest.raises(BadInput, match="already added" if meanwhile == "ipc add_peer" else "closed"):
            a.add_peer(blob, route="nixl")
        assert fake_a.remotes == set()
        if meanwhile == "ipc add_peer":
            assert a.peer(b.name).route == "ipc"
            a.transfer(b.name, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}).wait(5)
    finally:
        a.close()
        b.close()
        for buf in bufs:
            buf.close()


def test_a_wait_from_another_thread_while_close_gives_up_on_its_transfer_ends_typed(pair, monkeypatch):
    """A transfer that never completes, waited on from a thread while close runs: close is bounded (it gives up
    on the transfer past the agent's timeout, keeping the NIXL agent), the waiter ends in a typed error naming
    the request -- never a hang, never success."""
    import threading
    from gpuxfer.errors import GpuxferError
    fake, (a, b), p, bufs = pair
    fake.stuck = True
    monkeypatch.setattr(a, "timeout_s", 0.3)
    h = a.transfer(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}, name="never")
    got, started = [], threading.Event()

    def waiter():
        started.set()
        try:
            h.wait(30)
            got.append("returned")
        except GpuxferError as exc:
            got.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    started.wait(10)
    a.close()
    t.join(30)
    assert not t.is_alive() and len(got) == 1 and isinstance(got[0], NotRegistered) and "never" in str(got[0])
    assert a.closed and not any(c[1] == "deregister_memory" for c in fake.calls)


def test_close_never_frees_the_notification_words_while_the_poller_writes_one(pair, monkeypatch):
    """The poller writing a notification word when close's bounded wait for it passes: the words are freed only
    after the write (close takes the lock the poller delivers under), never under it."""
    import threading
    fake, (a, b), p, bufs = pair
    back = b.add_peer(a.metadata(), route="nixl")
    freed, entered, seen = threading.Event(), threading.Event(), []
    real_close, real_write = a.flags.close, a.platform.host_write_flag

    def close():
        freed.set()
        real_close()

    def write(ptr, value, device):
        entered.set()
        freed.wait(3)                   # close frees the words meanwhile, unless the write holds them
        seen.append(freed.is_set())
        if not freed.is_set():
            real_write(ptr, value, device)

    monkeypatch.setattr(a.flags, "close", close)
    monkeypatch.setattr(a.platform, "host_write_flag", write)
    monkeypatch.setattr(a, "timeout_s", 0.2)
    b.transfer(back, "push", local_blocks={"g": [0]}, remote_blocks={"g": [1]}, notify_slot=3).wait(5)
    assert entered.wait(10)             # the poller writes the word
    a.close()
    assert seen == [False] and freed.is_set()


def test_calls_in_any_order_around_remove_peer_and_close_end_typed(pair):
    """Posts, prepares, removes and adds after remove_peer or close: typed errors naming what is gone, never a
    transfer handed to NIXL for a removed peer."""
    fake, (a, b), p, bufs = pair
    x = a.prepare(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
    h = x.post()
    h.wait(5)
    with pytest.raises(BadInput, match="already added"):
        a.add_peer(b.metadata(), route="nixl")
    a.remove_peer(p)
    for call in (lambda: a.remove_peer(p), lambda: a.remove_peer(b.name), x.post,
                 lambda: a.prepare(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})):
        with pytest.raises(NotRegistered):
            call()
    assert h.done()                     # a transfer that completed stays so
    p2 = a.add_peer(b.metadata(), route="nixl")
    with pytest.raises(NotRegistered):
        x.post()                        # prepared for the peer removed, not the one added since
    a.close()
    for call in (x.post, lambda: a.add_peer(b.metadata()), lambda: a.metadata(),
                 lambda: a.prepare(p2, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})):
        with pytest.raises(BadInput, match="closed"):
            call()
    with pytest.raises(NotRegistered):
        a.remove_peer(p2)
    a.close()
