"""connect()'s settings and specs from a careless or hostile caller: every value is accepted or refused with
:class:`BadInput` naming it when the object is built, never another exception later (an overflow in a wait, a
wrapped size). The Hypothesis tests draw from the values a caller may pass by mistake."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuxfer import config
from gpuxfer.errors import BadInput
from gpuxfer.pp import ConnectOptions
from gpuxfer.pp.options import MAX_RECV_SLOTS
from gpuxfer.pp.spec import MAX_SLOT_BYTES, SpecTable
from gpuxfer.pp.transport import resolve_timeout
from gpuxfer.pp.watchdog import close_all


@pytest.mark.parametrize("bad, named", [
    (dict(timeout_s=1e10), "timeout"), (dict(timeout_s=1e300), "timeout"), (dict(timeout_s=10 ** 400), "timeout"),
    (dict(timeout_s=True), "timeout"), (dict(timeout_s=float("nan")), "timeout"), (dict(timeout_s=[5]), "timeout"),
    (dict(inline_bytes=float("nan")), "inline_bytes"), (dict(inline_bytes=float("inf")), "inline_bytes"),
    (dict(inline_bytes=[1]), "inline_bytes"), (dict(inline_bytes=1.5), "inline_bytes"),
    (dict(inline_bytes=True), "inline_bytes"), (dict(recv_slots=MAX_RECV_SLOTS + 1), "recv_slots"),
    (dict(recv_slots=10 ** 30), "recv_slots"), (dict(inject_failure="x"), "RANK:PHASE"),
    (dict(inject_failure="1:nope"), "RANK:PHASE"),
])
def test_values_that_failed_later_are_refused_when_built(bad, named):
    """Each of these was accepted and failed later: a timeout past the clocks' range (OverflowError out of
    every step), an inline size that is no integer (ValueError / TypeError), so many slots the per-slot lists
    exhaust memory, an injection spec only the rank it named parsed (the others hung in setup)."""
    with pytest.raises(BadInput, match=named):
        ConnectOptions(**bad)


def test_the_longest_timeout_is_accepted_and_the_variable_has_the_same_bound(monkeypatch):
    assert resolve_timeout(config.MAX_SECONDS) == config.MAX_SECONDS
    assert ConnectOptions(timeout_s=np.float32(2.5), inline_bytes=np.int64(4096), recv_slots=MAX_RECV_SLOTS)
    monkeypatch.setenv("GPUXFER_PP_TIMEOUT_S", "1e10")
    with pytest.raises(BadInput, match="GPUXFER_PP_TIMEOUT_S"):
        resolve_timeout(None)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "x", 1e10])
def test_close_all_checks_its_timeout(bad):
    with pytest.raises(BadInput, match="timeout"):
        close_all([], bad)


@pytest.mark.parametrize("spec, why", [
    ({"x": ((1 << 62, 4), torch.float32)}, "B per step"),          # int64 products wrapped to 0 B
    ({"x": ((1 << 62 | 1, 4), torch.uint8)}, "B per step"),        # ... to 4 elements
    ({"x": ((1000,), torch.uint8), "y": (((1 << 63) - 1,), torch.uint8)}, "B per step"),
    ({"x": ((10 ** 40,), torch.uint8)}, "2\\*\\*63"),              # OverflowError
    ({"x": ((0, 10 ** 30), torch.uint8)}, "2\\*\\*63"),             # no bytes, but no int64 metadata word
    ({"x": ((1.5,), torch.uint8)}, "integers"), ({"x": ((True,), torch.uint8)}, "integers"),
    ({"x": ("12", torch.uint8)}, "integers"),
    ({"x": ((1,), torch.uint8), 1: ((1,), torch.uint8)}, "names"),  # TypeError from sorted()
])
def test_specs_past_what_a_step_can_hold_are_refused(spec, why):
    with pytest.raises(BadInput, match=why):
        SpecTable(spec)


def test_the_largest_step_is_accepted():
    t = SpecTable({"x": ((MAX_SLOT_BYTES // 4,), torch.float32)})
    assert t.slot_bytes == MAX_SLOT_BYTES and t.max_numel == (MAX_SLOT_BYTES // 4,)


# --------------------------------------------------------------------------- property tests

_ANY = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
                 st.text(max_size=12), st.sampled_from(["auto", "nccl", "copy_engine", "copy_engine_graph", "sdma",
                                                         "remote", "copy", "group", "raise", "exit", "1M", "0",
                                                         "64K", "1:alloc", "0:probe,1:open", "-3", "1e400"]),
                 st.lists(st.integers(0, 4), max_size=2), st.just(object()))
_FIELDS = ("backend", "device", "timeout_s", "on_timeout", "metadata", "recv_slots", "flag_path",
           "inline_bytes", "recv_views", "graph", "meta_channel", "inject_failure")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(_FIELDS), _ANY, max_size=5))
def test_connect_options_accept_or_refuse_with_bad_input(kw):
    try:
        o = ConnectOptions(**kw)
    except BadInput:
        return
    # accepted: every value is one connect() can use as it is
    if o.timeout_s is not None:
        assert 0 < resolve_timeout(o.timeout_s) <= config.MAX_SECONDS
    assert 2 <= o.recv_slots <= MAX_RECV_SLOTS and type(o.recv_slots) is int
    assert o.device is None or (type(o.device) is int and o.device >= 0)
    assert all(type(getattr(o, f)) is bool for f in ("metadata", "recv_views", "graph"))
    if o.inline_bytes is not None:
        from gpuxfer.pp.copy_engine import inline_bytes_from_env
        assert inline_bytes_from_env(o.inline_bytes) >= 0


_DIM = st.one_of(st.integers(-3, 2 ** 64 + 5), st.sampled_from([0, 1, 2, 7, 2 ** 31, 2 ** 62 + 1, 2 ** 63]),
                 st.floats(allow_nan=True), st.booleans(), st.text(max_size=2))
_SHAPE = st.one_of(st.lists(_DIM, max_size=10).map(tuple), _DIM, st.none())
_DTYPE = st.one_of(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool,
                                    torch.complex64, torch.float8_e4m3fn]), st.text(max_size=3), st.none())
_ENTRY = st.one_of(st.tuples(_SHAPE, _DTYPE), st.tuples(_SHAPE), st.tuples(_SHAPE, _DTYPE, _DTYPE), _SHAPE)
_NAME = st.one_of(st.text(max_size=4), st.integers(0, 3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_NAME, _ENTRY, max_size=4), st.lists(_SHAPE, max_size=4))
def test_specs_and_step_shapes_accept_or_refuse_with_bad_input(spec, step):
    """A spec is refused with BadInput or holds sizes that add up (no wrapped product); a step's shapes
    against it give a layout inside the slot or BadInput."""
    try:
        t = SpecTable(spec)
    except BadInput:
        return
    for shape, dtype, numel, item in zip(t.max_shapes, t.dtypes, t.max_numel, t.itemsizes):
        assert numel == math.prod(shape) and numel * item <= t.slot_bytes <= MAX_SLOT_BYTES
    try:
        lay = t.layout(step)
    except BadInput:
        return
    assert lay.total <= t.slot_bytes
    buf = np.zeros(t.meta_len, dtype=np.int64)
    t.encode(buf, 1, lay.shapes)
    assert t.decode(buf, step=1, peer=0, rank=1) == lay.shapes


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, 0, 1e10, pytest.param(10 ** 400, id="1e400"),
                                 "120", None, True, [5]])
def test_init_cpu_group_checks_its_timeout(bad, tmp_path):
    """``init_cpu_group`` given a timeout no group can take (NaN, an infinity, past a week, not a number):
    BadInput naming it before any group is made, not datetime's ValueError, OverflowError or TypeError."""
    import torch.distributed as dist

    from gpuxfer.pp.launch import init_cpu_group
    try:
        with pytest.raises(BadInput, match="init_cpu_group's timeout_s"):
            init_cpu_group(0, 1, f"file://{tmp_path}/rendezvous", timeout_s=bad)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
