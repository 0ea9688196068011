"""A decode worker's claims against forged params, without vLLM: a load naming a request that another load of this
instance claimed whose params were not checked yet (its handshake under way, or earlier in the same step) waits for
that check instead of failing: forged params then fail alone and the genuine load reads; genuine params named twice
(vLLM's n > 1 children) still fail the second once the first's seal held; a claimant whose load ends before any
check (a handshake without a seal key) lets the waiting load start on its own."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from gpuxfer.integrations.vllm.loads import Load
from gpuxfer.integrations.vllm.params import seal_key
from test_vllm_seal import _decode, _rp
from test_vllm_worker_polls import SEAL_KEY, _sealed

CLAIM = (("127.0.0.1", 1, "p"), "p-x")


def _forged():
    """Params naming the genuine request p-x, sealed with a key that is not the prefill engine's."""
    return dataclasses.replace(_sealed(_rp("p-x", (1, 2)), seal_key(b"not the engine's")), lease_deadline=1e300)


def _poll_until(w, n: int):
    recving, failed = set(), set()
    for _ in range(n):
        _, r, f = w.poll()
        recving |= r
        failed |= f
    return recving, failed


def test_forged_params_during_a_handshake_do_not_fail_the_genuine_load(monkeypatch):
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY], answer_after=2)
    w.start_loads([Load("d-forged", _forged(), (np.array([7, 8]),), 0, 31)])
    assert w.poll()[1:] == (set(), set())                    # the handshake under way
    w.start_loads([Load("d-real", _sealed(_rp("p-x", (1, 2))), (np.array([9, 10]),), 0, 31)])
    recving, failed = _poll_until(w, 4)
    assert recving == {"d-forged", "d-real"} and failed == {"d-forged"}
    assert posted == [([1, 2], "d-real")]
    assert list(w.decode.claims) == [CLAIM]
    assert not w.decode._deferred and not w.decode._claimants and not w.decode.pending
    assert w.take_load_errors() == {7, 8}


def test_forged_params_first_in_the_same_step_do_not_fail_the_genuine_load(monkeypatch):
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY])
    w.start_loads([Load("d-warm", _sealed(_rp("p-w", (3, 4))), (np.array([5, 6]),), 0, 31)])
    assert _poll_until(w, 2) == ({"d-warm"}, set())          # the engine known and ready
    w.start_loads([Load("d-forged", _forged(), (np.array([7, 8]),), 0, 31),
                   Load("d-real", _sealed(_rp("p-x", (1, 2))), (np.array([9, 10]),), 0, 31)])
    recving, failed = _poll_until(w, 2)
    assert recving == {"d-forged", "d-real"} and failed == {"d-forged"}
    assert posted[-1] == ([1, 2], "d-real") and len(posted) == 2
    assert CLAIM in w.decode.claims


def test_genuine_params_named_twice_still_fail_the_second(monkeypatch):
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY], answer_after=1)
    real = _sealed(_rp("p-x", (1, 2)))
    w.start_loads([Load("d-a", real, (np.array([7, 8]),), 0, 31)])
    w.start_loads([Load("d-b", real, (np.array([9, 10]),), 0, 31)])
    recving, failed = _poll_until(w, 4)
    assert recving == {"d-a", "d-b"} and failed == {"d-b"}
    assert posted == [([1, 2], "d-a")]
    assert w.take_load_errors() == {9, 10}
    assert not w.decode._deferred and not w.decode.pending


def test_a_claimant_ended_unchecked_lets_the_waiting_load_start(monkeypatch):
    """The first handshake carries no seal key: the load claiming first fails unchecked (and drops its claim); the
    load waiting on it then starts, handshakes afresh and reads."""
    w, clients, posted = _decode(monkeypatch, [None, SEAL_KEY], answer_after=1)
    w.start_loads([Load("d-a", _forged(), (np.array([7, 8]),), 0, 31)])
    w.start_loads([Load("d-b", _sealed(_rp("p-x", (1, 2))), (np.array([9, 10]),), 0, 31)])
    recving, failed = _poll_until(w, 6)
    assert recving == {"d-a", "d-b"} and failed == {"d-a"}
    assert len(clients) == 2 and posted == [([1, 2], "d-b")]
    assert list(w.decode.claims) == [CLAIM]


