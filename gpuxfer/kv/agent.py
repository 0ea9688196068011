"""The KV transfer API: register an engine's own KV caches, swap metadata bytes, move requests by block ID.

Shaped like NIXL's agent, Mooncake's TransferEngine and vLLM's ``register_kv_caches``::

    agent = KVAgent("decode-0", device=0)                       # one per process (and device)
    agent.register_group("full", block_tokens=16, layers=kv_caches)   # {layer name: torch tensor}
    blob = agent.metadata()                                     # bytes: send them over any channel
    peer = agent.add_peer(blob_from_prefill)                    # opens the peer's caches over IPC
    xfer = agent.prepare(peer, "pull", local_blocks={"full": decode_ids},
                         remote_blocks={"full": prefill_ids})   # per-request setup: checks the IDs
    handle = xfer.post()                                        # a few launches, one small upload
    handle.wait(timeout_s=30)                                   # or handle.done(), handle.event

**KV-cache groups.** A group is a set of layers sharing one block table (vLLM's
hybrid allocator: full attention, sliding window, DeepSeek-V4's compressed and
indexer caches each form groups). A request names block IDs per group on each side.
Each layer tensor is described by its number of blocks, its block stride in bytes and
the *pieces* of a block: the K and V halves when the leading dimension is 2
(``(2, num_blocks, block_tokens, heads, dim)``), the two halves of ``(num_blocks, 2,
...)``, or the whole block (``(num_blocks, block_tokens, 584)`` for DeepSeek-V4's
584-byte slots, a packed slab). :func:`describe_layer` reads that from the tensor's
shape and strides; :class:`KVLayerSpec` states it explicitly (any strided view, a
slab of a packed layout).

**Memory.** The tensors are the engine's own (torch's caching allocator included):
the platform exports the allocation holding each one (``Platform.export_range``: the
base allocation and the offset in it), once per allocation. Memory that cannot be
exported (torch's expandable segments on CUDA) raises
:class:`~gpuxfer.errors.NotExportable` at registration.

**Transfers.** ``pull``: the local agent's blocks are the destination and the peer's
the source; ``push``: the reverse. With the ``triton`` engine (one-sided) the work runs
on the local device: the descriptor-copy kernel reading or writing the peer's memory
through the IPC mapping. With ``pack`` (two-sided, :class:`_PackTransfer`) both sides
prepare and post the request -- the source ``push``, the destination ``pull`` -- and
the source's packed chunks travel staging to staging on a copy engine.
Descriptors are expanded on the device from the block IDs and the registered layout
(:mod:`gpuxfer.kernels.block_kernel`). Everything per (peer, direction, layer range) -- the
plane table, the tilings, a ring of device buffers with their launches bound once and
captured as a graph (:class:`_Slot`) -- is built once and cached; per request ``prepare``
writes one small int64 array (a header and the block IDs) on the host, and ``post``
uploads it into a free slot and launches the slot's graph (:class:`_SlotTransfer`).

**Different block sizes.** When one side's block size divides the other's (prefill
64-token blocks, decode 16-token blocks), tokens are matched, not blocks: a 64-token
block feeds four 16-token blocks. The pieces must be token-major (the default; pass
``token_major=False`` for head-major layouts, which then need equal block sizes).

**Completion and notification.** ``post(stream=None)`` enqueues on the agent's stream
(or the caller's, after the work already queued there: layer-wise streaming) and
returns a :class:`KVTransferHandle` (``done()``, ``wait(timeout_s)``, ``event``). With
``notify_slot=k`` the initiator's stream then bumps word ``k`` of the peer's
notification area (the n-th notification to a slot writes n), so the peer can learn
the request landed (push) or its blocks were read (pull): :meth:`KVAgent.notification`
polls it, :meth:`KVAgent.wait_notification` waits with a timeout,
:meth:`KVAgent.stream_wait_notification` blocks a stream until it arrives::

    prefill (push initiator)                        decode (peer)
    ------------------------                        -------------
    xfer = prepare(peer, "push", ...)   host: check IDs, stage them (per-request setup)
    h = xfer.post(stream)               host: ~5 calls, returns (post host time)
      stream: upload IDs -> expand -> copy pieces -> notify  ----+
    h.done() / h.wait()                  <- complete            |  (8-byte write into decode's word k)
                                                                +-> wait_notification(k, n) returns, or
                                                                    stream_wait_notification(s, k, n)
                                                                    lets decode's kernels on s go on

Every call validates its input and raises a typed error: :class:`~gpuxfer.errors.BlockIdError`
(out of range, duplicated destination blocks, counts that do not match),
:class:`~gpuxfer.errors.LayoutMismatch` (the two sides' groups, layers or pieces differ),
:class:`~gpuxfer.errors.NotRegistered`, :class:`~gpuxfer.errors.BadMetadata`,
:class:`~gpuxfer.errors.TransferTimeout` naming the request. Block IDs are checked on the
host (vectorised over the IDs, which are few next to the descriptors); the expansion
kernel also masks any ID outside its group, so no access leaves the registered memory
whatever the IDs hold.
"""
from __future__ import annotations

import collections
import itertools
import json
import logging
import math
import os
import re
import socket
import struct
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import (BackendUnavailable, BadInput, BadMetadata, BlockIdError, LayoutMismatch, NotRegistered,
                      TransferTimeout)
from ..platforms.base import (FLAG_OP_WAIT, FLAG_OP_WRITE, RELEASE_VALUE, Closable, DeviceBuffer, Event, IpcHandle,
                              Platform, Stream, flag_ops_array)
from ..sync import wait_flag_or_raise
from .engines.base import FailsOnTimeout, on_timeout_from_env
from .plan import DIRECTIONS

log = logging.getLogger("gpuxfer.kv.agent")

__all__ = ["KVAgent", "KVPeer", "KVTransfer", "KVTransferHandle", "KVLayerSpec", "KVPiece", "KVLayer",
           "describe_layer", "layout_groups", "METADATA_VERSION", "NOTIFY_SLOTS", "AGENT_ENGINES"]

METADATA_MAGIC = b"GXKV"
METADATA_VERSION = 1
_HEADER = struct.Struct("<4sHHI")           # magic, version, flags (0), body length
MAX_METADATA_BYTES = 64 << 20
_MAX_INT = 1 << 62
_MAX_NAME = 512
_MAX_PIECES = 16
NOTIFY_SLOTS = 64                           # notification words per agent
# the pack engine's words, two of each (a transfer of parity p uses word + p; see _PackTransfer):
_AVAIL = NOTIFY_SLOTS                       # chunks of the transfer the peer's source copied into our staging
_FREE = NOTIFY_SLOTS + 2                    # chunks of our source's transfer the peer's destination unpacked
_GO = NOTIFY_SLOTS + 4                      # the peer's destination posted the transfer (1), or reset it (0)
_PACKED = NOTIFY_SLOTS + 6                  # chunks of our source's transfer packed (its lane copies them)
_COPIED = NOTIFY_SLOTS + 8                  # chunks of our source's transfer its lane copied out of our staging
_PACK_WORDS = tuple(range(NOTIFY_SLOTS, NOTIFY_SLOTS + 10))
_PROBE = NOTIFY_SLOTS + 15                  # where a pack agent's probe of remote stream writes lands (the peer's)
_CTRL_WORDS = NOTIFY_SLOTS + 16
_CTRL_BYTES = _CTRL_WORDS * 8
#: the engines the agent runs
AGENT_ENGINES = ("triton", "pack", "copy_engine")
#: the pack engine's staging: slots x bytes (the host emulation's are smaller)
PACK_SLOTS = 2
PACK_SLOT_BYTES = 192 << 20
#: a request's chunks: at least this many bytes each (where the slot holds them), growing past it so a request
#: takes at most about PACK_MAX_CHUNKS of them -- a graph's launch costs the host time per node, so a post's
#: host time stays near that of a request of PACK_MAX_CHUNKS chunks, while small requests keep small chunks
#: (a short pipeline fill)
PACK_CHUNK_BYTES = 32 << 20
PACK_MAX_CHUNKS = 16
PACK_SLOT_BYTES_EMULATION = 1 << 20
#: shapes of pack transfers an agent keeps (buffers, kernels, graphs), the least recently posted going first
PACK_SHAPES = 8

_LOCAL_AGENTS: "weakref.WeakValueDictionary[str, KVAgent]" = weakref.WeakValueDictionary()
#: streams and device memory that queued work may still touch when their owner was closed (a wait that never
#: completed): kept for the life of the process rather than destroyed or freed under that work
_LEAKED: list = []


# ============================================================================ layer descriptions


@dataclass(frozen=True)
class KVPiece:
    """A contiguous part of every block of a layer: ``nbytes`` at ``offset`` from the block's start."""

    offset: int
    nbytes: int


@dataclass(frozen=True)
class KVLayerSpec:
    """An explicit layer description: ``tensor``'s block ``i`` starts ``i * block_stride_bytes`` bytes
    after ``tensor.data_ptr()`` and holds ``pieces`` (``(offset, nbytes)`` pairs or :class:`KVPiece`).

    ``token_major``: each piece stores its tokens (or compressed entries) in order, so a prefix of
    a block's tokens is a prefix of each piece (needed to pair different block sizes).
    ``index``: the model layer number layer ranges select by (default: from the name).
    """

    tensor: Any
    num_blocks: int
    block_stride_bytes: int
    pieces: Sequence[Any]
    token_major: bool = True
    index: int | None = None


@dataclass(frozen=True)
class KVLayer:
    """A registered layer, as both sides see it (addresses are this process's)."""

    name: str
    index: int
    ptr: int                    # address of block 0
    num_blocks: int
    block_stride: int
    pieces: tuple[KVPiece, ...]
    extent: int                 # bytes from ptr the layer's memory spans
    token_major: bool

    @property
    def span(self) -> tuple[int, int]:
        """``[first, end)`` addresses the layer's blocks occupy."""
        lo = min(p.offset for p in self.pieces)
        hi = max(p.offset + p.nbytes for p in self.pieces) + (self.num_blocks - 1) * self.block_stride
        return self.ptr + lo, self.ptr + hi

    def as_meta(self, alloc: int, offset: int) -> dict:
        return {"name": self.name, "index": self.index, "alloc": alloc, "offset": offset,
                "num_blocks": self.num_blocks, "block_stride": self.block_stride, "extent": self.extent,
                "token_major": self.token_major, "pieces": [[p.offset, p.nbytes] for p in self.pieces]}


def _check_layer(name: str, num_blocks: int, block_stride: int, pieces: tuple[KVPiece, ...], extent: int,
                 err=BadInput) -> None:
    """Every block of every piece inside ``extent``; distinct blocks of a piece never overlap."""
    if num_blocks < 1 or block_stride < 1 or not pieces or len(pieces) > _MAX_PIECES:
        raise err(f"layer {name!r}: needs >= 1 block, a positive block stride and 1..{_MAX_PIECES} pieces "
                  f"(got {num_blocks} blocks, stride {block_stride}, {len(pieces)} pieces)")
    for k, p in enumerate(pieces):
        if p.offset < 0 or p.nbytes < 1:
            raise err(f"layer {name!r}, piece {k}: offset {p.offset} and size {p.nbytes} must be >= 0 and >= 1")
        if p.nbytes > block_stride:
            raise err(f"layer {name!r}, piece {k}: {p.nbytes} bytes per block exceed the block stride "
                      f"{block_stride}: consecutive blocks would overlap")
        end = p.offset + (num_blocks - 1) * block_stride + p.nbytes
        if end > extent:
            raise err(f"layer {name!r}, piece {k}: block {num_blocks - 1} ends at byte {end}, past the "
                      f"{extent} bytes of the layer's memory")


def _layer_index(name: str, position: int) -> int:
    """vLLM's rule: the first integer in the layer name (``model.layers.12.attn`` -> 12), else the position."""
    m = re.search(r"\d+", name)
    return int(m.group()) if m else position


def _torch():
    import torch
    return torch


