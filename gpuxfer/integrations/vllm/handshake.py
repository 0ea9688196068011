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
from typing import Any, NamedTuple, Sequence

from ...errors import BadInput, LayoutMismatch
from ...kv.layers import KVLayerSpec
from .params import MAX_TP

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
    rank, size = info.get("tp_rank", 0), info.get("tp_size", 1)
    if type(rank) is not int or type(size) is not int or not 0 <= rank < size <= MAX_TP:
        # (the decode side lists the ranks of the peer's size it reads: a size past any real one is refused here)
        raise BadInput(f"the peer's engine description names tensor parallel rank {_short(rank)} of {_short(size)}, "
                       f"not a rank of a size of 1..{MAX_TP}")
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


def sources(local: dict, remote: dict) -> int:
    """How many prefill ranks one decode rank reads from: the prefill's tensor parallel size over the decode's
    where it is a multiple of it, else 1. ``local``: this (decode) worker's description."""
    lt, rt = local.get("tp_size", 1), remote.get("tp_size", 1)
    return rt // lt if type(rt) is int and type(lt) is int and 1 <= lt < rt and rt % lt == 0 else 1


class Pairing(NamedTuple):
    """How this (decode) worker reads one prefill rank, per group index: the pieces ``[start, stop)`` of the
    peer's blocks to read (``remote``), of this worker's blocks to write (``local``), and the groups it reads
    nothing of (``skip``: an MLA latent another prefill rank supplies). Empty everywhere: whole blocks."""

    remote: dict
    local: dict
    skip: frozenset


