"""A Hypothesis state machine over KVAgent's public calls on the host emulation: two agents in one process
(register groups, add and remove peers, prepare, post, wait, notifications, close), every error typed, and
after every completed transfer the bytes of both agents' caches checked against a model of what each block
holds.

Bounded for CI (a few examples of a few dozen steps; the ``copy_engine`` engine moves bytes without Triton's
interpreter, the ``triton`` one is drawn for some examples). Calls that hit the other agent's freed memory
(a survivor posting to a closed agent in the same process) are left out: closing is a final step of both."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpuxfer.errors import BadInput, BlockIdError, GpuxferError, NotRegistered, TransferMismatch
from gpuxfer.kv.agent import KVAgent, KVLayerSpec

BLOCKS, ROW = 8, 32             # blocks per group, bytes per block (one layer, one piece)
GROUPS = ("g0", "g1")
NAMES = ("pre", "dec")


class AgentMachine(RuleBasedStateMachine):
    """``model[i][g]``: the bytes agent ``i``'s group ``g`` must hold; ``peers[i]``: agent ``i``'s peer (the
    other agent) or None; ``notified[i][k]``: notifications agent ``i`` sent to slot ``k`` of the other."""

    def __init__(self):
        super().__init__()
        from gpuxfer.platforms.host import HostPlatform
        self.plat = HostPlatform()
        self.bufs = [self.plat.alloc(len(GROUPS) * 2 * BLOCKS * ROW, d) for d in (0, 1)]
        self.flat = [self.plat.as_tensor(b) for b in self.bufs]
        self.agents: list = [None, None]
        self.model = [{}, {}]
        self.peers = [None, None]
        self.peer_groups = [set(), set()]       # the other agent's groups when the peer was added
        self.notified = [{}, {}]
        self.rng = np.random.default_rng(0)
        self.closed = False
        self.moves = 0

    @initialize(engine=st.sampled_from(["copy_engine"] * 4 + ["triton", "pack"]))
    def start(self, engine):
        self.engine = engine
        self.agents = [KVAgent(n, platform=self.plat, device=d, engine=engine, timeout_s=60, slot_bytes=256)
                       for d, n in enumerate(NAMES)]
        for i in (0, 1):                # a pair that can move group g0 from the start
            self.register(i, GROUPS[0], 0)
        for i in (0, 1):
            self.add_peer(i)
        self.transfer(0, "pull", GROUPS[0], 3, None, 0, "wait", _Fixed())

    def teardown(self):
        for a in reversed(self.agents):
            if a is not None:
                a.close()
        for b in self.bufs:
            b.close()
        self.plat.close()

    def _cache(self, i: int, g: str):
        k = GROUPS.index(g)
        return self.flat[i][k * 2 * BLOCKS * ROW:][:BLOCKS * ROW].view(BLOCKS, ROW)

    # ---- registration ----
    @precondition(lambda self: not self.closed)
    @rule(i=st.integers(0, 1), g=st.sampled_from(GROUPS), shift=st.sampled_from([0, 8, ROW]))
    def register(self, i, g, shift):
        agent = self.agents[i]
        if g in self.model[i]:
            with pytest.raises(BadInput, match="already registered|overlaps"):
                agent.register_group(g, 16, {f"{g}.0": self._cache(i, g)})
            # the same memory shifted by part of a block, as another group: refused, nothing registered
            if shift and shift < ROW:
                k = GROUPS.index(g)
                view = self.flat[i][k * 2 * BLOCKS * ROW + shift:][:BLOCKS * ROW]
                with pytest.raises(BadInput, match="overlaps"):
                    agent.register_group(f"alias-{g}", 16, {"x.0": KVLayerSpec(view, BLOCKS, ROW, [(0, ROW)])})
            return
        cache = self._cache(i, g)
        cache.copy_(_random(self.rng, cache.shape))
        agent.register_group(g, 16, {f"{g}.0": cache})
        self.model[i][g] = cache.numpy().copy()

    # ---- peers ----
    @precondition(lambda self: not self.closed)
    @rule(i=st.integers(0, 1))
    def add_peer(self, i):
        agent, other = self.agents[i], self.agents[1 - i]
        if self.peers[i] is not None:
            with pytest.raises(BadInput, match="already added"):
                agent.add_peer(other.metadata())
            return
        self.peers[i] = agent.add_peer(other.metadata())
        self.peer_groups[i] = set(self.model[1 - i])
        self.notified[i] = {}

    @precondition(lambda self: not self.closed)
    @rule(i=st.integers(0, 1))
    def remove_peer(self, i):
        agent = self.agents[i]
        if self.peers[i] is None:
            with pytest.raises(NotRegistered):
                agent.remove_peer(NAMES[1 - i])
            return
        agent.remove_peer(self.peers[i])
        self.peers[i] = None

    # ---- transfers ----
    _TRANSFER = dict(i=st.integers(0, 1), op=st.sampled_from(["pull", "push"]), g=st.sampled_from(GROUPS),
                     n=st.integers(0, BLOCKS), bad=st.sampled_from([None] * 6 + ["range", "repeat"]),
                     notify=st.sampled_from([None, 0, 5]), wait=st.sampled_from(["wait", "done", "remove"]),
                     data=st.data())

    @precondition(lambda self: not self.closed)
    @rule(**_TRANSFER)
    def transfer(self, i, op, g, n, bad, notify, wait, data):
        agent, peer = self.agents[i], self.peers[i]
        mine = data.draw(st.permutations(range(BLOCKS)))[:n]
        theirs = data.draw(st.permutations(range(BLOCKS)))[:n]
        if bad == "range" and n:
            theirs[0] = BLOCKS
        if bad == "repeat" and n > 1:
            (mine if op == "pull" else theirs)[1] = (mine if op == "pull" else theirs)[0]
        if peer is None:
            with pytest.raises(NotRegistered):
                agent.prepare(NAMES[1 - i], op, local_blocks={g: mine}, remote_blocks={g: theirs})
            return
        if g not in self.model[i] or g not in self.peer_groups[i]:
            with pytest.raises(NotRegistered):
                agent.prepare(peer, op, local_blocks={g: mine}, remote_blocks={g: theirs}, notify_slot=notify)
            return
        bad_ids = (bad == "range" and n) or (bad == "repeat" and n > 1)
        if bad_ids:
            with pytest.raises(BlockIdError):
                agent.prepare(peer, op, local_blocks={g: mine}, remote_blocks={g: theirs}, notify_slot=notify)
            return
        if self.engine == "pack":
            self._pack(i, op, g, mine, theirs, data.draw(st.integers(0, 4)) == 0)
            return
        x = agent.prepare(peer, op, local_blocks={g: mine}, remote_blocks={g: theirs}, notify_slot=notify)
        posts = data.draw(st.integers(1, 2))
        for _ in range(posts):
            h = x.post()
            if wait == "wait":
                h.wait(60)
            elif wait == "done":
                assert self.plat.event_wait(h.event, 60) and h.done()
        if wait == "remove":            # removing the peer waits for what was posted with it
            agent.remove_peer(peer)
            self.peers[i] = None
            assert h.done()
        src, dst = (1 - i, i) if op == "pull" else (i, 1 - i)
        s_ids, d_ids = (theirs, mine) if op == "pull" else (mine, theirs)
        self.model[dst][g][d_ids] = self.model[src][g][s_ids]
        self.moves += 1
        event(f"{self.engine}: transfers")
        if notify is not None:
            self.notified[i][notify] = self.notified[i].get(notify, 0) + posts
            assert h.notify_value == self.notified[i][notify]
            got = self.agents[1 - i].wait_notification(notify, self.notified[i][notify], 60)
            assert got == self.notified[i][notify]
        self._check_bytes()

    def _pack(self, i, op, g, mine, theirs, mismatch):
        """Both sides of a pack transfer (the destination posts first); ``mismatch``: the destination names
        other blocks (the next ones, or one fewer), so both sides raise TransferMismatch, no byte moves, and
        both agents are failed from then on."""
        s, d = (i, 1 - i) if op == "push" else (1 - i, i)
        s_ids, d_ids = (mine, theirs) if op == "push" else (theirs, mine)
        if self.peers[1 - i] is None or g not in self.peer_groups[1 - i]:
            return                      # the other side cannot take part (its peer or group is missing)
        mismatch = mismatch and len(d_ids) > 0
        d_req, s_req = d_ids, s_ids
        if mismatch and len(d_ids) > 1 and d_ids[0] % 2:
            d_req, s_req = d_ids[:-1], s_ids[:-1]
        elif mismatch:
            d_req = [(x + 1) % BLOCKS for x in d_ids]
        xs = self.agents[s].prepare(self.peers[s], "push", local_blocks={g: s_ids}, remote_blocks={g: d_ids})
        xd = self.agents[d].prepare(self.peers[d], "pull", local_blocks={g: d_req}, remote_blocks={g: s_req})
        handles = [xd.post(), xs.post()]
        if not mismatch:
            for h in handles:
                h.wait(60)
            self.model[d][g][d_ids] = self.model[s][g][s_ids]
            self.moves += 1
            self._check_bytes()
            return
        for h in handles:
            with pytest.raises(TransferMismatch):
                h.wait(60)
        self._check_bytes()             # nothing moved
        self.closed = True              # both agents failed: every call raises, close still works

    @precondition(lambda self: not self.closed)
    @rule(**_TRANSFER)
    def transfer_more(self, **kw):
        """(transfers drawn twice as often as other calls)"""
        self.transfer(**kw)

    @precondition(lambda self: not self.closed)
    @rule(i=st.integers(0, 1), slot=st.sampled_from([-1, 0, 5, 64, "x"]))
    def notification(self, i, slot):
        agent = self.agents[i]
        if not isinstance(slot, int) or not 0 <= slot < 64:
            with pytest.raises(BadInput):
                agent.notification(slot)
            return
        # what the other agent sent to this slot, while its peer link lived (removing a peer keeps the word)
        assert agent.notification(slot) >= self.notified[1 - i].get(slot, 0)

    @precondition(lambda self: not self.closed and self.moves >= 3)
    @rule(i=st.integers(0, 1))
    def close_all(self, i):
        """Close both agents (the one drawn first): every later call raises a typed error."""
        first, second = self.agents[i], self.agents[1 - i]
        first.close()
        first.close()
        with pytest.raises(GpuxferError):
            first.metadata()
        with pytest.raises(GpuxferError):
            first.register_group("late", 16, {"l.0": self._cache(i, GROUPS[0])})
        second.close()
        self.closed = True

    @precondition(lambda self: self.closed)
    @rule(i=st.integers(0, 1), call=st.sampled_from(["metadata", "prepare", "notification", "wait_notification",
                                                     "add_peer", "remove_peer", "close"]))
    def after_close(self, i, call):
        """Every call on a closed (or failed) agent: a typed error (close: again, nothing)."""
        agent = self.agents[i]
        calls = {"metadata": agent.metadata,
                 "prepare": lambda: agent.prepare(NAMES[1 - i], "pull", local_blocks={"g0": [0]},
                                                  remote_blocks={"g0": [0]}),
                 "notification": lambda: agent.notification(0),
                 "wait_notification": lambda: agent.wait_notification(0, 1, 1.0),
                 "add_peer": lambda: agent.add_peer(b"GXKV"),
                 "remove_peer": lambda: agent.remove_peer(NAMES[1 - i])}
        if call == "close":
            agent.close()
            return
        if call == "remove_peer" and not agent._closed:     # a failed agent's peers may still be removed
            try:
                calls[call]()
            except GpuxferError:
                pass
            return
        with pytest.raises(GpuxferError):
            calls[call]()

    def _check_bytes(self):
        for i in (0, 1):
            for g, want in self.model[i].items():
                np.testing.assert_array_equal(self._cache(i, g).numpy(), want, err_msg=f"{NAMES[i]} {g}")

    @invariant()
    def agents_healthy(self):
        if not self.closed:
            assert all(a is None or a.failed is None for a in self.agents)


class _Fixed:
    """A stand-in for ``st.data()`` in the set-up's transfer: the first blocks, in order."""

    def draw(self, strategy):
        return list(range(BLOCKS)) if "permutations" in repr(strategy) else 1


def _random(rng, shape):
    import torch
    return torch.from_numpy(rng.integers(0, 256, tuple(shape), dtype=np.uint8))


AgentMachine.TestCase.settings = settings(max_examples=10, stateful_step_count=30, deadline=None,
                                          suppress_health_check=list(HealthCheck), derandomize=True)
test_agent_state_machine = AgentMachine.TestCase