def test_a_forged_claim_pruned_meanwhile_is_still_dropped_when_its_seal_fails(monkeypatch):
    """The claims are pruned (a poll that reported loads, past ``_prune_claims_at``) while forged params' handshake
    is under way: their claim, kept (its engine pending), is still the forged load's own, so it goes when their seal
    fails, and the genuine load waiting on it reads (a claim left would refuse every load of the request until its
    forged lease deadline)."""
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY], answer_after=2)
    w.start_loads([Load("d-forged", _forged(), (np.array([7, 8]),), 0, 31)])
    assert w.poll()[1:] == (set(), set())
    w.decode._prune_claims()
    assert CLAIM in w.decode.claims
    w.start_loads([Load("d-real", _sealed(_rp("p-x", (1, 2))), (np.array([9, 10]),), 0, 31)])
    recving, failed = _poll_until(w, 4)
    assert recving == {"d-forged", "d-real"} and failed == {"d-forged"}
    assert posted == [([1, 2], "d-real")]
    assert w.decode.claims[CLAIM][1] != 1e300


def test_an_unchecked_claim_pruned_meanwhile_goes_when_its_load_ends_unchecked(monkeypatch):
    """As above, the handshake carrying no seal key: the load fails unchecked and its claim, pruned meanwhile, still
    goes; a later load of the request handshakes again and reads."""
    w, clients, posted = _decode(monkeypatch, [None, SEAL_KEY], answer_after=1)
    w.start_loads([Load("d-a", _forged(), (np.array([7, 8]),), 0, 31)])
    w.decode._prune_claims()
    assert _poll_until(w, 3) == ({"d-a"}, {"d-a"})
    assert CLAIM not in w.decode.claims
    w.start_loads([Load("d-b", _sealed(_rp("p-x", (1, 2))), (np.array([9, 10]),), 0, 31)])
    assert _poll_until(w, 4) == ({"d-b"}, set())
    assert posted == [([1, 2], "d-b")]


def test_forged_params_of_a_prefill_of_two_ranks_do_not_fail_the_genuine_load(monkeypatch):
    """As the first test, the prefill of two ranks (one read from each, reported together): forged params naming
    the genuine request reach the worker first, while both ranks' handshakes are under way; the genuine load's
    parts wait for them, then read both ranks."""
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY, SEAL_KEY], prefill_tp=2, answer_after=2)
    forged = dataclasses.replace(_sealed(_rp("p-x", (1, 2), tp=2), seal_key(b"not the engine's")),
                                 lease_deadline=1e300)
    w.start_loads([Load("d-forged", forged, (np.array([7, 8]),), 0, 31)])
    assert w.poll()[1:] == (set(), set())
    w.start_loads([Load("d-real", _sealed(_rp("p-x", (1, 2), tp=2)), (np.array([9, 10]),), 0, 31)])
    recving, failed = _poll_until(w, 5)
    assert recving == {"d-forged", "d-real"} and failed == {"d-forged"}
    assert posted == [([1, 2], "d-real")] * 2
    assert not w.decode._deferred and not w.decode._claimants and not w.decode.pending and not w.decode._parts
    assert w.take_load_errors() == {7, 8}


