"""The seal of the vLLM connector's ``kv_transfer_params``, without vLLM: params a prefill sealed check out; any field
a decode acts on, altered, does not; a missing or garbled seal is refused as the params are parsed; a decode worker
checks a load's seal against the key its prefill engine's handshake carried before anything is read (once a load),
so params altered by a client (another request's blocks, a pushed-out lease) fail that load alone with nothing
posted and no release sent with their key; a handshake without a seal key fails its loads, and a later load
handshakes again; the prefill worker's handshake carries the seal key, never the hold keys' secret."""
from __future__ import annotations

import dataclasses
import hmac
import pickle
import struct
import types

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gpuxfer.errors import BadInput
from gpuxfer.integrations.vllm import engines as engines_mod, loads as loads_mod, staging as staging_mod
from gpuxfer.integrations.vllm.handshake import decode_info, encode_info, engine_info
from gpuxfer.integrations.vllm.holds import make_key
from gpuxfer.integrations.vllm.lease import now
from gpuxfer.integrations.vllm.loads import Load
from gpuxfer.integrations.vllm.params import (BadSeal, BadTransferParams, RemotePrefill, build_params, check_seal,
                                              for_release, for_workers, parse_remote_prefill, seal_key)
from gpuxfer.integrations.vllm import params as params_mod
from gpuxfer.integrations.vllm.scheduler import SchedulerSide
from gpuxfer.integrations.vllm.worker import Settings, WorkerSide
from test_vllm_worker_polls import SEAL_KEY, _Client, _sealed

EPS = [("127.0.0.1", 5601), ("10.0.0.2", 5602)]


def made(tp: int = 1, key: bytes = SEAL_KEY, **kw) -> dict:
    args = dict(engine_id="p0", endpoints=EPS[:tp], request_id="r1", block_ids=[[3, 4, 5], [0, 7, 9]],
                block_sizes=[16, 32], lease_deadline=1234.5, key=make_key(b"s" * 16, "r1"), seal_key=key)
    args.update(kw)
    return build_params(**args)


def parsed(params: dict) -> RemotePrefill:
    return parse_remote_prefill(params, [16, 32])


@pytest.mark.parametrize("tp", [1, 2])
def test_params_a_prefill_sealed_check_out(tp):
    rp = parsed(made(tp))
    check_seal(rp, SEAL_KEY)
    with pytest.raises(BadSeal):
        check_seal(rp, seal_key(b"another engine's secret"))
    with pytest.raises(BadSeal, match="no seal key"):
        check_seal(rp, None)


def _alter(p: dict, field: str) -> None:
    if field == "block id":
        p["remote_block_ids"][0][1] += 1
    elif field == "other group's block id":
        p["remote_block_ids"][1][2] -= 1
    elif field == "block moved between groups":
        p["remote_block_ids"] = [p["remote_block_ids"][0] + [7], [0, 9]]
    elif field == "deadline":
        p["lease_deadline"] += 1000.0
    elif field == "request":
        p["remote_request_id"] = "r2"
    elif field == "engine":
        p["remote_engine_id"] = "p1"
    elif field == "block sizes":
        p["remote_block_sizes"] = [32, 32]
    elif field == "key":
        p["remote_key"] = make_key(b"s" * 16, "r1")
    elif field == "no key":
        del p["remote_key"]
    elif field == "host":
        p["remote_host"] = "10.0.0.9"
        if "remote_endpoints" in p:
            p["remote_endpoints"][0][0] = "10.0.0.9"
    elif field == "port":
        p["remote_port"] += 1
        if "remote_endpoints" in p:
            p["remote_endpoints"][0][1] += 1
    elif field == "rank 1's endpoint":
        p["remote_endpoints"][1][1] += 1
    elif field == "fewer ranks":
        del p["remote_endpoints"]
        p["tp_size"] = 1


def test_a_release_checks_without_the_block_ids():
    """What a worker is handed to release a request carries the digest of its block IDs instead of the arrays: its
    seal checks out, and that of params altered before it does not."""
    rp = parsed(made(2))
    check_seal(for_release(rp), SEAL_KEY)
    assert for_release(rp).block_ids == ()
    p = made(2)
    _alter(p, "block id")
    with pytest.raises(BadSeal):
        check_seal(for_release(parsed(p)), SEAL_KEY)


