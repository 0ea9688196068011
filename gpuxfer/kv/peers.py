"""An agent's peers (:class:`KVPeer`): another agent, added from its metadata bytes -- its caches mapped
here (or, in this process, used as they are), its flag words reached over a flag link
(:class:`~gpuxfer.flaglink.FlagLink`) -- and the registries an agent and its peers share: what an agent
registered (:class:`Registry`: its groups, their allocations, its peers), the live agents of this process,
and what a close kept alive for queued work still touching it."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from ..common import process_namespace
from ..errors import BadInput, BadMetadata, NotRegistered
from ..flaglink import FlagLink
from ..platforms.base import Closable, Event, IpcHandle, Stream
from .control import AGENT_WORDS, NOTIFY, NOTIFY_SLOTS, check_slot
from .host_notify import open_peer
from .layers import KVLayer, _torch
from .metadata import PeerMetadata, handle_meta

log = logging.getLogger("gpuxfer.kv.agent")

#: the registries of this process's open agents, by uid (a peer that is one of them uses its memory as it is)
_LOCAL_AGENTS: "weakref.WeakValueDictionary[str, Registry]" = weakref.WeakValueDictionary()
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


class Registry:
    """What an agent registered, under one lock: its groups, the allocations holding their layers (each once,
    by IPC handle), where each layer lies in them, the kernels' anchors per tensor, and its peers by name.
    Another agent of this process that adds it as a peer reads it here (:data:`_LOCAL_AGENTS`); ``shared`` is
    then the agent's flag words and staging (:class:`~gpuxfer.kv.lifetime._Shared`), ``closed`` whether it
    was closed."""

    def __init__(self, name: str, device: int, rank: int, slot_bytes: int):
        self.name, self.device, self.rank, self.slot_bytes = name, device, rank, slot_bytes
        self.lock = threading.Lock()
        self.groups: dict[str, _Group] = {}
        self.allocs: list[IpcHandle] = []
        self.alloc_bases: list[int] = []
        self.alloc_keys: dict[bytes, int] = {}
        self.layer_refs: dict[tuple[str, str], tuple[int, int]] = {}
        self.flats: dict[int, Any] = {}
        self.peers: dict[str, KVPeer] = {}
        self.shared: Any = None
        self.closed = False

    def allocation(self, handle: IpcHandle, base: int) -> int:
        """The index of the allocation ``handle`` exports (at ``base`` here), listed on first sight."""
        with self.lock:
            a = self.alloc_keys.get(handle.payload)
            if a is None:
                a = self.alloc_keys[handle.payload] = len(self.allocs)
                self.alloc_bases.append(base)   # first: NIXL's side reads allocs, then their bases, without the lock
                self.allocs.append(handle)
            return a

    def flat(self, tensor):
        """A 1-element uint8 tensor at ``tensor.data_ptr()`` over its storage (a kernel anchor), kept by address."""
        torch = _torch()
        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        flat.set_(tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(), (1,), (1,))
        self.flats[int(tensor.data_ptr())] = flat
        return flat

    def flat_at(self, ptr: int):
        flat = self.flats.get(int(ptr))
        if flat is None:
            raise NotRegistered(f"no registered tensor of agent {self.name!r} starts at 0x{int(ptr):x}")
        return flat

    def peer(self, name: str) -> "KVPeer":
        p = self.peers.get(name) if isinstance(name, str) else None
        if p is None:
            raise NotRegistered(f"agent {self.name!r} has no peer {name!r}; peers: {', '.join(self.peers) or 'none'}")
        return p

    def metadata(self) -> dict:
        """The metadata's ``allocations`` and ``groups`` (:meth:`KVAgent.metadata
        <gpuxfer.kv.agent.KVAgent.metadata>`)."""
        with self.lock:
            return {"allocations": [handle_meta(h) for h in self.allocs],
                    "groups": [{"name": g.name, "block_tokens": g.block_tokens,
                                "layers": [lay.as_meta(*self.layer_refs[(g.name, lay.name)]) for lay in g.layers]}
                               for g in self.groups.values() if (g.name, g.layers[0].name) in self.layer_refs]}

    def clear(self) -> None:
        """Forget the groups, their anchors and the peers (a closed agent's)."""
        self.groups, self.flats, self.peers = {}, {}, {}


def _registered(local: Registry, meta: PeerMetadata, held: tuple) -> list:
    """``[(group of meta, its layers as agent local registered them)]``, for a peer in this process: its metadata
    must say exactly what that agent holds -- its allocations, flag words and staging, every layer of every group
    it lists (offsets, extents, strides, pieces) -- since the agent's own memory is used, as a remote peer's
    metadata must fit the mappings of its handles. Anything else is :class:`BadMetadata`."""
    def differs(what: str) -> BadMetadata:
        return BadMetadata(f"peer {meta.agent!r} names agent {local.name!r} of this process, but {what}")

    with local.lock:
        allocs, groups, refs = list(local.allocs), dict(local.groups), dict(local.layer_refs)
    if meta.agent != local.name or meta.device != local.device:
        raise differs(f"as {meta.agent!r} on device {meta.device}, not {local.name!r} on device {local.device}")
    if local.closed:
        raise differs("that agent is closed")
    flags, staging = held           # (the caller holds them)
    ctrl = flags.export()
    staging_payload = None if staging is None else staging.export().payload
    if len(meta.allocations) > len(allocs):
        raise differs(f"lists {len(meta.allocations)} allocations; it holds {len(allocs)}")
    for i, (h, real) in enumerate(zip(meta.allocations, allocs)):
        if (h.payload, h.nbytes, h.device) != (real.payload, real.nbytes, real.device):
            raise differs(f"its allocation {i} is not that agent's")
    if (meta.control.payload, meta.control.nbytes) != (ctrl.payload, ctrl.nbytes):
        raise differs("its flag words are not that agent's")
    if (meta.staging is None) != (staging is None) or (staging is not None and (
            meta.slot_bytes != local.slot_bytes or meta.staging.payload != staging_payload
            or meta.staging.nbytes != staging.nbytes)):
        raise differs("its staging is not that agent's")
    out = []
    for g in meta.groups:
        real = groups.get(g.name)
        if real is None or real.block_tokens != g.block_tokens or len(real.layers) != len(g.layers):
            raise differs(f"its group {g.name!r} is not one that agent registered")
        for (lay, a, off), rl in zip(g.layers, real.layers):
            if dataclasses.replace(rl, ptr=0) != lay or refs.get((g.name, rl.name)) != (a, off):
                raise differs(f"layer {lay.name!r} of its group {g.name!r} is not as that agent registered it")
        out.append((g, list(real.layers)))
    return out


class KVPeer(Closable):
    """Another agent, added from its metadata: its caches mapped here (or, in this process, used as they are),
    and :attr:`flags`, the flag link to its words (the agent's words shared, stage words of the link's own).
    :attr:`route`: how transfers reach it (``"ipc"``; :class:`~gpuxfer.kv.nixl_route.NixlPeer`: ``"nixl"``)."""

    route = "ipc"
    _held = None                            # a peer agent of this process: its _Shared, held while this is open
    local_view = None                       # {group: this agent's _Group seen through some pieces} (add_peer)

    def __init__(self, agent, meta: PeerMetadata, poster):
        """``agent``: the :class:`~gpuxfer.kv.agent.KVAgent` adding it; ``poster``: that agent's
        :class:`~gpuxfer.kv.posting.Poster` (its post lock, its posted transfers, its stream's calls bound once)."""
        self.agent, self.meta, self.name, self.poster = agent, meta, meta.agent, poster
        self._calls = poster.calls
        self._closed = False
        self._mappings: list[Any] = []
        self._owned: list[Any] = []
        self.flags: FlagLink | None = None
        self.host_words = None              # the peer's notification words' host copy, where mapped here
        self.staging_ptr: int | None = None
        self._seq = [0] * NOTIFY_SLOTS
        self._notified: list = [None] * NOTIFY_SLOTS     # per slot: (stream, event) of its last notifying post
        self.pack_sent = 0                  # pack transfers (with chunks) this agent's source posted to the peer
        self.pack_recv = 0                  # pack transfers (with chunks) this agent's destination posted
        self.engine = agent.engine          # the engine of transfers with this peer (KVAgent._peer_engine)
        self.addressable = True             # whether this process can address the peer's caches (kernels)
        plat, dev = agent.platform, agent.device
        try:
            here = meta.pid == os.getpid() and meta.namespace == process_namespace()
            local = _LOCAL_AGENTS.get(meta.uid)
            if local is not None and not here:
                raise BadMetadata(f"peer {meta.agent!r} names agent {local.name!r} of this process but pid "
                                  f"{meta.pid} of another process")
            if here and local is None:
                raise BadMetadata(f"peer {meta.agent!r} claims this process but is not a live agent here")
            self._local = local
            held = None if local is None else local.shared.acquire()
            if local is not None and held is None:
                raise BadMetadata(f"peer {meta.agent!r} of this process is closed")
            if held is not None:
                self._held = local.shared
            self.flags = FlagLink(plat, dev, AGENT_WORDS, rank=agent.rank, peer=meta.agent,
                                  name=f"agent {agent.name!r}", shared=agent.flags)
            self._owned.append(self.flags)
            self.groups: dict[str, _Group] = {}
            if local is not None:
                for g, layers in _registered(local, meta, held):
                    self.groups[g.name] = _Group(g.name, g.block_tokens, layers, [(a, off) for _, a, off in g.layers])
                flags, staging = held
                self.flags.open(flags)
                self.staging_ptr = None if staging is None else staging.ptr
                self._open_host_words()
                return
            bases = []
            for i, h in enumerate(meta.allocations):
                m = self._open(h, f"allocation {i}")
                self._mappings.append(m)
                self._check_claim(m.ptr, h.nbytes, "an allocation")
                bases.append(m.ptr)
                self.addressable = self.addressable and m.addressable
            try:
                self.flags.open(meta.control)
            except BadMetadata:
                raise
            except BadInput as exc:
                raise BadMetadata(f"peer {meta.agent!r}: its flag words: {exc}") from None
            self._check_claim(self.flags.peer_mem.ptr, meta.control.nbytes, "flag words")
            if meta.staging is not None:
                st = self._open(meta.staging, "its staging")
                self._mappings.append(st)
                self._check_claim(st.ptr, meta.staging.nbytes, "staging")
                self.staging_ptr = st.ptr
            for g in meta.groups:
                layers = [KVLayer(lay.name, lay.index, bases[a] + off, lay.num_blocks, lay.block_stride, lay.pieces,
                                  lay.extent, lay.token_major) for lay, a, off in g.layers]
                self.groups[g.name] = _Group(g.name, g.block_tokens, layers, [(a, off) for _, a, off in g.layers])
            self._open_host_words()
        except BaseException:
            self._release()
            raise

    def _open_host_words(self) -> None:
        """Map the peer's host copy of its notification words, where its metadata names one and this host has it
        (:mod:`.host_notify`): owned, closed with the peer's mappings."""
        if self.meta.host_words is not None:
            self.host_words = open_peer(self.agent.platform, self.agent.device, self.meta.host_words, self.name,
                                        self.meta.uid)
            if self.host_words is not None:
                self._owned.append(self.host_words)

    def _open(self, handle: IpcHandle, what: str) -> Any:
        """Map the peer's ``handle``; a handle the platform cannot use is bad metadata."""
        try:
            return self.agent.platform.open_handle(handle, self.agent.device)
        except BadMetadata:
            raise
        except BadInput as exc:
            raise BadMetadata(f"peer {self.meta.agent!r}: {what}: {exc}") from None

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
            return self._local.flat_at(ptr)
        a, off = layer_ref
        mappings = self._mappings
        if self._closed or not 0 <= a < len(mappings):
            raise NotRegistered(f"peer {self.name!r} was removed from agent {self.agent.name!r}")
        m = mappings[a]
        if not m.addressable:
            return None
        return self.agent.platform.as_tensor(m, shape=(1,), offset=off)

    def next_notification(self, slot: int) -> int:
        """The value the next notification this agent sends to word ``slot`` of the peer writes (the n-th
        writes n): what a post with ``notify_slot=slot`` made next, and nothing else in between, will write."""
        return self._seq[check_slot(slot)] + 1

    def notify(self, s: Stream, slot: int) -> tuple[int, Event]:
        """Queue the next notification to word ``slot`` of the peer on ``s`` (an open stream of the agent's device,
        after the work already there), then an event: ``(value, event)``. From any thread: it queues under the agent's post lock, the peer checked
        there (:class:`~gpuxfer.errors.NotRegistered` once removed, :class:`~gpuxfer.errors.BadInput` once the
        agent closed), and the agent keeps the event as it keeps a post's, so ``remove_peer`` and ``close`` wait
        for it. A peer of the NIXL route is notified by a transfer's ``notify_slot`` (:class:`BadInput`)."""
        check_slot(slot)
        if not isinstance(s, Stream):
            raise BadInput(f"notify needs a Stream of the platform, got {s!r}")
        self.poster.stream(s)           # (an open stream of the agent's device)
        if self.route != "ipc":
            raise BadInput(f"peer {self.name!r} is reached over {self.route}: notify it with a transfer's notify_slot")
        poster = self.poster
        with poster.lock:
            poster.check_usable(self)
            value, event = self._notify(s, slot)
            poster.track(event, (), s)
        return value, event

    def _notify(self, s: Stream, slot: int) -> tuple[int, Event]:
        """:meth:`notify` for a post, which holds the agent's post lock and checked the peer.

        The n-th notification to a slot writes n once the post that wrote n - 1 completed: a post on another
        stream waits for that post's event first (on one stream, stream order does it). So the peer's word
        never goes down and value n says the data of the first n notifying posts landed; and the copy path's
        stage word of the slot is read by one copy at a time."""
        plat, agent = self.agent.platform, self.agent
        last = self._notified[slot]
        if last is not None and last[0] is not s:
            plat.stream_wait_event(s, last[1])
        value = self._seq[slot] + 1
        calls = self._calls if s is agent.stream else None
        self.flags.signal(s, NOTIFY + slot, value, NOTIFY + slot, calls)
        words = self.host_words
        if words is not None:       # then its host copy (:mod:`.host_notify`), after the word on the same stream
            if calls is not None:
                calls.write_flag(words.ptr(slot), value)
            else:
                plat.write_flag(s, words.ptr(slot), value)
        event = plat.record_event(s)
        self._seq[slot] = value
        self._notified[slot] = (s, event)
        return value, event

    @property
    def remote_flags(self) -> bool:
        """Whether signals to the peer are stream writes into its words (probed), else stage writes and 8-byte
        copies."""
        return self.flags.remote

    def _keep(self) -> list:
        """Give up what queued work may still touch -- the mappings, the flag link, a peer agent of this process's
        memory held -- for the life of the process: the list to keep (closing the peer then frees nothing)."""
        keep = self._mappings + self._owned + ([self._held] if self._held is not None else [])
        self._mappings, self._owned, self._held = [], [], None
        return keep

    def _release(self) -> None:
        for m in reversed(self._mappings + self._owned):
            try:
                m.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing
                log.warning("peer %s: closing %r failed: %s", self.name, m, exc)
        self._mappings, self._owned = [], []
        held, self._held = self._held, None
        if held is not None:
            held.release()

    def __repr__(self) -> str:
        return f"KVPeer({self.name!r}, pid {self.meta.pid}, {len(self.meta.groups)} groups)"
