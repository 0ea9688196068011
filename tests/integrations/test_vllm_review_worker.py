"""Review of the vLLM connector's worker side: orders of its public calls (shutdown racing the engine thread, calls
after shutdown, twice-shutdown) and hostile loads, over a prefill and a decode WorkerSide in one process."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from test_vllm_parts import _drive, _load, _moved, _zero, workers  # noqa: F401 - the fixture


def test_calls_after_shutdown_and_twice_shutdown(workers):
    """Every worker call after shutdown, shutdown twice: loads fail (reported, their blocks as load errors)."""
    P, D = workers(device_ids=False)
    D.start_loads([_load(P, "a", [1, 2], [3, 4])])
    _drive(P, D, {"a"})
    D.close()
    D.close()
    D.start_loads([_load(P, "b", [5, 6], [7, 8])])
    got = set()
    for _ in range(50):
        _, r, f = D.poll()
        got |= r
        assert r <= f
        if "b" in got:
            break
    assert "b" in got
    assert D.take_load_errors() == {5, 6}
    D.release([_load(P, "c", [5, 6], [9, 10]).remote])
    assert D.take_stats() is not None or True
    P.close()
    P.close()
    P.poll()


@pytest.mark.parametrize("delay", [0.0, 0.05])
@pytest.mark.parametrize("which", ["decode", "prefill", "both"])
def test_shutdown_from_another_thread_while_the_engine_threads_step(workers, delay, which):
    """vLLM's shutdown from another thread while the engine threads start loads and poll: no call of either raises,
    and every load started is reported (failed where the shutdown came first), within a bound."""
    P, D = workers(device_ids=False)
    errors, reported, started = [], set(), []
    stop = threading.Event()

    def engine():
        i = 0
        try:
            while not stop.is_set() and i < 100:
                req = f"r{i}"
                k = i % 10
                D.start_loads([_load(P, req, [1 + k, 11 + k], [3, 4])])
                started.append(req)
                i += 1
                for _ in range(3):
                    P.poll()
                    _, r, f = D.poll()
                    reported.update(r)
                D.take_load_errors()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
    t = threading.Thread(target=engine)
    t.start()
    time.sleep(delay)
    if which in ("decode", "both"):
        D.close()
    if which in ("prefill", "both"):
        P.close()
    time.sleep(0.1)
    stop.set()
    t.join(60)
    assert not t.is_alive()
    assert not errors, errors
    deadline = time.monotonic() + 60
    while set(started) - reported:
        assert time.monotonic() < deadline, sorted(set(started) - reported)[:5]
        P.poll()
        reported |= D.poll()[1]


# ------------------------------------------------------------------------------- params naming a prefill of their own

def _side(host, name: str, fill: int, secret: bytes | None, **settings):
    import torch
    from gpuxfer.integrations.vllm.worker import Settings, WorkerSide
    from test_vllm_parts import BS, _caches
    buf, caches = _caches(host, fill=False)
    if fill:
        for c in caches.values():
            c.fill_(fill)
    w = WorkerSide(engine_id=name, model="m", dtype="auto/float16", layout="LBHNC",
                   groups=[("FullAttentionSpec", BS, list(caches))], platform=host,
                   settings=Settings(lease_s=60, host="127.0.0.1", port=0, handshake_timeout_s=30,
                                     token_major=True, engine="copy_engine", device_ids=False, **settings))
    if secret is not None:
        w.keyed_by(secret)
    w.register(caches)
    w.caches, w.buf = caches, buf
    assert torch.is_tensor(next(iter(caches.values())))
    return w


def test_a_decode_reads_only_from_the_prefills_it_was_given(host):
    """The seal key a decode checks params with comes from the handshake of the side channel the params name, so
    params naming a side channel their maker runs (a prefill instance of the same model under someone else's
    control) carry a seal that checks out: without a list of the prefills to read from, the decode loads their KV,
    which vLLM then caches under the params' prompt for every later request of that prefix. With
    ``prefills`` set, a load naming another side channel fails at once, with no connection made and nothing
    moved; the listed prefill's loads go on."""
    import torch
    from gpuxfer.integrations.vllm.worker import prefills_setting
    ws = []
    try:
        genuine = _side(host, "p", 3, b"g" * 16)
        ws.append(genuine)
        theirs = _side(host, "x", 7, b"x" * 16)          # another prefill engine, its own secret and seal key
        ws.append(theirs)
        D = _side(host, "d", 0, None, prefills=prefills_setting([["127.0.0.1", genuine.server.port]]))
        ws.append(D)
        forged = _load(theirs, "a", [1, 2], [3, 4])
        forged.remote = __import__("dataclasses").replace(forged.remote, engine_id="x")
        from gpuxfer.integrations.vllm.params import seal_key, seal_of
        forged.remote = __import__("dataclasses").replace(
            forged.remote, seal=seal_of(forged.remote, seal_key(theirs.prefill.secret)))
        D.start_loads([forged, _load(genuine, "b", [5, 6], [7, 8])])
        (r_x,) = [r for k, r in D.decode.remotes.items() if k[2] == "x"]
        assert r_x.state == "failed" and r_x.client is None        # no connection made
        assert _drive(genuine, D, {"a", "b"}) == ({"a", "b"}, {"a"})
        assert all(not D.caches[n][b].any() for n in D.caches for b in (1, 2))
        assert all(torch.equal(D.caches[n][b], genuine.caches[n][a]) for n in D.caches for a, b in ((7, 5), (8, 6)))
        assert D.take_load_errors() == {1, 2}
    finally:
        for w in reversed(ws):
            w.close()
        for w in ws:
            w.buf.close()


