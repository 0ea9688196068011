"""A Hypothesis state machine over KVAgent's public calls with the two agents in two spawned processes, as
engines run them: the test process drives each child over a pipe (register groups, swap metadata and add
peers, remove peers, prepare/post/wait pulls and pushes, notifications, close either agent, a child exiting
or killed with SIGKILL, mid-sequence or while the survivor transfers).

Every child reply is bounded (a child silent for :data:`REPLY_S` fails the test, both children killed);
every call ends as the model says or in a typed error (:class:`~gpuxfer.errors.GpuxferError`), never
another exception; after every completed transfer the bytes of every live child's caches are checked
against a model of what each block holds; every exit code is asserted (0 for an exit, -9 for a kill; any
other signal is the failure this test is for).

Caches are the platform's shared memory (any engine reaches them: a peer keeps its mapping of a dead
process's pages, so a transfer with it completes with the bytes last there) or plain tensors (cross-memory
attach, ``copy_engine``: a dead peer fails the transfer with a typed error). Bounded for CI: a few examples
of a few dozen steps per engine and memory; ``triton`` (Triton's interpreter: slow) is marked ``slow``."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

BLOCKS, ROW = 8, 32             # blocks per group, bytes per block (one layer, one piece)
GROUPS = ("g0", "g1")
NAMES = ("pre", "dec")
SPAN = 2 * BLOCKS * ROW         # bytes from one group's cache to the next in a child's buffer
AGENT_S = 30.0                  # the agents' timeout_s
REPLY_S = 60.0                  # the longest a child may take to answer one command (start-up: twice that)
STUCK_S = 0.3                   # a wait for a notification nobody sends


# ---------------------------------------------------------------------------------------------- the children

def _fill(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (BLOCKS, ROW), dtype=np.uint8)


class _Side:
    """A child's agent and caches; each method is a command of the pipe."""

    def __init__(self, name: str, device: int, engine: str, memory: str):
        import torch
        from gpuxfer.kv.agent import KVAgent
        from gpuxfer.platforms.host import HostPlatform
        self.plat = HostPlatform()
        if memory == "shared":
            self.buf = self.plat.alloc(len(GROUPS) * SPAN, device)
            self.flat = self.plat.as_tensor(self.buf)
        else:
            self.buf = None
            self.flat = torch.zeros(len(GROUPS) * SPAN, dtype=torch.uint8)
        self.agent = KVAgent(name, platform=self.plat, device=device, engine=engine, timeout_s=AGENT_S)
        self.peer = None
        self.other = NAMES[1 - NAMES.index(name)]

    def state(self) -> dict:
        a = self.agent
        return {"agent": "closed" if a._closed else "failed" if a.failed is not None else "open",
                "peer": self.peer is not None}

    def _cache(self, g: str):
        return self.flat[GROUPS.index(g) * SPAN:][:BLOCKS * ROW].view(BLOCKS, ROW)

    def register(self, g: str, seed: int | None):
        import torch
        if seed is not None:
            self._cache(g).copy_(torch.from_numpy(_fill(seed)))
        self.agent.register_group(g, 16, {f"{g}.0": self._cache(g)})

    def register_alias(self, g: str, shift: int):
        from gpuxfer.kv.agent import KVLayerSpec
        view = self.flat[GROUPS.index(g) * SPAN + shift:][:BLOCKS * ROW]
        self.agent.register_group(f"alias-{g}", 16, {"x.0": KVLayerSpec(view, BLOCKS, ROW, [(0, ROW)])})

    def metadata(self) -> bytes:
        return self.agent.metadata()

    def add_peer(self, meta: bytes) -> str:
        self.peer = self.agent.add_peer(meta)
        return self.peer.engine

    def remove_peer(self):
        self.agent.remove_peer(self.peer if self.peer is not None else self.other)
        self.peer = None

    def transfer(self, op, g, mine, theirs, notify, posts, wait) -> list:
        peer = self.peer if self.peer is not None else self.other
        x = self.agent.prepare(peer, op, local_blocks={g: mine}, remote_blocks={g: theirs}, notify_slot=notify)
        values = []
        for _ in range(posts):
            h = x.post()
            if wait == "wait":
                h.wait(AGENT_S)
            elif wait == "done":
                assert self.plat.event_wait(h.event, AGENT_S) and h.done()
            values.append(h.notify_value)
        if wait == "remove":            # removing the peer waits for what was posted with it
            self.agent.remove_peer(peer)
            self.peer = None
            assert h.done()
        return values

    def notification(self, slot):
        return self.agent.notification(slot)

    def wait_notification(self, slot, value, timeout_s):
        return self.agent.wait_notification(slot, value, timeout_s)

    def caches(self) -> bytes:
        return self.flat.numpy().tobytes()

    def close(self):
        self.agent.close()
        self.agent.close()
        self.peer = None

    def exit(self):
        self.agent.close()
        if self.buf is not None:
            self.buf.close()
        self.plat.close()