@pytest.mark.parametrize("field", ["block id", "other group's block id", "block moved between groups", "deadline",
                                   "request", "engine", "block sizes", "key", "no key", "host", "port"])
@pytest.mark.parametrize("tp", [1, 2])
def test_each_field_altered_fails_the_seal(field, tp):
    p = made(tp)
    _alter(p, field)
    rp = parsed(p)
    with pytest.raises(BadSeal):
        check_seal(rp, SEAL_KEY)


@pytest.mark.parametrize("field", ["rank 1's endpoint", "fewer ranks"])
def test_tensor_parallel_endpoints_altered_fail_the_seal(field):
    p = made(2)
    _alter(p, field)
    with pytest.raises(BadSeal):
        check_seal(parsed(p), SEAL_KEY)


@pytest.mark.parametrize("seal", [None, "", 7, ["ab"], "ab" * 31, "ab" * 33, "zz" * 32, " " + "ab" * 31 + "a",
                                  "é" * 64, "0x" + "ab" * 31])
def test_a_missing_or_garbled_seal_is_refused(seal):
    p = made()
    if seal is None:
        del p["remote_seal"]
    else:
        p["remote_seal"] = seal
    with pytest.raises(BadTransferParams, match="remote_seal"):
        parsed(p)


@given(key=st.binary(max_size=130), msg=st.binary(max_size=300))
@settings(max_examples=200, deadline=None)
def test_the_seal_mac_is_hmac_sha256(key, msg):
    """The seal's MAC (a copy of the key's HMAC object, made once a key) is HMAC-SHA256, a key longer than a block
    included, and the kept object is not changed by a MAC made from it."""
    rp = types.SimpleNamespace(signed=msg)
    assert params_mod.seal_of(rp, key) == hmac.digest(key, msg, "sha256")
    assert params_mod.seal_of(rp, key) == hmac.digest(key, msg, "sha256")      # (from the kept object)


def test_what_a_seal_covers_is_made_once_and_a_copy_with_other_fields_makes_its_own():
    """The scheduler side makes what a load's seal covers (for_workers) and it travels with the params (pickled, as
    the step's metadata goes to the workers); a copy with any field replaced covers its own fields, so an altered
    copy of checked params fails its seal."""
    rp = for_workers(parsed(made(2)))
    assert "signed" in vars(rp)
    back = pickle.loads(pickle.dumps(rp))
    assert vars(back)["signed"] == rp.signed
    check_seal(back, SEAL_KEY)
    for change in ({"lease_deadline": rp.lease_deadline + 1000.0}, {"request_id": "r2"},
                   {"block_ids": (np.array([3, 4, 6]), rp.block_ids[1])}, {"endpoints": rp.endpoints[:1]},
                   {"key": None}, {"prompt": b"x" * 32}):
        forged = dataclasses.replace(rp, **change)
        with pytest.raises(BadSeal):
            check_seal(forged, SEAL_KEY)
    check_seal(dataclasses.replace(rp, token="t"), SEAL_KEY)        # (the claim token is not sealed)


