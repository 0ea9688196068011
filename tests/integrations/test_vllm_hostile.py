"""The vLLM connector's worker side under hostile orders of calls and peers, without vLLM: a handshake whose loads
timed out before it did, shutdown while the engine thread steps, loads after shutdown, a peer's description or
handshake answer past what a real one can be, the handshakes under way at once, releases from strangers in the
log, a load named again while in flight."""
from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from gpuxfer.errors import BadInput
from gpuxfer.integrations.vllm.channel import MAX_INFO, ChannelClosed, SideChannelClient, frame
from gpuxfer.integrations.vllm.handshake import INFO_VERSION, decode_info, encode_info
from gpuxfer.integrations.vllm import engines
from gpuxfer.integrations.vllm.lease import now
from gpuxfer.integrations.vllm.loads import Load, _Remote
from gpuxfer.integrations.vllm.params import RemotePrefill
from gpuxfer.kv.metadata import MAX_METADATA_BYTES
from gpuxfer.integrations.vllm.holds import make_key
from test_vllm_worker_polls import _Client, _in_flight, _Server, _two_part_load, _worker


def _load(req: str, port: int, engine: str = "p") -> Load:
    rp = RemotePrefill(engine, "127.0.0.1", port, f"{engine}-{req}", (np.arange(1, 3),), (16,), now() + 60)
    return Load(req, rp, (np.arange(5, 7),), 0, 31)


def test_a_handshake_its_loads_gave_up_on_first_is_closed():
    """A prefill that accepts the connection and says nothing: the load fails at its handshake timeout, read from
    the step's clock, which a handshake begun later in the step (behind other loads of the step) has not reached
    yet. That handshake must end with its last load, not stay pending with its socket open for good (a poll
    advances handshakes only while loads wait)."""
    w = _worker()
    silent = socket.create_server(("127.0.0.1", 0))     # listens; never accepts, never answers
    try:
        w.decode.start([_load("a", silent.getsockname()[1])])
        (r,) = w.decode.remotes.values()
        got = w.decode.finished(time.monotonic() + w.settings.handshake_timeout_s + 1)
        assert got == ({"a"}, {"a"})
        assert not w.decode.pending
        assert not w.decode.remotes and not r.client.alive
    finally:
        w.close()
        silent.close()


def test_shutdown_while_the_engine_thread_names_a_new_prefill():
    """vLLM's shutdown comes from another thread than the engine's steps: a client's close waits for its sender
    thread (up to seconds), and a step naming a new prefill engine meanwhile must neither break the shutdown
    (a dict changing under its iteration) nor open a connection once the shutdown began."""
    w = _worker()
    r = _Remote(("127.0.0.1", 1, "p"), state="ready", client=_Client())
    w.decode.remotes[r.key] = r
    closing, named = threading.Event(), threading.Event()

    def close():
        closing.set()
        assert named.wait(10)
        r.client.alive = False
    r.client.close = close
    silent = socket.create_server(("127.0.0.1", 0))
    errors = []

    def engine():
        try:
            assert closing.wait(10)
            w.start_loads([_load("b", silent.getsockname()[1], engine="q")])
        except BaseException as exc:        # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            named.set()
    t = threading.Thread(target=engine)
    t.start()
    try:
        w.close()
        t.join(10)
        assert not t.is_alive() and not errors
        q = w.decode.remotes[("127.0.0.1", silent.getsockname()[1], "q")]
        assert q.state == "failed" and q.client is None        # no connection made past the shutdown
        assert w.poll() == (set(), {"b"}, {"b"})
    finally:
        silent.close()


def _info(**kw) -> dict:
    g = {"kind": "MLAAttentionSpec", "block_size": 16, "kernel_tokens": 16, "token_major": True, "layers": ["l0"],
         "bytes_per_token": 576, "content": [1, 576], "pieces": 1, "kv_heads": 1}
    return dict({"version": INFO_VERSION, "engine_id": "p", "model": "m", "dtype": "auto/bfloat16", "layout": None,
                 "groups": [g]}, **kw)


