"""``ConnectOptions``: connect()'s settings in one frozen object, checked when built; keywords map onto it."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gpuxfer.errors import BadInput
from gpuxfer.pp import ConnectOptions


def test_defaults_and_normalised_values():
    o = ConnectOptions()
    assert (o.backend, o.platform, o.device, o.metadata, o.recv_slots, o.graph, o.recv_views) == \
        (None, None, None, True, 2, False, False)
    o = ConnectOptions(device=np.int64(3), recv_slots=np.int32(4), metadata=None, recv_views=1)
    assert (o.device, o.recv_slots, o.metadata, o.recv_views) == (3, 4, False, True)
    assert type(o.device) is int and type(o.recv_slots) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.recv_slots = 5


@pytest.mark.parametrize("bad, named", [
    (dict(recv_slots=1), "recv_slots"), (dict(recv_slots=True), "recv_slots"), (dict(recv_slots="4"), "recv_slots"),
    (dict(device=-1), "device"), (dict(device=1.5), "device"), (dict(metadata="yes"), "metadata"),
    (dict(timeout_s=0), "timeout"), (dict(timeout_s=float("inf")), "timeout"), (dict(on_timeout="abort"), "on_timeout"),
    (dict(flag_path="fast"), "flag_path"), (dict(inline_bytes=-1), "inline_bytes"), (dict(meta_channel="x"), "meta_channel"),
    (dict(backend="ucx"), "ucx"), (dict(graph=True, backend="nccl"), "graph=True"), (dict(inject_failure=3), "inject"),
])
def test_bad_settings_are_refused_when_built_naming_them(bad, named):
    with pytest.raises(BadInput, match=named):
        ConnectOptions(**bad)


def test_keywords_take_the_place_of_fields_and_are_checked_again():
    base = ConnectOptions(backend="nccl", timeout_s=30.0)
    o = base.with_settings({"backend": "copy_engine", "recv_slots": 3})
    assert (o.backend, o.timeout_s, o.recv_slots) == ("copy_engine", 30.0, 3) and base.backend == "nccl"
    assert base.with_settings({}) is base
    with pytest.raises(BadInput, match="recv_slots"):
        base.with_settings({"recv_slots": 0})
    with pytest.raises(TypeError, match="'recv_slot'"):
        base.with_settings({"recv_slot": 3})


def test_connect_refuses_an_unknown_keyword_before_any_collective():
    from gpuxfer.pp import connect
    with pytest.raises(TypeError, match="'timeout'"):
        connect(send_to=1, specs={}, timeout=5)