def test_genuine_params_of_a_prefill_of_two_ranks_named_twice_still_fail_the_second(monkeypatch):
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY, SEAL_KEY], prefill_tp=2, answer_after=1)
    real = _sealed(_rp("p-x", (1, 2), tp=2))
    w.start_loads([Load("d-a", real, (np.array([7, 8]),), 0, 31)])
    w.start_loads([Load("d-b", real, (np.array([9, 10]),), 0, 31), Load("d-c", real, (np.array([11, 12]),), 0, 31)])
    recving, failed = _poll_until(w, 5)
    assert recving == {"d-a", "d-b", "d-c"} and failed == {"d-b", "d-c"}
    assert posted == [([1, 2], "d-a")] * 2
    assert w.take_load_errors() == {9, 10, 11, 12}
    assert not w.decode._deferred and not w.decode.pending and not w.decode._parts


def test_several_loads_waiting_on_a_forged_claim_start_one_at_a_time(monkeypatch):
    """Forged params first, then the genuine params named twice (vLLM's n > 1 children) and another forgery: once
    the first forgery failed, the loads waiting start one after another on the claim, so one genuine load reads and
    the other fails as loaded twice."""
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY], answer_after=2)
    real = _sealed(_rp("p-x", (1, 2)))
    w.start_loads([Load("d-f1", _forged(), (np.array([1, 2]),), 0, 31)])
    w.start_loads([Load("d-f2", _forged(), (np.array([3, 4]),), 0, 31), Load("d-a", real, (np.array([5, 6]),), 0, 31),
                   Load("d-b", real, (np.array([7, 8]),), 0, 31)])
    recving, failed = _poll_until(w, 8)
    assert recving == {"d-f1", "d-f2", "d-a", "d-b"} and failed == {"d-f1", "d-f2", "d-b"}
    assert posted == [([1, 2], "d-a")]
    assert not w.decode._deferred and not w.decode._claimants and not w.decode.pending


def test_params_sealed_by_another_engine_rank_do_not_fail_the_genuine_load(monkeypatch):
    """Params of a prefill of two ranks naming a side channel their maker runs as rank 0 (so they carry its seal, its
    key from its own handshake) and the genuine rank 1 under the genuine request: checked at rank 0, they are not
    at rank 1 (another key), so the genuine load's part waiting on their claim there waits for that check too."""
    rogue = seal_key(b"a side channel the params' maker runs")
    w, clients, posted = _decode(monkeypatch, [rogue, SEAL_KEY, SEAL_KEY], prefill_tp=2, answer_after=2)
    eps = (("10.0.0.9", 1), ("127.0.0.1", 2))
    forged = _sealed(dataclasses.replace(_rp("p-x", (1, 2), tp=2), host="10.0.0.9", endpoints=eps), rogue)
    w.start_loads([Load("d-forged", forged, (np.array([7, 8]),), 0, 31)])
    clients[1].pumps = -3                   # (rank 1 answers later than the params' maker)
    assert w.poll()[1:] == (set(), set())
    w.start_loads([Load("d-real", _sealed(_rp("p-x", (1, 2), tp=2)), (np.array([9, 10]),), 0, 31)])
    recving, failed = _poll_until(w, 8)
    assert recving == {"d-forged", "d-real"} and failed == {"d-forged"}
    assert posted.count(([1, 2], "d-real")) == 2


def _random_step(rng, i: int, tp: int, started: dict) -> list:
    """Step ``i``'s loads: one or two, each of p-x or p-y, forged (sealed with another key, a far-off lease) or genuine,
    on a prefill of ``tp`` ranks; ``started`` gets ``{load name: (request, kind)}``."""
    batch = []
    for j in range(rng.randrange(1, 3)):
        req, kind = rng.choice(["p-x", "p-y"]), rng.choice(["forged", "real"])
        rp = _sealed(_rp(req, (1, 2), tp=tp))
        if kind == "forged":
            rp = dataclasses.replace(_sealed(_rp(req, (1, 2), tp=tp), seal_key(b"x")), lease_deadline=1e300)
        started[f"d{i}-{j}"] = (req, kind)
        batch.append(Load(f"d{i}-{j}", rp, (np.array([10 * i + 2 * j + 100, 10 * i + 2 * j + 101]),), 0, 31))
    return batch


