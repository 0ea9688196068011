"""Hostile orders and inputs against the vLLM connector's worker side, without vLLM: a prefill and a decode worker in
one process over the host emulation (the fixtures of test_vllm_parts.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from test_vllm_parts import BLOCKS, _drive, _load, _moved, _zero, workers  # noqa: F401  (a fixture)


def _named(load, host: str):
    """``load`` with its params naming the prefill's side channel by another spelling of its address."""
    return dataclasses.replace(load, remote=dataclasses.replace(load.remote, host=host))


def test_params_naming_the_prefill_by_another_address_spelling_leave_its_peer_alone(workers):
    """Params a client forged to name the prefill's side channel as ``127.1`` (the same address, spelled otherwise;
    numeric, so no resolver): the decode worker handshakes with the same prefill rank again. That second handshake
    must not take the peer the first one's loads read through: the genuine params of later requests still load."""
    P, D = workers(device_ids=False)
    D.start_loads([_load(P, "a", [3, 4], [7, 8])])
    assert _drive(P, D, {"a"}) == ({"a"}, set())
    forged = _named(_load(P, "x", [5, 6], [9, 10]), "127.1")
    forged = dataclasses.replace(forged, remote=dataclasses.replace(forged.remote, seal=b"\0" * 32))
    D.start_loads([forged])
    assert _drive(P, D, {"x"}) == ({"x"}, {"x"})
    assert _zero(D, [5, 6])
    D.start_loads([_load(P, "b", [10, 11], [1, 2])])
    assert _drive(P, D, {"b"}) == ({"b"}, set())
    assert _moved(P, D, [3, 4, 10, 11], [7, 8, 1, 2])


def test_params_naming_the_prefill_by_another_address_first_leave_the_genuine_loads_alone(workers):
    """The same, the forged address handshaking first: the genuine params' handshake (the same prefill rank) still
    loads, and later loads of both addresses find one mapping of the prefill's caches."""
    P, D = workers(device_ids=False)
    forged = _named(_load(P, "x", [5, 6], [9, 10]), "127.1")
    forged = dataclasses.replace(forged, remote=dataclasses.replace(forged.remote, seal=b"\0" * 32))
    D.start_loads([forged])
    assert _drive(P, D, {"x"}) == ({"x"}, {"x"})
    for req, local, remote in (("a", [3, 4], [7, 8]), ("b", [10, 11], [1, 2])):
        D.start_loads([_load(P, req, local, remote)])
        assert _drive(P, D, {req}) == ({req}, set())
    assert _moved(P, D, [3, 4, 10, 11], [7, 8, 1, 2]) and _zero(D, [5, 6])
    assert len(D.agent.peers) == 1


# ------------------------------------------------------------------------------------- params of another prompt

def _request(rid: str, prompt: list[int], params=None, status: str = "WAITING"):
    import types
    return types.SimpleNamespace(request_id=rid, prompt_token_ids=prompt, num_prompt_tokens=len(prompt),
                                 kv_transfer_params=params, status=types.SimpleNamespace(name=status))


def test_params_name_their_prompt_under_the_seal():
    """A prefill's params carry the digest of the request's prompt, under the seal: a client that swaps in the
    digest of another prompt breaks the seal; one that drops it leaves params that load into no request."""
    from gpuxfer.integrations.vllm.params import (BadSeal, check_seal, parse_remote_prefill, prompt_digest)
    from gpuxfer.integrations.vllm.scheduler import SchedulerSide
    P = SchedulerSide(engine_id="p0", block_sizes=[16], lease_s=60, endpoints=[("127.0.0.1", 5601)])
    prompt = list(range(1, 41))
    _, params = P.request_finished(_request("r1", prompt, {"do_remote_decode": True}, "FINISHED_LENGTH_CAPPED"),
                                   ([3, 4, 5],))
    assert params["remote_prompt"] == prompt_digest(prompt).hex()
    check_seal(parse_remote_prefill(params, [16]), P.seal_key)
    for other in (dict(params, remote_prompt=prompt_digest(prompt[::-1]).hex()),
                  {k: v for k, v in params.items() if k != "remote_prompt"}):
        with pytest.raises(BadSeal):
            check_seal(parse_remote_prefill(other, [16]), P.seal_key)


