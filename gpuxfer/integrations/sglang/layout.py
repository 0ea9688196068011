"""SGLang's ``KVArgs`` as a :class:`~gpuxfer.kv.KVAgent` sees it, and the geometry two instances must share.
No SGLang import: ``kv_args`` is any object with SGLang's attribute names.

``KVArgs`` describes memory by address: ``kv_data_ptrs[e]`` / ``kv_data_lens[e]`` / ``kv_item_lens[e]`` per
entry (MHA: every layer's K buffer, then every layer's V buffer; MLA: one buffer per layer; draft-model
entries appended), page ``p`` of entry ``e`` at ``ptr[e] + p * kv_item_lens[e]``. Every entry becomes one
layer of the agent's group ``kv`` (``page_size``-token blocks, one piece per page), so a request's page
indices name blocks of every entry at once. The aux metadata buffers (one row per request, host memory) are
read and written here by address; a copy of them registered with the agent is :mod:`.rows`'.
"""
from __future__ import annotations

import ctypes
import json
import numbers
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


def _tp_size(size: Any) -> int | None:
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
            raise BadInput(f"the attention TP size {size!r:.40} is not a positive integer")
        size = int(size)
    return size


def geometry(kv_args: Any, attn_tp_size: int | None = None, tp_size: int | None = None) -> dict:
    """What a prefill and a decode instance must agree on for their pages to pair. ``attn_tp_size``: the rank's
    attention TP size where its pool holds a TP slice of the KV heads (MHA), with its rank in it
    (``KVArgs.engine_rank`` modulo the size); None where every rank holds all of it (MLA). ``tp_size``: the
    rank's attention TP size whatever its pool (:func:`destinations` reads it; ``attn_tp_size`` by default)."""
    attn_tp_size = _tp_size(attn_tp_size)
    rank = None if attn_tp_size is None else int(getattr(kv_args, "engine_rank", 0) or 0) % attn_tp_size
    return {"page_size": int(kv_args.page_size), "kv_item_lens": _ints(kv_args, "kv_item_lens"),
            "attn_tp_size": attn_tp_size, "attn_tp_rank": rank,
            "tp_size": attn_tp_size if tp_size is None else _tp_size(tp_size),
            "aux_item_lens": _ints(kv_args, "aux_item_lens"),
            "kv_cache_dtype": str(getattr(kv_args, "kv_cache_dtype_str", "") or ""),
            "kv_layout": getattr(kv_args, "kv_layout", None),
            "num_draft_entries": int(getattr(kv_args, "num_draft_entries", 0) or 0)}


def _sliced(ours: dict, theirs: dict) -> bool:
    """Whether two MHA ranks' pages hold different slices of the heads (their attention TP sizes differ)."""
    pt, dt = ours.get("attn_tp_size"), theirs.get("attn_tp_size")
    return pt is not None and dt is not None and pt != dt


def geometry_differences(ours: dict, theirs: dict) -> list[str]:
    """Every way ``theirs`` (a decode instance's :func:`geometry`) differs from ``ours``, in words. MHA ranks of
    different attention TP sizes hold pages of different sizes; :func:`head_share` pairs those."""
    out = []
    keys = ["page_size", "aux_item_lens", "kv_cache_dtype", "kv_layout", "num_draft_entries"]
    if not _sliced(ours, theirs):
        keys.insert(1, "kv_item_lens")
    for key in keys:
        if ours.get(key) != theirs.get(key):
            out.append(f"{key}: prefill {ours.get(key)!r}, decode {theirs.get(key)!r}")
    if "attn_tp_size" in theirs and (ours.get("attn_tp_size") is None) != (theirs["attn_tp_size"] is None):
        out.append(f"attention TP size: prefill {ours.get('attn_tp_size')!r}, decode {theirs['attn_tp_size']!r} "
                   "(one pool is MLA, every rank holding all of it, the other MHA, each rank a slice of the heads)")
    return out


