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