@pytest.mark.parametrize("seed", range(40))
def test_any_order_of_forged_and_genuine_loads_reports_each_once_and_reads_once(monkeypatch, seed):
    """Forged and genuine params of one request (and of a second one), started in random steps over engines whose
    handshakes answer late, with claims pruned at random: every load is reported exactly once within a bound, the
    forged ones failed, exactly one load of each request whose genuine params came reads (none of the others), and
    nothing is left deferred or claimed by a load that ended."""
    rng = random.Random(seed)
    tp = rng.choice([1, 2])
    w, clients, posted = _decode(monkeypatch, [SEAL_KEY] * 8, prefill_tp=tp, answer_after=rng.randrange(4))
    started, reported, failed = {}, set(), set()
    for i in range(rng.randrange(3, 9)):
        w.start_loads(_random_step(rng, i, tp, started))
        if rng.random() < 0.3:
            w.decode._prune_claims()
        for _ in range(rng.randrange(3)):
            _, r, f = w.poll()
            assert not (r & reported)
            reported |= r
            failed |= f
    for _ in range(12):
        _, r, f = w.poll()
        assert not (r & reported)
        reported |= r
        failed |= f
    assert reported == set(started)
    assert {n for n, (_, kind) in started.items() if kind == "forged"} <= failed
    readers = [n for n in reported - failed]
    assert all(started[n][1] == "real" for n in readers)
    for req in ("p-x", "p-y"):
        real = any(started[n] == (req, "real") for n in started)
        assert len([n for n in readers if started[n][0] == req]) == int(real)
    assert len({name for _, name in posted}) == len(posted) // tp and set(readers) == {name for _, name in posted}
    assert not w.decode._deferred and not w.decode._claimants and not w.decode.pending and not w.decode._parts
    assert all(held[1] != 1e300 for held in w.decode.claims.values())


@pytest.mark.parametrize("seed", range(60))
def test_any_order_with_failed_handshakes_releases_and_engines_gone_reports_each_once(monkeypatch, seed):
    """As above, some handshakes carrying no seal key, releases of the genuine params and connections closing among
    the steps: every load is reported exactly once within a bound, the forged ones failed, at most one load of each
    request reads, and nothing is left deferred, pending or claimed by a load that ended."""
    rng = random.Random(1000 + seed)
    tp = rng.choice([1, 2])
    keys = [rng.choice([SEAL_KEY, SEAL_KEY, None]) for _ in range(64)]
    w, clients, posted = _decode(monkeypatch, keys, prefill_tp=tp, answer_after=rng.randrange(4))
    w.decode.agent.remove_peer = lambda peer: None
    started, reported, failed = {}, set(), set()

    def poll():
        _, r, f = w.poll()
        assert not (r & reported) and f <= r
        reported.update(r)
        failed.update(f)

    for i in range(rng.randrange(3, 10)):
        w.start_loads(_random_step(rng, i, tp, started))
        if rng.random() < 0.2:
            w.release([_sealed(_rp(rng.choice(["p-x", "p-y"]), (1, 2), tp=tp))])
        if rng.random() < 0.2 and clients:
            rng.choice(clients).close()
        if rng.random() < 0.2:
            w.decode._prune_claims()
        for _ in range(rng.randrange(3)):
            poll()
    for _ in range(20):
        poll()
    assert reported == set(started)
    assert {n for n, (_, kind) in started.items() if kind == "forged"} <= failed
    readers = reported - failed
    assert all(started[n][1] == "real" for n in readers)
    for req in ("p-x", "p-y"):
        assert len([n for n in readers if started[n][0] == req]) <= 1
    assert not w.decode._deferred and not w.decode._claimants and not w.decode.pending and not w.decode._parts
    assert not w.decode.waiting and not w.decode.inflight and not w.decode.ended and not w.decode.unanswered
    assert all(held[1] != 1e300 for held in w.decode.claims.values())
