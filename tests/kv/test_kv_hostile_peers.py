"""Hostile and careless peers at ``KVAgent.add_peer`` on the host emulation: forged metadata of an agent of
this process (checked against its real registrations), a peer whose pid is ours in another PID namespace, a
failed add that leaves nothing behind, oversized metadata, and IPC payloads that are not what they claim.

Each agent's arena holds its layer and, right after it, guard bytes nobody registered: a forgery that got
through would read them (pull) or overwrite them (push)."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from gpuxfer.errors import BadInput, BadMetadata
from gpuxfer.kv.agent import KVAgent
from gpuxfer.kv.metadata import MAX_METADATA_ALLOCATIONS, MAX_METADATA_BYTES, METADATA_VERSION

BLOCKS, BLOCK = 4, 64
ALL = {"full": list(range(BLOCKS))}


def _blob(body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return struct.pack("<4sHHI", b"GXKV", METADATA_VERSION, 0, len(raw)) + raw


def _body(agent: KVAgent) -> dict:
    return json.loads(agent.metadata()[12:])


class Side:
    """An agent over one shared-memory buffer: its one layer at byte 0, guard bytes after it."""

    def __init__(self, plat, name: str, device: int, seed: int):
        self.buf = plat.alloc(1 << 14, device)
        flat = plat.as_tensor(self.buf)
        flat.copy_(torch.from_numpy(np.random.default_rng(seed).integers(0, 256, flat.numel(), dtype=np.uint8)))
        self.layer = flat[:BLOCKS * BLOCK].view(BLOCKS, BLOCK)
        self.guard = flat[BLOCKS * BLOCK:]
        self.agent = KVAgent(name, platform=plat, device=device, timeout_s=60)
        self.agent.register_group("full", 1, {"layers.0": self.layer})
        self.saved = (self.layer.clone(), self.guard.clone())

    def untouched(self) -> bool:
        return torch.equal(self.layer, self.saved[0]) and torch.equal(self.guard, self.saved[1])

    def close(self):
        self.agent.close()
        self.buf.close()


def _sides(plat):
    last = plat.device_count() - 1
    return Side(plat, "prefill", 0, seed=1), Side(plat, "decode", min(1, last), seed=2)


@pytest.fixture
def sides(host):
    pre, dec = _sides(host)
    yield pre, dec
    dec.close()
    pre.close()


@pytest.fixture
def any_sides(platform):
    """Both agents in this process on every platform present (CUDA: ``-m gpu``; one device is enough)."""
    pre, dec = _sides(platform)
    yield pre, dec
    dec.close()
    pre.close()


def _layer(body: dict) -> dict:
    return body["groups"][0]["layers"][0]


def _shift(body, _):
    _layer(body)["offset"] += BLOCKS * BLOCK                     # the layer moved onto the guard


def _more_blocks(body, _):
    _layer(body).update(num_blocks=2 * BLOCKS, extent=2 * BLOCKS * BLOCK)


def _wider_stride(body, _):
    _layer(body).update(block_stride=2 * BLOCK, extent=2 * BLOCKS * BLOCK)


def _moved_piece(body, _):
    _layer(body).update(pieces=[[BLOCKS * BLOCK, BLOCK]], extent=2 * BLOCKS * BLOCK)


def _extra_allocation(body, other):
    body["allocations"].append(_body(other)["allocations"][0])  # another agent's buffer, named as this one's
    _layer(body)["alloc"] = 1


def _larger_allocation(body, _):
    body["allocations"][0]["nbytes"] = 1 << 30                  # past the buffer: any memory of the process
    _layer(body)["offset"] = 1 << 29


FORGERIES = [_shift, _more_blocks, _wider_stride, _moved_piece, _extra_allocation, _larger_allocation]


@pytest.mark.parametrize("op", ["pull", "push"])
@pytest.mark.parametrize("forge", FORGERIES, ids=lambda f: f.__name__.strip("_"))
def test_forged_metadata_of_an_agent_of_this_process_is_refused(any_sides, op, forge):
    """Metadata naming a live agent of this process (its pid and uid) is checked against what that agent
    registered, not against the sizes it claims: a layer moved, grown or widened, an allocation added or
    enlarged is BadMetadata at add_peer (never an IndexError), and no byte of either side moves."""
    pre, dec = any_sides
    initiator, victim = (dec, pre) if op == "pull" else (pre, dec)    # pull reads the victim, push writes it
    body = _body(victim.agent)
    forge(body, initiator.agent)
    with pytest.raises(BadMetadata, match="names agent"):
        peer = initiator.agent.add_peer(_blob(body))
        # reached only where the forgery was accepted: the transfer shows what it touches
        initiator.agent.transfer(peer, op, local_blocks=ALL, remote_blocks=ALL).wait(60)
    assert pre.untouched() and dec.untouched()
    assert not initiator.agent.peers


def test_true_metadata_of_an_agent_of_this_process_moves_its_blocks(any_sides):
    """The check lets the real metadata through: a pull moves the peer's blocks and nothing else."""
    pre, dec = any_sides
    peer = dec.agent.add_peer(pre.agent.metadata())
    assert peer._local is pre.agent._registry and not peer._mappings
    dec.agent.transfer(peer, "pull", local_blocks={"full": [0, 1]}, remote_blocks={"full": [3, 2]}).wait(60)
    assert torch.equal(dec.layer[:2], pre.saved[0][[3, 2]]) and torch.equal(dec.layer[2:], dec.saved[0][2:])
    assert pre.untouched() and torch.equal(dec.guard, dec.saved[1])