def test_the_scheduler_seals_what_it_hands_out():
    """A finished prefill request's params carry the seal of its engine's seal key, a one-way derivation of the
    hold keys' secret; the secret itself appears nowhere in them."""
    s = SchedulerSide(engine_id="p0", block_sizes=[16], lease_s=60, endpoints=[("127.0.0.1", 5601)])
    req = types.SimpleNamespace(request_id="r1", kv_transfer_params={"do_remote_decode": True},
                                status=types.SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
    hold, params = s.request_finished(req, ([3, 4, 5],))
    assert hold and s.seal_key == seal_key(s.secret) != s.secret
    rp = parse_remote_prefill(params, [16])
    check_seal(rp, seal_key(s.secret))
    assert s.secret.hex() not in repr(params) and s.seal_key.hex() not in repr(params)


def test_the_prefill_handshake_carries_the_seal_key_once_keyed():
    w = WorkerSide(engine_id="p", model="m", dtype="auto/float16", layout=None,
                   groups=[("FullAttentionSpec", 16, ["l0"])],
                   settings=Settings(lease_s=60, host="127.0.0.1", port=0, handshake_timeout_s=5, token_major=True))
    w.info = engine_info(engine_id="p", model="m", dtype="auto/float16", layout=None, groups=[_group()])
    w._info_bytes = w._described()
    assert "seal_key" not in decode_info(w._info_bytes)
    secret = b"q" * 16
    w.keyed_by(secret)
    info = decode_info(w._info_bytes)
    assert info["seal_key"] == seal_key(secret).hex()
    assert secret.hex() not in w._info_bytes.decode() and "seal_key" not in w.info


# ------------------------------------------------------------------------------------------------- a decode worker

def _group():
    return {"kind": "FullAttentionSpec", "block_size": 16, "kernel_tokens": 16, "token_major": True,
            "layers": ["l0"], "bytes_per_token": 512, "pieces": 2, "content": [2, 128], "kv_heads": 2}


class _Handle:
    event = None

    def done(self) -> bool:
        return True


def _decode(monkeypatch, seal_keys: list, prefill_tp: int = 1, answer_after: int = 0):
    """A decode worker whose side channel reaches a prefill engine "p" (of ``prefill_tp`` ranks: port 1 + r is rank
    r) at any port; each new connection's handshake carries the next entry of ``seal_keys`` as its seal key (None:
    none), answered at its ``answer_after + 1``-th pump. Its agent records what is posted (remote block IDs, name);
    its clients what they send (as a real one, a closed client sends nothing)."""
    clients = []

    class Client(_Client):
        readers = 1

        def __init__(self, host, port, timeout_s):
            super().__init__()
            g = _group() if prefill_tp == 1 else dict(_group(), bytes_per_token=256, pieces=1, content=[1, 128],
                                                        kv_heads=1)
            self.info = engine_info(engine_id="p", model="m", dtype="auto/float16", layout=None, groups=[g],
                                    tp=(port - 1, prefill_tp))
            key = seal_keys[len(clients)]
            if key is not None:
                self.info["seal_key"] = key.hex() if isinstance(key, bytes) else key
            clients.append(self)

        def pump(self):
            self.pumps = getattr(self, "pumps", 0) + 1
            return (encode_info(self.info), b"meta") if self.pumps > answer_after else None

        def notify(self, op, reqs, keys=None, tokens=None) -> bool:
            if not self.alive:
                return False
            self.sent.append((op, list(reqs)))
            return True

    posted = []

    def post_many(xs):
        posted.extend(x.x for x in xs if x.x[1] != "warm-up")
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
    local = engine_info(engine_id="d", model="m", dtype="auto/float16", layout=None, groups=[_group()])
    agent = types.SimpleNamespace(
        timeout_s=60.0, peers={}, post_many=post_many,
        add_peer=lambda meta, route=None, pieces=None, local_pieces=None: types.SimpleNamespace(route="ipc",
                                                                                              engine="copy_engine"),
        prepare=lambda peer, op, local_blocks, remote_blocks, name=None, device_ids=False: _Prep(
            (np.asarray(remote_blocks["g0"]).tolist(), name)))
    w.decode.bind(agent, local, [16], [8192], None)
    return w, clients, posted


def _rp(req: str, blocks=(1, 2), deadline: float | None = None, tp: int = 1) -> RemotePrefill:
    eps = (("127.0.0.1", 1), ("127.0.0.1", 2))[:tp] if tp > 1 else ()
    return RemotePrefill("p", "127.0.0.1", 1, req, (np.array(blocks, dtype=np.int64),), (16,),
                         now() + 60 if deadline is None else deadline, eps, make_key(b"s" * 16, req))


def test_a_load_whose_params_were_altered_fails_alone_and_nothing_is_read(monkeypatch):
    """Three loads in a step from one prefill engine: one as sealed, one whose block IDs a client pointed at
    another request's blocks (in range: the agent would read them), one whose lease deadline a client pushed out.
    The altered two fail alone: nothing is posted for them, their blocks are load errors, no release goes out with
    their key (it would end the hold of the params they were altered from), and they claim nothing (the real
    params load later)."""
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY])
    good, other = _sealed(_rp("p-good", (1, 2))), _sealed(_rp("p-other", (5, 6)))
    stolen = dataclasses.replace(other, block_ids=good.block_ids)           # p-other's seal over p-good's blocks
    late = dataclasses.replace(_sealed(_rp("p-late", (3, 4))), lease_deadline=now() + 1e6)
    w.start_loads([Load("d-good", good, (np.array([7, 8]),), 0, 31),
                   Load("d-stolen", stolen, (np.array([9, 10]),), 0, 31),
                   Load("d-late", late, (np.array([11, 12]),), 0, 31)])
    _, recving, failed = w.poll()
    (client,) = clients
    assert recving == {"d-good", "d-stolen", "d-late"} and failed == {"d-stolen", "d-late"}
    assert posted == [([1, 2], "d-good")]
    assert w.take_load_errors() == {9, 10, 11, 12}
    assert client.sent == [("release", []), ("done", ["p-good"])]        # (the connection probed: names nothing)
    assert list(w.decode.claims) == [(("127.0.0.1", 1, "p"), "p-good")]
    w.start_loads([Load("d-other", other, (np.array([13, 14]),), 0, 31)])        # the real params of p-other
    assert w.poll()[1:] == ({"d-other"}, set())
    assert posted[-1] == ([5, 6], "d-other")


