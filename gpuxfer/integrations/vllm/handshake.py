"""What two vLLM instances tell each other once (the engine description beside the agent's metadata
bytes), the check that they can pair, and how vLLM 0.33's per-layer cache views become agent layers.
No vLLM import.

vLLM 0.33 allocates one backing buffer and hands each layer a strided view of it, logically
``[blocks, heads, tokens, content]`` (the content of one token of one head, in bytes or in the cache
dtype), laid out in the order the resolved layout says. Where K and V sit inside the content, and so
whether a prefix of a block's tokens is a prefix of its bytes, is the attention backend's business:
the CPU backend reads a head's block as rows of keys then values (not token-major), FlashAttention
and FlashInfer keep a token's K and V together in its content (token-major), MLA has one latent per
token. Only token-major layers pair different block sizes.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from ...errors import BadInput, LayoutMismatch
from ...kv.layers import KVLayerSpec

INFO_VERSION = 1
MAX_PIECES = 16


def describe_view(view, token_major: bool) -> tuple[KVLayerSpec, int, bool]:
    """``(spec, tokens per kernel block, token-major)`` of one layer's ``[B, H, N, C]`` view.

    Head-major blocks (``LBHNC``: a head's tokens in a row) give one piece per head (up to 16 heads;
    one piece for the whole block, not token-major, past that), whether or not the content is
    token-major, so that two instances of one model describe a block alike; token-outer blocks (``LBNHC``) give one piece. Any other arrangement
    raises :class:`LayoutMismatch` naming the strides."""
    if view.dim() != 4:
        raise LayoutMismatch(f"a vLLM 0.33 KV-cache view is [blocks, heads, tokens, content], got shape "
                             f"{tuple(view.shape)}")
    el = view.element_size()
    nb, heads, tokens, content = view.shape
    sb, sh, sn, sc = (s * el for s in view.stride())
    cb = content * el
    if sc != el and content > 1:
        raise LayoutMismatch(f"the content of a token is not dense (strides {tuple(view.stride())})")
    if sn == cb:                                            # head-major: a head's tokens in a row
        heads_dense = heads == 1 or sh == tokens * cb
        if heads_dense and (heads == 1 or heads > MAX_PIECES):
            pieces = [(0, heads * tokens * cb)]
            token_major = token_major and heads == 1
        elif heads <= MAX_PIECES:
            pieces = [(h * sh, tokens * cb) for h in range(heads)]
        else:
            raise LayoutMismatch(f"{heads} heads apart from one another in a block (byte strides "
                                 f"{(sb, sh, sn, sc)}): more than {MAX_PIECES} pieces")
    elif sh == cb and sn == heads * cb:                     # token-outer: a token's heads in a row
        pieces = [(0, tokens * heads * cb)]
    else:
        raise LayoutMismatch(f"unsupported KV-cache view: shape {tuple(view.shape)}, byte strides "
                             f"{(sb, sh, sn, sc)} (neither head-major nor token-outer blocks)")
    return KVLayerSpec(view, int(nb), int(sb), pieces, token_major=token_major), int(tokens), token_major


def engine_info(*, engine_id: str, model: str, dtype: str, layout: str | None, groups: Sequence[dict],
                tp: tuple[int, int] = (0, 1)) -> dict:
    """The description a worker sends with its agent metadata. ``groups``: per KV-cache group
    ``{"kind", "block_size", "kernel_tokens", "token_major", "layers": [names], "bytes_per_token"}``; ``tp``: the
    worker's ``(rank, world size)`` in its engine's tensor parallel group."""
    return {"version": INFO_VERSION, "engine_id": engine_id, "model": model, "dtype": dtype, "layout": layout,
            "groups": [dict(g) for g in groups], "tp_rank": tp[0], "tp_size": tp[1]}


def agent_name(engine_id: str, rank: int, world: int) -> str:
    """The KV agent of tensor parallel rank ``rank`` of ``world`` of an engine."""
    return f"vllm-{engine_id}" if world == 1 else f"vllm-{engine_id}-tp{rank}"


def encode_info(info: dict) -> bytes:
    return json.dumps(info, separators=(",", ":")).encode()


def decode_info(raw: bytes) -> dict:
    """A peer's engine description, checked for shape (not trusted for anything else)."""
    try:
        info = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadInput(f"the peer's engine description is not JSON: {exc}") from None
    if not isinstance(info, dict):
        raise BadInput(f"the peer's engine description is a JSON {type(info).__name__}, not an object")
    if info.get("version") != INFO_VERSION:
        raise BadInput(f"the peer's engine description is of version {_short(info.get('version'))}, this "
                       f"instance's of version {INFO_VERSION}: run the same gpuxfer version on both instances")
    groups = info.get("groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise BadInput("the peer's engine description lists no groups")
    for g in groups:
        for k in ("block_size", "kernel_tokens"):
            v = g.get(k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BadInput(f"the peer's engine description has a group with {k}={v!r}")
    return info


def readers(local: dict, remote: dict) -> int:
    """How many decode ranks read shares of one prefill rank: the decode's tensor parallel size over the
    prefill's where it is a multiple of it, else 1. ``local``: this (decode) worker's description."""
    lt, rt = local.get("tp_size", 1), remote.get("tp_size", 1)
    return lt // rt if type(rt) is int and 1 <= rt <= lt and lt % rt == 0 else 1


def check_compatible(local: dict, remote: dict) -> dict[int, tuple[int, int]]:
    """Raise :class:`LayoutMismatch` naming every difference that keeps this (decode) worker from reading the
    peer: tensor parallel sizes (the same, or the decode's ``k`` times the prefill's) and ranks (decode rank i
    reads prefill rank ``i // k``), model, KV dtype, groups (kind, layers, heads, bytes per token), block sizes
    that do not divide one another, or different block sizes on a layer that is not token-major.

    With ``k`` > 1 a decode rank reads its share of the prefill rank's heads: share ``i % k`` of an MHA group's
    ``k`` times as many heads, which needs one piece per head on both sides (head-major blocks, vLLM's
    ``LBHNC`` layout); where the decode ranks outnumber the KV heads (each holds a replica of one), the one head
    it holds; or an MLA group's whole latent. Returns, per group index read by a share of its heads,
    the pieces ``[start, stop)`` of the peer's blocks to read (empty: whole blocks)."""
    problems: list[str] = []
    views: dict[int, tuple[int, int]] = {}
    lt, rt = local.get("tp_size", 1), remote.get("tp_size", 1)
    lr, rr = local.get("tp_rank", 0), remote.get("tp_rank", 0)
    k = readers(local, remote)
    if lt != rt and k == 1:
        problems.append(f"tensor parallel size: this instance {_short(lt)}, the peer {_short(rt)} (the decode "
                        "instance's must be the prefill's or a multiple of it)")
    elif rr != lr // k:
        problems.append(f"tensor parallel rank: this worker {_short(lr)} reads prefill rank {lr // k}, the peer is "
                        f"rank {_short(rr)}")
    for key in ("model", "dtype"):
        if local.get(key) != remote.get(key):
            problems.append(f"{key}: this instance {local.get(key)!r}, the peer {remote.get(key)!r}")
    lg, rg = local["groups"], remote["groups"]
    if len(lg) != len(rg):
        problems.append(f"KV-cache groups: this instance has {len(lg)}, the peer {len(rg)}")
    for i, (a, b) in enumerate(zip(lg, rg)):
        for key in ("kind", "layers") if k > 1 else ("kind", "layers", "bytes_per_token"):
            if a.get(key) != b.get(key):
                problems.append(f"group {i} {key}: this instance {_short(a.get(key))}, the peer {_short(b.get(key))}")
        if k > 1:
            view, why = _head_share(a, b, k, lr % k)
            if why:
                problems.append(f"group {i}: {why}")
            elif view is not None:
                views[i] = view
        ka, kb = a["kernel_tokens"], b["kernel_tokens"]
        if ka != kb:
            if ka % kb and kb % ka:
                problems.append(f"group {i}: {ka}- and {kb}-token blocks do not divide one another")
            elif not (a.get("token_major") and b.get("token_major")):
                problems.append(f"group {i}: block sizes differ ({ka} and {kb} tokens) and the layout is not "
                                "token-major on both sides (the attention backend keeps a block's keys and values "
                                "apart), so blocks cannot be split or merged: run both instances with the same "
                                "--block-size")
    if problems:
        raise LayoutMismatch(f"engine {remote.get('engine_id')!r} cannot pair with engine "
                             f"{local.get('engine_id')!r}: " + "; ".join(problems))
    return views


def _head_share(mine: dict, theirs: dict, k: int, share: int) -> tuple[tuple[int, int] | None, str | None]:
    """``(pieces of the peer's blocks to read or None for whole blocks, None)`` for decode share ``share`` of
    ``k`` of one group, or ``(None, why not)``."""
    def pair(g):
        c = g.get("content")
        ok = isinstance(c, list) and len(c) == 2 and all(type(x) is int and x > 0 for x in c)
        return tuple(c) if ok else None
    (hl, cl), (hr, cr) = pair(mine) or (0, 0), pair(theirs) or (0, 0)
    bl, br = mine.get("bytes_per_token"), theirs.get("bytes_per_token")
    if "MLA" in str(mine.get("kind")):         # a latent every rank holds whole
        if hl == hr and cl == cr and bl == br:
            return None, None
        return None, (f"an MLA latent is read whole, but the peer's ranks hold {_short(hr)} heads of {_short(cr)} "
                      f"bytes per token, this worker's {hl} of {cl}")
    ok = hl and cl == cr and type(bl) is int and type(br) is int and br * hl == bl * hr
    if ok and hr == k * hl:
        first, n = share * hl, hl           # each decode rank its own heads
    elif ok and hl == 1 and hr < k and k % hr == 0:
        # more decode ranks than KV heads: vLLM gives rank r head r * H // TP (replicas of one head on
        # neighbouring ranks), which is head share * hr // k of the prefill rank it reads
        first, n = share * hr // k, 1
    else:
        return None, (f"the peer's ranks hold {_short(hr)} heads of {_short(cr)} bytes per token "
                      f"({_short(br)} bytes per token in all), this worker's {hl} of {cl} ({bl}): with {k} decode "
                      f"ranks per prefill rank, each reads 1/{k} of a prefill rank's heads, or one of them where "
                      "the decode ranks hold replicas of one head")
    if theirs.get("kv_heads") != hr or mine.get("kv_heads") != hl:
        return None, (f"a block's {_short(hr)} head slots on the peer and {hl} here are not one per KV head (the "
                      f"peer's KV heads: {_short(theirs.get('kv_heads'))}, this worker's: {mine.get('kv_heads')}; the "
                      "attention backend packs its pages otherwise, e.g. FlashInfer's NVFP4 K slots then V slots): "
                      "no range of them is a decode rank's share of the heads")
    if hr == 1:
        return None, None                   # the prefill rank's one head, whole
    if theirs.get("pieces") != hr or mine.get("pieces") != hl:
        return None, (f"a decode rank reads a share of a prefill rank's heads from blocks of one piece per head "
                      f"(the peer's blocks: {_short(theirs.get('pieces'))} pieces for {hr} heads, this worker's: "
                      f"{_short(mine.get('pieces'))} for {hl}): run both instances with "
                      "VLLM_KV_CACHE_LAYOUT=LBHNC, at most 16 KV heads per prefill rank")
    return (first, first + n), None


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 120 else r[:117] + "..."