@pytest.mark.parametrize("tp", [{"tp_size": 1 << 40}, {"tp_size": 1 << 40, "tp_rank": 0}, {"tp_size": 0},
                                {"tp_size": -2}, {"tp_size": 2.0}, {"tp_size": "2"}, {"tp_size": True},
                                {"tp_rank": -1}, {"tp_rank": 2, "tp_size": 2}, {"tp_rank": 0.0}, {"tp_rank": None}])
def test_a_peer_description_naming_a_hostile_tensor_parallel_size_is_refused(tp):
    """The decode side lists the prefill ranks it reads from a peer's tensor parallel size (one per rank): a forged
    size of 2^40 would have it build a list of 2^40 ranks on the engine thread (an MLA group pairs with a prefill
    of any size, and a refused handshake looks the ranks up too). The description is refused by name instead."""
    with pytest.raises(BadInput, match="tensor parallel"):
        decode_info(encode_info(_info(**tp)))


def test_a_peer_description_of_a_plausible_tensor_parallel_size_is_taken():
    assert decode_info(encode_info(_info()))["engine_id"] == "p"
    assert decode_info(encode_info(_info(tp_rank=3, tp_size=4)))["tp_size"] == 4


@pytest.mark.parametrize("answer", [
    struct.pack(">I", MAX_INFO + 1),                                         # an engine description
    frame(b"{}") + struct.pack(">I", MAX_METADATA_BYTES + (1 << 20)),       # agent metadata
    frame(b"{}") + frame(b"m") + struct.pack(">I", 9),                      # the 8-byte clock
], ids=["description", "metadata", "clock"])
def test_a_handshake_answer_longer_than_its_frame_can_be_is_refused_at_its_length(answer):
    """Each frame of a handshake answer has a most it can hold (a description of the most layers an agent's metadata
    lists, that metadata, a double): a length past it fails the handshake as it arrives, instead of having the
    decode buffer up to three frames of MAX_FRAME bytes (192 MiB) per prefill engine a request's params name."""
    lst = socket.create_server(("127.0.0.1", 0))
    go = threading.Event()

    def serve():
        s, _ = lst.accept()
        s.recv(100)
        s.sendall(answer)
        go.wait(30)
        s.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    c = SideChannelClient("127.0.0.1", lst.getsockname()[1], 30.0)
    try:
        with pytest.raises(ChannelClosed, match="bytes"):
            c.handshake()
        assert not c.alive
    finally:
        go.set()
        c.close()
        t.join(10)
        lst.close()


def test_handshakes_under_way_at_once_are_bounded(monkeypatch):
    """Each request's params may name prefill ranks of its own (up to MAX_TP of them a request), each a connection
    until its handshake ends (up to its timeout): past MAX_HANDSHAKES under way, a load naming a new engine fails
    at once with no connection made, so hostile params cannot take every file descriptor of the engine."""
    monkeypatch.setattr(engines, "MAX_HANDSHAKES", 2)
    w = _worker()
    silent = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    try:
        w.decode.start([_load(f"r{i}", s.getsockname()[1], engine=f"e{i}") for i, s in enumerate(silent)])
        states = {k[2]: (r.state, r.client is not None) for k, r in w.decode.remotes.items()}
        assert states == {"e0": ("pending", True), "e1": ("pending", True), "e2": ("failed", False)}
        assert w.poll() == (set(), {"r2"}, {"r2"})
        assert set(k[2] for k in w.decode.remotes) == {"e0", "e1"}
        w.decode.start([_load("r3", silent[2].getsockname()[1], engine="e2")])     # still two under way
        assert w.decode.remotes[("127.0.0.1", silent[2].getsockname()[1], "e2")].client is None
    finally:
        w.close()
        for s in silent:
            s.close()