@pytest.mark.parametrize("prompt", ["another", "longer", "unbound"])
def test_params_of_another_prompt_load_into_no_request_and_are_released(prompt):
    """A decode request whose prompt is not the one its params were made for (another of the same length, one that
    extends it, or params that name no prompt) loads nothing: computed locally, its params released."""
    from gpuxfer.integrations.vllm.scheduler import SchedulerSide
    P = SchedulerSide(engine_id="p0", block_sizes=[16], lease_s=60, endpoints=[("127.0.0.1", 5601)])
    D = SchedulerSide(engine_id="d0", block_sizes=[16], lease_s=60, endpoints=None)
    mine = list(range(1, 41))
    _, params = P.request_finished(_request("r1", mine, {"do_remote_decode": True}, "FINISHED_LENGTH_CAPPED"),
                                   ([3, 4, 5],))
    theirs = {"another": mine[::-1], "longer": mine + [7], "unbound": mine}[prompt]
    if prompt == "unbound":
        params = {k: v for k, v in params.items() if k != "remote_prompt"}
    req = _request("d1", theirs, dict(params))
    assert D.get_num_new_matched_tokens(req, 0) == (0, False)
    D.update_state_after_alloc(req, None, 0)
    out = D.build_payload()
    assert out["loads"] == [] and [rp.request_id for rp in out["releases"]] == ["r1"]
    ok = _request("d2", mine, dict(params if prompt != "unbound" else {}))
    if prompt != "unbound":                     # the same params, their own prompt: loaded
        assert D.get_num_new_matched_tokens(ok, 0) == (39, True)


# ------------------------------------------------------------------------------------------------------ shutdown

def test_a_shutdown_closes_prefill_ends_that_stopped_reading_together():
    """A decode worker's shutdown with several prefill ends that answered their handshake and then stopped reading
    (their socket full of queued done messages): each client's sender gets its grace to send what was queued, but
    the shutdown waits for one grace, not one a prefill end; and every sender thread ends."""
    import socket
    import threading
    import time

    from gpuxfer.integrations.vllm import engines as engines_mod
    from gpuxfer.integrations.vllm.client import SideChannelClient
    from gpuxfer.integrations.vllm.frames import _CLOCK, frame

    stop = threading.Event()
    listeners, threads, clients = [], [], []

    def serve(ls):
        c, _ = ls.accept()
        c.recv(100)
        c.sendall(frame(b"{}") + frame(b"m") + frame(_CLOCK.pack(1.0)))
        stop.wait(60)               # reads nothing more
        c.close()

    try:
        for _ in range(6):
            ls = socket.create_server(("127.0.0.1", 0))
            listeners.append(ls)
            t = threading.Thread(target=serve, args=(ls,), daemon=True)
            t.start()
            threads.append(t)
            c = SideChannelClient("127.0.0.1", ls.getsockname()[1], 30.0)
            c.handshake()
            for _ in range(100):
                c.notify("done", ["x" * 500] * 1000)
            clients.append(c)
        engines = engines_mod.PrefillEngines.__new__(engines_mod.PrefillEngines)
        engines.remotes = {i: engines_mod._Remote(key=("127.0.0.1", i, "p"), client=c) for i, c in enumerate(clients)}
        t0 = time.monotonic()
        engines.close()
        took = time.monotonic() - t0
        assert all(not c._sender.is_alive() for c in clients)
        # a grace of a second a client, one after the other, takes six seconds at least whatever the machine (each
        # sender stays stuck until its grace ran out); one shared grace takes one
        assert took < 6.0, took
    finally:
        stop.set()
        for ls in listeners:
            ls.close()
        for t in threads:
            t.join(timeout=10)


# ---------------------------------------------------------------------------------------- handshakes under way