def _tensor_extent(t) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element (non-negative strides)."""
    if any(s < 0 for s in t.stride()):
        raise BadInput(f"a tensor of shape {tuple(t.shape)} has negative strides")
    if t.numel() == 0:
        raise BadInput(f"a tensor of shape {tuple(t.shape)} is empty")
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def _contiguous_tail(t, start: int) -> bool:
    """Whether dimensions ``start:`` of ``t`` are laid out densely (row-major)."""
    expect = 1
    for n, s in zip(reversed(t.shape[start:]), reversed(t.stride()[start:])):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def describe_layer(tensor, *, name: str = "layer", position: int = 0, num_blocks: int | None = None,
                   token_major: bool = True, index: int | None = None) -> KVLayer:
    """A layer description from a KV-cache tensor's shape and strides.

    * ``(2, num_blocks, ...)`` (vLLM's flash-attention layout): two pieces, K and V, each one
      block's ``...`` (dense), the V piece ``stride(0)`` elements after the K piece;
    * ``(num_blocks, 2, d2, ...)`` with 4+ dimensions (FlashInfer's): two pieces, K and V;
    * ``(num_blocks, ...)``: one piece, the whole block (dense); the block stride may exceed it
      (padded pages, a layer of a packed slab).

    ``num_blocks`` settles the ambiguous case of 2 blocks. A :class:`KVLayerSpec` describes anything else.
    """
    torch = _torch()
    if isinstance(tensor, KVLayerSpec):
        return _from_spec(tensor, name, position)
    if not isinstance(tensor, torch.Tensor):
        raise BadInput(f"layer {name!r}: expected a torch.Tensor or a KVLayerSpec, got {type(tensor).__name__}")
    t = tensor
    shape, strides, el = tuple(t.shape), t.stride(), t.element_size()
    if t.dim() < 2:
        raise BadInput(f"layer {name!r}: a KV-cache tensor needs a block dimension and a block, got shape {shape}")
    kv_first = t.dim() >= 3 and shape[0] == 2 and (num_blocks is None or shape[1] == num_blocks)
    if num_blocks is not None and shape[0] == num_blocks and not (shape[0] == 2 and shape[1] == num_blocks):
        kv_first = False
    if kv_first:
        nb, stride = shape[1], strides[1] * el
        if not _contiguous_tail(t, 2):
            raise BadInput(f"layer {name!r}: the block of a (2, num_blocks, ...) tensor must be dense, "
                           f"got shape {shape} strides {strides}")
        nbytes = math.prod(shape[2:]) * el
        pieces = (KVPiece(0, nbytes), KVPiece(strides[0] * el, nbytes))
    else:
        nb, stride = shape[0], strides[0] * el
        if t.dim() >= 4 and shape[1] == 2:
            if not _contiguous_tail(t, 2):
                raise BadInput(f"layer {name!r}: the K and V halves of a (num_blocks, 2, ...) tensor must be "
                               f"dense, got shape {shape} strides {strides}")
            nbytes = math.prod(shape[2:]) * el
            pieces = (KVPiece(0, nbytes), KVPiece(strides[1] * el, nbytes))
        else:
            if not _contiguous_tail(t, 1):
                raise BadInput(f"layer {name!r}: the block of a (num_blocks, ...) tensor must be dense, "
                               f"got shape {shape} strides {strides}")
            pieces = (KVPiece(0, math.prod(shape[1:]) * el),)
    if num_blocks is not None and nb != num_blocks:
        raise BadInput(f"layer {name!r}: shape {shape} holds {nb} blocks, not {num_blocks}")
    layer = KVLayer(name=name, index=_layer_index(name, position) if index is None else int(index),
                    ptr=int(t.data_ptr()), num_blocks=int(nb), block_stride=int(stride), pieces=pieces,
                    extent=_tensor_extent(t), token_major=bool(token_major))
    _check_layer(name, layer.num_blocks, layer.block_stride, pieces, layer.extent)
    return layer


def _from_spec(spec: KVLayerSpec, name: str, position: int) -> KVLayer:
    torch = _torch()
    t = spec.tensor
    if not isinstance(t, torch.Tensor):
        raise BadInput(f"layer {name!r}: KVLayerSpec.tensor must be a torch.Tensor, got {type(t).__name__}")
    for v, what in ((spec.num_blocks, "num_blocks"), (spec.block_stride_bytes, "block_stride_bytes")):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise BadInput(f"layer {name!r}: {what} must be an int, got {v!r}")
    pieces = []
    for p in spec.pieces:
        if isinstance(p, KVPiece):
            pieces.append(p)
        else:
            try:
                off, n = p
                pieces.append(KVPiece(int(off), int(n)))
            except (TypeError, ValueError):
                raise BadInput(f"layer {name!r}: a piece must be (offset, nbytes), got {p!r}") from None
    # an explicit description may reach past the view into the rest of its storage
    extent = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    layer = KVLayer(name=name, index=_layer_index(name, position) if spec.index is None else int(spec.index),
                    ptr=int(t.data_ptr()), num_blocks=int(spec.num_blocks),
                    block_stride=int(spec.block_stride_bytes), pieces=tuple(pieces), extent=int(extent),
                    token_major=bool(spec.token_major))
    _check_layer(name, layer.num_blocks, layer.block_stride, layer.pieces, layer.extent)
    return layer


def layout_groups(layout, pool) -> list[tuple[str, int, dict[str, KVLayerSpec]]]:
    """The KV-cache groups of a :class:`~gpuxfer.kv.layout.PoolLayout` laid over ``pool`` (a flat uint8
    tensor): ``(group name, block tokens, {layer name: spec})`` for :meth:`KVAgent.register_group`.

    An unpacked region is a group of ``planes`` layers (one piece per block: the region's page);
    a packed group is a group of one layer (its slab). Page indices of the layout's block
    tables are the block IDs.
    """
    torch = _torch()
    if not isinstance(pool, torch.Tensor) or pool.dtype != torch.uint8 or pool.dim() != 1:
        raise BadInput("pool must be a flat uint8 tensor")
    if pool.numel() < layout.pool_bytes:
        raise BadInput(f"pool holds {pool.numel()} bytes, the layout needs {layout.pool_bytes}")
    trs = {t.name: t for t in layout.workload.transfer_regions(layout.page_tokens)}
    out = []
    for r in layout.regions:
        layers = {}
        for plane in range(r.planes):
            start = r.base_offset_bytes + plane * r.plane_stride_bytes
            view = pool[start:start + r.pool_pages * r.page_stride_bytes]
            layers[f"{r.name}.{plane}"] = KVLayerSpec(view, r.pool_pages, r.page_stride_bytes,
                                                      [(0, r.desc_bytes)], index=plane)
        out.append((r.name, trs[r.name].tokens_per_page, layers))
    return out


# ============================================================================ metadata


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
    if control.nbytes < _CTRL_BYTES:
        raise BadMetadata(f"metadata control: {control.nbytes} bytes, need {_CTRL_BYTES}")
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
    return PeerMetadata(agent, uid, pid, host, plat, device, control, allocs, tuple(groups), staging, slot_bytes)


# ============================================================================ groups and peers


@dataclass
class _Group:
    name: str
    block_tokens: int
    layers: list[KVLayer]
    flats: list[Any]                # per layer: a 1-element uint8 tensor at its ptr (local groups), or
                                    # (allocation index, offset) (a peer's groups): kernel anchors

    @property
    def num_blocks(self) -> int:
        return min(lay.num_blocks for lay in self.layers)


class KVPeer(Closable):
    """Another agent, added from its metadata: its caches mapped here (or, in this process, used as they are)."""

    def __init__(self, agent: "KVAgent", meta: PeerMetadata):
        self.agent, self.meta, self.name = agent, meta, meta.agent
        self._closed = False
        self._mappings: list[Any] = []
        self._owned: list[Any] = []
        self.scratch: DeviceBuffer | None = None
        self.staging_ptr: int | None = None
        self._seq = [0] * NOTIFY_SLOTS
        self._notified: list = [None] * NOTIFY_SLOTS     # per slot: (stream, event) of its last notifying post
        self.pack_sent = 0                  # pack transfers (with chunks) this agent's source posted to the peer
        self.pack_recv = 0                  # pack transfers (with chunks) this agent's destination posted
        self.remote_flags = False           # pack signals: a stream write into the peer's word (probed), else a
                                            # write into scratch and an 8-byte copy
        plat, dev = agent.platform, agent.device
        try:
            local = _LOCAL_AGENTS.get(meta.uid) if meta.pid == os.getpid() else None
            if meta.pid == os.getpid() and local is None:
                raise BadMetadata(f"peer {meta.agent!r} claims this process but is not a live agent here")
            self._local = local
            if local is not None:
                bases = list(local._alloc_bases)
                self.control_ptr = local.control.ptr
                self.staging_ptr = None if local.staging is None else local.staging.ptr
            else:
                bases = []
                for h in meta.allocations:
                    m = plat.open_handle(h, dev)
                    self._mappings.append(m)
                    real = plat.allocation_range(m.ptr, dev)
                    if real is not None and real[1] < h.nbytes:
                        raise BadMetadata(f"peer {meta.agent!r} claims an allocation of {h.nbytes} bytes; the "
                                          f"mapping holds {real[1]}")
                    bases.append(m.ptr)
                ctrl = plat.open_handle(meta.control, dev)
                self._mappings.append(ctrl)
                self.control_ptr = ctrl.ptr
                if meta.staging is not None:
                    st = plat.open_handle(meta.staging, dev)
                    self._mappings.append(st)
                    self.staging_ptr = st.ptr
            self.groups: dict[str, _Group] = {}
            for g in meta.groups:
                layers = [KVLayer(lay.name, lay.index, bases[a] + off, lay.num_blocks, lay.block_stride, lay.pieces,
                                  lay.extent, lay.token_major) for lay, a, off in g.layers]
                self.groups[g.name] = _Group(g.name, g.block_tokens, layers, [(a, off) for _, a, off in g.layers])
            self.scratch = plat.alloc(_CTRL_BYTES, dev)
            self._owned.append(self.scratch)
        except BaseException:
            self._release()
            raise

    def anchor(self, layer_ref: tuple[int, int], ptr: int):
        """A 1-element uint8 tensor at ``ptr`` (a layer of this peer) on the agent's device."""
        if self._local is not None:
            return self._local._flat_at(ptr)
        a, off = layer_ref
        m = self._mappings[a]
        return self.agent.platform.as_tensor(m, shape=(1,), offset=off)

    def notify(self, s: Stream, slot: int) -> tuple[int, Event]:
        """Queue the next notification to word ``slot`` of the peer on ``s``, then the post's event: ``(value,
        event)``. The caller holds the agent's post lock.

        The n-th notification to a slot writes n once the post that wrote n - 1 completed: a post on another
        stream waits for that post's event first (on one stream, stream order does it). So the peer's word
        never goes down and value n says the data of the first n notifying posts landed; and the copy path's
        scratch word (``scratch + 8 * slot``) is read by one copy at a time."""
        plat, agent = self.agent.platform, self.agent
        last = self._notified[slot]
        if last is not None and last[0] is not s:
            plat.stream_wait_event(s, last[1])
        value = self._seq[slot] + 1
        target = self.control_ptr + 8 * slot
        word = target if self.remote_flags else self.scratch.ptr + 8 * slot
        if s is agent.stream:
            agent._calls.write_flag(word, value)
        else:
            plat.write_flag(s, word, value)
        if not self.remote_flags:
            plat.copy_async(s, target, word, 8)
        event = plat.record_event(s)
        self._seq[slot] = value
        self._notified[slot] = (s, event)
        return value, event

    def _release(self) -> None:
        for m in reversed(self._mappings + self._owned):
            try:
                m.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing
                log.warning("peer %s: closing %r failed: %s", self.name, m, exc)
        self._mappings, self._owned = [], []

    def __repr__(self) -> str:
        return f"KVPeer({self.name!r}, pid {self.meta.pid}, {len(self.meta.groups)} groups)"


# ============================================================================ routes (cached per peer, op, layers)


@dataclass
class _Route:
    """Everything a transfer between the agent and a peer in one direction needs, built once."""

    op: str
    groups: list[str]                            # route-local group order
    splits: list[tuple[int, int]]                # per group: (src split, dst split)
    limits: list[tuple[int, int]]                # per group: (src blocks, dst blocks)
    dst_classes: list[list[int]]                 # groups whose destination memory overlaps
    planes: Any                                  # (P, PLANE_FIELDS) int64 on the device
    table: np.ndarray                            # the same on the host
    plane_group: np.ndarray                      # (P,) group of each plane
    classes: list[tuple[int, int, int]]          # (first plane, end plane, segment bytes), planes sorted by size
    src_anchor: Any
    dst_anchor: Any
    launch_classes: list[tuple[int, int, int]] = field(default_factory=list)   # per copy launch: (first plane,
                                                 # end plane, segment bytes): neighbouring sizes tiled alike
    plane_bytes: np.ndarray | None = None        # (P,) segment bytes of each plane
    slots: list["_Slot"] = field(default_factory=list)    # the ring of device buffers posts run in


#: a route's ring: at most this many slots (posts on other streams still running hold theirs)
RING_SLOTS = 4
#: a slot's smallest capacities (descriptor rows, request entries); larger requests grow it geometrically
MIN_SLOT_ROWS = 1024
MIN_SLOT_ENTRIES = 1024


class _Slot:
    """A route's device buffers for one request at a time: the request array (header + block IDs) and the
    ``(rows, 3)`` descriptors, both zeroed when made; the launchers bound to them once (the expansion over a
    fixed grid, one copy per tiling whose row range each launch reads from the request's header on the
    device); the graph of those launches where the platform captures one. Whatever a request writes into
    ``req``, every access stays inside these buffers and the registered memory (the kernels' bounds), and
    every row of ``out`` holds zeros or a descriptor the expansion wrote: so any request whose rows and
    entries fit can run here, one after another.

    A slot is free for a post on stream ``s`` once the last post on it completed, or when that post was on
    ``s`` itself (stream order puts the new upload after it)."""

    __slots__ = ("rows", "entries", "req", "out", "req_ptr", "expand", "copies", "graph", "event", "stream", "used")

    def __init__(self, route: "_Route", rows: int, entries: int, device):
        from ..kernels.blocks import expand_launcher
        from ..kernels.launch import copy_range_launcher
        torch = _torch()
        self.rows, self.entries = rows, entries
        self.req = torch.empty(entries, dtype=torch.int64, device=device)
        self.out = torch.empty((rows, 3), dtype=torch.int64, device=device)
        self.req_ptr = self.req.data_ptr()
        self.expand = expand_launcher(route.planes, self.req, self.out, n_groups=len(route.groups))
        self.copies = [f for f in (copy_range_launcher(route.src_anchor, route.dst_anchor, self.out, self.req,
                                                       lo_at=a, hi_at=b, nbytes_hint=c)
                                   for a, b, c in route.launch_classes) if f is not None]
        self.graph = None
        self.event = None
        self.stream = None
        self.used = 0

    def kernels(self, stream=None) -> None:
        """The expansion and the copies, on ``stream`` (a driver handle) or torch's current stream."""
        if self.expand is not None:
            self.expand(stream)
        for launch in self.copies:
            launch(stream)

    def enqueue(self, plat: Platform, s: Stream) -> None:
        """The kernels on ``s``, launched one by one: straight on its driver handle where the platform gives one."""
        native = plat.native_stream(s)
        if native is None:
            plat.launch(s, self.kernels)
        else:
            self.kernels(native)


def _pair_pieces(group: str, mine: KVLayer, theirs: KVLayer, bt_src: int, bt_dst: int, src_is_mine: bool
                 ) -> list[tuple[int, int, int]]:
    """Per piece: (source piece offset, destination piece offset, segment bytes)."""
    src, dst = (mine, theirs) if src_is_mine else (theirs, mine)
    if len(src.pieces) != len(dst.pieces):
        raise LayoutMismatch(f"group {group!r}, layer {mine.name!r}: {len(src.pieces)} pieces per block on the "
                             f"source, {len(dst.pieces)} on the destination")
    seg_tokens = min(bt_src, bt_dst)
    out = []
    for k, (ps, pd) in enumerate(zip(src.pieces, dst.pieces)):
        if bt_src == bt_dst:
            if ps.nbytes != pd.nbytes:
                raise LayoutMismatch(f"group {group!r}, layer {mine.name!r}, piece {k}: {ps.nbytes} bytes per "
                                     f"block on the source, {pd.nbytes} on the destination")
            out.append((ps.offset, pd.offset, ps.nbytes))
            continue
        if not (src.token_major and dst.token_major):
            raise LayoutMismatch(f"group {group!r}, layer {mine.name!r}: block sizes differ ({bt_src} and {bt_dst} "
                                 "tokens) but a side's pieces are not token-major")
        if ps.nbytes * bt_dst != pd.nbytes * bt_src:
            raise LayoutMismatch(f"group {group!r}, layer {mine.name!r}, piece {k}: {ps.nbytes} bytes per "
                                 f"{bt_src}-token block and {pd.nbytes} per {bt_dst}-token block are not the same "
                                 "bytes per token")
        small = ps.nbytes if bt_src == seg_tokens else pd.nbytes
        big, ratio = (ps.nbytes, bt_src // seg_tokens) if bt_src > seg_tokens else (pd.nbytes, bt_dst // seg_tokens)
        if big % ratio or big // ratio != small:
            raise LayoutMismatch(f"group {group!r}, layer {mine.name!r}, piece {k}: {big} bytes do not split "
                                 f"into {ratio} equal segments")
        out.append((ps.offset, pd.offset, small))
    return out


def _overlap_classes(spans: list[list[tuple[int, int]]]) -> list[list[int]]:
    """Groups (by index) whose memory spans intersect, merged transitively (union-find)."""
    parent = list(range(len(spans)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in itertools.combinations(range(len(spans)), 2):
        if any(a < d and c < b for a, b in spans[i] for c, d in spans[j]):
            parent[find(i)] = find(j)
    classes: dict[int, list[int]] = {}
    for i in range(len(spans)):
        classes.setdefault(find(i), []).append(i)
    return list(classes.values())


# ============================================================================ transfers


def _as_ids(ids, request: str, group: str, side: str) -> np.ndarray:
    """Block IDs as a contiguous 1-D int64 array (``request``, ``group`` and ``side`` name them in errors)."""
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1 and ids.flags.c_contiguous:
        return ids
    what = f"request {request!r}, group {group!r}, {side}"
    torch = _torch()
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise BlockIdError(f"{what}: block IDs must be on the host (a list, a numpy array or a CPU tensor)")
        ids = ids.numpy()
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise BlockIdError(f"{what}: block IDs must be a 1-D sequence of integers, got {arr.dtype} {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= _MAX_INT:
        raise BlockIdError(f"{what}: block ID {int(arr.max())} is out of range")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _check_range(ids: np.ndarray, limit: int, request: str, group: str, side: str) -> None:
    """Every ID in ``[0, limit)``: one reduction (a negative ID read unsigned is past any limit)."""
    if ids.size and int(ids.view(np.uint64).max()) >= limit:
        bad = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise BlockIdError(f"request {request!r}, group {group!r}, {side}: block ID {int(ids[bad])} at position {bad} is out of range "
                           f"(the group holds blocks 0..{limit - 1})")


class _Scratch(threading.local):
    """Per thread: an int64 array over block IDs, all -1 between uses (each use puts back what it wrote),
    so checking or ordering a request's IDs costs O(IDs), not a fresh array over the group's blocks."""

    def __init__(self):
        self.slots = np.full(0, -1, dtype=np.int64)
        self.positions = np.arange(0, dtype=np.int64)

    def get(self, limit: int) -> np.ndarray:
        if self.slots.size < limit:
            self.slots = np.full(max(limit, 2 * self.slots.size), -1, dtype=np.int64)
        return self.slots[:limit]

    def arange(self, n: int) -> np.ndarray:
        """``np.arange(n)`` as a read-only view of one kept array."""
        if self.positions.size < n:
            self.positions = np.arange(max(n, 2 * self.positions.size), dtype=np.int64)
            self.positions.flags.writeable = False
        return self.positions[:n]


_SCRATCH = _Scratch()


def _sort_order(keys: np.ndarray, limit: int) -> np.ndarray:
    """An order sorting ``keys`` (IDs in ``[0, limit)``). Distinct keys among a good share of the range go
    by one scatter and one pass over the range; others by a comparison sort."""
    n = keys.size
    if limit <= 16 * n:
        slot = _SCRATCH.get(limit)
        slot[keys] = _SCRATCH.arange(n)
        order = slot[slot >= 0]
        slot[keys] = -1
        if order.size == n:
            return order
    return np.argsort(keys)


def _check_unique(ids: np.ndarray, limit: int, request: str, groups: list[str]) -> None:
    """No ID twice in ``ids`` (all in ``[0, limit)``): each ID's slot takes the position of one of its
    occurrences; an occurrence that reads back another position is a duplicate. O(len(ids))."""
    if ids.size < 2:
        return
    at = _SCRATCH.arange(ids.size)
    slot = _SCRATCH.get(limit)
    slot[ids] = at
    differ = slot[ids] != at
    slot[ids] = -1
    if differ.any():
        dup = np.flatnonzero(differ)
        raise BlockIdError(f"request {request!r}, group(s) {', '.join(groups)}: destination block "
                           f"{int(ids[dup[0]])} appears more than once (two copies "
                           "would land on the same bytes)")


class KVTransferHandle:
    """A posted transfer: ``done()``, ``wait(timeout_s)``, ``event`` (make another stream wait on it).

    ``notify_value`` is what the peer's notification word holds once it landed (None: no notification).
    """

    __slots__ = ("transfer", "event", "name", "notify_value", "_stream", "_keep")

    def __init__(self, transfer: "KVTransfer", event: Event, stream: Stream, notify_value: int | None):
        self.transfer, self.event, self._stream, self.notify_value = transfer, event, stream, notify_value
        self.name = transfer.name
        self._keep = transfer._buffers      # device buffers stay alive while the work may run

    def done(self) -> bool:
        return self.transfer.agent.platform.event_query(self.event)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the transfer has completed; :class:`TransferTimeout` naming the request past ``timeout_s``."""
        from ..sync import SPIN_S, wait_event_or_raise
        agent = self.transfer.agent
        agent.check()
        t = agent.timeout_s if timeout_s is None else float(timeout_s)
        try:
            wait_event_or_raise(agent.platform, self.event, t, rank=agent.rank, what=f"KV transfer {self.name!r}",
                                spin_s=SPIN_S)
        except TransferTimeout as exc:
            err = TransferTimeout(rank=agent.rank, step=0, flag=f"request {self.name!r}", expected=1, seen=0,
                                  timeout_s=t, what=f"{self.transfer.describe()} did not complete")
            if self.transfer.waits_on_peer:
                agent.fail(err)
            raise err from exc

    def stream_wait(self, stream: Stream) -> None:
        """Make ``stream``'s later work wait for this transfer."""
        self.transfer.agent.platform.stream_wait_event(stream, self.event)

    def __repr__(self) -> str:
        return f"KVTransferHandle({self.name!r})"


class KVTransfer:
    """A prepared request: block IDs checked and staged; :meth:`post` may be called again and again."""

    waits_on_peer = False           # whether its streams wait on flags the peer writes (a timeout fails the agent)
    _pooled = None                  # the host array's pool token (:class:`_RequestPool`), if it came from the pool

    def __init__(self, agent: "KVAgent", peer: KVPeer, route: _Route, op: str, name: str, n_seg: np.ndarray,
                 host_req, dev_req, out, max_segments: int, launches: list, notify_slot: int | None,
                 descriptors: int, nbytes: int):
        self.agent, self.peer, self.route, self.op, self.name = agent, peer, route, op, name
        self.n_seg = n_seg
        self.descriptors, self.nbytes = descriptors, nbytes
        self.notify_slot = notify_slot
        self._host_req, self._dev_req, self._out = host_req, dev_req, out
        self._buffers = (host_req, dev_req, out)
        self._req_bytes = int(host_req.numel()) * 8
        self._build_launches(max_segments, launches)

    def _build_launches(self, max_segments: int, launches: list) -> None:
        """What an engine binds to one request at prepare (nothing by default)."""

    def describe(self) -> str:
        return (f"{self.op} of request {self.name!r} with peer {self.peer.name!r} ({self.descriptors:,} "
                f"descriptors, {self.nbytes:,} bytes)")

    def post(self, stream: Stream | None = None) -> KVTransferHandle:
        """Enqueue the transfer on ``stream`` (default: the agent's own) and return its handle; host work that
        does not depend on the number of descriptors (each engine's transfer says what it is)."""
        raise NotImplementedError

    def _finish(self, s: Stream) -> tuple[int | None, Event]:
        """The end of a post on ``s`` (the caller holds the agent's post lock): the notification, if the request
        has one (:meth:`KVPeer.notify`), and the post's event: ``(notified value or None, event)``."""
        if self.notify_slot is None:
            return None, self.agent.platform.record_event(s)
        return self.peer.notify(s, self.notify_slot)

    def expanded_descriptors(self) -> np.ndarray:
        """The ``(N, 3)`` descriptors of this request (offsets from the source and destination anchors), as the
        engine expands them -- for checking the expansion; not a transfer path."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"KVTransfer({self.describe()})"

    def __del__(self):
        """The host array goes back to the agent's pool: the agent keeps a posted transfer until its last post
        completed, so nothing reads the array any more."""
        pool = getattr(getattr(self, "agent", None), "_requests", None)
        if pool is not None and self._pooled is not None:
            pool.give(self._pooled)


class _SlotTransfer(KVTransfer):
    """The ``triton`` engine: a prepared request is only its host array; each post runs it in a slot of the
    route's ring (:class:`_Slot`) -- one upload of the array, one graph launch (or the slot's launches where
    the platform captures no graph), the notification, one event::

        prepare (host)                 post (host)                          stream
        --------------                 -----------                          ------
        check the IDs, write the       take a free slot of the route  ->
        header and IDs into a          copy_async(slot.req, array)    ->    upload (header + IDs)
        pooled host array              launch_graph(slot.graph)       ->    expand (IDs -> descriptors)
                                                                             copy per tiling (rows from the header)
                                       [notify: 2 stream operations]  ->    peer's word k := n
                                       record_event                   ->    event

    The array goes back to the agent's pool when the transfer is collected, which is after its last post
    completed (the agent keeps a posted transfer until its event completes)."""

    def __init__(self, agent: "KVAgent", peer: KVPeer, route: _Route, op: str, name: str, n_seg: np.ndarray,
                 host, array: np.ndarray, notify_slot: int | None, descriptors: int, nbytes: int):
        self._pooled = host
        self._array = array
        self._entries = int(array.shape[0])
        self._host_ptr = host[0].data_ptr()        # the array is a view from the owner's first entry
        super().__init__(agent, peer, route, op, name, n_seg, host[0], None, None, 0, [], notify_slot, descriptors,
                         nbytes)
        self._req_bytes = self._entries * 8

    def _run(self, s: Stream, expand_only: bool = False) -> "_Slot":
        """Upload this request into a free slot and enqueue its kernels on ``s`` (the caller holds the post lock)."""
        agent = self.agent
        plat = agent.platform
        slot = agent._take_slot(self.route, s, self.descriptors, self._entries)
        plat.copy_async(s, slot.req_ptr, self._host_ptr, self._req_bytes)
        if expand_only:
            if slot.expand is not None:
                plat.launch(s, slot.expand)
        elif slot.graph is not None:
            if s is agent.stream:
                agent._calls.launch_graph(slot.graph)
            else:
                plat.launch_graph(s, slot.graph)
        else:
            slot.enqueue(plat, s)
        return slot

    def post(self, stream: Stream | None = None) -> KVTransferHandle:
        """Enqueue the transfer on ``stream`` (default: the agent's own) and return its handle.

        Host work: one copy (the request array) into a free slot of the route, one graph launch (the
        expansion and one copy per kernel tiling, captured once per slot; launched one by one where the
        platform captures no graph), a notification (two stream operations, :meth:`KVPeer.notify`) if asked
        for, one event; none of it depends on the number of descriptors.
        """
        agent = self.agent
        agent._check_usable(self.peer)
        s = agent.stream if stream is None else stream
        with agent._post_lock:
            slot = self._run(s)
            value, event = self._finish(s)
            slot.event, slot.stream = event, s
        agent._track(event, (self, slot))
        return KVTransferHandle(self, event, s, value)

    def expanded_descriptors(self) -> np.ndarray:
        """Run only the upload and the expansion (in a slot, on the agent's stream), wait, and return the
        ``(N, 3)`` descriptors (offsets from the source and destination anchors) -- for checking the expansion;
        not a transfer path."""
        agent = self.agent
        plat, s = agent.platform, agent.stream
        with agent._post_lock:
            slot = self._run(s, expand_only=True)
            event = plat.record_event(s)
            slot.event, slot.stream = event, s
        agent._track(event, (self, slot))
        if not plat.event_wait(event, agent.timeout_s):
            raise TransferTimeout(rank=agent.rank, step=0, flag=f"request {self.name!r}", expected=1, seen=0,
                                  timeout_s=agent.timeout_s, what="expanding the descriptors")
        return slot.out[:self.descriptors].cpu().numpy().copy()


class _RequestPool:
    """Host int64 arrays for request arrays, pinned where the device is a GPU (the upload is then a DMA),
    kept for reuse by capacity (powers of two): taking one costs a list pop, not an allocation."""

    KEEP = 16                   # arrays kept per capacity

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.free: dict[int, list] = {}

    def take(self, n: int):
        """``(token, array)``: an array of ``n`` entries, and what to give back once it is no longer read."""
        cap = 1 << max(10, (n - 1).bit_length())
        try:
            token = self.free[cap].pop()
        except (KeyError, IndexError):
            torch = _torch()
            owner = torch.empty(cap, dtype=torch.int64, pin_memory=self.pinned)
            token = (owner, owner.numpy())
        return token, token[1][:n]

    def give(self, token) -> None:
        kept = self.free.setdefault(token[1].shape[0], [])
        if len(kept) < self.KEEP:
            kept.append(token)


class _PackShape:
    """What every pack transfer of one shape -- one route, one number of segments per group, hence the same
    descriptor rows and chunks -- shares: the device request and descriptor buffers, the kernels bound to
    them (one pack or unpack per chunk, its slot fixed), and per parity the captured graph of a post.

    Made at the first :meth:`KVAgent.prepare` of the shape, which on a GPU also loads the route's kernels
    (launches over an all-zero table, moving nothing): a kernel's first launch loads it, which waits for
    the device's queues, so it must not come while a stream of the process waits for the peer. A post
    uploads its request into :attr:`req` and enqueues :meth:`record`; once the shape was posted, its next
    prepare or post captures the graphs of both parities (where the platform captures), and posts replay
    them: one driver call per stream whatever the number of chunks."""

    def __init__(self, agent: "KVAgent", x: "_PackTransfer"):
        torch = _torch()
        from ..kernels.blocks import expand_launcher, request_header_len
        from ..kernels.launch import pack_launcher, unpack_launcher
        dev = agent._torch_device()
        self.agent, self.peer, self.route, self.source = agent, x.peer, x.route, x.source
        self.req = torch.empty(x._req_bytes // 8, dtype=torch.int64, device=dev)
        self.out = torch.empty((max(x.descriptors, 1), 3), dtype=torch.int64, device=dev)
        r = self.route
        G = len(r.groups)
        self.expand = expand_launcher(r.planes, self.req, self.out, n_groups=G,
                                      max_segments=int(x.n_seg.max()) if x.n_seg.size else 0)
        stage = agent.platform.as_tensor(agent.staging)
        local = r.src_anchor if self.source else r.dst_anchor

        def launcher(out, a, b, at, c):
            if self.source:
                return pack_launcher(local, stage, out, start=a, end=b, staging_offset=at, row_bytes=c)
            return unpack_launcher(stage, local, out, start=a, end=b, staging_offset=at, row_bytes=c)

        self.chunks: list[tuple[int, Any]] = []             # (bytes, the launch of its pack or unpack)
        for i, (a, b, nbytes, c) in enumerate(x._chunks):
            self.chunks.append((nbytes, launcher(self.out, a, b, (i % PACK_SLOTS) * agent.slot_bytes, c)))
        warm = (id(r), self.source)
        if not agent.platform.kernels_interpreted and warm not in agent._pack_warm:
            # on torch's current stream, after the zeros: every row copies 0 bytes, the request expands nothing
            zreq = torch.zeros(request_header_len(len(r.plane_group), G) + 1, dtype=torch.int64, device=dev)
            zout = torch.zeros((1, 3), dtype=torch.int64, device=dev)
            fns = [expand_launcher(r.planes, zreq, zout, n_groups=G, max_segments=1)]
            fns += [launcher(zout, 0, 1, 0, c) for _, _, c in r.classes if c <= agent.slot_bytes]
            for fn in fns:
                if fn is not None:
                    fn()
            agent._track(agent.platform.record_event(agent.platform.current_stream(agent.device)), (zreq, zout))
            agent._pack_warm.add(warm)
        self.graphs: list[Any] = [None] * 2
        self.posts = 0
        self.capturable = True

    def graph(self, parity: int):
        """The graphs of a post of ``parity`` -- ``(stream part, the source's lane part or None)`` --: once the
        shape was posted (a shape posted once may never come again), both parities' graphs are captured, at
        its next prepare or post (a prepare, in one process, comes before either side waits on the other);
        None where the platform captures none (the post then enqueues the operations). Neighbouring flag
        operations go into a graph as one batch (fewer nodes to launch); a capture that fails so is tried
        again with one node per operation."""
        agent = self.agent
        if self.graphs[parity] is None and self.capturable and self.posts and agent.graphs:
            plat = agent.platform
            for batch in (True, False):
                try:
                    if agent._capture_stream is None:
                        agent._capture_stream = plat.create_stream(agent.device)
                    cs = agent._capture_stream
                    for p in (0, 1):
                        g = plat.capture_graph(cs, lambda c, p=p: self.record(c, p, batch))
                        lane = (plat.capture_graph(cs, lambda c, p=p: self.record_copies(c, p, batch))
                                if self.source else None)
                        self.graphs[p] = None if g is None or (self.source and lane is None) else (g, lane)
                    break
                except Exception as exc:  # noqa: BLE001 - without batches, else one by one at each post
                    log.warning("agent %s: capturing a pack transfer%s failed (%s: %s)", agent.name,
                                " (flag operations in batches)" if batch else "", type(exc).__name__, exc)
                    self.graphs = [None] * 2
            self.capturable = all(g is not None for g in self.graphs)
        return self.graphs[parity]

    def _signal(self, q: "_FlagQueue", word: int, value: int) -> None:
        """The peer's control ``word`` := ``value`` after the work before it: a stream write into it where
        the probe saw one land (queued, so it joins a batch), else a write into our scratch copy of the word
        and an 8-byte copy-engine copy into the peer's."""
        peer = self.peer
        if peer.remote_flags:
            q.write(peer.control_ptr + 8 * word, value)
            return
        local = peer.scratch.ptr + 8 * word
        q.write(local, value)
        q.copy(peer.control_ptr + 8 * word, local, 8)

    def record(self, s: Stream, parity: int, batch: bool = False) -> None:
        """Enqueue this side's stream part of one transfer (see :class:`_PackTransfer`) on ``s``, the request
        already in :attr:`req`: every value is a constant of the shape and the parity, so a graph replays it.
        The source's copies go on its lane (:meth:`record_copies`)."""
        agent = self.agent
        q = _FlagQueue(agent.platform, s, batch)
        ctrl = agent.control.ptr
        avail, free, go = _AVAIL + parity, _FREE + parity, _GO + parity
        if self.expand is not None:
            q.launch(self.expand)
        if self.source:
            packed, copied = _PACKED + parity, _COPIED + parity
            q.wait(ctrl + 8 * go, 1)
            for i, (_, fn) in enumerate(self.chunks):
                if i:
                    q.write(ctrl + 8 * packed, i)       # chunk i - 1 is in its slot
                if i >= PACK_SLOTS:                     # the lane copied the slot's previous chunk out
                    q.wait(ctrl + 8 * copied, i - PACK_SLOTS + 1)
                q.launch(fn)
            q.write(ctrl + 8 * packed, len(self.chunks))
        else:
            self._signal(q, free, 0)            # the source is past every wait on it (its transfer before last)
            self._signal(q, go, 1)
            for i, (_, fn) in enumerate(self.chunks):
                q.wait(ctrl + 8 * avail, i + 1)
                if i == 0:
                    self._signal(q, go, 0)      # the source is past its wait on it
                q.launch(fn)
                self._signal(q, free, i + 1)
        q.flush()

    def record_copies(self, c: Stream, parity: int, batch: bool = False) -> None:
        """The source's lane of one transfer on ``c``: each packed chunk to the peer's slot, then the signal."""
        agent, peer = self.agent, self.peer
        q = _FlagQueue(agent.platform, c, batch)
        ctrl, slot = agent.control.ptr, agent.slot_bytes
        avail, free = _AVAIL + parity, _FREE + parity
        packed, copied = _PACKED + parity, _COPIED + parity
        for i, (nbytes, _) in enumerate(self.chunks):
            k = i % PACK_SLOTS
            q.wait(ctrl + 8 * packed, i + 1)
            if i >= PACK_SLOTS:                 # the destination unpacked the slot's previous chunk
                q.wait(ctrl + 8 * free, i - PACK_SLOTS + 1)
            q.copy(peer.staging_ptr + k * slot, agent.staging.ptr + k * slot, nbytes)
            q.write(ctrl + 8 * copied, i + 1)
            self._signal(q, avail, i + 1)
        q.wait(ctrl + 8 * free, len(self.chunks))
        self._signal(q, avail, 0)               # the destination is past every wait on it
        q.write(ctrl + 8 * packed, 0)           # both lanes are past every wait on these
        q.write(ctrl + 8 * copied, 0)
        q.flush()


class _FlagQueue:
    """Operations for one stream, in order: flag writes and waits are held until the next copy or launch
    (or :meth:`flush`) and then go as one :meth:`Platform.flag_ops` batch when ``batch`` (one graph node
    where captured), else one call each."""

    __slots__ = ("plat", "s", "batch", "native", "ops")

    def __init__(self, plat: Platform, s: Stream, batch: bool):
        self.plat, self.s, self.batch, self.native = plat, s, batch, plat.native_stream(s)
        self.ops: list[tuple[int, int, int]] = []

    def wait(self, ptr: int, value: int) -> None:
        self.ops.append((FLAG_OP_WAIT, ptr, value))

    def write(self, ptr: int, value: int) -> None:
        self.ops.append((FLAG_OP_WRITE, ptr, value))

    def flush(self) -> None:
        ops, self.ops = self.ops, []
        if self.batch and len(ops) > 1:
            self.plat.flag_ops(self.s, flag_ops_array(ops))
            return
        for op, ptr, value in ops:
            if op == FLAG_OP_WAIT:
                self.plat.wait_flag(self.s, ptr, value)
            else:
                self.plat.write_flag(self.s, ptr, value)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.flush()
        self.plat.copy_async(self.s, dst, src, nbytes)

    def launch(self, fn) -> None:
        """A kernel's launch: straight on the stream's driver handle where the platform gives one."""
        self.flush()
        if self.native is None:
            self.plat.launch(self.s, fn)
        else:
            fn(self.native)


class _PackTransfer(KVTransfer):
    """The ``pack`` engine: two-sided. The source side packs its blocks' pieces into its staging slot
    (a local kernel), copies the slot into the destination's staging on a copy engine and signals;
    the destination side waits, unpacks into its blocks and signals the slot free. Both sides prepare
    and post the same request (the source ``push``, the destination ``pull``, the same block IDs); the
    two derive the same descriptor order and chunks from the request. Chunk ``i`` of a transfer goes
    through slot ``i % PACK_SLOTS``; a chunk holds rows of one segment size, so row ``j`` of it sits at
    ``(j - first row) * size`` in the slot (no offsets to compute).

    The source packs on the posting stream and copies on a lane stream of its own, so chunk ``i + 1`` is
    packed while chunk ``i`` is on the wire (local words PACKED / COPIED hand the chunks between the
    two). Every flag value is a constant of the transfer's shape, so a post of a shape seen before is a
    graph replay per stream (:class:`_PackShape`): the words come in two sets, used by a pair's
    transfers in turn (parity ``p``: the n-th transfer in one direction uses set ``n % 2`` on both
    sides), and each word the peer waits on is reset by the side that writes it, once the waiting side
    is past its last wait (nothing this side's own queued work does can undo a release of its words)::

        source stream (p)          source lane (p)                destination stream (p)
        upload, expand                                            upload, expand
                                                                  signal the source: FREE[p] := 0,
        wait GO[p] >= 1  <------------------------------------------------------- GO[p] := 1
        chunk i:                   chunk i:                       chunk i:
         [wait COPIED[p] >= i+1-S]  wait PACKED[p] >= i + 1        wait AVAIL[p] >= i + 1
         pack -> own slot i % S     [wait FREE[p] >= i + 1 - S]    (i = 0: signal the source: GO[p] := 0)
         PACKED[p] := i + 1         copy own slot -> peer's slot   unpack own slot -> blocks
                                    signal AVAIL[p] := i + 1 --->  signal the source: FREE[p] := i + 1
                                    COPIED[p] := i + 1
                                   wait FREE[p] >= chunks  <-----
                                   signal AVAIL[p] := 0
                                   PACKED[p] := 0, COPIED[p] := 0
        wait the lane (event)
        event (the data has landed)                               event (the data has landed)

    (S = ``PACK_SLOTS``; a signal is a stream write into the peer's word where :meth:`KVAgent.add_peer`'s
    probe saw one land, else a local write and an 8-byte copy of it.) Why the resets are safe: the source's transfer before last of parity ``p``
    ended (its last wait on FREE[p]) before the destination's previous transfer could end; the
    destination passed its waits on AVAIL[p] before its last FREE[p]; each reset travels on the
    writer's stream ahead of anything it writes into the word later; the lane resets its local words
    once both lanes are past their waits, before the stream's next transfer (which waits for the lane).
    A transfer of no chunks moves nothing and touches no flag (both sides know). An agent's pack posts
    run one after another (a post on another stream waits for the one before): its staging serves both
    directions.
    """

    waits_on_peer = True

    def __init__(self, *a, chunks: list, pooled, entries: int, **kw):
        self._chunks = chunks
        self._pooled = pooled           # the host array's pool token: back to the pool when collected
        super().__init__(*a, **kw)
        self._req_bytes = entries * 8   # the request's entries (the pooled array may hold more)
        agent, peer = self.agent, self.peer
        self.source = self.op == "push"
        if agent.staging is None:
            raise BadInput(f"agent {agent.name!r} has no staging buffer: build it with engine='pack'")
        if self.source and peer.staging_ptr is None:
            raise BadInput(f"peer {peer.name!r} has no staging buffer (its agent does not run the pack engine)")
        self._buffers = (self._host_req,)
        self._shape_key = (id(self.route), self.source, self.n_seg.tobytes())
        self._host_ptr = self._host_req.data_ptr()
        self._shape = None
        if chunks:
            with agent._post_lock:
                self._shape = agent._pack_shape(self)
                if self._shape.posts:       # a shape seen again: its graphs now, not inside a post
                    self._shape.graph(0)

    def _build_launches(self, max_segments: int, launches: list) -> None:
        """Nothing per request: the kernels belong to the request's shape (:class:`_PackShape`)."""

    def post(self, stream: Stream | None = None) -> KVTransferHandle:
        """Enqueue this side's part (see the class docstring) on ``stream``; the handle completes when the
        data has landed on the destination. Host work: the request upload and, for a shape posted before,
        one graph launch (else the operations one by one), a notification if asked for, one event.

        A post that fails part way fails the agent (:meth:`KVAgent.fail`): the peer may already have acted on
        the signals it queued, so the two sides' transfers no longer pair up; its error is raised from every
        later call instead of a timeout of the next transfer."""
        agent, peer = self.agent, self.peer
        agent._check_usable(peer)
        s = agent.stream if stream is None else stream
        if not isinstance(s, Stream) or s.closed:
            raise BadInput(f"request {self.name!r}: cannot post on {s!r}: not an open stream of the platform")
        with agent._post_lock:
            if agent._pack_peer not in (None, peer.meta.uid):
                raise BadInput(f"agent {agent.name!r} already runs pack transfers with another peer: its control "
                               "words hand chunks to one peer (use one agent per pack peer)")
            agent._pack_peer = peer.meta.uid
            try:
                return self._post(s)
            except Exception as exc:
                log.error("agent %s: posting %s failed part way (%s: %s); the agent fails", agent.name,
                          self.describe(), type(exc).__name__, exc)
                agent.fail(exc)
                raise

    def _post(self, s: Stream) -> KVTransferHandle:
        agent, peer = self.agent, self.peer
        plat = agent.platform
        tail = agent._pack_tail
        if tail is not None and tail[0] is not s:
            plat.stream_wait_event(s, tail[1])
        keep: tuple = self._buffers
        shape = self._shape
        if shape is not None:
            parity = (peer.pack_sent if self.source else peer.pack_recv) % 2
            plat.copy_async(s, shape.req.data_ptr(), self._host_ptr, self._req_bytes)
            graphs = shape.graph(parity)
            lane = agent._pack_lane() if self.source else None
            if graphs is None:
                shape.record(s, parity)
                if lane is not None:
                    shape.record_copies(lane, parity)
            else:
                if s is agent.stream:
                    agent._calls.launch_graph(graphs[0])
                else:
                    plat.launch_graph(s, graphs[0])
                if lane is not None:
                    plat.launch_graph(lane, graphs[1])
            if lane is not None:            # the handle's event comes after the lane's copies
                agent._lane_event = plat.record_event(lane, agent._lane_event)
                plat.stream_wait_event(s, agent._lane_event)
            shape.posts += 1
            if self.source:                 # counted once the transfer is queued
                peer.pack_sent += 1
            else:
                peer.pack_recv += 1
            keep = (self, shape)
        value, event = self._finish(s)
        agent._track(event, keep)
        agent._pack_tail = (s, event)
        return KVTransferHandle(self, event, s, value)

    def expanded_descriptors(self) -> np.ndarray:
        """The descriptors of the request (its shape's expansion; for checking, not a transfer path)."""
        agent = self.agent
        plat, s = agent.platform, agent.stream
        shape = self._shape
        if shape is None:
            return np.zeros((0, 3), dtype=np.int64)
        with agent._post_lock:
            tail = agent._pack_tail
            if tail is not None and tail[0] is not s:
                plat.stream_wait_event(s, tail[1])
            plat.copy_async(s, shape.req.data_ptr(), self._host_ptr, self._req_bytes)
            if shape.expand is not None:
                plat.launch(s, shape.expand)
            event = plat.record_event(s)
            agent._pack_tail = (s, event)
        agent._track(event, (self, shape))
        if not plat.synchronize(s, agent.timeout_s):
            raise TransferTimeout(rank=agent.rank, step=0, flag=f"request {self.name!r}", expected=1, seen=0,
                                  timeout_s=agent.timeout_s, what="expanding the descriptors")
        return shape.out[:self.descriptors].cpu().numpy().copy()


def expand_on_host(table: np.ndarray, request: np.ndarray, n_groups: int) -> np.ndarray:
    """The expansion kernel's descriptors computed with NumPy, one vector operation per plane (for engines
    whose driver API takes host arrays). ``request`` must be well formed (:meth:`KVAgent.prepare` builds it)."""
    P = table.shape[0]
    head = P + 1
    n_rows = int(request[P])
    out = np.zeros((n_rows, 3), dtype=np.int64)
    for p in range(P):
        sb, ss, db, ds, seg, g, rs, rd, _, _ = (int(v) for v in table[p])
        row0, n = int(request[p]), int(request[head + g])
        if n == 0:
            continue
        soff, doff = int(request[head + n_groups + g]), int(request[head + 2 * n_groups + g])
        j = np.arange(n, dtype=np.int64)
        out[row0:row0 + n, 0] = sb + request[soff + j // rs] * ss + (j % rs) * seg
        out[row0:row0 + n, 1] = db + request[doff + j // rd] * ds + (j % rd) * seg
        out[row0:row0 + n, 2] = seg
    return out


class _CopyEngineTransfer(KVTransfer):
    """The ``copy_engine`` engine: one-sided, no SM. ``cuMemcpyBatchAsync`` takes host arrays of addresses,
    so the descriptors are expanded on the host once, at :meth:`KVAgent.prepare` (the per-request setup:
    one NumPy operation per plane); a post is the batch calls (8,192 copies each) and an event."""

    def _build_launches(self, max_segments: int, launches: list) -> None:
        r = self.route
        d = expand_on_host(r.table, self._host_req.numpy(), len(r.groups))
        self._srcs = np.ascontiguousarray(d[:, 0] + np.int64(r.src_anchor.data_ptr()))
        self._dsts = np.ascontiguousarray(d[:, 1] + np.int64(r.dst_anchor.data_ptr()))
        self._sizes = np.ascontiguousarray(d[:, 2])

    def post(self, stream: Stream | None = None) -> KVTransferHandle:
        agent = self.agent
        agent._check_usable(self.peer)
        plat = agent.platform
        s = agent.stream if stream is None else stream
        with agent._post_lock:
            if self._sizes.size:
                plat.copy_batch_async(s, self._dsts, self._srcs, self._sizes)
            value, event = self._finish(s)
        agent._track(event, (self,))
        return KVTransferHandle(self, event, s, value)

    def expanded_descriptors(self) -> np.ndarray:
        r = self.route
        return np.stack([self._srcs - r.src_anchor.data_ptr(), self._dsts - r.dst_anchor.data_ptr(), self._sizes],
                        axis=1)


# ============================================================================ the agent


class KVAgent(Closable, FailsOnTimeout):
    """One process's side of KV transfers: its registered caches, its peers, its stream.

    ``platform``: a :class:`~gpuxfer.platforms.base.Platform` (default: the process's,
    :func:`gpuxfer.platforms.current`); ``device``: the local device every transfer runs on; ``engine``:
    ``"triton"`` (``"auto"`` picks it), ``"pack"`` (both agents of a pair run it) or ``"copy_engine"``;
    ``timeout_s``: the default of every wait; ``rank``: how errors name this side;
    ``slot_bytes``: the pack engine's staging slot (192 MiB; 1 MiB on the host emulation); a request's chunks are
    32 MiB or about a sixteenth of the request, whichever is larger, up to the slot.

    **Failure.** When a wait on a peer times out -- a ``pack`` transfer's handle (its streams wait on
    flags the peer writes) or :meth:`wait_notification` -- the agent fails, as a benchmark side does
    (:class:`~gpuxfer.kv.engines.FailsOnTimeout`): it writes a release value into its own control words
    (the pack flags and every notification slot a stream was made to wait on), so none of its streams
    stays blocked, and raises the error from every later call; ``close`` still works.
    ``on_timeout="exit"`` (or ``GPUXFER_KV_ON_TIMEOUT=exit``) then ends the process. A ``triton``
    transfer queues no wait on the peer: its handle's timeout only raises.
    """

    def __init__(self, name: str, *, platform: Platform | None = None, device: int = 0, engine: str = "auto",
                 timeout_s: float = 60.0, rank: int = 0, slot_bytes: int | None = None,
                 on_timeout: str | None = None):
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME:
            raise BadInput(f"agent name must be a string of 1..{_MAX_NAME} characters, got {name!r}")
        engine = "triton" if engine == "auto" else engine
        if engine not in AGENT_ENGINES:
            raise BadInput(f"KVAgent runs engine(s) {', '.join(AGENT_ENGINES)}; got {engine!r}")
        self._closed = False
        self.failed = None
        self.on_timeout = on_timeout_from_env(on_timeout)
        self._waited_slots: set[int] = set()        # notification slots a stream was made to wait on
        self._stream_waits: dict[int, Event] = {}     # per stream made to wait on a slot: an event after its wait
        if platform is None:
            from ..platforms import current
            platform = current()
        self.platform, self.name, self.engine = platform, name, engine
        self.device = int(device)
        self.timeout_s, self.rank = float(timeout_s), int(rank)
        from .engines.launch import kernel_reason
        why = kernel_reason(platform)
        if why is not None:
            raise BackendUnavailable(engine, {name: why})
        self.uid = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}
        self._allocs: list[IpcHandle] = []
        self._alloc_bases: list[int] = []
        self._alloc_keys: dict[bytes, int] = {}
        self._layer_refs: dict[tuple[str, str], tuple[int, int]] = {}
        self._flats: dict[int, Any] = {}
        self._peers: dict[str, KVPeer] = {}
        self._routes: dict[tuple, _Route] = {}
        self._names = itertools.count()
        self._inflight: collections.deque = collections.deque()     # (event, buffers) of posted transfers
        self._pack_peer: str | None = None                          # the one peer pack transfers go to
        self._pack_shapes: collections.OrderedDict = collections.OrderedDict()   # shape key -> _PackShape
        self._pack_tail: tuple | None = None                        # (stream, event) of the last pack post
        self._pack_warm: set = set()                                # (route id, source?) whose kernels are loaded
        self._lane: Stream | None = None                            # a pack source's copies (beside its packs)
        self._lane_event: Event | None = None
        self._requests = _RequestPool(pinned=not platform.host_memory)     # host arrays of requests
        self._post_lock = threading.Lock()                          # a route's ring, one post at a time
        self._capture_stream: Stream | None = None                  # where slots' graphs are captured
        self.graphs = True                                          # capture slots' launches as graphs
        self._slot_uses = itertools.count(1)
        self.control: DeviceBuffer | None = None
        self.staging: DeviceBuffer | None = None
        self.stream: Stream | None = None
        if slot_bytes is None:
            slot_bytes = PACK_SLOT_BYTES_EMULATION if platform.kernels_interpreted else PACK_SLOT_BYTES
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes < 256 or slot_bytes % 256:
            raise BadInput(f"slot_bytes must be a positive multiple of 256, got {slot_bytes!r}")
        self.slot_bytes = slot_bytes
        try:
            if engine == "pack":
                self.staging = platform.alloc(PACK_SLOTS * slot_bytes, self.device)
            self.control = platform.alloc(_CTRL_BYTES, self.device)
            self.stream = platform.create_stream(self.device)
            self._calls = platform.stream_calls(self.stream)        # the stream's flag and graph calls, bound once
            platform.memset_async(self.stream, self.control.ptr, 0, _CTRL_BYTES)
            if not platform.synchronize(self.stream, self.timeout_s):
                raise TransferTimeout(rank=self.rank, step=0, flag="notification words (memset)", expected=1,
                                      seen=0, timeout_s=self.timeout_s)
        except BaseException:
            self._release()
            raise
        _LOCAL_AGENTS[self.uid] = self

    # ------------------------------------------------------------------ registration

    def _torch_device(self):
        return self.platform.torch_device(self.device)

    def register_group(self, name: str, block_tokens: int, layers: Mapping[str, Any] | Sequence[Any], *,
                       token_major: bool = True) -> None:
        """Register a KV-cache group: layers sharing one block table of ``block_tokens``-token blocks.

        ``layers``: ``{layer name: tensor or KVLayerSpec}`` (vLLM's ``kv_caches`` for the group's
        layers) or a sequence (named ``"<group>.<i>"``). Tensors must be on the agent's device, in
        memory the platform can export. Adding a peer or a transfer does not need every group: a
        request names the groups it moves.
        """
        self._check_open()
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME:
            raise BadInput(f"group name must be a string of 1..{_MAX_NAME} characters, got {name!r}")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or not 0 < block_tokens < 1 << 32:
            raise BadInput(f"group {name!r}: block_tokens must be a positive int, got {block_tokens!r}")
        if name in self._groups:
            raise BadInput(f"group {name!r} is already registered")
        if isinstance(layers, Mapping):
            items = list(layers.items())
        else:
            items = [(f"{name}.{i}", t) for i, t in enumerate(layers)]
        if not items:
            raise BadInput(f"group {name!r} has no layers")
        torch = _torch()
        want = self._torch_device()
        described: list[KVLayer] = []
        for pos, (lname, t) in enumerate(items):
            if not isinstance(lname, str) or not 0 < len(lname) <= _MAX_NAME:
                raise BadInput(f"group {name!r}: layer names must be strings, got {lname!r}")
            tensor = t.tensor if isinstance(t, KVLayerSpec) else t
            if not isinstance(tensor, torch.Tensor):
                raise BadInput(f"group {name!r}, layer {lname!r}: expected a torch.Tensor, got {type(tensor).__name__}")
            if tensor.device != want:
                raise BadInput(f"group {name!r}, layer {lname!r}: the tensor is on {tensor.device}; this agent's "
                               f"device is {want}")
            described.append(describe_layer(t, name=lname, position=pos, token_major=token_major))
        refs = []
        for lay in described:
            ex = self.platform.export_range(lay.ptr, lay.extent, self.device)
            key = ex.handle.payload
            with self._lock:
                a = self._alloc_keys.get(key)
                if a is None:
                    a = self._alloc_keys[key] = len(self._allocs)
                    self._allocs.append(ex.handle)
                    self._alloc_bases.append(lay.ptr - ex.offset)
            refs.append((a, ex.offset))
        flats = []
        for (lname, t), lay in zip(items, described):
            flats.append(self._flat(t.tensor if isinstance(t, KVLayerSpec) else t))
        with self._lock:
            if name in self._groups:
                raise BadInput(f"group {name!r} is already registered")
            self._groups[name] = _Group(name, block_tokens, described, flats)
            for lay, ref in zip(described, refs):
                self._layer_refs[(name, lay.name)] = ref
            self._routes.clear()

    def register_kv_caches(self, kv_caches: Mapping[str, Any], block_tokens: int, *, group: str = "kv") -> None:
        """vLLM's ``register_kv_caches``: every layer in one group of ``block_tokens``-token blocks."""
        self.register_group(group, block_tokens, kv_caches)

    def _flat(self, tensor):
        """A 1-element uint8 tensor at ``tensor.data_ptr()`` over its storage (a kernel anchor)."""
        torch = _torch()
        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        flat.set_(tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(), (1,), (1,))
        self._flats[int(tensor.data_ptr())] = flat
        return flat

    def _flat_at(self, ptr: int):
        flat = self._flats.get(int(ptr))
        if flat is None:
            raise NotRegistered(f"no registered tensor of agent {self.name!r} starts at 0x{int(ptr):x}")
        return flat

    @property
    def groups(self) -> dict[str, tuple[int, int, int]]:
        """``{group: (block tokens, blocks, layers)}``."""
        return {g.name: (g.block_tokens, g.num_blocks, len(g.layers)) for g in self._groups.values()}

    # ------------------------------------------------------------------ metadata and peers

    def metadata(self) -> bytes:
        """This agent's caches and notification words, as versioned bytes for :meth:`add_peer` elsewhere."""
        self._check_open()
        ctrl = self.platform.export_handle(self.control)
        body = {
            "agent": self.name, "uid": self.uid, "pid": os.getpid(), "host": socket.gethostname() or "unknown",
            "platform": self.platform.name, "device": self.device,
            "control": {"payload": ctrl.payload.hex(), "nbytes": ctrl.nbytes, "device": ctrl.device},
            "staging": None if self.staging is None else dict(
                self._handle_meta(self.platform.export_handle(self.staging)), slot_bytes=self.slot_bytes),
            "allocations": [{"payload": h.payload.hex(), "nbytes": h.nbytes, "device": h.device}
                            for h in self._allocs],
            "groups": [{"name": g.name, "block_tokens": g.block_tokens,
                        "layers": [lay.as_meta(*self._layer_refs[(g.name, lay.name)]) for lay in g.layers]}
                       for g in self._groups.values()],
        }
        raw = json.dumps(body, separators=(",", ":")).encode()
        return _HEADER.pack(METADATA_MAGIC, METADATA_VERSION, 0, len(raw)) + raw

    @staticmethod
    def _handle_meta(h: IpcHandle) -> dict:
        return {"payload": h.payload.hex(), "nbytes": h.nbytes, "device": h.device}

    def add_peer(self, metadata: bytes) -> KVPeer:
        """Add the agent whose :meth:`metadata` these bytes are: map its caches and notification words."""
        self._check_open()
        meta = decode_metadata(metadata)
        if meta.platform != self.platform.name:
            raise BadMetadata(f"peer {meta.agent!r} runs on platform {meta.platform!r}, this agent on "
                              f"{self.platform.name!r}")
        if meta.host != (socket.gethostname() or "unknown"):
            raise BackendUnavailable(self.engine, {meta.agent: f"the peer is on host {meta.host!r}; the "
                                                              f"{self.engine} engine maps its memory over IPC"})
        if meta.uid == self.uid:
            raise BadInput("an agent cannot be its own peer")
        if meta.agent in self._peers:
            raise BadInput(f"peer {meta.agent!r} is already added (remove_peer first)")
        peer = KVPeer(self, meta)
        with self._lock:
            self._peers[meta.agent] = peer
        if self.engine == "pack":
            peer.remote_flags = self._probe_remote_flags(peer)
        self._warm(peer)
        return peer

    def _probe_remote_flags(self, peer: KVPeer) -> bool:
        """Whether a stream write into the peer's control words lands (``$GPUXFER_FLAG_PATH``: ``auto`` probes
        -- a write of a fresh value on a stream of its own, read back through the mapping --, ``remote`` /
        ``copy`` force one path; CUDA 13.1+ refuses remote stream writes)."""
        from ..flaglink import SETUP_TIMEOUT_S, flag_path_from_env
        path = flag_path_from_env()
        if path != "auto":
            return path == "remote"
        plat = self.platform
        word = peer.control_ptr + 8 * _PROBE
        nonce = int.from_bytes(os.urandom(6), "little") + 1
        timeout = min(self.timeout_s, SETUP_TIMEOUT_S)
        s = plat.create_stream(self.device)
        pending, ok = False, False
        try:
            plat.write_flag(s, word, nonce)
            pending = not plat.synchronize(s, timeout)
            ok = not pending and plat.read_flag(word, self.device) == nonce
        except Exception as exc:  # noqa: BLE001 - the remote path is optional (CUDA 13.1+ refuses it): logged
            log.info("agent %s: a remote stream write to peer %s failed (%s: %s)", self.name, peer.name,
                     type(exc).__name__, exc)
        if pending:
            # the write is still queued: the stream is kept, not destroyed under it
            log.warning("agent %s: the probe's stream write to peer %s did not complete within %g s; its stream "
                        "is kept for the life of the process", self.name, peer.name, timeout)
            _LEAKED.append(s)
        else:
            try:
                s.close()
            except Exception as exc:  # noqa: BLE001 - a stream a refused operation left unusable: logged
                log.warning("agent %s: closing the probe's stream failed (%s: %s)", self.name, type(exc).__name__,
                            exc)
        if not ok:
            log.info("agent %s: pack signals to peer %s go by 8-byte copies", self.name, peer.name)
        return ok

    def _warm(self, peer: KVPeer) -> None:
        """Build the routes of whole requests (every shared group, every layer) in both directions now, so a
        request's setup finds them; a layout the peer does not match raises when a request names it."""
        from ..kernels import blocks, launch  # noqa: F401 - loaded here, not in the first request's setup
        shared = tuple(g for g in self._groups if g in peer.groups)
        if not shared:
            return
        for op in DIRECTIONS:
            try:
                self._route(peer, op, None, shared)
            except (LayoutMismatch, BadInput) as exc:
                log.debug("agent %s: no %s route with peer %s yet: %s", self.name, op, peer.name, exc)

    def remove_peer(self, peer: "KVPeer | str") -> None:
        """Forget a peer, then close its mappings and free its scratch once every transfer posted with it
        completed (waiting at most the agent's timeout).

        Past the timeout the agent fails (:meth:`fail`: its waits are released, its error is raised from
        every later call) and waits once more; what still runs then may touch the peer's mappings and
        scratch, so those are kept for the life of the process (logged) instead of freed under it."""
        name = peer.name if isinstance(peer, KVPeer) else peer
        with self._lock:
            p = self._peers.pop(name, None)
            for k in [k for k in self._routes if k[0] == name]:
                del self._routes[k]
        if p is None:
            raise NotRegistered(f"agent {self.name!r} has no peer {name!r}")
        for key in [k for k, v in self._pack_shapes.items() if v.peer is p]:
            del self._pack_shapes[key]
        posts = [(e, b) for e, b in self._inflight if any(getattr(x, "peer", None) is p for x in b)]
        events = [e for e, _ in posts] + [n[1] for n in p._notified if n is not None]
        if not self._completed(events):
            log.warning("agent %s: transfers with peer %s did not complete within %g s of remove_peer; the agent "
                        "fails and releases its waits", self.name, name, self.timeout_s)
            self.fail(TransferTimeout(rank=self.rank, step=0, flag=f"transfers with peer {name!r}", expected=1,
                                      seen=0, timeout_s=self.timeout_s, what="removing the peer"))
            if not self._completed(events):
                keep = p._mappings + p._owned
                p._mappings, p._owned = [], []
                log.error("agent %s: transfers with peer %s still run after the waits were released; keeping %d "
                          "buffers and mappings they may touch for the life of the process", self.name, name,
                          len(keep))
                _LEAKED.extend(keep)
                _LEAKED.append(posts)
        p.close()

    def peer(self, name: str) -> KVPeer:
        p = self._peers.get(name)
        if p is None:
            raise NotRegistered(f"agent {self.name!r} has no peer {name!r}; peers: {', '.join(self._peers) or 'none'}")
        return p

    # ------------------------------------------------------------------ routes

    def _route(self, peer: KVPeer, op: str, layers: tuple[int, int] | None, groups: tuple[str, ...]) -> _Route:
        key = (peer.name, op, layers, groups)
        r = self._routes.get(key)
        if r is None:
            r = self._build_route(peer, op, layers, groups)
            with self._lock:
                self._routes[key] = r
        return r

    def _build_route(self, peer: KVPeer, op: str, layers: tuple[int, int] | None, names: tuple[str, ...]
                     ) -> _Route:
        torch = _torch()
        from ..kernels.blocks import PLANE_FIELDS
        src_is_mine = op == "push"
        rows, plane_group, splits, limits, dst_spans, keys = [], [], [], [], [], []
        src_ptrs, dst_ptrs = [], []        # (absolute piece address of block 0, anchor maker)
        for gi, gname in enumerate(names):
            mine, theirs = self._groups[gname], peer.groups[gname]
            bts, btd = (mine.block_tokens, theirs.block_tokens) if src_is_mine else \
                (theirs.block_tokens, mine.block_tokens)
            if max(bts, btd) % min(bts, btd):
                raise LayoutMismatch(f"group {gname!r}: block sizes {bts} (source) and {btd} (destination) tokens; "
                                     "one must divide the other")
            seg = min(bts, btd)
            splits.append((bts // seg, btd // seg))
            src_g, dst_g = (mine, theirs) if src_is_mine else (theirs, mine)
            limits.append((src_g.num_blocks, dst_g.num_blocks))
            theirs_by_name = {lay.name: (lay, ref) for lay, ref in zip(theirs.layers, theirs.flats)}
            selected = [(lay, fl) for lay, fl in zip(mine.layers, mine.flats)
                        if layers is None or layers[0] <= lay.index < layers[1]]
            if layers is None and len(theirs.layers) != len(mine.layers):
                raise LayoutMismatch(f"group {gname!r}: {len(mine.layers)} layers here, {len(theirs.layers)} on "
                                     f"peer {peer.name!r}")
            spans = []
            for lay, fl in selected:
                other = theirs_by_name.get(lay.name)
                if other is None:
                    raise LayoutMismatch(f"group {gname!r}: peer {peer.name!r} has no layer {lay.name!r}")
                olay, oref = other
                mine_anchor = (lambda f=fl: f)
                their_anchor = (lambda o=oref, p=olay.ptr: peer.anchor(o, p))
                s_lay, d_lay = (lay, olay) if src_is_mine else (olay, lay)
                s_anc, d_anc = (mine_anchor, their_anchor) if src_is_mine else (their_anchor, mine_anchor)
                src_ptrs.append((s_lay.ptr, s_anc))
                dst_ptrs.append((d_lay.ptr, d_anc))
                spans.append(d_lay.span)
                for k, (ps_off, pd_off, seg_bytes) in enumerate(_pair_pieces(gname, lay, olay, bts, btd,
                                                                              src_is_mine)):
                    keys.append((-seg_bytes, gname, lay.name, k))
                    rows.append([s_lay.ptr + ps_off, s_lay.block_stride, d_lay.ptr + pd_off, d_lay.block_stride,
                                 seg_bytes, gi, bts // seg, btd // seg, src_g.num_blocks, dst_g.num_blocks])
                    plane_group.append(gi)
            dst_spans.append(spans)
        if not rows:
            raise BadInput(f"layer range {layers} selects no layer of the groups shared with peer {peer.name!r}")
        src_base, src_anchor = min(src_ptrs, key=lambda x: x[0])
        dst_base, dst_anchor = min(dst_ptrs, key=lambda x: x[0])
        table = np.array(rows, dtype=np.int64)
        table[:, 0] -= src_base
        table[:, 2] -= dst_base
        # largest segments first, each size together; then by group, layer and piece names: an order
        # both sides derive alike (whatever order they registered in)
        order = np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
        table, pg = table[order], np.asarray(plane_group, dtype=np.int64)[order]
        cuts = np.flatnonzero(np.diff(table[:, 4])) + 1
        bounds = [0, *cuts.tolist(), len(table)]
        classes = [(a, b, int(table[a, 4])) for a, b in zip(bounds[:-1], bounds[1:])]
        from ..kernels import launch as kl
        merged: list[list] = []         # one copy launch per tiling: neighbouring sizes tiled alike share one
        for a, b, c in classes:
            key = (kl.choose_config(c), kl.choose_config(c, few_programs=True))
            if merged and merged[-1][3] == key:
                merged[-1][1] = b
            else:
                merged.append([a, b, c, key])
        dev = self._torch_device()
        planes = torch.from_numpy(np.ascontiguousarray(table)).to(dev)
        if dev.type != "cpu":
            self.platform.synchronize(self.platform.current_stream(self.device), self.timeout_s)
        assert table.shape[1] == PLANE_FIELDS
        return _Route(op=op, groups=names, splits=splits, limits=limits, dst_classes=_overlap_classes(dst_spans),
                      planes=planes, table=table, plane_group=pg, classes=classes, src_anchor=src_anchor(),
                      dst_anchor=dst_anchor(), launch_classes=[(a, b, c) for a, b, c, _ in merged],
                      plane_bytes=np.ascontiguousarray(table[:, 4]))

    # ------------------------------------------------------------------ transfers

    def prepare(self, peer: "KVPeer | str", op: str, *, local_blocks: Mapping[str, Any],
                remote_blocks: Mapping[str, Any], layers: tuple[int, int] | None = None,
                notify_slot: int | None = None, name: str | None = None) -> KVTransfer:
        """Per-request setup: check the block IDs, stage them for upload, size the launches.

        ``op``: ``"pull"`` (the peer's blocks -> ours) or ``"push"`` (ours -> the peer's).
        ``local_blocks`` / ``remote_blocks``: ``{group: block IDs}`` on each side, the same groups;
        where block sizes differ, the side with larger blocks lists ``ceil(n / ratio)`` of them for
        the other side's ``n``. ``layers``: ``(first, stop)`` model layer numbers to move (default:
        all). ``notify_slot``: bump this word of the peer's notification area after the data
        (0..63). ``name``: how errors and timeouts name the request.
        """
        self._check_open()
        if op not in DIRECTIONS:
            raise BadInput(f"op must be one of {', '.join(DIRECTIONS)}, got {op!r}")
        peer = self.peer(peer) if isinstance(peer, str) else peer
        self._check_usable(peer)
        if layers is not None:
            if (not isinstance(layers, (tuple, list)) or len(layers) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
                    or not 0 <= layers[0] < layers[1]):
                raise BadInput(f"layers must be (first, stop) with 0 <= first < stop, got {layers!r}")
            layers = (int(layers[0]), int(layers[1]))
        if notify_slot is not None and (isinstance(notify_slot, bool) or not isinstance(notify_slot, int)
                                        or not 0 <= notify_slot < NOTIFY_SLOTS):
            raise BadInput(f"notify_slot must be an int in 0..{NOTIFY_SLOTS - 1}, got {notify_slot!r}")
        name = f"{self.name}#{next(self._names)}" if name is None else str(name)
        if not isinstance(local_blocks, Mapping) or not isinstance(remote_blocks, Mapping):
            raise BlockIdError(f"request {name!r}: local_blocks and remote_blocks must map group -> block IDs")
        if set(local_blocks) != set(remote_blocks):
            raise BlockIdError(f"request {name!r}: local_blocks names groups {sorted(map(str, local_blocks))}, "
                               f"remote_blocks {sorted(map(str, remote_blocks))}; they must be the same")
        for g in local_blocks:
            if g not in self._groups or g not in peer.groups:
                shared = [x for x in self._groups if x in peer.groups]
                raise NotRegistered(f"request {name!r}: group {g!r} is not registered on both agent "
                                    f"{self.name!r} and peer {peer.name!r} (shared: {', '.join(shared) or 'none'})")
        if not local_blocks:
            raise BlockIdError(f"request {name!r} names no group")
        route = self._route(peer, op, layers, tuple(g for g in self._groups if g in local_blocks))
        G = len(route.groups)
        n_seg = np.zeros(G, dtype=np.int64)
        src_ids: list[np.ndarray] = [np.zeros(0, np.int64)] * G
        dst_ids: list[np.ndarray] = [np.zeros(0, np.int64)] * G
        for gi, g in enumerate(route.groups):
            if g not in local_blocks:
                continue
            mine = _as_ids(local_blocks[g], name, g, "local blocks")
            theirs = _as_ids(remote_blocks[g], name, g, "remote blocks")
            s, d = (mine, theirs) if op == "push" else (theirs, mine)
            rs, rd = route.splits[gi]
            n = len(s) if rs == 1 else len(d)
            if -(-n // rs) != len(s) or -(-n // rd) != len(d):
                raise BlockIdError(f"request {name!r}, group {g!r}: {len(s)} source and {len(d)} destination "
                                   f"blocks do not cover the same tokens (block-size ratio {rs}:{rd})")
            ls, ld = route.limits[gi]
            _check_range(s, ls, name, g, "source (local)" if op == "push" else "source (remote)")
            _check_range(d, ld, name, g, "destination (remote)" if op == "push" else "destination (local)")
            if rs == rd == 1 and len(s) > 1:
                # copies run in the order of the peer's blocks: programs running together touch
                # neighbouring peer memory (the fastest order measured for the descriptor-copy kernel);
                # the order of the copies is free, no two destinations overlap. The pack engine's two
                # sides must agree on it: both take the source's.
                if op == "pull" or self.engine == "pack":
                    order = _sort_order(s, ls)
                else:
                    order = _sort_order(d, ld)
                s, d = s[order], d[order]
            n_seg[gi], src_ids[gi], dst_ids[gi] = n, s, d
        for cls in route.dst_classes:
            ids = [dst_ids[gi] for gi in cls if dst_ids[gi].size]
            if ids:
                _check_unique(np.concatenate(ids) if len(ids) > 1 else ids[0], max(route.limits[gi][1] for gi in cls),
                              name, [route.groups[gi] for gi in cls])
        return self._stage(peer, route, op, name, n_seg, src_ids, dst_ids, notify_slot)

    def _stage(self, peer, route: _Route, op, name, n_seg, src_ids, dst_ids, notify_slot) -> KVTransfer:
        """The request array (header + block IDs, as :mod:`gpuxfer.kernels.block_kernel` lays it out) in a host
        array, and the transfer of the agent's engine around it."""
        P, G = len(route.plane_group), len(route.groups)
        head = P + 1 + 3 * G
        ids = src_ids + dst_ids
        sizes = np.fromiter((a.size for a in ids), dtype=np.int64, count=2 * G)
        total = head + int(sizes.sum())
        plane_rows = n_seg[route.plane_group]
        n_rows = int(plane_rows.sum())
        nbytes = int(plane_rows @ route.plane_bytes)
        if self.engine in ("triton", "pack"):
            host, h = self._requests.take(total)
        else:
            h = np.empty(total, dtype=np.int64)
            host = _torch().from_numpy(h)
        h[0] = 0
        np.cumsum(plane_rows, out=h[1:P + 1])
        h[P + 1:P + 1 + G] = n_seg
        starts = h[P + 1 + G:head]
        starts[0] = head
        np.cumsum(sizes[:-1], out=starts[1:])
        starts[1:] += head
        np.concatenate(ids, out=h[head:total])
        if self.engine == "triton":
            return _SlotTransfer(self, peer, route, op, name, n_seg, host, h[:total], notify_slot, n_rows, nbytes)
        if self.engine == "copy_engine":
            return _CopyEngineTransfer(self, peer, route, op, name, n_seg, host, host, None, 0, [], notify_slot,
                                       n_rows, nbytes)
        return self._stage_pack(peer, route, op, name, n_seg, host, h[:total], notify_slot, n_rows, nbytes)

    def _stage_pack(self, peer, route: _Route, op, name, n_seg, host, array, notify_slot, n_rows, nbytes
                    ) -> KVTransfer:
        """The pack engine's transfer: its chunks (the device buffers and kernels belong to its shape,
        :class:`_PackShape`, shared by every request of that shape)."""
        chunks = []
        row_start = array[:len(route.plane_group) + 1]
        slot = self.slot_bytes
        target = min(slot, max(min(PACK_CHUNK_BYTES, slot), -(-nbytes // PACK_MAX_CHUNKS)))
        for a, b, c in route.classes:
            r0, r1 = int(row_start[a]), int(row_start[b])
            if r1 <= r0:
                continue
            if c > slot:
                raise BadInput(f"request {name!r}: {c}-byte segments do not fit the pack engine's "
                               f"{slot}-byte staging slots")
            per = max(target // c, 1)
            chunks += [(x, min(x + per, r1), (min(x + per, r1) - x) * c, c) for x in range(r0, r1, per)]
        return _PackTransfer(self, peer, route, op, name, n_seg, host[0], None, None,
                             int(n_seg.max()) if n_seg.size else 0, [], notify_slot, n_rows, nbytes, chunks=chunks,
                             pooled=host, entries=int(array.shape[0]))

    def _take_slot(self, route: _Route, s: Stream, rows: int, entries: int) -> _Slot:
        """A slot of ``route``'s ring free for a post on ``s`` that holds ``rows`` descriptors and ``entries``
        request entries: one last used on ``s`` or whose last post completed (made, or remade larger --
        geometrically --, when it is too small); a new one while the ring has room; else the least recently
        used, once its last post completed (waiting at most the agent's timeout)."""
        plat, slots = self.platform, route.slots
        i = -1
        for k, slot in enumerate(slots):
            if slot.stream is s or plat.event_query(slot.event):     # every slot has its last event
                i = k
                break
        if i < 0:
            if len(slots) < RING_SLOTS:
                i = len(slots)
            else:
                i = min(range(len(slots)), key=lambda k: slots[k].used)
                if not plat.event_wait(slots[i].event, self.timeout_s):
                    raise TransferTimeout(rank=self.rank, step=0, flag="a free slot", expected=1, seen=0,
                                          timeout_s=self.timeout_s,
                                          what=f"all {len(slots)} slots of a route still run earlier posts")
        if i == len(slots):
            slot = self._new_slot(route, s, max(rows, MIN_SLOT_ROWS), max(entries, MIN_SLOT_ENTRIES))
            slots.append(slot)
            return self._use(slot)
        slot = slots[i]
        if slot.rows < rows or slot.entries < entries:
            slot = slots[i] = self._new_slot(route, s, slot.rows if rows <= slot.rows else max(rows, 2 * slot.rows),
                                             slot.entries if entries <= slot.entries else
                                             max(entries, 2 * slot.entries))
        return self._use(slot)

    def _use(self, slot: _Slot) -> _Slot:
        slot.used = next(self._slot_uses)
        return slot

    def _new_slot(self, route: _Route, s: Stream, rows: int, entries: int) -> _Slot:
        """A slot's buffers, zeroed on ``s`` (after torch's current stream, where the caching allocator may
        have used the memory last), its launchers, and its graph (captured on a stream of the agent's)."""
        plat = self.platform
        slot = _Slot(route, rows, entries, self._torch_device())
        plat.stream_wait_event(s, plat.record_event(plat.current_stream(self.device)))
        plat.memset_async(s, slot.req_ptr, 0, entries * 8)
        plat.memset_async(s, slot.out.data_ptr(), 0, rows * 24)
        if not plat.kernels_interpreted:
            # one run of the fixed launches over the zeroed request (it moves nothing) loads the compiled
            # kernels, so the capture below records launches only
            slot.enqueue(plat, s)
        slot.event, slot.stream = plat.record_event(s), s
        if self.graphs:
            try:
                if self._capture_stream is None:
                    self._capture_stream = plat.create_stream(self.device)
                slot.graph = plat.capture_graph(self._capture_stream, lambda c: slot.enqueue(plat, c))
            except Exception as exc:  # noqa: BLE001 - the same launches run one by one instead
                log.warning("agent %s: capturing a slot's launches as a graph failed (%s: %s); posts launch them "
                            "one by one", self.name, type(exc).__name__, exc)
                self.graphs = False
            if slot.graph is None:
                self.graphs = False
        return slot

    def transfer(self, peer: "KVPeer | str", op: str, *, local_blocks: Mapping[str, Any],
                 remote_blocks: Mapping[str, Any], stream: Stream | None = None, **kw) -> KVTransferHandle:
        """:meth:`prepare` then :meth:`KVTransfer.post`."""
        return self.prepare(peer, op, local_blocks=local_blocks, remote_blocks=remote_blocks, **kw).post(stream)

    def _pack_shape(self, x: "_PackTransfer") -> "_PackShape":
        """The cached :class:`_PackShape` of ``x``'s shape (built on first use; the least recently used of
        more than :data:`PACK_SHAPES` goes: posts in flight keep theirs alive through :meth:`_track`)."""
        shapes = self._pack_shapes
        shape = shapes.get(x._shape_key)
        if shape is None:
            shape = shapes[x._shape_key] = _PackShape(self, x)
            while len(shapes) > PACK_SHAPES:
                shapes.popitem(last=False)
        else:
            shapes.move_to_end(x._shape_key)
        return shape

    def _pack_lane(self) -> Stream:
        if self._lane is None:
            self._lane = self.platform.create_stream(self.device)
        return self._lane

    def _track(self, event: Event, buffers: tuple) -> None:
        """Keep a posted transfer's buffers until its event completes (dropping the transfer and its
        handle early must not free memory the stream still reads); completed entries go first."""
        q = self._inflight
        while q and self.platform.event_query(q[0][0]):
            q.popleft()
        q.append((event, buffers))

    # ------------------------------------------------------------------ notifications

    def _slot(self, slot: int) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < NOTIFY_SLOTS:
            raise BadInput(f"notification slot must be an int in 0..{NOTIFY_SLOTS - 1}, got {slot!r}")
        return self.control.ptr + 8 * slot

    def notification(self, slot: int = 0) -> int:
        """The value of notification word ``slot`` (how many notifications reached it), read now."""
        self._check_open()
        return self.platform.read_flag(self._slot(slot), self.device)

    def wait_notification(self, slot: int, value: int, timeout_s: float | None = None) -> int:
        """Poll word ``slot`` until it holds ``value`` or more; :class:`TransferTimeout` past ``timeout_s``."""
        self._check_open()
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        try:
            return wait_flag_or_raise(self.platform, self._slot(slot), int(value), t, rank=self.rank,
                                      step=int(value), flag=f"notification slot {slot} of agent {self.name!r}",
                                      device=self.device)
        except TransferTimeout as exc:
            self.fail(exc)
            raise

    def stream_wait_notification(self, stream: Stream, slot: int, value: int) -> None:
        """Block ``stream``'s later work (not the host) until word ``slot`` holds ``value`` or more."""
        self._check_open()
        ptr = self._slot(slot)
        self._waited_slots.add(slot)
        self.platform.wait_flag(stream, ptr, int(value))
        self._stream_waits[id(stream)] = self.platform.record_event(stream)    # close drains past it

    # ------------------------------------------------------------------ failure

    def failure_name(self) -> str:
        return f"KV agent {self.name!r} (rank {self.rank}, {self.platform.name}:{self.device})"

    def release_waits(self) -> None:
        """Write the release value into this agent's words its streams (or the caller's) may wait on: the
        pack flags and the notification slots waited on from a stream. Best effort: the abort path."""
        if self.control is None:
            return
        for word in (*_PACK_WORDS, *sorted(self._waited_slots)):
            try:
                self.platform.host_write_flag(self.control.ptr + 8 * word, RELEASE_VALUE, self.device)
            except Exception as exc:  # noqa: BLE001 - keep releasing
                log.warning("agent %s: releasing control word %d failed: %s", self.name, word, exc)

    # ------------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise BadInput(f"agent {self.name!r} is closed")
        self.check()

    def _check_usable(self, peer: KVPeer) -> None:
        self._check_open()
        if not isinstance(peer, KVPeer) or peer.agent is not self:
            raise NotRegistered(f"{peer!r} is not a peer of agent {self.name!r}")
        if peer.closed or self._peers.get(peer.name) is not peer:
            raise NotRegistered(f"peer {peer.name!r} was removed from agent {self.name!r}")

    def _drained(self) -> bool:
        """Wait (:meth:`_completed`) for every posted transfer (the caller's streams included), every stream
        made to wait on a notification and the agent's own streams; whether all completed."""
        plat = self.platform
        events = [e for e, _ in getattr(self, "_inflight", ())] + list(getattr(self, "_stream_waits", {}).values())
        for st in (getattr(self, "stream", None), getattr(self, "_lane", None)):
            if st is not None:
                try:
                    events.append(plat.record_event(st))
                except Exception as exc:  # noqa: BLE001 - a stream an error stopped runs nothing more
                    log.warning("agent %s: %r ended in an error: %s", self.name, st, exc)
        return self._completed(events)

    def _completed(self, events: list) -> bool:
        """Wait, at most the agent's timeout in all, for ``events``; whether all completed. Work that ended in
        an error is done (logged)."""
        import time
        plat = self.platform
        deadline = time.monotonic() + self.timeout_s
        done = True
        for e in events:
            try:
                done = plat.event_wait(e, max(0.0, deadline - time.monotonic())) and done
            except Exception as exc:  # noqa: BLE001 - the work ended in an error: nothing more runs
                log.warning("agent %s: queued work ended in an error: %s", self.name, exc)
        return done

    def _release(self) -> None:
        """Drain (every queued wait bounded: the agent's timeout; released once), then close the peers'
        mappings, the streams, and free the control words and the staging. What a GPU wait that did not
        pass may still read or write -- the control words, the staging, the peers' mappings and scratch, the
        posted transfers' buffers -- is kept for the life of the process instead (logged)."""
        _LOCAL_AGENTS.pop(getattr(self, "uid", ""), None)
        drained = self._drained()
        if not drained:
            log.warning("agent %s: queued work did not complete within %g s of close; releasing its waits",
                        self.name, self.timeout_s)
            self.release_waits()
            drained = self._drained()
        peers = list(getattr(self, "_peers", {}).values())
        if not drained:
            keep = [b for b in (getattr(self, "control", None), getattr(self, "staging", None)) if b is not None]
            for p in peers:
                keep += p._mappings + p._owned
                p._mappings, p._owned = [], []
            log.error("agent %s: queued work still runs after its waits were released; keeping %d buffers and "
                      "mappings it may touch for the life of the process", self.name, len(keep))
            _LEAKED.extend(keep)
            _LEAKED.append(getattr(self, "_inflight", None))
            self.control = self.staging = None
        for p in peers:
            p.close()
        self._pack_shapes = collections.OrderedDict()
        self._pack_tail = None
        self._peers = {}
        self._routes = {}
        self._inflight = collections.deque()
        self._stream_waits = {}
        self._groups, self._flats = {}, {}
        if getattr(self, "stream", None) is not None:
            self.stream.close()
            self.stream = None
        if getattr(self, "_capture_stream", None) is not None:
            self._capture_stream.close()
            self._capture_stream = None
        if getattr(self, "_lane", None) is not None:
            self._lane.close()
            self._lane = None
        if getattr(self, "control", None) is not None:
            self.control.close()
            self.control = None
        if getattr(self, "staging", None) is not None:
            self.staging.close()
            self.staging = None

    def __repr__(self) -> str:
        return (f"KVAgent({self.name!r}, {self.platform.name}:{self.device}, {len(self._groups)} groups, "
                f"{len(self._peers)} peers{', closed' if self._closed else ''})")
