"""SGLang's ``KVArgs`` as a :class:`~gpuxfer.kv.KVAgent` sees it, and the geometry two instances must share.
No SGLang import: ``kv_args`` is any object with SGLang's attribute names.

``KVArgs`` describes memory by address: ``kv_data_ptrs[e]`` / ``kv_data_lens[e]`` / ``kv_item_lens[e]`` per
entry (MHA: every layer's K buffer, then every layer's V buffer; MLA: one buffer per layer; draft-model
entries appended), page ``p`` of entry ``e`` at ``ptr[e] + p * kv_item_lens[e]``. Every entry becomes one
layer of the agent's group ``kv`` (``page_size``-token blocks, one piece per page), so a request's page
indices name blocks of every entry at once. The aux metadata buffers (one row per request) travel as bytes
on SGLang's control socket, not through the agent (see :mod:`.conn`).
"""
from __future__ import annotations

import ctypes
import json
from typing import Any

from ...errors import BadInput, BadMetadata

GROUP = "kv"
#: what a registration payload may hold at most (an agent's metadata is far smaller)
MAX_PAYLOAD_BYTES = 16 << 20


def _ints(kv_args: Any, name: str) -> list[int]:
    vals = getattr(kv_args, name, None)
    if vals is None:
        return []
    try:
        out = [int(v) for v in vals]
    except (TypeError, ValueError):
        raise BadInput(f"KVArgs.{name} must be a list of integers, got {vals!r}") from None
    return out