def test_releases_that_do_not_count_are_not_logged_each_at_info(caplog):
    """Anyone reaching a prefill's side channel can queue up to MAX_EVENTS releases a step, each naming any request
    and no key: only a release that ends (or counts towards ending) a hold is logged at info, so a stranger cannot
    have the engine write a log line for each of them."""
    import logging
    w = _worker()
    w.server = srv = _Server()
    w.keyed_by(b"s" * 16)
    key = make_key(b"s" * 16, "held")
    w.hold({"held": (now() + 60, key)})
    for i in range(100):
        srv.events.put(("release", f"stranger{i}", 1, None, None))
    srv.events.put(("release", "held", 1, "0" * 24, None))                  # a held request, another key
    with caplog.at_level(logging.INFO, logger="gpuxfer.vllm"):
        assert w.poll()[0] == set()
        assert not [r for r in caplog.records if r.levelno == logging.INFO]
        srv.events.put(("release", "held", 1, key, None))
        assert w.poll()[0] == {"held"}
    assert [r.levelno for r in caplog.records if "released request held" in r.getMessage()] == [logging.INFO]
    assert w.take_stats()["forged"] == 101


def test_a_load_named_again_while_its_read_is_in_flight_changes_nothing():
    """A step's metadata naming a request whose load is still in flight (replayed metadata) must not take the
    place of that load: reported failed at once, it would have vLLM recompute the request while the read still
    writes its blocks, and report the request a second time when the read ends. The second load is dropped
    (logged); the first is reported once, when its read ended."""
    w = _worker()
    r, sts = _in_flight(w, 1, now() + 60)
    w.decode.claims[(r.key, sts[0].load.remote.request_id)] = (r, now() + 60)
    w.start_loads([sts[0].load])
    assert w.poll() == (set(), set(), set())
    assert w.decode.pending == {("d0", 0): sts[0]}
    sts[0].handle.finished = True
    assert w.poll() == (set(), {"d0"}, set())
    assert w.poll() == (set(), set(), set())
    assert r.client.sent == [("done", ["p0"])]
    # a load read from two prefill ranks, named again once one of its reads was reported
    w, ranks, sts = _two_part_load(True)
    sts[0].handle.finished = True
    assert w.poll() == (set(), set(), set()) and list(w.decode.pending) == [("d0", 1)]
    w.start_loads([sts[0].load])
    assert w.poll() == (set(), set(), set()) and w.decode._parts == {"d0": [1, False]}
    sts[1].handle.finished = True
    assert w.poll() == (set(), {"d0"}, set())
    assert [rk.client.sent for rk in ranks] == [[("done", ["p0"])], [("done", ["p0"])]]


def test_a_held_requests_key_is_compared_in_constant_time(monkeypatch):
    """A done or release message for a held request is counted only with the hold's key, a MAC: it is compared with
    ``hmac.compare_digest`` (a comparison that stops at the first wrong character would let a peer guess the key a
    character at a time), and a key of any characters (not ASCII, another length) is refused without an error."""
    import hmac
    from gpuxfer.integrations.vllm import holds
    compared, digest_eq = [], hmac.compare_digest

    def compare(a, b):
        compared.append((a, b))
        return digest_eq(a, b)
    monkeypatch.setattr(holds.hmac, "compare_digest", compare)
    w = _worker()
    w.server = srv = _Server()
    w.keyed_by(b"s" * 16)
    key = make_key(b"s" * 16, "held")
    w.hold({"held": (now() + 60, key)})
    for wrong in (key[:-1] + ("0" if key[-1] != "0" else "1"), "é" * len(key), "\ud800" * 3, key + "0", ""):
        srv.events.put(("release", "held", 1, wrong, None))
    assert w.poll()[0] == set()
    assert sum(key.encode() in (a, b) or key in (a, b) for a, b in compared) >= 3
    assert w.take_stats()["forged"] == 5
    assert w.prefill.claims.claim("held", key, "t1") is True        # the reader's claim, then its done
    srv.events.put(("done", "held", 1, key, "t1"))
    assert w.poll()[0] == {"held"}
