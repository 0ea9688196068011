"""How a :class:`~gpuxfer.kv.agent.KVAgent` meets its peers (:class:`Peering`): the metadata bytes it publishes,
and :meth:`~gpuxfer.kv.agent.KVAgent.add_peer`'s steps -- the bytes decoded, the views asked for, the route chosen
(IPC or NIXL), the peer built, probed and its routes of whole requests built (:meth:`Peering.warm`) before it
is added under the registry's lock, so a failed add leaves no peer behind."""
from __future__ import annotations

import logging
import os
import socket
from typing import Mapping

from ..common import process_namespace
from ..errors import BadInput, BadMetadata, LayoutMismatch
from . import host_notify, nixl_route, views
from .descriptors import DIRECTIONS
from .engine_choice import peer_engine
from .metadata import decode_metadata, encode_metadata, handle_meta
from .nixl_peer import NixlPeer
from .peers import KVPeer

log = logging.getLogger("gpuxfer.kv.agent")


def _taken(registry, meta) -> BadInput | None:
    """The error of adding ``meta``'s agent as a peer where ``registry`` holds it already: a peer of its name
    (:class:`BadInput`), or the same agent (its uid) under another name (:class:`BadMetadata`: renamed metadata,
    whose peer would keep notification counts and pack parities of its own over the same words); else None."""
    if meta.agent in registry.peers:
        return BadInput(f"peer {meta.agent!r} is already added (remove_peer first)")
    other = next((p.name for p in list(registry.peers.values()) if p.meta.uid == meta.uid), None)
    if other is not None:
        return BadMetadata(f"peer {meta.agent!r} is agent {meta.uid!r}, already added as peer {other!r} (one peer "
                           "per agent)")
    return None


