"""Views of a group's layers that a transfer with one peer sees through (``KVAgent.add_peer``'s ``pieces``,
``local_pieces``, ``token_slice``, ``local_token_slice``): a range of each layer's pieces (the heads one tensor
parallel rank holds, one piece per head), or each token-major piece cut into its block's token rows and each
row cut to a byte range (a range of heads of token-major pages). Every piece of a view lies inside a checked
piece of its layer, so nothing outside a layer is reachable through one."""
from __future__ import annotations

import dataclasses
import numbers
from typing import Mapping, Sequence

from ..errors import BadInput
from .layers import _MAX_ROW_PIECES, KVLayer, KVPiece, _check_layer
from .peers import _Group


def _pair(arg: str, name: str, rng) -> tuple[int, int]:
    """``rng`` as two ints ``(start, stop)``, ``0 <= start < stop``; :class:`BadInput` naming ``arg`` otherwise."""
    if (not isinstance(rng, (tuple, list)) or len(rng) != 2
            or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in rng)
            or not 0 <= int(rng[0]) < int(rng[1])):
        raise BadInput(f"{arg}[{name!r}] must be (start, stop) with 0 <= start < stop, got {rng!r:.80}")
    return int(rng[0]), int(rng[1])


def _cut_pieces(arg: str, name: str, rng, layers: Sequence[KVLayer], whose: str) -> list[KVLayer]:
    """Each of ``layers`` (a group's) cut to its pieces ``[start, stop)`` (``rng``): a subset of checked pieces,
    every byte still inside its layer; :class:`BadInput` naming ``whose`` layers where a range is past them."""
    a, b = _pair(arg, name, rng)
    for lay in layers:
        if b > len(lay.pieces):
            raise BadInput(f"{arg}[{name!r}] = ({a}, {b}), but layer {lay.name!r} of {whose} has "
                           f"{len(lay.pieces)} pieces per block")
    return [dataclasses.replace(lay, pieces=lay.pieces[a:b]) for lay in layers]


def _cut_rows(arg: str, name: str, rng, layers: Sequence[KVLayer], block_tokens: int, whose: str) -> list[KVLayer]:
    """Each of ``layers`` (a group's, of ``block_tokens``-token blocks) seen as its token rows: every piece
    (token-major) cut into its block's tokens, each token's row (the piece's bytes over ``block_tokens``) cut to
    bytes ``[start, stop)`` (``rng``), piece by piece then token by token. Each new piece lies inside a piece of
    the layer; the layer is no longer token-major (a prefix of a block's tokens is a prefix of its pieces, not of
    each piece), so it pairs only with blocks of the same size. At most :data:`_MAX_ROW_PIECES` pieces over the
    group (a route holds a plane per piece); :class:`BadInput` naming what does not fit."""
    a, b = _pair(arg, name, rng)
    total = sum(len(lay.pieces) for lay in layers) * block_tokens
    if total > _MAX_ROW_PIECES:
        raise BadInput(f"{arg}[{name!r}]: the token rows of {whose}'s group {name!r} ({len(layers)} layers of "
                       f"{block_tokens}-token blocks) make {total} pieces, over the {_MAX_ROW_PIECES} a view holds")
    out = []
    for lay in layers:
        if not lay.token_major:
            raise BadInput(f"{arg}[{name!r}]: layer {lay.name!r} of {whose} is not token-major (registered with "
                           "token_major=False): its pieces have no token rows")
        pieces = []
        for k, p in enumerate(lay.pieces):
            row, rest = divmod(p.nbytes, block_tokens)
            if rest or b > row:
                raise BadInput(f"{arg}[{name!r}] = ({a}, {b}), but piece {k} of layer {lay.name!r} of {whose} holds "
                               f"{p.nbytes} bytes per {block_tokens}-token block"
                               + (", not whole token rows" if rest else f": {row}-byte token rows"))
            pieces.extend(KVPiece(p.offset + t * row + a, b - a) for t in range(block_tokens))
        cut = dataclasses.replace(lay, pieces=tuple(pieces), token_major=False)
        _check_layer(cut.name, cut.num_blocks, cut.block_stride, cut.pieces, cut.extent, max_pieces=_MAX_ROW_PIECES)
        out.append(cut)
    return out


def check_arguments(**views) -> None:
    """``KVAgent.add_peer``'s view arguments (``pieces=...``): each None or a mapping (group -> (start, stop)),
    before anything tests their truth (an array's raises); :class:`BadInput` naming one that is neither."""
    for arg, view in views.items():
        if view is not None and not isinstance(view, Mapping):
            raise BadInput(f"{arg} must map group -> (start, stop), got {type(view).__name__}")


def _views(pieces, token_slice) -> dict:
    """``{group: [(kind, range)]}`` of a side's ``pieces`` and ``token_slice`` arguments (mappings or None:
    :func:`check_arguments`), pieces first."""
    out: dict = {}
    for kind, view in (("pieces", pieces), ("token_slice", token_slice)):
        for name, rng in (view or {}).items():
            out.setdefault(name, []).append((kind, rng))
    return out


def _view_layers(arg: str, name: str, cuts, layers: Sequence[KVLayer], block_tokens: int,
                 whose: str) -> list[KVLayer]:
    """``layers`` of group ``name`` seen through ``cuts`` (:func:`_views`), in order."""
    for kind, rng in cuts:
        if kind == "pieces":
            layers = _cut_pieces(f"{arg}pieces", name, rng, layers, whose)
        else:
            layers = _cut_rows(f"{arg}token_slice", name, rng, layers, block_tokens, whose)
    return list(layers)


def peer_view(meta, pieces: Mapping[str, tuple[int, int]] | None, token_slice=None):
    """``meta`` with each named group's layers seen through their pieces ``[start, stop)`` (``pieces``), then
    cut to bytes ``[start, stop)`` of their token rows (``token_slice``, :func:`_cut_rows`): every byte still
    inside its layer. :class:`BadInput` naming a group the peer lacks or a range its layers do not have."""
    groups = {g.name: g for g in meta.groups}
    for name, cuts in _views(pieces, token_slice).items():
        g = groups.get(name)
        if g is None:
            raise BadInput(f"{cuts[0][0]} names group {name!r}; peer {meta.agent!r} has groups {sorted(groups)}")
        layers = _view_layers("", name, cuts, [lay for lay, _, _ in g.layers], g.block_tokens, f"peer {meta.agent!r}")
        groups[name] = dataclasses.replace(g, layers=tuple(
            (lay, alloc, off) for lay, (_, alloc, off) in zip(layers, g.layers)))
    return dataclasses.replace(meta, groups=tuple(groups[g.name] for g in meta.groups))


def local_view(registry, pieces: Mapping[str, tuple[int, int]] | None, token_slice=None) -> dict:
    """This agent's groups named in ``pieces`` or ``token_slice``, seen through them as :func:`peer_view`
    sees a peer's: ``{group: _Group}``."""
    out = {}
    for name, cuts in _views(pieces, token_slice).items():
        g = registry.groups.get(name)
        if g is None:
            raise BadInput(f"local_{cuts[0][0]} names group {name!r}; this agent has groups "
                           f"{sorted(registry.groups)}")
        out[name] = _Group(g.name, g.block_tokens,
                           _view_layers("local_", name, cuts, g.layers, g.block_tokens, "this agent"), g.flats)
    return out
