"""The vLLM connector against peers and params that disagree, and peers that send too much: a load is never
reported done while heads of its blocks were read from no prefill rank (the peer a part reached is the rank the
params name for that part, of the size they name); a decode's message stays within MAX_MESSAGE whatever its
request IDs' characters; the words that come before their hold are bounded in all, not per request by what a
message claims; so are the host names resolved at once. No vLLM import."""
from __future__ import annotations

import time
import types

import numpy as np
import pytest

from gpuxfer.integrations.vllm import channel, engines as engines_mod
from gpuxfer.integrations.vllm.handshake import encode_info, engine_info
from gpuxfer.integrations.vllm.holds import PrefillHolds
from gpuxfer.integrations.vllm.lease import now
from gpuxfer.integrations.vllm.loads import Load
from gpuxfer.integrations.vllm.params import RemotePrefill
from gpuxfer.integrations.vllm.worker import Settings, WorkerSide
from test_vllm_worker_polls import SEAL_KEY, _Client, _sealed


def _group(heads):
    return {"kind": "FullAttentionSpec", "block_size": 16, "kernel_tokens": 16, "token_major": True,
            "layers": ["l0"], "bytes_per_token": heads * 256, "pieces": heads, "content": [heads, 128],
            "kv_heads": heads}


class _Handle:
    event = None

    def done(self) -> bool:
        return True