def destinations(ours: dict, theirs: dict) -> int | None:
    """How many decode ranks name pages for one room of a prefill rank (``ours``: its :func:`geometry`) when
    one of them is a rank of ``theirs``, by SGLang's rank mapping: one per prefill rank where the decode's
    attention TP size is at most the prefill's, else the decode ranks sharing one prefill rank (their TP sizes'
    ratio). None where a side states no TP size (a decode of an earlier gpuxfer with an MLA pool)."""
    pt, dt = ours.get("tp_size"), theirs.get("tp_size", theirs.get("attn_tp_size"))
    if not (_whole(pt) and _whole(dt) and pt >= 1 and dt >= 1):
        return None
    return max(1, dt // pt)


def total_kv_heads(kv_args: Any, attn_tp_size: int) -> int:
    """The model's KV heads, as SGLang's ``KVArgs`` of a prefill rank give them (``total_kv_head_num``, else
    ``kv_head_num`` per rank times the attention TP size); 0 where it gives neither."""
    total = int(getattr(kv_args, "total_kv_head_num", 0) or 0)
    return total if total > 0 else int(getattr(kv_args, "kv_head_num", 0) or 0) * int(attn_tp_size)


def _rank_heads(total: int, tp: int, rank: int, who: str) -> tuple[int, int]:
    """The global KV heads ``[first, first + n)`` rank ``rank`` of attention TP size ``tp`` holds: ``total / tp``
    heads each, or, with more ranks than heads, one head held by ``tp / total`` consecutive ranks (SGLang's
    replication); :class:`BadInput` where neither divides the other."""
    if total % tp == 0:
        n = total // tp
        return rank * n, n
    if tp % total == 0:
        return rank // (tp // total), 1
    raise BadInput(f"{total} KV heads do not split evenly over the {who}'s attention TP size {tp}: "
                   "heads cannot be sliced between the ranks")


def _whole(x) -> bool:
    """``x`` is an int (a bool is not: JSON's ``true`` is no count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def head_share(ours: dict, theirs: dict, total_heads: int, heads_here: int = 0) -> dict:
    """How a prefill rank (``ours``: its :func:`geometry`) pushes to a decode rank (``theirs``) of an MHA pool at
    another attention TP size: the :meth:`KVAgent.add_peer <gpuxfer.kv.KVAgent.add_peer>` views
    (``local_token_slice`` / ``token_slice``: bytes ``[a, b)`` of each token's row of every entry on each side)
    of the global KV heads the two ranks share; ``{}`` where pages pair whole (equal TP sizes, an MLA pool, or
    two ranks holding the same heads). ``total_heads``: the model's KV heads (:func:`total_kv_heads`);
    ``heads_here``: the prefill rank's (``KVArgs.kv_head_num``; 0: not known).

    SGLang's rank mapping pairs a decode rank with the prefill ranks whose heads it holds (decode TP smaller:
    each of them, each one response) or with the one prefill rank holding its heads (decode TP larger); so one
    of the two ranks' heads lies within the other's, and the push carries those. Ranks replicating a head (more
    ranks than heads) hold it alike: each replica of a prefill head sends it (the same bytes), as SGLang's
    Mooncake backend does. :class:`BadInput` naming what cannot be sliced: heads that do not split evenly, a
    rank outside its TP size, entries whose page bytes are not whole heads of one size, ranks sharing no head."""
    if not _sliced(ours, theirs):
        return {}
    pt, dt = ours["attn_tp_size"], theirs["attn_tp_size"]
    pr, dr = ours.get("attn_tp_rank"), theirs.get("attn_tp_rank")
    for who, r, t in (("prefill", pr, pt), ("decode", dr, dt)):
        if not _whole(t) or t < 1:
            raise BadInput(f"the {who}'s attention TP size {t!r:.40} is not a positive integer")
        if not _whole(r) or not 0 <= r < t:
            raise BadInput(f"the {who}'s attention TP rank {r!r:.40} is not one of its TP size {t} (a decode of a "
                           "gpuxfer without head slicing names none)")
    if total_heads < 1:
        raise BadInput("the prefill's KVArgs give no KV head count (total_kv_head_num or kv_head_num): heads "
                       "cannot be sliced between attention TP sizes")
    p0, hp = _rank_heads(total_heads, pt, pr, "prefill")
    d0, hd = _rank_heads(total_heads, dt, dr, "decode")
    if heads_here and heads_here != hp:
        raise BadInput(f"the prefill rank holds {heads_here} KV heads, not the {hp} of {total_heads} over its "
                       f"attention TP size {pt}")
    page, p_items, d_items = ours["page_size"], ours["kv_item_lens"], theirs.get("kv_item_lens")
    if not isinstance(d_items, list) or not all(_whole(i) for i in d_items):
        raise BadInput(f"the decode's kv_item_lens {d_items!r:.80} are not a list of integers")
    if len(p_items) != len(d_items):
        raise BadInput(f"the prefill has {len(p_items)} KV entries, the decode {len(d_items)}")
    sizes = set()
    for e, (pi, di) in enumerate(zip(p_items, d_items)):
        for who, item, heads in (("prefill", pi, hp), ("decode", di, hd)):
            if item % (page * heads):
                raise BadInput(f"KV entry {e}: the {who}'s {item}-byte pages are not {page} tokens of {heads} heads")
        if pi // (page * hp) != di // (page * hd):
            raise BadInput(f"KV entry {e}: a head's bytes per token differ: prefill {pi // (page * hp)} "
                           f"({pi}-byte pages of {hp} heads), decode {di // (page * hd)} ({di}-byte pages of {hd})")
        sizes.add(pi // (page * hp))
    if len(sizes) != 1:
        raise BadInput(f"the KV entries' heads differ in size ({sorted(sizes)} bytes per token): one head slice "
                       "serves every entry only where they are alike")
    hb = sizes.pop()
    first, end = max(p0, d0), min(p0 + hp, d0 + hd)
    if (first, end) not in ((p0, p0 + hp), (d0, d0 + hd)):
        raise BadInput(f"decode rank {dr} of attention TP size {dt} holds KV heads {d0}..{d0 + hd - 1}, prefill "
                       f"rank {pr} of TP size {pt} heads {p0}..{p0 + hp - 1}: neither holds the other's")
    mine, theirs_ = ((first - p0) * hb, (end - p0) * hb), ((first - d0) * hb, (end - d0) * hb)
    if mine == (0, hp * hb) and theirs_ == (0, hd * hb):
        return {}
    return {"local_token_slice": {GROUP: mine}, "token_slice": {GROUP: theirs_}}


def encode_registration(geom: dict, metadata: bytes) -> bytes:
    """A decode instance's registration payload: its geometry (JSON) and its agent's metadata."""
    head = json.dumps(geom, sort_keys=True).encode()
    return len(head).to_bytes(4, "little") + head + metadata


def decode_registration(payload: bytes) -> tuple[dict, bytes]:
    """Inverse of :func:`encode_registration`; ``BadMetadata`` for anything else (bounded, never read past)."""
    if not isinstance(payload, (bytes, bytearray)):
        raise BadMetadata(f"a gpuxfer SGLang registration payload must be bytes, got {type(payload).__name__}")
    if not 4 <= len(payload) <= MAX_PAYLOAD_BYTES:
        raise BadMetadata(f"a gpuxfer SGLang registration payload of {len(payload)} bytes (4..{MAX_PAYLOAD_BYTES})")
    n = int.from_bytes(payload[:4], "little")
    if n > len(payload) - 4:
        raise BadMetadata(f"a registration payload claims a {n}-byte geometry in {len(payload) - 4} bytes")
    try:
        geom = json.loads(bytes(payload[4:4 + n]))
    except (ValueError, RecursionError) as exc:     # (JSON nested past the parser's depth: a RecursionError)
        raise BadMetadata(f"a registration payload's geometry is not JSON: {exc}") from None
    if not isinstance(geom, dict):
        raise BadMetadata(f"a registration payload's geometry is a {type(geom).__name__}, not an object")
    return geom, bytes(payload[4 + n:])


def read_aux_rows(kv_args: Any, index: int) -> list[bytes]:
    """Row ``index`` of every aux (metadata) buffer: host memory of this process."""
    out = []
    for ptr, n, item in zip(_ints(kv_args, "aux_data_ptrs"), _ints(kv_args, "aux_data_lens"),
                            _ints(kv_args, "aux_item_lens")):
        if item <= 0 or not 0 <= index < n // item:
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
        if item <= 0 or not 0 <= index < n // item or len(row) != item:
            raise BadInput(f"a {len(row)}-byte metadata row at row {index} of a {n}-byte buffer of {item}-byte rows")
    for (ptr, n, item), row in zip(bufs, rows):
        ctypes.memmove(ptr + index * item, row, item)
