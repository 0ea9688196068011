"""A metadata fuzzer: real metadata, mutated (a field of the wrong type, huge, negative or overflowing
numbers, missing keys, entries added or dropped) or as bytes (truncated, flipped, random), fed to
``KVAgent.add_peer`` both as a peer of this process and as another process's. Every outcome is a peer or a
:class:`~gpuxfer.errors.GpuxferError`, never another exception; a peer that is added only ever addresses what
was registered: a peer of this process the agent's own layers, another process's its mapped allocations."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

from gpuxfer.errors import GpuxferError
from gpuxfer.kv.agent import KVAgent
from gpuxfer.kv.metadata import METADATA_VERSION

_SETTINGS = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class _World:
    """Two agents over shared-memory arenas; ``body`` is the prefill agent's metadata as JSON."""

    def __init__(self, plat):
        self.bufs = [plat.alloc(1 << 15, d) for d in (0, 1)]
        views = [plat.as_tensor(b) for b in self.bufs]
        self.pre = KVAgent("prefill", platform=plat, device=0, timeout_s=60, host_notify=True)    # (host_words)
        self.dec = KVAgent("decode", platform=plat, device=1, timeout_s=60)
        for agent, flat in ((self.pre, views[0]), (self.dec, views[1])):
            layers = {f"model.layers.{i}.attn": flat[i * 4096:(i + 1) * 4096].view(torch.bfloat16).view(2, 4, 4, 2, 32)
                      for i in range(2)}
            agent.register_group("full", 4, layers)
            agent.register_group("mla", 4, {"layers.0.mla": flat[8192:8192 + 4 * 584].view(4, 584)})
        self.blob = self.pre.metadata()
        self.body = json.loads(self.blob[12:])

    def close(self):
        self.dec.close()
        self.pre.close()
        for b in self.bufs:
            b.close()


@pytest.fixture(scope="module")
def world():
    from gpuxfer.platforms.host import HostPlatform
    plat = HostPlatform()
    w = _World(plat)
    yield w
    w.close()
    plat.close()


def _blob(body) -> bytes:
    raw = json.dumps(body).encode()
    return struct.pack("<4sHHI", b"GXKV", METADATA_VERSION, 0, len(raw)) + raw


def _paths(node, path=()):
    """Every place in the JSON tree: (path, node)."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


_NUMBERS = st.one_of(st.sampled_from([0, 1, -1, 2, 63, 64, 255, 256, 4096, 1 << 31, 1 << 32, 1 << 62, (1 << 62) - 1,
                                      1 << 63, 1 << 64, -(1 << 63), 10 ** 30]),
                     st.integers(-(1 << 70), 1 << 70))
_VALUES = st.one_of(_NUMBERS, st.booleans(), st.none(), st.floats(allow_nan=True), st.text(max_size=20),
                    st.sampled_from(["", "00", "zz", "2f677831", "/gx1_2_abcdef01".encode().hex()]),
                    st.lists(_NUMBERS, max_size=3), st.dictionaries(st.text(max_size=5), _NUMBERS, max_size=2))


@st.composite
def _mutated(draw, body):
    """``body`` with 1..3 edits: a value replaced, shifted by a number, a key dropped, a list entry duplicated
    or dropped."""
    b = json.loads(json.dumps(body))
    for _ in range(draw(st.integers(1, 3))):
        places = [(p, n) for p, n in _paths(b) if p]
        path, node = draw(st.sampled_from(places))
        parent = b
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        kind = draw(st.sampled_from(["replace", "shift", "drop", "dup"]))
        if kind == "shift" and isinstance(node, int) and not isinstance(node, bool):
            parent[key] = node + draw(_NUMBERS)
        elif kind == "drop":
            del parent[key]
        elif kind == "dup" and isinstance(node, (list, dict)) and isinstance(parent, list):
            parent.append(json.loads(json.dumps(node)))
        else:
            parent[key] = draw(_VALUES)
    return b


def _identity(draw, b: dict) -> dict:
    """As the agent of this process the metadata names, or as another process's agent."""
    if draw(st.booleans()) and isinstance(b, dict):
        b["uid"], b["pid"] = "a" * 32, (b.get("pid") if isinstance(b.get("pid"), int) else 0) + 1
    return b


def _check_added(world, peer) -> None:
    """A peer that was added addresses only registered memory."""
    pre, dec = world.pre, world.dec
    try:
        if peer._local is not None:
            assert peer._local is pre._registry
            for name, g in peer.groups.items():
                assert g.layers == pre._registry.groups[name].layers
        else:
            for g in peer.groups.values():
                for lay, (a, off) in zip(g.layers, g.flats):
                    m = peer._mappings[a]
                    lo, hi = lay.span
                    assert m.ptr <= lay.ptr and lay.ptr + lay.extent <= m.ptr + m.nbytes
                    assert m.ptr <= lo <= hi <= m.ptr + m.nbytes
    finally:
        dec.remove_peer(peer)


def _add(world, blob) -> None:
    try:
        peer = world.dec.add_peer(blob)
    except GpuxferError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event("added")
    _check_added(world, peer)


@_SETTINGS
@given(data=st.data())
def test_structured_mutations_of_real_metadata(world, data):
    body = data.draw(_mutated(world.body))
    _add(world, _blob(_identity(data.draw, body)))
    assert not world.dec.peers


@_SETTINGS
@given(data=st.data())
def test_byte_mutations_of_real_metadata(world, data):
    blob = bytearray(world.blob)
    kind = data.draw(st.sampled_from(["truncate", "flip", "splice", "random"]))
    if kind == "truncate":
        blob = blob[:data.draw(st.integers(0, len(blob)))]
    elif kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(blob) - 1))
            blob[i] = data.draw(st.integers(0, 255))
    elif kind == "splice":
        i = data.draw(st.integers(12, len(blob)))
        blob = blob[:i] + data.draw(st.binary(max_size=40)) + blob[i:]
        blob[8:12] = struct.pack("<I", len(blob) - 12)          # a header that agrees: the body is parsed
    else:
        blob = bytearray(data.draw(st.binary(max_size=200)))
    _add(world, bytes(blob))
    assert not world.dec.peers
