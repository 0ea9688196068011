"""KV-cache layers as the agent sees them: a layer's blocks, their stride and the pieces of a block
(:class:`KVPiece`, :class:`KVLayerSpec`, :class:`KVLayer`), read from a tensor's shape and strides
(:func:`describe_layer`), and checked."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import BadInput

_MAX_INT = 1 << 62
_MAX_NAME = 512
_MAX_PIECES = 16
#: the pieces a group's layers may have together once a view cut each of their pieces into token rows
#: (``KVAgent.add_peer``'s ``token_slice``): a route has a plane per piece and layer, and a request a descriptor per
#: plane and block, so this keeps a sliced request's descriptors within a few times an unsliced one's
_MAX_ROW_PIECES = 1024


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
                 err=BadInput, max_pieces: int = _MAX_PIECES) -> None:
    """Every block of every piece inside ``extent``; distinct blocks of a piece never overlap; 1..``max_pieces``
    pieces."""
    if num_blocks < 1 or block_stride < 1 or not pieces or len(pieces) > max_pieces:
        raise err(f"layer {name!r}: needs >= 1 block, a positive block stride and 1..{max_pieces} pieces "
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


def _checked_index(name: str, index) -> int:
    """A layer's model layer number, as metadata carries it: an int in ``[0, 2^62)``, else :class:`BadInput`."""
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= int(index) < _MAX_INT:
        raise BadInput(f"layer {name!r}: its layer index must be an int in [0, 2^62), got {index!r} (the first "
                       "integer in its name unless given: KVLayerSpec(index=...) or describe_layer(index=...))")
    return int(index)


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


def checked_flag(name: str, value, what: str = "token_major") -> bool:
    """``value`` as a bool: :class:`BadInput` naming layer or group ``name`` unless it is one (a truthy string
    or number is no answer to a yes-or-no setting)."""
    if not isinstance(value, (bool, np.bool_)):
        raise BadInput(f"{name}: {what} must be a bool, got {value!r}")
    return bool(value)


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
    layer = KVLayer(name=name, index=_checked_index(name, _layer_index(name, position) if index is None else index),
                    ptr=int(t.data_ptr()), num_blocks=int(nb), block_stride=int(stride), pieces=pieces,
                    extent=_tensor_extent(t), token_major=checked_flag(f"layer {name!r}", token_major))
    _check_layer(name, layer.num_blocks, layer.block_stride, pieces, layer.extent)
    return layer