@pytest.mark.parametrize("bad", ["127.0.0.1", [["h", 0]], [["h", 70000]], [["h", "1"]], [""], [1], [["h", 1, 2]],
                                 [["h", True]], list(map(str, range(5000)))])
def test_hostile_prefills_settings_are_refused(bad):
    from gpuxfer.errors import BadInput
    from gpuxfer.integrations.vllm.worker import prefills_setting
    with pytest.raises(BadInput, match="prefills"):
        prefills_setting(bad)
    assert prefills_setting(["h", ["h", 1], ("g", 65535)]) == frozenset({"h", ("h", 1), ("g", 65535)})


# ------------------------------------------------------------------------------------- the handshake's warm-up reads

def test_the_warm_up_reads_of_a_new_prefill_hold_the_engine_thread_no_longer_than_a_handshake_may_take():
    """A handshake ends with a warm-up read of the peer's null block per group, waited for on the engine thread (and
    under the worker's lock, which a shutdown takes). A peer whose reads do not complete (a NIXL peer gone quiet after
    its handshake answered) held the step for the agent's timeout per group (60 s each) and the shutdown with it. The
    waits are bounded by the handshake's own time in all, and the handshake still ends ready."""
    import types
    from gpuxfer.errors import TransferTimeout
    from gpuxfer.integrations.vllm.engines import _Remote
    from gpuxfer.integrations.vllm.worker import Settings, WorkerSide
    from test_vllm_worker_polls import _Client
    w = WorkerSide(engine_id="d", model="m", dtype="auto/float16", layout=None,
                   groups=[("FullAttentionSpec", 16, ["l0"]), ("SlidingWindowSpec", 16, ["l1"])],
                   settings=Settings(lease_s=60, host="127.0.0.1", port=0, handshake_timeout_s=5, token_major=True))
    waits = []

    class _Quiet:               # a read that never completes: a wait lasts its whole timeout, then raises
        def wait(self, timeout_s=None):
            waits.append(60.0 if timeout_s is None else timeout_s)
            raise TransferTimeout(rank=0, step=0, flag="f", expected=1, seen=0, timeout_s=waits[-1])

        def done(self):
            return False

    peer = types.SimpleNamespace(route="nixl", engine="copy_engine", name="p")
    agent = types.SimpleNamespace(peers={}, rank=0, timeout_s=60.0, add_peer=lambda *a, **k: peer,
                                  prepare=lambda *a, **k: types.SimpleNamespace(post=lambda: _Quiet()))
    engines = w.decode.engines
    engines.bind(agent, {"groups": []}, [16, 16], [1, 1], None)
    client = _Client()
    client.peer_clock = types.SimpleNamespace(same=False)
    r = _Remote(("10.0.0.1", 5601, "p"), client=client, meta=b"m", groups=((16, 16), (16, 16)))
    engines.remotes[r.key] = r
    engines._attach(r)
    assert r.state == "ready" and r.peer is peer
    assert waits and sum(waits) <= w.settings.handshake_timeout_s, waits