def _child(conn, name: str, device: int, engine: str, memory: str) -> None:
    """Answer each ``(command, args)`` with ``{"status": "ok", "value"} | {"status": "typed", "error", "mro",
    "message"} | {"status": "untyped", "traceback"}`` and the agent's state; ``exit`` closes all and returns."""
    from gpuxfer.errors import GpuxferError
    side = _Side(name, device, engine, memory)
    conn.send({"status": "ok", "value": os.getpid(), **side.state()})
    while True:
        cmd, args = conn.recv()
        try:
            reply = {"status": "ok", "value": getattr(side, cmd)(*args)}
        except GpuxferError as exc:
            reply = {"status": "typed", "error": type(exc).__name__,
                     "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
        except BaseException:  # noqa: BLE001 - reported: the test fails on it
            reply = {"status": "untyped", "traceback": traceback.format_exc()}
        conn.send({**reply, **side.state()})
        if cmd == "exit":
            return


# ---------------------------------------------------------------------------------------------- the machine

class TwoProcessMachine(RuleBasedStateMachine):
    """``model[i][g]``: the bytes child ``i``'s group ``g`` must hold, ``known[i][g]``: which blocks the model
    knows (a transfer a dead peer failed leaves its destination blocks unknown); ``agent[i]``: ``open``,
    ``failed`` or ``closed``; ``proc[i]``: ``alive``, ``exited`` or ``killed``; ``peers[i]``: whether agent
    ``i`` holds the other as a peer, ``peer_groups[i]`` the other's groups in the metadata it added;
    ``meta[i]``: agent ``i``'s last metadata and its groups; ``notified[i][k]``: what agent ``i`` sent to
    slot ``k`` of the other over its current peer link."""

    def __init__(self):
        super().__init__()
        self.ctx = mp.get_context("spawn")
        self.procs: list = [None, None]
        self.conns: list = [None, None]
        self.model = [{}, {}]
        self.known = [{}, {}]
        self.agent = ["open", "open"]
        self.proc = ["alive", "alive"]
        self.peers = [False, False]
        self.peer_groups = [set(), set()]
        self.meta: list = [None, None]
        self.notified = [{}, {}]
        self.seeds = iter(range(1, 1 << 30))
        self.log: list[str] = []
        self.broken = False             # a child failed the test: teardown only kills

    # ---- the pipe

    setup = ("copy_engine", "shared")   # (engine, memory): each test's subclass names its own

    @initialize()
    def start(self):
        setup = self.engine, self.memory = self.setup
        for i in (0, 1):
            parent, child = self.ctx.Pipe()
            self.procs[i] = self.ctx.Process(target=_child, args=(child, NAMES[i], i, *setup), daemon=True)
            self.procs[i].start()
            child.close()
            self.conns[i] = parent
        for i in (0, 1):
            self._reply(i, "start", 2 * REPLY_S)
        for i in (0, 1):                # a pair that can move group g0 from the start
            self.register(i, GROUPS[0], 0)
        for i in (0, 1):
            self.add_peer(i)
        self.transfer(0, "pull", GROUPS[0], 3, None, None, "wait", _Fixed())

    def _send(self, i: int, cmd: str, *args) -> None:
        self.log.append(f"{NAMES[i]}.{cmd}{args if cmd not in ('add_peer',) else ''}")
        self.conns[i].send((cmd, args))

    def _reply(self, i: int, cmd: str, within: float = REPLY_S) -> dict:
        """Child ``i``'s answer to ``cmd``, within ``within`` s; an untyped error, a death or silence fails."""
        conn = self.conns[i]
        try:
            ready = conn.poll(within)
            reply = conn.recv() if ready else None
        except (EOFError, OSError):
            self.procs[i].join(10)
            self._fail(f"child {NAMES[i]} died during {cmd} with exit code {self.procs[i].exitcode}")
        if reply is None:
            self._fail(f"child {NAMES[i]} (pid {self.procs[i].pid}) did not answer {cmd} within {within:g} s")
        if reply["status"] == "untyped":
            self._fail(f"child {NAMES[i]}: {cmd} raised an untyped error:\n{reply['traceback']}")
        return reply

    def _fail(self, why: str):
        self.broken = True
        raise AssertionError(f"{why}\nmodel: agents {self.agent}, processes {self.proc}, peers {self.peers}\n"
                             f"calls:\n  " + "\n  ".join(self.log[-40:]))

    def _call(self, i: int, cmd: str, *args) -> dict:
        self._send(i, cmd, *args)
        return self._reply(i, cmd)

    def _ok(self, i: int, cmd: str, *args):
        """The command's value: it must succeed."""
        r = self._call(i, cmd, *args)
        if r["status"] != "ok":
            self._fail(f"{NAMES[i]}.{cmd} raised {r['error']}: {r['message']}")
        self._sync(i, r)
        return r["value"]

    def _raises(self, i: int, error: str, cmd: str, *args, match: str | None = None) -> dict:
        """The command must raise ``error`` (a class name of gpuxfer.errors or a base of it)."""
        r = self._call(i, cmd, *args)
        if r["status"] != "typed" or error not in r["mro"] or (match and not any(m in r["message"]
                                                                                  for m in match.split("|"))):
            self._fail(f"{NAMES[i]}.{cmd}: expected {error}{f' ({match})' if match else ''}, got {r}")
        self._sync(i, r)
        return r

    def _sync(self, i: int, r: dict) -> None:
        assert r["agent"] == self.agent[i], f"{NAMES[i]}: agent {r['agent']}, the model says {self.agent[i]}"
        assert r["peer"] == self.peers[i], f"{NAMES[i]}: peer {r['peer']}, the model says {self.peers[i]}"

    def _adopt(self, i: int, r: dict) -> None:
        """Where the model allows either outcome (a dead peer): take the child's state."""
        self.agent[i] = r["agent"]
        self.peers[i] = r["peer"]

    def teardown(self):
        errors = []
        for i in (0, 1):
            p = self.procs[i]
            if p is None or self.proc[i] != "alive" or self.broken:
                continue
            try:
                r = self._call(i, "exit")
                if r["status"] != "ok":
                    errors.append(f"{NAMES[i]}: exit raised {r['error']}: {r['message']}")
            except AssertionError as exc:
                errors.append(str(exc))
            p.join(REPLY_S)
            if p.is_alive():
                errors.append(f"child {NAMES[i]} did not exit within {REPLY_S:g} s")
            elif p.exitcode != 0:
                errors.append(f"child {NAMES[i]} exited with code {p.exitcode}")
        for p in self.procs:
            if p is not None and p.is_alive():
                p.kill()
                p.join(10)
        for c in self.conns:
            if c is not None:
                c.close()
        assert not errors, "\n".join(errors)

    # ---- predicates

    def _alive(self, i: int) -> bool:
        return self.proc[i] == "alive"

    def _open(self, i: int) -> bool:
        return self._alive(i) and self.agent[i] == "open"

    def _both_alive(self) -> bool:
        return self._alive(0) and self._alive(1)

    # ---- registration

    @rule(i=st.integers(0, 1), g=st.sampled_from(GROUPS), shift=st.sampled_from([0, 8, ROW]))
    def register(self, i, g, shift):
        if not self._alive(i):
            return
        if self.agent[i] != "open":
            self._raises(i, "GpuxferError", "register", g, None)
            return
        if g in self.model[i]:
            self._raises(i, "BadInput", "register", g, None, match="already registered|overlaps")
            if shift and shift < ROW:   # the same memory shifted by part of a block, as another group
                self._raises(i, "BadInput", "register_alias", g, shift, match="overlaps")
            return
        seed = next(self.seeds)
        self._ok(i, "register", g, seed)
        self.model[i][g] = _fill(seed)
        self.known[i][g] = np.ones(BLOCKS, bool)
        self._check_bytes()

    # ---- peers

    @rule(i=st.integers(0, 1))
    def add_peer(self, i):
        """Agent ``i`` adds the other with fresh metadata, or its last metadata where the other agent is
        closed or its process gone (a stale peer: added or refused with a typed error)."""
        j = 1 - i
        if not self._alive(i):
            return
        if self._open(j):
            self.meta[j] = (self._ok(j, "metadata"), set(self.model[j]))
        elif self._alive(j):
            self._raises(j, "GpuxferError", "metadata")
        if self.meta[j] is None:
            return
        meta, groups = self.meta[j]
        if self.agent[i] != "open":
            self._raises(i, "GpuxferError", "add_peer", meta)
        elif self.peers[i]:
            self._raises(i, "BadInput", "add_peer", meta, match="already added")
        elif self._open(j):
            self._added(i, groups)
            self._ok(i, "add_peer", meta)
        else:
            r = self._call(i, "add_peer", meta)
            event(f"add_peer of a {self.proc[j]} process's {self.agent[j]} agent: {r.get('error', 'added')}")
            self._adopt(i, r)
            if r["status"] == "ok":
                self._added(i, groups)

    def _added(self, i: int, groups: set) -> None:
        self.peers[i] = True
        self.peer_groups[i] = set(groups)
        self.notified[i] = {}

    @rule(i=st.integers(0, 1))
    def remove_peer(self, i):
        if not self._alive(i):
            return
        if self.agent[i] == "closed":
            self._raises(i, "GpuxferError", "remove_peer")
        elif not self.peers[i]:
            self._raises(i, "NotRegistered", "remove_peer")
        else:                           # a failed agent's peers are still removed
            self.peers[i] = False
            self._ok(i, "remove_peer")

    # ---- transfers

    _TRANSFER = dict(i=st.integers(0, 1), op=st.sampled_from(["pull", "push"]), g=st.sampled_from(GROUPS),
                     n=st.integers(0, BLOCKS), bad=st.sampled_from([None] * 6 + ["range", "repeat"]),
                     notify=st.sampled_from([None, 0, 5]), wait=st.sampled_from(["wait", "done", "remove"]),
                     data=st.data())

    @rule(**_TRANSFER)
    def transfer(self, i, op, g, n, bad, notify, wait, data, kill=False):
        """Agent ``i`` moves ``n`` blocks of group ``g``; ``kill``: SIGKILL the other child right after the
        command (the survivor's transfer completes, or fails with a typed error)."""
        j = 1 - i
        if not self._alive(i):
            return
        mine = data.draw(st.permutations(range(BLOCKS)))[:n]
        theirs = data.draw(st.permutations(range(BLOCKS)))[:n]
        posts = data.draw(st.integers(1, 2))
        if bad == "range" and n:
            theirs[0] = BLOCKS
        if bad == "repeat" and n > 1:
            (mine if op == "pull" else theirs)[1] = (mine if op == "pull" else theirs)[0]
        args = ("transfer", op, g, mine, theirs, notify, posts, wait)
        if self.agent[i] != "open":
            self._raises(i, "GpuxferError", *args)
        elif not self.peers[i]:
            self._raises(i, "NotRegistered", *args)
        elif g not in self.model[i] or g not in self.peer_groups[i]:
            self._raises(i, "NotRegistered", *args)
        elif (bad == "range" and n) or (bad == "repeat" and n > 1):
            self._raises(i, "BlockIdError", *args)
        else:
            self._send(i, *args)
            if kill:
                self._kill(j)
            r = self._reply(i, "transfer")
            self._moved(i, op, g, mine, theirs, notify, posts, wait, r)
            return
        if kill:
            self._kill(j)

    @precondition(lambda self: self._alive(0) or self._alive(1))
    @rule(**_TRANSFER)
    def transfer_more(self, **kw):
        """(transfers drawn twice as often as other calls)"""
        self.transfer(**kw)

    def _moved(self, i, op, g, mine, theirs, notify, posts, wait, r) -> None:
        """The model after agent ``i``'s transfer replied ``r``: it succeeded (required while the other process
        lives), or the other process is gone and it raised a typed error."""
        j = 1 - i
        src, dst = (j, i) if op == "pull" else (i, j)
        s_ids, d_ids = (theirs, mine) if op == "pull" else (mine, theirs)
        if r["status"] != "ok":
            if self._alive(j):
                self._fail(f"{NAMES[i]}'s {op} with a live peer raised {r['error']}: {r['message']}")
            event(f"{op} with a {self.proc[j]} peer: {r['error']}")
            self._adopt(i, r)
            if dst == i:                # what landed before the error is unknown
                self.known[i][g][d_ids] = False
            self._check_bytes()
            return
        if wait == "remove":
            self.peers[i] = False
        self._sync(i, r)
        if not self._alive(j):
            event(f"{op} with a {self.proc[j]} peer completed")
        self.model[dst][g][d_ids] = self.model[src][g][s_ids]
        self.known[dst][g][d_ids] = self.known[src][g][s_ids]
        event(f"{self.engine}: transfers")
        if notify is not None:
            sent = self.notified[i].get(notify, 0)
            assert r["value"] == [sent + k + 1 for k in range(posts)], (r["value"], sent)
            self.notified[i][notify] = sent + posts
            if self._open(j):
                assert self._ok(j, "wait_notification", notify, sent + posts, AGENT_S) == sent + posts
        self._check_bytes()

    # ---- notifications

    @rule(i=st.integers(0, 1), slot=st.sampled_from([-1, 0, 5, 64, "x"]))
    def notification(self, i, slot):
        if not self._alive(i):
            return
        if self.agent[i] != "open":
            self._raises(i, "GpuxferError", "notification", slot)
        elif not isinstance(slot, int) or not 0 <= slot < 64:
            self._raises(i, "BadInput", "notification", slot)
        else:   # what the other agent sent to this slot over its current peer link (removing it keeps the word)
            assert self._ok(i, "notification", slot) >= self.notified[1 - i].get(slot, 0)

    @rule(i=st.integers(0, 1), slot=st.sampled_from([0, 5]))
    def wait_notification_never_sent(self, i, slot):
        """A wait for a notification nobody sends: TransferTimeout, and the agent fails (every later call
        raises it; close and remove_peer still work)."""
        if not self._alive(i):
            return
        if self.agent[i] != "open":
            self._raises(i, "GpuxferError", "wait_notification", slot, 1 << 40, STUCK_S)
            return
        self.agent[i] = "failed"
        self._raises(i, "TransferTimeout", "wait_notification", slot, 1 << 40, STUCK_S)

    # ---- the end of an agent or a process

    @rule(i=st.integers(0, 1))
    def close(self, i):
        """Close agent ``i``; its process lives on (its caches are still read, the other may still write them)."""
        if not self._alive(i):
            return
        self.agent[i], self.peers[i] = "closed", False
        self._ok(i, "close")
        event(f"{NAMES[i]} closed")

    @precondition(lambda self: self._both_alive())
    @rule(i=st.integers(0, 1))
    def exit(self, i):
        """Child ``i`` closes everything and exits (code 0)."""
        r = self._call(i, "exit")
        assert r["status"] == "ok", r
        self.procs[i].join(REPLY_S)
        assert not self.procs[i].is_alive(), f"{NAMES[i]} did not exit within {REPLY_S:g} s"
        assert self.procs[i].exitcode == 0, f"{NAMES[i]} exited with code {self.procs[i].exitcode}"
        self.proc[i] = "exited"
        event(f"{NAMES[i]} exited")

    @precondition(lambda self: self._both_alive())
    @rule(during=st.booleans(), **_TRANSFER)
    def kill(self, during, i, **t):
        """SIGKILL child ``1 - i``, between commands or right after child ``i`` was told to transfer."""
        if during:
            self.transfer(i, **t, kill=True)
        else:
            self._kill(1 - i)

    @precondition(lambda self: self._both_alive())
    @rule(during=st.booleans(), **_TRANSFER)
    def kill_more(self, **kw):
        """(kills drawn twice as often: what the survivor does after one is the point)"""
        self.kill(**kw)

    def _kill(self, i: int) -> None:
        event(f"SIGKILL {NAMES[i]}")
        self.log.append(f"SIGKILL {NAMES[i]}")
        os.kill(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].join(REPLY_S)
        assert not self.procs[i].is_alive(), f"{NAMES[i]} outlived SIGKILL by {REPLY_S:g} s"
        assert self.procs[i].exitcode == -signal.SIGKILL, f"{NAMES[i]} exited with code {self.procs[i].exitcode}"
        self.proc[i] = "killed"

    @rule(i=st.integers(0, 1), call=st.sampled_from(["metadata", "notification", "wait_notification",
                                                     "add_peer"]))
    def after_the_end(self, i, call):
        """A closed or failed agent: every call raises a typed error."""
        if not self._alive(i) or self.agent[i] == "open":
            return
        args = {"metadata": (), "notification": (0,), "wait_notification": (0, 1, 1.0), "add_peer": (b"GXKV",)}
        self._raises(i, "TransferTimeout" if self.agent[i] == "failed" else "BadInput", call, *args[call])

    # ---- bytes

    def _check_bytes(self) -> None:
        for i in (0, 1):
            if not self._alive(i) or not self.model[i]:
                continue
            flat = np.frombuffer(self._ok(i, "caches"), np.uint8)
            for g, want in self.model[i].items():
                got = flat[GROUPS.index(g) * SPAN:][:BLOCKS * ROW].reshape(BLOCKS, ROW)
                k = self.known[i][g]
                np.testing.assert_array_equal(got[k], want[k],
                                              err_msg=f"{NAMES[i]} {g}\n" + "\n".join(self.log[-30:]))


class _Fixed:
    """A stand-in for ``st.data()`` in the set-up's transfer: the first blocks, in order, posted once."""

    def draw(self, strategy):
        return list(range(BLOCKS)) if "permutations" in repr(strategy) else 1


def _test(engine: str, memory: str, examples: int, steps: int):
    """The machine's test with ``engine`` over ``memory`` (``shared``: the platform's allocations; ``plain``:
    torch tensors, reached by cross-memory attach)."""
    machine = type(f"Machine_{engine}_{memory}", (TwoProcessMachine,), {"setup": (engine, memory)})
    # no shrinking: each example spawns two processes, and a failure's report holds its calls as found
    machine.TestCase.settings = settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                                         suppress_health_check=list(HealthCheck), derandomize=True,
                                         phases=[Phase.explicit, Phase.generate])
    return pytest.mark.timeout(600)(machine.TestCase)


test_copy_engine_over_shared_memory = _test("copy_engine", "shared", examples=4, steps=40)
test_copy_engine_over_plain_memory = _test("copy_engine", "plain", examples=4, steps=40)
test_auto_engine_over_plain_memory = _test("auto", "plain", examples=2, steps=40)
test_triton_over_shared_memory = pytest.mark.slow(_test("triton", "shared", examples=2, steps=20))