def test_one_requests_params_cannot_take_every_handshake_slot(workers):
    """Forged params of one request naming 128 prefill ranks, each a listener that accepts and never answers (a
    decode of TP 1 reads every rank of a prefill of more): their handshakes would be under way for the handshake
    timeout. They take at most MAX_HANDSHAKES_A_LOAD slots, and no more when the same params come again in another
    request; a genuine load of another prefill engine in the meantime must still handshake, not fail at once for want
    of a slot."""
    import socket
    import time

    from gpuxfer.integrations.vllm.engines import MAX_HANDSHAKES_A_LOAD
    from gpuxfer.integrations.vllm.loads import Load
    from gpuxfer.integrations.vllm.params import RemotePrefill

    P, D = workers(device_ids=False)
    silent = [socket.create_server(("127.0.0.1", 0), backlog=4) for _ in range(128)]
    try:
        eps = tuple(("127.0.0.1", s.getsockname()[1]) for s in silent)
        rp = RemotePrefill("q", *eps[0], "q-x", (np.arange(1, 3, dtype=np.int64),), (16,), time.monotonic() + 60, eps,
                           seal=b"\0" * 32)
        D.start_loads([Load("x", rp, (np.array([5, 6], dtype=np.int64),), 0, 31)])
        D.start_loads([Load("y", dataclasses.replace(rp, request_id="q-y"), (np.array([9, 10], dtype=np.int64),), 0,
                            31)])
        D.start_loads([_load(P, "a", [3, 4], [7, 8])])
        got = _drive(P, D, {"a"})
        assert got == ({"a"}, set()), got
        assert _moved(P, D, [3, 4], [7, 8])
        assert sum(r.state == "pending" for r in D.decode.remotes.values()) == MAX_HANDSHAKES_A_LOAD
    finally:
        for s in silent:            # (their queued connections reset: the forged handshakes end now)
            s.close()
    assert _drive(P, D, {"x", "y"}) == ({"x", "y"}, {"x", "y"})
    assert _zero(D, [5, 6, 9, 10])


def test_a_prefill_rank_answering_at_another_address_with_other_caches_takes_over(workers):
    """A prefill engine's rank handshaking at a second address with other caches (restarted elsewhere while its old
    connection still looks alive): its caches are mapped in place of the old ones, the old record fails over to a
    new handshake, and loads of both addresses land their own bytes."""
    P, D = workers(device_ids=False)
    P2, _ = workers(device_ids=False)              # another prefill of engine id "p" (and a decode left unused)
    D.start_loads([_load(P, "a", [3, 4], [7, 8])])
    assert _drive(P, D, {"a"}) == ({"a"}, set())
    D.start_loads([_load(P2, "b", [5, 6], [9, 10])])
    assert _drive(P2, D, {"b"}) == ({"b"}, set())
    assert _moved(P2, D, [5, 6], [9, 10])
    D.start_loads([_load(P, "c", [10, 11], [1, 2])])
    assert _drive(P, D, {"c"}) == ({"c"}, set())
    assert _moved(P, D, [3, 4, 10, 11], [7, 8, 1, 2])


def test_caches_registered_again_are_refused_and_loads_go_on(workers):
    """``register_kv_caches`` a second time: refused with a typed error (a second agent and side channel would leave
    the first open, and every later load of a prefill engine already handshaken with would fail over the first
    agent's peer); the worker's loads go on as before."""
    from gpuxfer.errors import BadInput
    P, D = workers(device_ids=False)
    D.start_loads([_load(P, "a", [3, 4], [7, 8])])
    assert _drive(P, D, {"a"}) == ({"a"}, set())
    server = D.server
    with pytest.raises(BadInput, match="register_kv_caches was called again"):
        D.register(D.caches)
    assert D.server is server
    D.start_loads([_load(P, "b", [5, 6], [9, 10])])
    assert _drive(P, D, {"b"}) == ({"b"}, set())
    assert _moved(P, D, [3, 4, 5, 6], [7, 8, 9, 10])