class _DeviceBytes:
    """A minimal ``__cuda_array_interface__`` (v3) over raw device bytes (torch aliases it, CUDA and ROCm)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def memory_at(ptr: int, nbytes: int, device) -> Any:
    """A uint8 tensor aliasing ``[ptr, ptr + nbytes)`` of this process's memory on torch ``device``: an
    engine's KV buffer known only by its address (SGLang's ``KVArgs``). Nothing is copied and nothing is
    owned: the memory must outlive the tensor and everything registered from it. Registration then exports
    it as it exports a tensor (``NotExportable`` where the platform cannot)."""
    torch = _torch()
    for v, what in ((ptr, "pointer"), (nbytes, "length")):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 < int(v) < _MAX_INT:
            raise BadInput(f"memory_at: the {what} must be a positive int, got {v!r}")
    ptr, nbytes, device = int(ptr), int(nbytes), torch.device(device)
    if device.type == "cpu":
        import ctypes
        t = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
    elif device.type == "cuda":
        t = torch.as_tensor(_DeviceBytes(ptr, nbytes), device=device)
    else:
        raise BadInput(f"memory_at: no raw-pointer view for torch device {device}")
    if t.data_ptr() != ptr or t.numel() != nbytes or t.device != device:
        raise BadInput(f"memory_at: torch did not alias [0x{ptr:x}, +{nbytes}) on {device} (got "
                       f"0x{t.data_ptr():x}, {t.numel()} bytes on {t.device})")
    return t


def _from_spec(spec: KVLayerSpec, name: str, position: int) -> KVLayer:
    torch = _torch()
    t = spec.tensor
    if not isinstance(t, torch.Tensor):
        raise BadInput(f"layer {name!r}: KVLayerSpec.tensor must be a torch.Tensor, got {type(t).__name__}")
    for v, what in ((spec.num_blocks, "num_blocks"), (spec.block_stride_bytes, "block_stride_bytes")):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise BadInput(f"layer {name!r}: {what} must be an int, got {v!r}")
    try:
        given = list(spec.pieces)
    except TypeError:
        raise BadInput(f"layer {name!r}: KVLayerSpec.pieces must be a sequence of (offset, nbytes) pairs, got "
                       f"{spec.pieces!r}") from None
    pieces = []
    for p in given:
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
    layer = KVLayer(name=name,
                    index=_checked_index(name, _layer_index(name, position) if spec.index is None else spec.index),
                    ptr=int(t.data_ptr()), num_blocks=int(spec.num_blocks),
                    block_stride=int(spec.block_stride_bytes), pieces=tuple(pieces), extent=int(extent),
                    token_major=checked_flag(f"layer {name!r}", spec.token_major))
    _check_layer(name, layer.num_blocks, layer.block_stride, layer.pieces, layer.extent)
    return layer


def _runs_overlap(a0: int, na: int, sa: int, ca: int, b0: int, nb: int, sb: int, cb: int,
                  same_block: bool = False) -> bool:
    """Whether two runs of intervals meet: run A is ``[a0 + i * sa, a0 + i * sa + na)`` for ``i < ca`` (each
    interval at most ``sa`` bytes: its own are disjoint), run B alike. Equal strides: O(1), from the range
    of block distances ``j - i`` that would overlap (``same_block``: only ``i == j`` meeting does not
    count); other strides: O(intervals in the window both runs span), vectorised."""
    lo, hi = max(a0, b0), min(a0 + (ca - 1) * sa + na, b0 + (cb - 1) * sb + nb)
    if lo >= hi:
        return False
    if sa == sb:
        d = b0 - a0                       # B_j meets A_i iff -nb < d + (j - i) * s < na
        m_lo = (-nb - d) // sa + 1
        m_hi = -((d - na) // sa) - 1
        m_lo, m_hi = max(m_lo, -(ca - 1)), min(m_hi, cb - 1)
        return m_lo <= m_hi and not (same_block and m_lo == m_hi == 0)
    if (hi - lo) // sa > (hi - lo) // sb:     # walk the run with fewer intervals in the window
        a0, na, sa, ca, b0, nb, sb, cb = b0, nb, sb, cb, a0, na, sa, ca
    first = max(0, (lo - a0 - na) // sa)
    last = min(ca - 1, (hi - a0) // sa)
    x = a0 + np.arange(first, last + 1, dtype=np.int64) * sa        # A's intervals in the window
    j_lo = np.maximum((x - b0 - nb) // sb + 1, 0)                   # first B_j ending after x
    j_hi = np.minimum((x + na - 1 - b0) // sb, cb - 1)              # last B_j starting before x + na
    return bool((j_lo <= j_hi).any())


def check_disjoint(group: str, layers: Sequence[KVLayer], registered: Sequence[tuple[str, Sequence[KVLayer]]],
                   err=BadInput) -> None:
    """Refuse memory a request's copies could write twice at once: two pieces of one layer, two layers of
    ``group``, or a layer of ``group`` and one of another registered group (``registered``: ``(group,
    layers)``), whose blocks meet -- except groups laid over the same memory block for block (the same
    block stride, block ``i`` of one meeting block ``i`` of the other only): they share a key range, so a
    request names each block once (:class:`~gpuxfer.kv.ids._RouteIds`). A sweep over the pieces' spans:
    only pieces whose spans meet are compared."""
    items = []                  # (span start, span end, run, group, layer, piece, new)
    for g, ls, new in [(g, ls, False) for g, ls in registered] + [(group, layers, True)]:
        for lay in ls:
            for k, p in enumerate(lay.pieces):
                a0 = lay.ptr + p.offset
                items.append((a0, a0 + (lay.num_blocks - 1) * lay.block_stride + p.nbytes,
                              (a0, p.nbytes, lay.block_stride, lay.num_blocks), g, lay, k, new))
    items.sort(key=lambda t: t[0])
    active: list = []
    for it in items:
        active = [a for a in active if a[1] > it[0]]
        for a in active:
            if not (it[6] or a[6]):
                continue
            if _runs_overlap(*a[2], *it[2], same_block=a[3] != it[3]):
                x, y = (it, a) if it[6] else (a, it)
                if x[4] is y[4]:
                    raise err(f"group {group!r}, layer {x[4].name!r}: pieces {min(x[5], y[5])} and "
                              f"{max(x[5], y[5])} overlap (a block's copies would write the same bytes twice)")
                where = f"layer {y[4].name!r}" + ("" if y[3] == group else f" of group {y[3]!r}")
                raise err(f"group {group!r}, layer {x[4].name!r} overlaps {where} (a request's copies would race "
                          "over the same bytes); register memory several layers share once, and lay groups over "
                          "the same memory only block for block (the same block stride and blocks)")
        active.append(it)