class _LateWarmUps:
    """A decode worker whose agent's reads complete only once ``ended[0]`` is set (a warm-up read then stays in
    flight past its handshake): each ``add_peer`` makes a new peer (``peers``) under the prefill rank's agent name,
    ``remove_peer`` records what it was given (``removed``)."""

    def __init__(self):
        import types
        from gpuxfer.errors import TransferTimeout
        from gpuxfer.integrations.vllm.handshake import agent_name
        from gpuxfer.integrations.vllm.worker import Settings, WorkerSide
        self.w = WorkerSide(engine_id="d", model="m", dtype="auto/float16", layout=None,
                            groups=[("FullAttentionSpec", 16, ["l0"])],
                            settings=Settings(lease_s=60, host="127.0.0.1", port=0, handshake_timeout_s=1,
                                              token_major=True))
        self.ended, self.removed, self.peers = [False], [], []
        ended = self.ended

        class _Late:
            def wait(self, timeout_s=None):
                raise TransferTimeout(rank=0, step=0, flag="f", expected=1, seen=0, timeout_s=timeout_s or 0.0)

            def done(self):
                return ended[0]

        def add_peer(*a, **k):
            self.peers.append(types.SimpleNamespace(route="nixl", engine="copy_engine", name=f"p{len(self.peers)}"))
            agent.peers[agent_name("p", 0, 1)] = self.peers[-1]
            return self.peers[-1]

        agent = types.SimpleNamespace(peers={}, rank=0, timeout_s=60.0, add_peer=add_peer,
                                      prepare=lambda *a, **k: types.SimpleNamespace(post=lambda: _Late()),
                                      remove_peer=self.removed.append)
        self.engines = self.w.decode.engines
        self.engines.bind(agent, {"groups": []}, [16], [1], None)

    def remote(self, host: str, meta: bytes):
        """A prefill rank "p" known at ``host`` whose handshake answered with ``meta`` (not attached yet)."""
        import types
        from gpuxfer.integrations.vllm.engines import _Remote
        from test_vllm_worker_polls import _Client
        client = _Client()
        client.peer_clock = types.SimpleNamespace(same=False)
        r = _Remote((host, 5601, "p"), client=client, meta=meta, groups=((16, 16),))
        self.engines.remotes[r.key] = r
        return r


def test_an_engine_gone_is_forgotten_only_once_its_warm_up_read_left_in_flight_ended():
    """A warm-up read the handshake stopped waiting for is not one of the engine's reads in flight: forgetting the
    engine once its side channel closed would remove its peer at once, and ``remove_peer`` waits for every read
    posted with it (up to the agent's timeout) on the engine thread. The engine is forgotten at the first poll after
    that read ended."""
    x = _LateWarmUps()
    engines, removed = x.engines, x.removed
    r = x.remote("10.0.0.1", b"m")
    engines._attach(r)
    assert r.state == "ready" and r.warming is not None
    r.client.close()                            # the engine goes
    engines.reap()
    assert removed == [] and r.key in engines.remotes
    x.ended[0] = True
    engines.reap()
    assert removed == [x.peers[0]] and r.key not in engines.remotes


def test_a_restarted_engine_is_mapped_again_only_once_the_old_ones_warm_up_read_left_in_flight_ended():
    """The same prefill rank answers a handshake at another address with other caches (it restarted) while the old
    record's warm-up read, which its handshake stopped waiting for, is still in flight: removing the old peer then
    would wait for that read (up to the agent's timeout) on the engine thread. The new handshake stays pending until
    the read ended, then replaces the old peer."""
    from gpuxfer.integrations.vllm.handshake import agent_name
    x = _LateWarmUps()
    engines, removed = x.engines, x.removed
    old = x.remote("10.0.0.1", b"old caches")
    engines._attach(old)
    assert old.state == "ready" and old.warming is not None and old.inflight == 0
    new = x.remote("10.0.0.2", b"new caches")
    engines._attach(new)
    assert removed == [] and new.state == "pending" and new.peer is None
    x.ended[0] = True
    engines._attach(new)
    assert removed == [agent_name("p", 0, 1)] and new.state == "ready" and new.peer is x.peers[1]
    assert old.state == "failed"


def test_an_engine_restarted_at_the_same_address_is_mapped_again_only_once_the_old_warm_up_read_ended(monkeypatch):
    """The same prefill rank restarted at the same address (its old connection seen dead) while the old record's
    warm-up read, which its handshake stopped waiting for, is still in flight: a load naming it then must not begin
    a handshake whose mapping removes the old peer (remove_peer would wait for that read on the engine thread); once
    the read ended, the next one does."""
    import types
    from gpuxfer.integrations.vllm import engines as engines_mod
    from gpuxfer.integrations.vllm.engines import _Remote
    from gpuxfer.integrations.vllm.handshake import agent_name
    from test_vllm_worker_polls import _Client

    class Client(_Client):
        def __init__(self, *a):
            super().__init__()
            self.peer_clock = types.SimpleNamespace(same=False)

    monkeypatch.setattr(engines_mod, "SideChannelClient", Client)
    x = _LateWarmUps()
    engines, removed = x.engines, x.removed
    key = ("10.0.0.1", 5601, "p")

    def handshaken(r: _Remote, meta: bytes) -> None:
        r.meta, r.groups = meta, ((16, 16),)
        engines._attach(r)

    old = engines.get(key)
    handshaken(old, b"old caches")
    assert old.state == "ready" and old.warming is not None
    old.client.close()                                  # the old prefill's connection seen dead: it restarted
    new = engines.get(key)
    if new is not old:
        handshaken(new, b"new caches")
    assert removed == []
    x.ended[0] = True
    new = engines.get(key)
    assert new is not old and new.state == "pending"
    handshaken(new, b"new caches")
    assert removed == [agent_name("p", 0, 1)] and new.state == "ready" and new.peer is x.peers[1]