def test_a_load_of_several_prefill_ranks_checks_its_seal_once(monkeypatch):
    """A decode of TP 1 reading a prefill of TP 2: one load, a read from each rank; its seal is checked once."""
    checked = []

    def count(rp, key):
        checked.append(rp.request_id)
        return check_seal(rp, key)
    monkeypatch.setattr(staging_mod, "check_seal", count)        # (staging.pair_load checks a load's seal)
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY, SEAL_KEY], prefill_tp=2)
    rp = _sealed(_rp("p0", tp=2))
    w.start_loads([Load("d0", rp, (np.array([7, 8]),), 0, 31)])
    assert w.poll()[1:] == ({"d0"}, set())
    assert len(posted) == 2 and checked == ["p0"]


def test_a_prefill_of_more_ranks_than_one_loads_share_of_handshakes_is_handshaken_over_later_loads(monkeypatch):
    """A decode of TP 1 reading a prefill of TP 2, with one load's share of handshakes (MAX_HANDSHAKES_A_LOAD) made 1
    and rank 0's handshake answered at its third pump: the first load begins rank 0's handshake and fails for rank 1
    with no connection made; a second load while rank 0's is under way begins none; once rank 0 answered, a third
    load begins rank 1's and reads both ranks."""
    monkeypatch.setattr(loads_mod, "MAX_HANDSHAKES_A_LOAD", 1)
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY, SEAL_KEY], prefill_tp=2, answer_after=2)
    w.start_loads([Load("d0", _sealed(_rp("p0", tp=2)), (np.array([7, 8]),), 0, 31)])
    w.start_loads([Load("d1", _sealed(_rp("p1", tp=2)), (np.array([9, 10]),), 0, 31)])
    assert len(clients) == 1 and [(k[1], r.state) for k, r in w.decode.remotes.items()] == [(1, "pending")]
    got = set()
    for _ in range(3):
        got |= w.poll()[2]
    assert got == {"d0", "d1"} and w.decode.remotes[("127.0.0.1", 1, "p")].state == "ready"
    posted.clear()
    w.start_loads([Load("d2", _sealed(_rp("p2", tp=2)), (np.array([11, 12]),), 0, 31)])
    outs = [w.poll()[1:] for _ in range(4)]                # (rank 1's handshake answers at its third pump too)
    assert set().union(*(o[0] for o in outs)) == {"d2"} and not set().union(*(o[1] for o in outs))
    assert len(clients) == 2 and posted == [([1, 2], "d2"), ([1, 2], "d2")]


