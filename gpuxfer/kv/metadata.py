"""The metadata bytes an agent publishes (:meth:`~gpuxfer.kv.agent.KVAgent.metadata`) and their
decoding: a versioned header, then JSON naming the agent, its flag words (``control``), its staging, its
allocations and its groups' layers. Hostile bytes raise :class:`~gpuxfer.errors.BadMetadata`,
never more."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Mapping

from ..errors import BadInput, BadMetadata
from ..platforms.base import IpcHandle
from .control import AGENT_FLAG_BYTES, PACK_SLOTS
from .host_notify import check_ref
from .layers import _MAX_INT, _MAX_NAME, _MAX_PIECES, KVLayer, KVPiece, _check_layer
from .nixl_route import MAX_NIXL_MD_BYTES, decode_nixl_meta

METADATA_MAGIC = b"GXKV"
#: the layout of the metadata bytes and what two agents must derive alike from a request (the flag words, the
#: pack engine's descriptor order and chunks): peers of another version are refused, never paired
METADATA_VERSION = 4
_HEADER = struct.Struct("<4sHHI")           # magic, version, flags (0), body length

# What real metadata needs, at most: the bounds decoding holds a peer's bytes to before and after parsing them
#: groups an agent's metadata lists (vLLM's hybrid allocator makes a handful)
MAX_METADATA_GROUPS = 256
#: layers, all groups together (a model's layers times the groups each belongs to)
MAX_METADATA_LAYERS = 4096
#: allocations (each layer lies in one; an agent lists each allocation once)
MAX_METADATA_ALLOCATIONS = MAX_METADATA_LAYERS
_LAYER_BYTES = 1024        # a layer's entry: its name (vLLM's are under 100 bytes), 16 pieces, its integers
_ALLOCATION_BYTES = 256    # an allocation's entry: a 64-byte IPC handle in hex and its integers
_FIXED_BYTES = 64 << 10    # the agent's name, host, control and staging handles, the groups' names
_NIXL_BYTES = 2 * MAX_NIXL_MD_BYTES + 24 * MAX_METADATA_ALLOCATIONS   # a NIXL agent's metadata in hex, its bases
#: the largest body accepted (what an agent publishes is held to it too)
MAX_METADATA_BYTES = (_FIXED_BYTES + MAX_METADATA_LAYERS * _LAYER_BYTES
                      + MAX_METADATA_ALLOCATIONS * _ALLOCATION_BYTES + _NIXL_BYTES)
# JSON containers and separators real metadata holds at most (a layer: its object, its piece list, each piece's
# pair; the others: an object or list each), twice over for brackets and commas inside names: checked on the
# raw bytes before parsing, so no body of many tiny values ("[[],[],...]") costs more than real metadata does
_MAX_CONTAINERS = 2 * (16 + 2 * MAX_METADATA_GROUPS + MAX_METADATA_LAYERS * (2 + _MAX_PIECES)
                       + MAX_METADATA_ALLOCATIONS)
_MAX_COMMAS = 2 * (64 + 4 * MAX_METADATA_GROUPS + MAX_METADATA_LAYERS * (10 + 2 * _MAX_PIECES)
                   + 4 * MAX_METADATA_ALLOCATIONS)


def check_metadata_size(body: bytes, err=BadMetadata) -> None:
    """Refuse a metadata body larger than real metadata can be (:data:`MAX_METADATA_BYTES`, its JSON
    containers and separators), before any parsing."""
    if len(body) > MAX_METADATA_BYTES:
        raise err(f"metadata body of {len(body)} bytes exceeds the {MAX_METADATA_BYTES}-byte limit "
                  f"({MAX_METADATA_LAYERS} layers, {MAX_METADATA_GROUPS} groups)")
    containers = body.count(b"[") + body.count(b"{")
    commas = body.count(b",")
    if containers > _MAX_CONTAINERS or commas > _MAX_COMMAS:
        raise err(f"metadata body holds {containers} JSON lists and objects and {commas} separators; metadata "
                  f"of at most {MAX_METADATA_LAYERS} layers holds at most {_MAX_CONTAINERS} and {_MAX_COMMAS}")


def encode_metadata(body: dict) -> bytes:
    """The metadata bytes of ``body`` (what :meth:`KVAgent.metadata` says), held to the bounds decoding holds
    a peer's to: metadata a peer would refuse raises :class:`~gpuxfer.errors.BadInput` here."""
    layers = sum(len(g["layers"]) for g in body["groups"])
    if len(body["groups"]) > MAX_METADATA_GROUPS or layers > MAX_METADATA_LAYERS:
        raise BadInput(f"agent {body['agent']!r}: {len(body['groups'])} groups of {layers} layers; metadata a "
                       f"peer accepts lists at most {MAX_METADATA_GROUPS} groups of {MAX_METADATA_LAYERS} layers")
    raw = json.dumps(body, separators=(",", ":")).encode()
    check_metadata_size(raw, err=BadInput)
    return _HEADER.pack(METADATA_MAGIC, METADATA_VERSION, 0, len(raw)) + raw