def test_a_peer_with_our_pid_in_another_pid_namespace_is_a_remote_peer(sides):
    """Two containers sharing IPC but not PIDs may both be pid 1: a peer whose pid is ours but whose PID
    namespace is another is another process, added as a remote peer (its memory mapped from its handles, its
    layout checked against the mappings) and usable as one."""
    pre, dec = sides
    body = _body(pre.agent)
    body.update(uid="e" * 32, namespace="another-boot/0:1")
    peer = dec.agent.add_peer(_blob(body))
    assert peer._local is None and peer._mappings
    dec.agent.transfer(peer, "pull", local_blocks={"full": [1]}, remote_blocks={"full": [2]}).wait(60)
    assert torch.equal(dec.layer[1], pre.saved[0][2]) and pre.untouched()
    dec.agent.remove_peer(peer)
    # a remote peer's layout is held to its mappings: the guard-reading forgery is refused there too
    _larger_allocation(body, None)
    with pytest.raises(BadMetadata):
        dec.agent.add_peer(_blob(body))


def test_same_process_means_the_same_pid_in_the_same_namespace(sides):
    """Our pid in our namespace naming no live agent, or a live agent's uid claimed by another process, is
    refused."""
    pre, dec = sides
    body = _body(pre.agent)
    with pytest.raises(BadMetadata, match="not a live agent"):
        dec.agent.add_peer(_blob(dict(body, uid="d" * 32)))
    with pytest.raises(BadMetadata, match="of another process"):
        dec.agent.add_peer(_blob(dict(body, namespace="another-boot/0:1")))
    with pytest.raises(BadMetadata, match="of another process"):
        dec.agent.add_peer(_blob(dict(body, pid=body["pid"] + 1)))
    assert not dec.agent.peers


def _mappings(plat) -> int:
    return sum(1 for m in plat._memory.values() if not m.closed and type(m).__name__ == "PeerMapping")


def test_a_group_with_no_layers_is_bad_metadata(sides):
    pre, dec = sides
    body = _body(pre.agent)
    body["groups"][0]["layers"] = []
    with pytest.raises(BadMetadata, match="1 or more"):
        dec.agent.add_peer(_blob(body))


def test_a_failed_add_peer_leaves_nothing_behind(sides, host, monkeypatch):
    """A step of add_peer that fails after the peer's memory was mapped (here: building its routes) leaves no
    peer and no mapping behind; a retry with the same metadata then works."""
    pre, dec = sides
    body = _body(pre.agent)
    body.update(uid="c" * 32, namespace="another-boot/0:1")        # a remote peer: its memory is mapped
    before = _mappings(host)

    def broken(*a, **k):
        raise RuntimeError("route building failed")
    monkeypatch.setattr(dec.agent._routes, "build", broken)
    with pytest.raises(RuntimeError, match="route building"):
        dec.agent.add_peer(_blob(body))
    assert not dec.agent.peers and not dec.agent._routes.routes and _mappings(host) == before
    monkeypatch.undo()
    peer = dec.agent.add_peer(_blob(body))
    dec.agent.transfer(peer, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [1]}).wait(60)
    assert torch.equal(dec.layer[0], pre.saved[0][1])
    with pytest.raises(BadInput, match="already added"):
        dec.agent.add_peer(_blob(body))


