"""The metadata bytes an agent publishes (:meth:`~gpuxfer.kv.agent.KVAgent.metadata`) and their
decoding: a versioned header, then JSON naming the agent, its flag words (``control``), its staging, its
allocations and its groups' layers. Hostile bytes raise :class:`~gpuxfer.errors.BadMetadata`,
never more."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Mapping

from ..errors import BadMetadata
from ..platforms.base import IpcHandle
from .control import AGENT_FLAG_BYTES, PACK_SLOTS
from .layers import _MAX_INT, _MAX_NAME, _MAX_PIECES, KVLayer, KVPiece, _check_layer

METADATA_MAGIC = b"GXKV"
#: the layout of the metadata bytes and what two agents must derive alike from a request (the flag words, the
#: pack engine's descriptor order and chunks): peers of another version are refused, never paired
METADATA_VERSION = 3
_HEADER = struct.Struct("<4sHHI")           # magic, version, flags (0), body length
MAX_METADATA_BYTES = 64 << 20


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


def _handle(d: Mapping, where: str, platform: str, pid: int) -> IpcHandle:
    raw = _s(d, "payload", where)
    try:
        payload = bytes.fromhex(raw)
    except ValueError:
        raise BadMetadata(f"{where}: payload is not hex") from None
    return IpcHandle(platform, _i(d, "device", where, 0, 1 << 16), _i(d, "nbytes", where, 1), payload, pid)


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
    host: str
    platform: str
    device: int
    control: IpcHandle
    allocations: tuple[IpcHandle, ...]
    groups: tuple[_PeerGroup, ...]
    staging: IpcHandle | None = None            # the pack engine's staging buffer, if the peer has one
    slot_bytes: int = 0
    nixl: dict | None = None                    # its NIXL agent (:func:`gpuxfer.kv.nixl_route.decode_nixl_meta`)


def decode_metadata(data: bytes) -> PeerMetadata:
    """Decode and validate metadata bytes; hostile input raises :class:`BadMetadata`, never more."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadMetadata(f"metadata must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise BadMetadata(f"metadata of {len(data)} bytes is shorter than its {_HEADER.size}-byte header")
    magic, version, flags, n = _HEADER.unpack_from(data)
    if magic != METADATA_MAGIC:
        raise BadMetadata(f"not gpuxfer KV metadata (magic {magic!r})")
    if version != METADATA_VERSION:
        raise BadMetadata(f"metadata version {version}; this gpuxfer reads version {METADATA_VERSION}")
    if flags != 0 or n != len(data) - _HEADER.size or n > MAX_METADATA_BYTES:
        raise BadMetadata(f"metadata header says {n} body bytes (flags {flags}); {len(data) - _HEADER.size} follow")
    try:
        body = json.loads(data[_HEADER.size:].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadMetadata(f"metadata body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadMetadata("metadata body must be a JSON object")
    where = "metadata"
    agent, uid, host, plat = (_s(body, k, where) for k in ("agent", "uid", "host", "platform"))
    pid = _i(body, "pid", where, 0, 1 << 32)
    device = _i(body, "device", where, 0, 1 << 16)
    control = _handle(body.get("control"), "metadata control", plat, pid)
    if control.nbytes < AGENT_FLAG_BYTES:
        raise BadMetadata(f"metadata control: {control.nbytes} bytes, need {AGENT_FLAG_BYTES}")
    staging, slot_bytes = None, 0
    if body.get("staging") is not None:
        staging = _handle(body["staging"], "metadata staging", plat, pid)
        slot_bytes = _i(body["staging"], "slot_bytes", "metadata staging", 1)
        if slot_bytes * PACK_SLOTS > staging.nbytes:
            raise BadMetadata(f"metadata staging: {PACK_SLOTS} slots of {slot_bytes} bytes exceed its "
                              f"{staging.nbytes} bytes")
    allocs = tuple(_handle(a, f"allocation {i}", plat, pid)
                   for i, a in enumerate(_l(body, "allocations", where, 1 << 16)))
    groups, seen = [], set()
    for gi, g in enumerate(_l(body, "groups", where, 1 << 12)):
        gw = f"group {gi}"
        name = _s(g, "name", gw)
        if name in seen:
            raise BadMetadata(f"{gw}: duplicate group name {name!r}")
        seen.add(name)
        bt = _i(g, "block_tokens", gw, 1, 1 << 32)
        layers, names = [], set()
        for li, lay in enumerate(_l(g, "layers", gw, 1 << 16)):
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
    from .nixl_route import decode_nixl_meta
    return PeerMetadata(agent, uid, pid, host, plat, device, control, allocs, tuple(groups), staging, slot_bytes,
                        decode_nixl_meta(body.get("nixl"), allocs))