def handle_meta(h: IpcHandle) -> dict:
    """How the metadata lists an IPC handle (:func:`_handle` reads it back, with the publisher's pid)."""
    return {"payload": h.payload.hex(), "nbytes": h.nbytes, "device": h.device}


def _i(d: Mapping, key: str, where: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    v = d.get(key) if isinstance(d, Mapping) else None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < hi:
        raise BadMetadata(f"{where}: {key!r} must be an integer in [{lo}, {hi}), got {v!r}")
    return v


def _s(d: Mapping, key: str, where: str) -> str:
    v = d.get(key) if isinstance(d, Mapping) else None
    if not isinstance(v, str) or not 0 < len(v) <= _MAX_NAME:
        raise BadMetadata(f"{where}: {key!r} must be a string of 1..{_MAX_NAME} characters, got {v!r:.80}")
    return v


def _l(d: Mapping, key: str, where: str, limit: int) -> list:
    v = d.get(key) if isinstance(d, Mapping) else None
    if not isinstance(v, list) or len(v) > limit:
        raise BadMetadata(f"{where}: {key!r} must be a list of at most {limit} entries")
    return v


def _handle(d: Mapping, where: str, platform: str, pid: int, namespace: str | None) -> IpcHandle:
    raw = _s(d, "payload", where)
    try:
        payload = bytes.fromhex(raw)
    except ValueError:
        raise BadMetadata(f"{where}: payload is not hex") from None
    return IpcHandle(platform, _i(d, "device", where, 0, 1 << 16), _i(d, "nbytes", where, 1), payload, pid,
                     namespace)


@dataclass(frozen=True)
class _PeerGroup:
    name: str
    block_tokens: int
    layers: tuple[tuple[KVLayer, int, int], ...]     # (layer with ptr 0, allocation index, offset in it)


@dataclass(frozen=True)
class PeerMetadata:
    """What :meth:`KVAgent.metadata` says, decoded and validated."""

    agent: str
    uid: str
    pid: int
    namespace: str | None                       # the PID namespace its pid counts in (None: not known)
    host: str
    platform: str
    device: int
    control: IpcHandle
    allocations: tuple[IpcHandle, ...]
    groups: tuple[_PeerGroup, ...]
    staging: IpcHandle | None = None            # the pack engine's staging buffer, if the peer has one
    slot_bytes: int = 0
    nixl: dict | None = None                    # its NIXL agent (:func:`gpuxfer.kv.nixl_route.decode_nixl_meta`)
    host_words: str | None = None               # its notification words' host copy's reference (host_words or
    #                                             host_memfd: :mod:`gpuxfer.kv.host_notify`)


def decode_metadata(data: bytes) -> PeerMetadata:
    """Decode and validate metadata bytes; hostile input raises :class:`BadMetadata`, never more."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadMetadata(f"metadata must be bytes, got {type(data).__name__}")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > _HEADER.size + MAX_METADATA_BYTES:      # before any copy
        raise BadMetadata(f"metadata of {size} bytes exceeds the {MAX_METADATA_BYTES}-byte body limit")
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise BadMetadata(f"metadata of {len(data)} bytes is shorter than its {_HEADER.size}-byte header")
    magic, version, flags, n = _HEADER.unpack_from(data)
    if magic != METADATA_MAGIC:
        raise BadMetadata(f"not gpuxfer KV metadata (magic {magic!r})")
    if version != METADATA_VERSION:
        raise BadMetadata(f"metadata version {version}; this gpuxfer reads version {METADATA_VERSION}")
    if flags != 0 or n != len(data) - _HEADER.size:
        raise BadMetadata(f"metadata header says {n} body bytes (flags {flags}); {len(data) - _HEADER.size} follow")
    raw = data[_HEADER.size:]
    check_metadata_size(raw)
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadMetadata(f"metadata body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadMetadata("metadata body must be a JSON object")
    where = "metadata"
    agent, uid, host, plat = (_s(body, k, where) for k in ("agent", "uid", "host", "platform"))
    pid = _i(body, "pid", where, 0, 1 << 32)
    namespace = body.get("namespace")
    if namespace is not None:
        namespace = _s(body, "namespace", where)
    device = _i(body, "device", where, 0, 1 << 16)
    control = _handle(body.get("control"), "metadata control", plat, pid, namespace)
    if control.nbytes < AGENT_FLAG_BYTES:
        raise BadMetadata(f"metadata control: {control.nbytes} bytes, need {AGENT_FLAG_BYTES}")
    staging, slot_bytes = None, 0
    if body.get("staging") is not None:
        staging = _handle(body["staging"], "metadata staging", plat, pid, namespace)
        slot_bytes = _i(body["staging"], "slot_bytes", "metadata staging", 1)
        if slot_bytes * PACK_SLOTS > staging.nbytes:
            raise BadMetadata(f"metadata staging: {PACK_SLOTS} slots of {slot_bytes} bytes exceed its "
                              f"{staging.nbytes} bytes")
    allocs, payloads = [], set()
    for i, a in enumerate(_l(body, "allocations", where, MAX_METADATA_ALLOCATIONS)):
        h = _handle(a, f"allocation {i}", plat, pid, namespace)
        if h.payload in payloads:       # an agent lists each allocation once: never map one twice
            raise BadMetadata(f"allocation {i}: the same IPC handle as an earlier allocation")
        payloads.add(h.payload)
        allocs.append(h)
    groups, seen, total = [], set(), 0
    for gi, g in enumerate(_l(body, "groups", where, MAX_METADATA_GROUPS)):
        gw = f"group {gi}"
        name = _s(g, "name", gw)
        if name in seen:
            raise BadMetadata(f"{gw}: duplicate group name {name!r}")
        seen.add(name)
        bt = _i(g, "block_tokens", gw, 1, 1 << 32)
        raw_layers = _l(g, "layers", gw, MAX_METADATA_LAYERS)
        total += len(raw_layers)
        if not raw_layers or total > MAX_METADATA_LAYERS:
            raise BadMetadata(f"{gw}: {len(raw_layers)} layers; a group has 1 or more, all groups "
                              f"{MAX_METADATA_LAYERS} at most")
        layers, names = [], set()
        for li, lay in enumerate(raw_layers):
            lw = f"group {name!r} layer {li}"
            lname = _s(lay, "name", lw)
            if lname in names:
                raise BadMetadata(f"{lw}: duplicate layer name {lname!r}")
            names.add(lname)
            a = _i(lay, "alloc", lw, 0, len(allocs))
            off = _i(lay, "offset", lw)
            extent = _i(lay, "extent", lw, 1)
            if off + extent > allocs[a].nbytes:
                raise BadMetadata(f"{lw}: bytes [{off}, {off + extent}) lie outside allocation {a} of "
                                  f"{allocs[a].nbytes} bytes")
            raw_pieces = _l(lay, "pieces", lw, _MAX_PIECES)
            pieces = []
            for p in raw_pieces:
                if (not isinstance(p, list) or len(p) != 2
                        or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _MAX_INT for x in p)):
                    raise BadMetadata(f"{lw}: a piece must be [offset, nbytes], got {p!r:.80}")
                pieces.append(KVPiece(p[0], p[1]))
            tm = lay.get("token_major")
            if not isinstance(tm, bool):
                raise BadMetadata(f"{lw}: token_major must be a boolean")
            layer = KVLayer(name=lname, index=_i(lay, "index", lw), ptr=0, num_blocks=_i(lay, "num_blocks", lw, 1),
                            block_stride=_i(lay, "block_stride", lw, 1), pieces=tuple(pieces), extent=extent,
                            token_major=tm)
            _check_layer(f"{name}/{lname}", layer.num_blocks, layer.block_stride, layer.pieces, layer.extent,
                         err=BadMetadata)
            layers.append((layer, a, off))
        groups.append(_PeerGroup(name, bt, tuple(layers)))
    host_words = check_ref(body.get("host_words"), body.get("host_memfd"))
    return PeerMetadata(agent, uid, pid, namespace, host, plat, device, control, tuple(allocs), tuple(groups), staging,
                        slot_bytes, decode_nixl_meta(body.get("nixl"), tuple(allocs)), host_words)