def check_compatible(local: dict, remote: dict) -> Pairing:
    """Raise :class:`LayoutMismatch` naming every difference that keeps this (decode) worker from reading the
    peer: tensor parallel sizes (the same, or the decode's ``k`` times the prefill's) and ranks (decode rank i
    reads prefill rank ``i // k``), model, KV dtype, groups (kind, layers, heads, bytes per token), block sizes
    that do not divide one another, or different block sizes on a layer that is not token-major.

    With ``k`` > 1 a decode rank reads its share of the prefill rank's heads: share ``i % k`` of an MHA group's
    ``k`` times as many heads, which needs one piece per head on both sides (head-major blocks, vLLM's
    ``LBHNC`` layout); where the decode ranks outnumber the KV heads (each holds a replica of one), the one head
    it holds; or an MLA group's whole latent. With the prefill's size ``m`` times the decode's, decode rank i
    reads prefill ranks ``i * m`` to ``i * m + m - 1``, each into its part of this worker's heads (the peer's j-th
    of them: this worker's heads ``j * h`` to ``(j + 1) * h``), an MLA latent from the first alone."""
    problems: list[str] = []
    remote_views: dict[int, tuple[int, int]] = {}
    local_views: dict[int, tuple[int, int]] = {}
    skip: set[int] = set()
    lt, rt = local.get("tp_size", 1), remote.get("tp_size", 1)
    lr, rr = local.get("tp_rank", 0), remote.get("tp_rank", 0)
    k, m = readers(local, remote), sources(local, remote)
    if lt != rt and k == 1 and m == 1:
        problems.append(f"tensor parallel size: this instance {_short(lt)}, the peer {_short(rt)} (one must be a "
                        "multiple of the other)")
    elif m > 1 and (type(rr) is not int or rr // m != lr):
        problems.append(f"tensor parallel rank: this worker {_short(lr)} reads prefill ranks {lr * m} to "
                        f"{lr * m + m - 1}, the peer is rank {_short(rr)}")
    elif m == 1 and rr != lr // k:
        problems.append(f"tensor parallel rank: this worker {_short(lr)} reads prefill rank {lr // k}, the peer is "
                        f"rank {_short(rr)}")
    for key in ("model", "dtype"):
        if local.get(key) != remote.get(key):
            problems.append(f"{key}: this instance {local.get(key)!r}, the peer {remote.get(key)!r}")
    lg, rg = local["groups"], remote["groups"]
    if len(lg) != len(rg):
        problems.append(f"KV-cache groups: this instance has {len(lg)}, the peer {len(rg)}")
    for i, (a, b) in enumerate(zip(lg, rg)):
        for key in ("kind", "layers") if k > 1 or m > 1 else ("kind", "layers", "bytes_per_token"):
            if a.get(key) != b.get(key):
                problems.append(f"group {i} {key}: this instance {_short(a.get(key))}, the peer {_short(b.get(key))}")
        if k > 1:
            view, why = _head_share(a, b, k, lr % k)
            if why:
                problems.append(f"group {i}: {why}")
            elif view is not None:
                remote_views[i] = view
        elif m > 1 and type(rr) is int:
            view, why = _head_part(a, b, m, rr % m)
            if why:
                problems.append(f"group {i}: {why}")
            elif view == "skip":
                skip.add(i)
            elif view is not None:
                local_views[i] = view
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
    return Pairing(remote_views, local_views, frozenset(skip))


def _contents(mine: dict, theirs: dict) -> tuple:
    """``(heads, content bytes, bytes per token)`` of a group on each side (zeros where a peer's are not
    positive ints)."""
    def pair(g):
        c = g.get("content")
        ok = isinstance(c, list) and len(c) == 2 and all(type(x) is int and x > 0 for x in c)
        return tuple(c) if ok else (0, 0)
    (hl, cl), (hr, cr) = pair(mine), pair(theirs)
    return hl, cl, mine.get("bytes_per_token"), hr, cr, theirs.get("bytes_per_token")


def _head_part(mine: dict, theirs: dict, m: int, part: int) -> tuple:
    """``(pieces of this worker's blocks the peer writes, or None for whole blocks, or "skip", None)`` for the
    peer that is prefill rank ``part`` of this worker's ``m``, of one group, or ``(None, why not)``."""
    hl, cl, bl, hr, cr, br = _contents(mine, theirs)
    if "MLA" in str(mine.get("kind")):         # a latent every prefill rank holds whole: read from the first
        if hl == hr and cl == cr and bl == br:
            return ("skip" if part else None), None
        return None, (f"an MLA latent is read whole, but the peer's ranks hold {_short(hr)} heads of {_short(cr)} "
                      f"bytes per token, this worker's {hl} of {cl}")
    if not (hr and hl == m * hr and cl == cr and type(br) is int and bl == m * br):
        return None, (f"the peer's ranks hold {_short(hr)} heads of {_short(cr)} bytes per token "
                      f"({_short(br)} bytes per token in all), this worker's {hl} of {cl} ({bl}): with {m} prefill "
                      f"ranks per decode rank, each supplies 1/{m} of a decode rank's heads")
    if theirs.get("kv_heads") != hr or mine.get("kv_heads") != hl:
        return None, (f"a block's {_short(hr)} head slots on the peer and {hl} here are not one per KV head (the "
                      f"peer's KV heads: {_short(theirs.get('kv_heads'))}, this worker's: {mine.get('kv_heads')}): "
                      "no range of this worker's slots is a prefill rank's heads")
    if mine.get("pieces") != hl or (hr > 1 and theirs.get("pieces") != hr):
        return None, (f"a prefill rank writes its part of a decode rank's heads into blocks of one piece per head "
                      f"(this worker's blocks: {_short(mine.get('pieces'))} pieces for {hl} heads, the peer's: "
                      f"{_short(theirs.get('pieces'))} for {hr}): run both instances with "
                      "VLLM_KV_CACHE_LAYOUT=LBHNC, at most 16 KV heads per decode rank")
    return (part * hr, (part + 1) * hr), None


def _head_share(mine: dict, theirs: dict, k: int, share: int) -> tuple[tuple[int, int] | None, str | None]:
    """``(pieces of the peer's blocks to read or None for whole blocks, None)`` for decode share ``share`` of
    ``k`` of one group, or ``(None, why not)``."""
    hl, cl, bl, hr, cr, br = _contents(mine, theirs)
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