# ----------------------------------------------------------------------------- amplification


def test_oversized_metadata_is_refused_before_parsing(sides):
    """A 64 MiB body of empty lists is refused by its length; one under the byte limit made of more JSON
    lists, objects or separators than real metadata holds is refused before it is parsed."""
    pre, dec = sides
    body = b"[" + b"[]," * ((64 << 20) // 3) + b"[]]"
    blob = struct.pack("<4sHHI", b"GXKV", METADATA_VERSION, 0, len(body)) + body
    with pytest.raises(BadMetadata, match="exceeds"):
        dec.agent.add_peer(blob)
    n = (MAX_METADATA_BYTES - 8) // 3
    for body in (b"[" + b"[]," * n + b"[]]", b"[" + b"0," * n + b"0]"):
        assert len(body) <= MAX_METADATA_BYTES
        blob = struct.pack("<4sHHI", b"GXKV", METADATA_VERSION, 0, len(body)) + body
        with pytest.raises(BadMetadata, match="holds .* JSON lists and objects"):
            dec.agent.add_peer(blob)


def test_an_agent_never_publishes_metadata_a_peer_refuses(host):
    """The bounds hold on the publishing side too: an agent past them gets BadInput from metadata()."""
    from gpuxfer.kv.metadata import MAX_METADATA_LAYERS
    buf = host.alloc(1 << 16, 0)
    agent = KVAgent("big", platform=host, device=0)
    try:
        flat = host.as_tensor(buf)
        agent.register_group("g", 1, [flat[4 * i:4 * i + 4].view(4, 1) for i in range(MAX_METADATA_LAYERS + 1)])
        with pytest.raises(BadInput, match="at most"):
            agent.metadata()
    finally:
        agent.close()
        buf.close()


# ----------------------------------------------------------------------------- host IPC payloads


def _remote(body: dict) -> dict:
    """The body as another process's agent's would say it (its handles are then opened by name)."""
    body.update(uid="b" * 32, pid=body["pid"] + 1)
    return body


@pytest.mark.parametrize("payload", [b"\xff\xfe/gx1_2_abcdef01", b"/gx1_2\x00_abcdef01", b"/../../etc/passwd",
                                     b"/gx1_2_abcdef01/../x", b"", b"relative"],
                         ids=["non-utf8", "nul", "dotdot", "dotdot-after", "empty", "relative"])
def test_a_host_payload_that_names_no_buffer_is_bad_metadata(sides, host, payload):
    pre, dec = sides
    body = _remote(_body(pre.agent))
    before = _mappings(host)
    for entry in (body["allocations"][0], body["control"]):
        saved = entry["payload"]
        entry["payload"] = payload.hex()
        with pytest.raises(BadMetadata):
            dec.agent.add_peer(_blob(body))
        entry["payload"] = saved
    assert _mappings(host) == before and not dec.agent.peers


def test_a_host_payload_whose_buffer_is_smaller_than_claimed_is_bad_metadata(sides, host):
    pre, dec = sides
    body = _remote(_body(pre.agent))
    body["allocations"][0]["nbytes"] *= 2
    with pytest.raises(BadMetadata, match="holds"):
        dec.agent.add_peer(_blob(body))
    assert not dec.agent.peers


@pytest.mark.parametrize("copies", [2, 65535])
def test_an_allocation_listed_twice_is_refused_before_any_mapping(sides, host, copies):
    """An agent lists each allocation once: duplicates (even 65,535 of them, past the allocation limit) are
    refused while decoding, before one mapping is opened."""
    pre, dec = sides
    body = _remote(_body(pre.agent))
    body["allocations"] = body["allocations"] * copies
    assert copies <= 2 or copies > MAX_METADATA_ALLOCATIONS
    before = _mappings(host)
    with pytest.raises(BadMetadata, match="same IPC handle|at most|exceeds"):
        dec.agent.add_peer(_blob(body))
    assert _mappings(host) == before