def test_a_handshake_without_a_seal_key_fails_its_loads_and_a_later_load_handshakes_again(monkeypatch, caplog):
    """A prefill engine whose handshake carries no seal key (a worker that ran none of the request's steps):
    its load fails with the reason logged and nothing posted or released; the record goes once no load names it,
    and the next load of that engine handshakes again (this time with a key) and loads."""
    w, clients, posted = _decode(monkeypatch, [None, SEAL_KEY])
    w.start_loads([Load("d0", _sealed(_rp("p0")), (np.array([7, 8]),), 0, 31)])
    assert w.poll()[1:] == ({"d0"}, {"d0"})
    assert w.take_load_errors() == {7, 8} and not posted and clients[0].sent == []
    assert any("carries no seal key" in m for m in caplog.messages)
    assert not w.decode.remotes                     # forgotten: no load names it
    w.start_loads([Load("d1", _sealed(_rp("p1")), (np.array([9, 10]),), 0, 31)])
    assert w.poll()[1:] == ({"d1"}, set())
    assert len(clients) == 2 and posted == [([1, 2], "d1")]


@pytest.mark.parametrize("key", ["", "ab" * 31, "zz" * 32, 7, ["ab" * 32]])
def test_a_handshake_with_a_malformed_seal_key_fails_with_a_typed_error(monkeypatch, key):
    w, clients, posted = _decode(monkeypatch, [key])
    w.start_loads([Load("d0", _sealed(_rp("p0")), (np.array([7, 8]),), 0, 31)])
    (r,) = w.decode.remotes.values()
    assert r.state == "failed" and r.error.startswith(f"{BadInput.__name__}: ") and "seal_key" in r.error
    assert w.poll()[1:] == ({"d0"}, {"d0"}) and not posted


def test_a_release_is_sent_for_sealed_params_no_load_claims_and_claims_them(monkeypatch):
    """The scheduler side releases the params of a request it will not load (nothing left to load, or aborted
    before its load). A release of params whose seal does not hold is not sent (its key is from nobody's params); one
    of a request a load of this worker is reading is not sent either (the prefill would free the blocks under the
    read); and a release sent claims the request, so the same params loaded afterwards fail rather than read blocks
    the release let the prefill free and reuse."""
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY])
    reading = _sealed(_rp("p-reading", (1, 2)))
    w.start_loads([Load("d-reading", reading, (np.array([7, 8]),), 0, 31)])      # posted, not reported yet
    (client,) = clients
    spare = _sealed(_rp("p-spare", (3, 4)))
    forged = [dataclasses.replace(_sealed(_rp(f"p-forged{i}", (5, 6))), lease_deadline=now() - 1) for i in range(2)]
    w.release([for_release(rp) for rp in (reading, spare, *forged)])      # (as the scheduler side hands them)
    assert client.sent == [("release", ["p-spare"]), ("release", [])]     # (then one probe for the failed seals)
    w.start_loads([Load("d-spare", spare, (np.array([9, 10]),), 0, 31)])
    _, recving, failed = w.poll()
    assert recving == {"d-reading", "d-spare"} and failed == {"d-spare"}
    assert posted == [([1, 2], "d-reading")] and w.take_load_errors() == {9, 10}


def test_a_refused_handshake_releases_only_the_sealed_loads_waiting_on_it(monkeypatch):
    """The prefill engine's caches cannot be mapped: the loads waiting on it fail, and those whose params carry its
    seal are released at once (the prefill frees their blocks); one whose params were altered is not (its key
    could be another request's)."""
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY], answer_after=1)

    def add_peer(*a, **k):
        raise engines_mod.GpuxferError("no mapping here")
    w.decode.engines.agent.add_peer = add_peer
    good = _sealed(_rp("p-good", (1, 2)))
    altered = dataclasses.replace(_sealed(_rp("p-altered", (3, 4))), block_ids=(np.array([5, 6]),))
    w.start_loads([Load("d-good", good, (np.array([7, 8]),), 0, 31),
                   Load("d-altered", altered, (np.array([9, 10]),), 0, 31)])
    assert len(clients) == 1                        # both waited on the handshake (answered at the second pump)
    assert clients[0].sent == [("release", ["p-good"])] and not clients[0].alive
    assert w.poll()[1:] == ({"d-good", "d-altered"}, {"d-good", "d-altered"}) and not posted


