"""An agent's peers (:class:`KVPeer`): another agent, added from its metadata bytes -- its caches mapped
here (or, in this process, used as they are), its flag words reached over a flag link
(:class:`~gpuxfer.flaglink.FlagLink`) -- and the registries an agent and its peers share: the live agents
of this process, and what a close kept alive for queued work still touching it."""
from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import BadMetadata
from ..flaglink import FlagLink
from ..platforms.base import Closable, Event, Stream
from .control import AGENT_WORDS, NOTIFY, NOTIFY_SLOTS
from .layers import KVLayer
from .metadata import PeerMetadata

if TYPE_CHECKING:
    from .agent import KVAgent

log = logging.getLogger("gpuxfer.kv.agent")

_LOCAL_AGENTS: "weakref.WeakValueDictionary[str, KVAgent]" = weakref.WeakValueDictionary()
#: streams and device memory that queued work may still touch when their owner was closed (a wait that never
#: completed): kept for the life of the process rather than destroyed or freed under that work
_LEAKED: list = []


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
    """Another agent, added from its metadata: its caches mapped here (or, in this process, used as they are),
    and :attr:`flags`, the flag link to its words (the agent's words shared, stage words of the link's own).
    :attr:`route`: how transfers reach it (``"ipc"``; :class:`~gpuxfer.kv.nixl_route.NixlPeer`: ``"nixl"``)."""

    route = "ipc"

    def __init__(self, agent: "KVAgent", meta: PeerMetadata):
        self.agent, self.meta, self.name = agent, meta, meta.agent
        self._closed = False
        self._mappings: list[Any] = []
        self._owned: list[Any] = []
        self.flags: FlagLink | None = None
        self.staging_ptr: int | None = None
        self._seq = [0] * NOTIFY_SLOTS
        self._notified: list = [None] * NOTIFY_SLOTS     # per slot: (stream, event) of its last notifying post
        self.pack_sent = 0                  # pack transfers (with chunks) this agent's source posted to the peer
        self.pack_recv = 0                  # pack transfers (with chunks) this agent's destination posted
        self.engine = agent.engine          # the engine of transfers with this peer (KVAgent._peer_engine)
        self.addressable = True             # whether this process can address the peer's caches (kernels)
        plat, dev = agent.platform, agent.device
        try:
            local = _LOCAL_AGENTS.get(meta.uid) if meta.pid == os.getpid() else None
            if meta.pid == os.getpid() and local is None:
                raise BadMetadata(f"peer {meta.agent!r} claims this process but is not a live agent here")
            self._local = local
            self.flags = FlagLink(plat, dev, AGENT_WORDS, rank=agent.rank, peer=meta.agent,
                                  name=f"agent {agent.name!r}", shared=agent.flags)
            self._owned.append(self.flags)
            if local is not None:
                bases = list(local._alloc_bases)
                self.flags.open(local.flags)
                self.staging_ptr = None if local.staging is None else local.staging.ptr
            else:
                bases = []
                for h in meta.allocations:
                    m = plat.open_handle(h, dev)
                    self._mappings.append(m)
                    self._check_claim(m.ptr, h.nbytes, "an allocation")
                    bases.append(m.ptr)
                    self.addressable = self.addressable and m.addressable
                self.flags.open(meta.control)
                self._check_claim(self.flags.peer_mem.ptr, meta.control.nbytes, "flag words")
                if meta.staging is not None:
                    st = plat.open_handle(meta.staging, dev)
                    self._mappings.append(st)
                    self._check_claim(st.ptr, meta.staging.nbytes, "staging")
                    self.staging_ptr = st.ptr
            self.groups: dict[str, _Group] = {}
            for g in meta.groups:
                layers = [KVLayer(lay.name, lay.index, bases[a] + off, lay.num_blocks, lay.block_stride, lay.pieces,
                                  lay.extent, lay.token_major) for lay, a, off in g.layers]
                self.groups[g.name] = _Group(g.name, g.block_tokens, layers, [(a, off) for _, a, off in g.layers])
        except BaseException:
            self._release()
            raise

    def _check_claim(self, ptr: int, nbytes: int, what: str) -> None:
        """The mapping at ``ptr`` holds the ``nbytes`` the metadata claims, where the platform can tell."""
        real = self.agent.platform.allocation_range(ptr, self.agent.device)
        if real is not None and real[0] + real[1] < ptr + nbytes:
            raise BadMetadata(f"peer {self.meta.agent!r} claims {what} of {nbytes} bytes; the mapping holds "
                              f"{real[0] + real[1] - ptr}")

    def anchor(self, layer_ref: tuple[int, int], ptr: int):
        """A 1-element uint8 tensor at ``ptr`` (a layer of this peer) on the agent's device, or None where the
        peer's memory is not addressable here (copies reach it, no tensor may view it)."""
        if self._local is not None:
            return self._local._flat_at(ptr)
        a, off = layer_ref
        m = self._mappings[a]
        if not m.addressable:
            return None
        return self.agent.platform.as_tensor(m, shape=(1,), offset=off)

    def notify(self, s: Stream, slot: int) -> tuple[int, Event]:
        """Queue the next notification to word ``slot`` of the peer on ``s``, then the post's event: ``(value,
        event)``. The caller holds the agent's post lock.

        The n-th notification to a slot writes n once the post that wrote n - 1 completed: a post on another
        stream waits for that post's event first (on one stream, stream order does it). So the peer's word
        never goes down and value n says the data of the first n notifying posts landed; and the copy path's
        stage word of the slot is read by one copy at a time."""
        plat, agent = self.agent.platform, self.agent
        last = self._notified[slot]
        if last is not None and last[0] is not s:
            plat.stream_wait_event(s, last[1])
        value = self._seq[slot] + 1
        self.flags.signal(s, NOTIFY + slot, value, NOTIFY + slot, agent._calls if s is agent.stream else None)
        event = plat.record_event(s)
        self._seq[slot] = value
        self._notified[slot] = (s, event)
        return value, event

    @property
    def remote_flags(self) -> bool:
        """Whether signals to the peer are stream writes into its words (probed), else stage writes and 8-byte
        copies."""
        return self.flags.remote

    def _release(self) -> None:
        for m in reversed(self._mappings + self._owned):
            try:
                m.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing
                log.warning("peer %s: closing %r failed: %s", self.name, m, exc)
        self._mappings, self._owned = [], []

    def __repr__(self) -> str:
        return f"KVPeer({self.name!r}, pid {self.meta.pid}, {len(self.meta.groups)} groups)"