class Peering:
    """An agent's metadata and peer additions. ``agent``: its name, uid, platform, device, engine, staging, slot
    size, NIXL side and timeout are read from it; ``registry``, ``routes``, ``poster``, ``lifetime``: its
    :class:`~gpuxfer.kv.peers.Registry` (the peers are added there), :class:`~gpuxfer.kv.routes.RouteCache`,
    :class:`~gpuxfer.kv.posting.Poster` and :class:`~gpuxfer.kv.lifetime.Lifetime` (which holds the flag words
    while their handles are exported)."""

    def __init__(self, agent, registry, routes, poster, lifetime):
        self.agent, self.registry, self.routes, self.poster, self.lifetime = agent, registry, routes, poster, lifetime

    def metadata(self) -> bytes:
        """:meth:`KVAgent.metadata <gpuxfer.kv.agent.KVAgent.metadata>`."""
        agent = self.agent
        self.poster.check_open()
        flags, staging = self.lifetime.hold()
        try:
            control = handle_meta(flags.export())
            staging_meta = None if staging is None else dict(
                handle_meta(agent.platform.export_handle(staging)), slot_bytes=agent.slot_bytes)
        finally:
            self.registry.shared.release()
        body = {
            "agent": agent.name, "uid": agent.uid, "pid": os.getpid(), "namespace": process_namespace(),
            "host": socket.gethostname() or "unknown", "platform": agent.platform.name, "device": agent.device,
            "control": control, "staging": staging_meta, **self.registry.metadata(),
        }
        if agent.nixl is not None:
            body["nixl"] = agent.nixl.metadata(len(body["allocations"]))
        if agent.host_words is not None:
            body.update(host_notify.metadata_entry(agent.host_words))
        return encode_metadata(body)

    def add(self, metadata: bytes, route: str | None, pieces: Mapping | None, local_pieces: Mapping | None,
            token_slice: Mapping | None, local_token_slice: Mapping | None) -> KVPeer:
        """:meth:`KVAgent.add_peer <gpuxfer.kv.agent.KVAgent.add_peer>`."""
        agent = self.agent
        self.poster.check_open()
        views.check_arguments(pieces=pieces, local_pieces=local_pieces, token_slice=token_slice,
                              local_token_slice=local_token_slice)
        meta = decode_metadata(metadata)
        if pieces or token_slice:
            meta = views.peer_view(meta, pieces, token_slice)
        local_view = views.local_view(self.registry, local_pieces, local_token_slice) \
            if local_pieces or local_token_slice else None
        if meta.platform != agent.platform.name:
            raise BadMetadata(f"peer {meta.agent!r} runs on platform {meta.platform!r}, this agent on "
                              f"{agent.platform.name!r}")
        route = nixl_route.choose_route(agent, meta, route)
        if meta.uid == agent.uid:
            raise BadInput("an agent cannot be its own peer")
        reg = self.registry
        taken = _taken(reg, meta)
        if taken is not None:
            raise taken
        if route == "nixl":
            side = agent.nixl
            if side is None:            # closed since the route was chosen
                raise BadInput(f"agent {agent.name!r} is closed")
            nixl_peer = NixlPeer(agent, meta, side, reg, self.poster, local_view)
            with reg.lock:      # an add_peer of the same name, or close, may have run meanwhile
                clash = BadInput("the agent was closed") if reg.closed else _taken(reg, meta)
                if clash is None:
                    reg.peers[meta.agent] = nixl_peer
            if clash is not None:
                nixl_peer.close()
                raise clash
            log.info("agent %s: peer %s (host %s) over the nixl route", agent.name, meta.agent, meta.host)
            return nixl_peer
        viewed = pieces or local_pieces or token_slice or local_token_slice
        if viewed and meta.pid == os.getpid() and meta.namespace == process_namespace():
            raise BadInput(f"peer {meta.agent!r}: a view of its pieces needs a peer in another process")
        if agent.staging is not None and meta.staging is not None and meta.slot_bytes != agent.slot_bytes:
            # each side addresses the pair's staging slots by its own slot size
            raise LayoutMismatch(f"peer {meta.agent!r} has {meta.slot_bytes}-byte staging slots, agent "
                                 f"{agent.name!r} {agent.slot_bytes}-byte ones: the pack engine needs equal slot_bytes")
        peer = KVPeer(agent, meta, self.poster)
        peer.local_view = local_view
        try:        # the peer is the agent's only once every step that can fail is behind it
            peer.engine = peer_engine(agent.engine, agent.auto_engine, peer.name, peer.addressable)
            if viewed and peer.engine == "pack":
                # both sides of a pack transfer build its route, and the other side's has no view to match
                what = "token rows" if token_slice or local_token_slice else "pieces"
                raise BadInput(f"peer {meta.agent!r}: the pack engine's two sides move whole blocks (a view of "
                               f"{what} needs the triton or copy_engine engine)")
            if agent.engine == "pack":
                peer.flags.probe_one_sided(agent.timeout_s)
            routes = self.warm(peer)
            with reg.lock:      # close lists the peers to close under it
                if reg.closed:
                    raise BadInput(f"agent {agent.name!r} is closed")
                taken = _taken(reg, meta)
                if taken is not None:
                    raise taken
                reg.peers[meta.agent] = peer
                self.routes.routes.update(routes)
        except BaseException:
            peer.close()
            raise
        return peer

    def warm(self, peer: KVPeer) -> dict:
        """The routes of whole requests (every shared group, every layer) in both directions, built now so a
        request's setup finds them: ``{route key: route}``; a layout the peer does not match raises when a
        request names it."""
        agent = self.agent
        from ..kernels import blocks, launch  # noqa: F401 - loaded here, not in the first request's setup
        shared = tuple(g for g in self.registry.groups if g in peer.groups)
        routes = {}
        for op in DIRECTIONS if shared else ():
            try:
                routes[(peer, op, None, frozenset(shared))] = self.routes.build(peer, op, None, shared)
            except (LayoutMismatch, BadInput) as exc:
                log.debug("agent %s: no %s route with peer %s yet: %s", agent.name, op, peer.name, exc)
        return routes