@pytest.mark.parametrize("how", ["no seal key", "caches not mapped"])
def test_a_load_that_fails_before_its_seal_checked_out_leaves_no_claim(monkeypatch, how):
    """A load whose params name a real prefill request but carry no seal of its engine (a far-off lease among what
    was altered), on a handshake that fails before they are checked: it fails and claims nothing, since a claim
    lasts as long as the params' lease deadline says and, while it stands, refuses every other load of that
    request. The real params, loaded after a fresh handshake, load; nothing of the forged ones is kept."""
    w, clients, posted = _decode(monkeypatch, [None if how == "no seal key" else SEAL_KEY, SEAL_KEY])
    add_peer = w.decode.engines.agent.add_peer
    if how == "caches not mapped":
        def refuse(*a, **k):
            raise engines_mod.GpuxferError("no mapping here")
        w.decode.engines.agent.add_peer = refuse
    real = _sealed(_rp("p-x", (1, 2)))
    forged = dataclasses.replace(_sealed(_rp("p-x", (1, 2)), seal_key(b"not the engine's")), lease_deadline=1e300)
    w.start_loads([Load("d-forged", forged, (np.array([7, 8]),), 0, 31)])
    assert w.poll()[1:] == ({"d-forged"}, {"d-forged"}) and not posted
    assert clients[0].sent == [] and w.decode.claims == {}
    w.decode.engines.agent.add_peer = add_peer
    w.start_loads([Load("d-real", real, (np.array([9, 10]),), 0, 31)])
    assert w.poll()[1:] == ({"d-real"}, set())
    assert len(clients) == 2 and posted == [([1, 2], "d-real")]
    assert list(w.decode.claims) == [(("127.0.0.1", 1, "p"), "p-x")]


def test_params_of_a_restarted_prefill_on_a_silently_dead_connection_handshake_again(monkeypatch):
    """A prefill engine restarted under the same engine id and port after its host was lost: the decode's connection
    to the old one never hears a close (nothing comes from a lost host; only a send finds the connection dead), so
    its record keeps the old seal key and the new engine's params fail their seal. A load failing its seal has the
    connection probed (an empty release: nothing for the prefill to do), once for the loads posted together; a dead
    connection then ends the record, and the next load handshakes again, gets the new key and loads."""
    new_key = seal_key(b"the restarted engine's secret")
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY, new_key])
    w.start_loads([Load("d0", _sealed(_rp("p0")), (np.array([7, 8]),), 0, 31)])
    assert w.poll()[1:] == ({"d0"}, set())
    (old,) = clients
    old.sent.clear()
    fresh = [_sealed(_rp(f"q{i}", (3, 4)), new_key) for i in range(2)]      # the restarted engine's params
    w.start_loads([Load(f"d{i + 1}", rp, (np.array([9 + 2 * i, 10 + 2 * i]),), 0, 31) for i, rp in enumerate(fresh)])
    assert w.poll()[1:] == ({"d1", "d2"}, {"d1", "d2"})
    assert old.sent == [("release", [])]            # one probe for the step's two
    old.alive = False                               # (what the probe found: the connection is dead)
    w.start_loads([Load("d3", _sealed(_rp("q3", (5, 6)), new_key), (np.array([13, 14]),), 0, 31)])
    assert w.poll()[1:] == ({"d3"}, set())
    assert len(clients) == 2 and posted[-1] == ([5, 6], "d3")


def test_the_sealed_encoding_is_fixed():
    """Both instances must encode what a seal covers alike, whatever version of gpuxfer each runs: the bytes of
    one case (a non-ASCII engine id, a lone surrogate in the request id, two ranks) are pinned."""
    import hashlib

    from gpuxfer.integrations.vllm.params import _canonical
    b = _canonical("p0\u00e9", "r1\ud800", bytes(range(32)), [16, 32], 1234.5,
                   [("127.0.0.1", 5601), ("h\U0001f600", 7)], None)
    assert len(b) == 132
    assert hashlib.sha256(b).hexdigest() == "63fbba88966f116bb81ada054a268b1ef9f04a39da8de95b809066a4e2ae1c90"


def _reference_canonical(engine_id, request_id, digest, block_sizes, lease_deadline, endpoints, key) -> bytes:
    """What a seal covers, each field packed on its own: the encoding :func:`_canonical` packs in one call."""
    def text(s):
        b = s.encode("utf-8", "surrogatepass")
        return struct.pack("<I", len(b)) + b
    parts = [b"gpuxfer-params-1\0", text(engine_id), text(request_id), digest,
             struct.pack(f"<I{len(block_sizes)}q", len(block_sizes), *block_sizes),
             struct.pack("<dI", lease_deadline, len(endpoints))]
    for h, p in endpoints:
        parts += [text(h), struct.pack("<I", p)]
    parts.append(text(key or ""))
    return b"".join(parts)