def _decode(monkeypatch, peers: dict):
    """A decode worker of TP 1 (four heads) whose side channel reaches, at each port of ``peers``, the prefill
    rank ``(rank, world)`` it names; its agent records the pieces each read writes."""
    class Client(_Client):
        readers = 1

        def __init__(self, host, port, timeout_s):
            super().__init__()
            rank, world = peers[port]
            self.info = engine_info(engine_id="p", model="m", dtype="auto/float16", layout=None,
                                    groups=[_group(4 // world)], tp=(rank, world))
            self.info["seal_key"] = SEAL_KEY.hex()

        def pump(self):
            return encode_info(self.info), b"meta"

    written = []

    def add_peer(meta, route=None, pieces=None, local_pieces=None):
        return types.SimpleNamespace(route="ipc", engine="triton", local=local_pieces)

    def prepare(peer, op, local_blocks, remote_blocks, name=None, device_ids=False):
        return (peer, name)

    def post_many(xs):
        for peer, name in (x.x for x in xs):
            if name != "warm-up":
                written.append((name, (peer.local or {}).get("g0", (0, 4))))
        return [_Handle() for _ in xs]

    class _Prep:
        def __init__(self, x):
            self.x = x

        def post(self):
            post_many([self])
            return types.SimpleNamespace(wait=lambda timeout_s=None: None)

    monkeypatch.setattr(engines_mod, "SideChannelClient", Client)
    w = WorkerSide(engine_id="d", model="m", dtype="auto/float16", layout=None,
                   groups=[("FullAttentionSpec", 16, ["l0"])],
                   settings=Settings(lease_s=60, host="127.0.0.1", port=0, handshake_timeout_s=5, token_major=True,
                                     device_ids=False))
    local = engine_info(engine_id="d", model="m", dtype="auto/float16", layout=None, groups=[_group(4)], tp=(0, 1))
    agent = types.SimpleNamespace(timeout_s=60.0, peers={}, add_peer=add_peer, post_many=post_many,
                                  prepare=lambda *a, **k: _Prep(prepare(*a, **k)))
    w.decode.bind(agent, local, [16], [2048], None)
    return w, written


def _heads(written, req):
    covered = set()
    for name, (a, b) in written:
        if name == req:
            covered |= set(range(a, b))
    return covered


def test_a_load_whose_params_name_fewer_prefill_ranks_than_the_peer_runs_is_not_done_with_heads_unwritten(
        monkeypatch):
    """Params of one prefill rank (no remote_endpoints) reaching rank 0 of a prefill of TP 2: that peer holds
    heads 0 and 1 of this worker's four, so a read from it alone leaves heads 2 and 3 unwritten. Before the
    prefill of several ranks was read, such a pairing was refused at the handshake (sizes differ); it must not
    now be reported done."""
    w, written = _decode(monkeypatch, {1: (0, 2)})
    rp = _sealed(RemotePrefill("p", "127.0.0.1", 1, "p0", (np.arange(1, 3),), (16,), now() + 60))
    w.start_loads([Load("d0", rp, (np.array([7, 8]),), 0, 31)])
    _, recving, failed = w.poll()
    assert recving == {"d0"}
    assert failed == {"d0"} or _heads(written, "d0") == {0, 1, 2, 3}


def test_a_load_whose_two_endpoints_reach_one_prefill_rank_is_not_done_with_heads_unwritten(monkeypatch):
    """Params of a prefill of TP 2 whose two endpoints both reach its rank 1 (one rank under two addresses, or
    stale params after a restart moved the ports): both reads write heads 2 and 3; heads 0 and 1 come from no
    prefill rank, so the load fails."""
    w, written = _decode(monkeypatch, {1: (1, 2), 2: (1, 2)})
    rp = _sealed(RemotePrefill("p", "127.0.0.1", 1, "p0", (np.arange(1, 3),), (16,), now() + 60,
                               (("127.0.0.1", 1), ("127.0.0.1", 2))))
    w.start_loads([Load("d0", rp, (np.array([7, 8]),), 0, 31)])
    _, recving, failed = w.poll()
    assert recving == {"d0"}
    assert failed == {"d0"} or _heads(written, "d0") == {0, 1, 2, 3}


def test_a_load_read_from_its_two_prefill_ranks_writes_every_head(monkeypatch):
    """The well-formed case beside those: each prefill rank writes its half of the heads, the load is done."""
    w, written = _decode(monkeypatch, {1: (0, 2), 2: (1, 2)})
    rp = _sealed(RemotePrefill("p", "127.0.0.1", 1, "p0", (np.arange(1, 3),), (16,), now() + 60,
                               (("127.0.0.1", 1), ("127.0.0.1", 2))))
    w.start_loads([Load("d0", rp, (np.array([7, 8]),), 0, 31)])
    assert w.poll()[1:] == ({"d0"}, set())
    assert sorted(b for n, b in written if n == "d0") == [(0, 2), (2, 4)]


def test_a_done_list_of_long_escaped_request_ids_reaches_the_prefill():
    """A step's done list of MAX_IDS_PER_MESSAGE requests whose IDs (at most MAX_REQUEST_ID characters each, as
    both ends check) JSON writes as escapes: each message the decode sends stays within MAX_MESSAGE, so the
    prefill takes them all rather than closing the connection."""
    srv = channel.SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"meta"), 5.0)
    cli = channel.SideChannelClient("127.0.0.1", srv.port, 5.0)
    try:
        cli.handshake()
        n = channel.MAX_IDS_PER_MESSAGE
        ids = [f"{i:04d}" + "\u00e9" * (channel.MAX_REQUEST_ID - 4) for i in range(n)]
        cli.notify("done", ids, ["k" * 16] * n)
        got, t0 = [], time.monotonic()
        while len(got) < n and time.monotonic() - t0 < 10:
            srv.pump()
            while not srv.events.empty():
                got.append(srv.events.get_nowait())
            time.sleep(0.01)
        assert len(got) == n and {g[1] for g in got} == set(ids)
        assert cli.alive
    finally:
        cli.close()
        srv.close()


def test_words_before_their_hold_are_bounded_in_all():
    """A peer naming 256 readers in each word (the most a message may) for many requests none holds: what the
    prefill keeps of them stays bounded in all (not 2 x 256 words for each of MAX_RELEASED requests)."""
    stats = {"forged": 0, "sends_done": 0, "leases_expired": 0}
    h = PrefillHolds(engine_id="p", lease_s=60, stats=stats)
    srv = types.SimpleNamespace(events=None, pump=lambda: None)
    import queue
    t = time.monotonic()
    for batch in range(2):
        srv.events = queue.SimpleQueue()
        for r in range(512):
            for _ in range(2 * channel.MAX_READERS):
                srv.events.put(("done", f"r{batch}-{r}", channel.MAX_READERS, "x" * 16, None))
        h.drain(srv, t)
    words = sum(len(w) for w in h.early.values())      # (entries kept)
    assert words <= 1 << 18, words


def test_host_names_resolving_at_once_are_bounded(monkeypatch):
    """Params naming a new host name each (hostile, or a resolver that hangs): each client resolves its name on a
    thread; while lookups hang, no more than MAX_RESOLVING run, and a client past them fails its handshake at
    its first pump instead of starting another thread."""
    import socket
    import threading
    gate = threading.Event()
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *a, flags=0, **k):
        if flags & socket.AI_NUMERICHOST or host == "127.0.0.1":
            return real(host, port, *a, flags=flags, **k)
        gate.wait(10)
        raise socket.gaierror("no such name")

    monkeypatch.setattr(channel.socket, "getaddrinfo", getaddrinfo)
    limit = getattr(channel, "MAX_RESOLVING", 64)
    clients = []
    try:
        for i in range(limit + 32):
            clients.append(channel.SideChannelClient(f"h{i}.invalid", 1, 5.0))
        running = [t for t in threading.enumerate() if t.name == "gpuxfer-vllm-resolve"]
        assert len(running) <= limit
        with pytest.raises(channel.ChannelClosed, match="being resolved already"):
            clients[-1].pump()
    finally:
        gate.set()
        for c in clients:
            c.close()