def check_supported(kv_args: Any) -> None:
    """Refuse what this backend does not move yet, naming it (``BadInput``)."""
    ptrs, lens, items = (_ints(kv_args, n) for n in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens"))
    if not ptrs:
        raise BadInput("KVArgs.kv_data_ptrs is empty: the gpuxfer backend needs the KV pool's buffers")
    if not len(ptrs) == len(lens) == len(items):
        raise BadInput(f"KVArgs: {len(ptrs)} kv_data_ptrs, {len(lens)} kv_data_lens and {len(items)} kv_item_lens "
                       "must be as many")
    for e, (ptr, n, item) in enumerate(zip(ptrs, lens, items)):
        if ptr <= 0 or item <= 0 or n < item:
            raise BadInput(f"KVArgs entry {e}: pointer 0x{ptr:x}, {n} bytes and {item}-byte pages describe no page")
    states = [s for s in (getattr(kv_args, "state_types", None) or [])]
    if states:
        raise BadInput(f"the gpuxfer SGLang backend moves the paged KV pool and metadata rows only; this model also "
                       f"has state buffers {[getattr(s, 'value', s) for s in states]} (mamba/SWA/DSA), not supported yet")
    if getattr(kv_args, "host_kv_data_ptrs", None):
        raise BadInput("the gpuxfer SGLang backend does not move host (hierarchical-cache) KV destinations")


def register_kv_args(agent: Any, kv_args: Any) -> None:
    """Every KV entry of ``kv_args`` as one layer of ``agent``'s group ``kv`` (``page_size``-token blocks)."""
    check_supported(kv_args)
    page_size = int(kv_args.page_size)
    layers = {}
    for e, (ptr, n, item) in enumerate(zip(_ints(kv_args, "kv_data_ptrs"), _ints(kv_args, "kv_data_lens"),
                                           _ints(kv_args, "kv_item_lens"))):
        layers[f"entry.{e}"] = agent.layer_at(ptr, n, item, index=e)
    agent.register_group(GROUP, page_size, layers)


def geometry(kv_args: Any, attn_tp_size: int | None = None) -> dict:
    """What a prefill and a decode instance must agree on for their pages to pair one to one. ``attn_tp_size``:
    the rank's attention TP size where its pool holds a TP slice of the KV heads (MHA); None where every rank
    holds all of it (MLA)."""
    return {"page_size": int(kv_args.page_size), "kv_item_lens": _ints(kv_args, "kv_item_lens"),
            "attn_tp_size": None if attn_tp_size is None else int(attn_tp_size),
            "aux_item_lens": _ints(kv_args, "aux_item_lens"),
            "kv_cache_dtype": str(getattr(kv_args, "kv_cache_dtype_str", "") or ""),
            "kv_layout": getattr(kv_args, "kv_layout", None),
            "num_draft_entries": int(getattr(kv_args, "num_draft_entries", 0) or 0)}


def geometry_differences(ours: dict, theirs: dict) -> list[str]:
    """Every way ``theirs`` (a decode instance's :func:`geometry`) differs from ``ours``, in words."""
    out = []
    for key in ("page_size", "kv_item_lens", "aux_item_lens", "kv_cache_dtype", "kv_layout", "num_draft_entries"):
        if ours.get(key) != theirs.get(key):
            out.append(f"{key}: prefill {ours.get(key)!r}, decode {theirs.get(key)!r}")
    if "attn_tp_size" in theirs and ours.get("attn_tp_size") != theirs["attn_tp_size"]:
        out.append(f"attention TP size: prefill {ours.get('attn_tp_size')!r}, decode {theirs['attn_tp_size']!r} "
                   "(pages move whole, rank to rank: an MHA pool's heads are split by TP, and different TP sizes "
                   "would need head slicing, which this backend does not do)")
    return out


def encode_registration(geom: dict, metadata: bytes) -> bytes:
    """A decode instance's registration payload: its geometry (JSON) and its agent's metadata."""
    head = json.dumps(geom, sort_keys=True).encode()
    return len(head).to_bytes(4, "little") + head + metadata


def decode_registration(payload: bytes) -> tuple[dict, bytes]:
    """Inverse of :func:`encode_registration`; ``BadMetadata`` for anything else (bounded, never read past)."""
    if not isinstance(payload, (bytes, bytearray)) or not 4 <= len(payload) <= MAX_PAYLOAD_BYTES:
        raise BadMetadata(f"a gpuxfer SGLang registration payload of {len(payload)} bytes (4..{MAX_PAYLOAD_BYTES})")
    n = int.from_bytes(payload[:4], "little")
    if n > len(payload) - 4:
        raise BadMetadata(f"a registration payload claims a {n}-byte geometry in {len(payload) - 4} bytes")
    try:
        geom = json.loads(bytes(payload[4:4 + n]))
    except ValueError as exc:
        raise BadMetadata(f"a registration payload's geometry is not JSON: {exc}") from None
    if not isinstance(geom, dict):
        raise BadMetadata(f"a registration payload's geometry is a {type(geom).__name__}, not an object")
    return geom, bytes(payload[4 + n:])


def read_aux_rows(kv_args: Any, index: int) -> list[bytes]:
    """Row ``index`` of every aux (metadata) buffer: host memory of this process."""
    out = []
    for ptr, n, item in zip(_ints(kv_args, "aux_data_ptrs"), _ints(kv_args, "aux_data_lens"),
                            _ints(kv_args, "aux_item_lens")):
        if not 0 <= index < n // item:
            raise BadInput(f"aux row {index} lies outside a {n}-byte metadata buffer of {item}-byte rows")
        out.append(ctypes.string_at(ptr + index * item, item))
    return out


def write_aux_rows(kv_args: Any, index: int, rows: list[bytes]) -> None:
    """Write ``rows`` (one per aux buffer, each exactly its row size) at row ``index``; ``BadInput`` before
    any byte is written where a row does not fit."""
    bufs = list(zip(_ints(kv_args, "aux_data_ptrs"), _ints(kv_args, "aux_data_lens"), _ints(kv_args, "aux_item_lens")))
    if len(rows) != len(bufs):
        raise BadInput(f"{len(rows)} metadata rows for {len(bufs)} metadata buffers")
    for (ptr, n, item), row in zip(bufs, rows):
        if not 0 <= index < n // item or len(row) != item:
            raise BadInput(f"a {len(row)}-byte metadata row at row {index} of a {n}-byte buffer of {item}-byte rows")
    for (ptr, n, item), row in zip(bufs, rows):
        ctypes.memmove(ptr + index * item, row, item)