_TEXT = st.text(min_size=1, max_size=12)        # (lone surrogates included)
_DIGEST = st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40),
                    st.binary(max_size=40).map(bytearray), st.binary(max_size=40).map(memoryview))


@settings(max_examples=400, deadline=None)
@given(engine_id=_TEXT, request_id=_TEXT, digest=_DIGEST,
       block_sizes=st.lists(st.one_of(st.integers(1, 1 << 20), st.integers(-2 ** 63, 2 ** 63 - 1)), max_size=4),
       lease_deadline=st.one_of(st.floats(), st.integers(-2 ** 53, 2 ** 53)),
       endpoints=st.lists(st.tuples(st.text(max_size=12), st.integers(0, 2 ** 32 - 1)), max_size=4),
       key=st.one_of(st.none(), st.text(alphabet=st.characters(max_codepoint=127), min_size=1, max_size=64)))
def test_what_a_seal_covers_is_the_reference_encoding_for_any_field(engine_id, request_id, digest, block_sizes,
                                                                     lease_deadline, endpoints, key):
    """Every value the params' parser admits (and wider: any int64 block size, any uint32 port, a NaN or infinite
    deadline, an empty host or endpoint list) and a digest of any length, as bytes or another buffer, encode to the
    bytes of the reference encoding: a digest is never padded or cut to 32 bytes."""
    from gpuxfer.integrations.vllm.params import _canonical
    args = (engine_id, request_id, digest, block_sizes, lease_deadline, endpoints, key)
    want = _reference_canonical(*args)
    assert _canonical(*args) == want


@pytest.mark.parametrize("digest", [b"\1" * 31, b"\1" * 33, b""])
def test_a_digest_of_another_length_than_32_bytes_is_encoded_as_given(digest):
    """A 33-byte digest is not cut to its first 32 bytes (the seal of the digest's prefix), nor a 31-byte one
    padded."""
    from gpuxfer.integrations.vllm.params import _canonical
    args = ("p0", "r1", digest, [16], 1.5, [("h", 1)], None)
    assert _canonical(*args) == _reference_canonical(*args)
    assert _canonical(*args) != _canonical("p0", "r1", (digest + bytes(32))[:32], [16], 1.5, [("h", 1)], None)


def test_a_loads_seal_is_checked_under_its_engines_key_with_that_keys_kept_hmac():
    """The engine thread checks a load's seal with its engine's key's HMAC object (params.keyed_mac, made at the
    handshake, another key's kept beside it): params sealed with the engine's key pass, again and again (a check
    leaves the kept object as it was), params altered after sealing fail with BadSeal, and params sealed with
    another key (a stale one) fail too."""
    from gpuxfer.integrations.vllm.lease import SAME_HOST
    from gpuxfer.integrations.vllm.params import keyed_mac
    other = b"o" * 32
    keyed_mac(SEAL_KEY), keyed_mac(other)

    def pair(rp):
        r = types.SimpleNamespace(client=_Client(), seal_key=SEAL_KEY, clock=SAME_HOST, world=1, rank=0,
                                  sources=(0,), reads=(), key=("h", 1, "p"))
        load = Load("d0", rp, (np.array([7, 8]),), 0, 31)
        st = types.SimpleNamespace(load=load, remote=r, part=0, nbytes=0)
        return staging_mod.pair_load(types.SimpleNamespace(tp_rank=0, tp_size=1), st), load

    good = _sealed(_rp("p0"))
    for _ in range(2):
        pairs, load = pair(good)
        assert pairs is None and load.sealed == SEAL_KEY    # (sealed; no group read from this engine: nothing moves)
    altered = dataclasses.replace(good, lease_deadline=good.lease_deadline + 1)     # (its seal kept)
    with pytest.raises(BadSeal):
        pair(altered)
    with pytest.raises(BadSeal):
        pair(_sealed(_rp("p0"), other))                     # (sealed with the stale key: not the engine's seal)
