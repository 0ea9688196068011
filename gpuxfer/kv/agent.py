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
:class:`~gpuxfer.errors.NotExportable` at registration. On the host emulation plain
CPU tensors register as they are (cma handles, :mod:`gpuxfer.platforms.host_cma`): a
peer reaches them by cross-memory-attach copies only, so ``engine="auto"`` moves that
peer's blocks with ``copy_engine`` and ``triton`` is refused at :meth:`KVAgent.add_peer`.

**Transfers.** ``pull``: the local agent's blocks are the destination and the peer's
the source; ``push``: the reverse. With the ``triton`` engine (one-sided) the work runs
on the local device: the descriptor-copy kernel reading or writing the peer's memory
through the IPC mapping. With ``pack`` (two-sided, :class:`~gpuxfer.kv.pack_transfer._PackTransfer`) both sides
prepare and post the request -- the source ``push``, the destination ``pull`` -- and
the source's packed chunks travel staging to staging on a copy engine.
Descriptors are expanded on the device from the block IDs and the registered layout
(:mod:`gpuxfer.kernels.block_kernel`). Everything per (peer, direction, layer range) -- the
plane table, the tilings, a ring of device buffers with their launches bound once and
captured as a graph (:class:`~gpuxfer.kv.triton_transfer._Slot`) -- is built once and cached; per request ``prepare``
writes one small int64 array (a header and the block IDs) on the host, and ``post``
uploads it into a free slot and launches the slot's graph (:class:`~gpuxfer.kv.triton_transfer._SlotTransfer`).

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
    h.done() / h.wait()                  <- complete            |  (a flag-link signal into decode's word k)
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
import functools
import itertools
import logging
import numbers
import os
import socket
import threading
import time
import uuid
from typing import Any, Mapping, Sequence

from ..common import process_namespace
from ..errors import (BackendUnavailable, BadInput, BadMetadata, BlockIdError, LayoutMismatch, NotRegistered,
                      TransferTimeout)
from ..flaglink import FlagWords
from ..platforms.base import RELEASE_VALUE, Closable, DeviceBuffer, Event, IpcHandle, Platform, Stream
from ..sync import check_timeout
from .control import AGENT_WORDS, NOTIFY, NOTIFY_SLOTS, PACK_SLOTS
from .descriptors import DIRECTIONS
from .device_ids import prepare_device, wants_device_ids
from .engine_choice import AGENT_ENGINES, kernel_reason, peer_engine
from .failure import FailsOnTimeout, on_timeout_from_env
from .layers import (_MAX_NAME, KVLayer, KVLayerSpec, KVPiece, check_disjoint, describe_layer, memory_at,
                     _torch)
from . import nixl_route
from .metadata import METADATA_VERSION, decode_metadata, encode_metadata
from .lifetime import _Lifetime, _Shared
from .peers import _LEAKED, _LOCAL_AGENTS, KVPeer, _Group  # noqa: F401 - _LEAKED: what close kept (tests look)
from .posting import _PostResources, _ended
from .routes import _Route, _Routes
from .triton_transfer import _RequestPool
from .request_arrays import _RequestArrays
from .transfer import KVTransfer, KVTransferHandle

log = logging.getLogger("gpuxfer.kv.agent")

__all__ = ["KVAgent", "KVPeer", "KVTransfer", "KVTransferHandle", "KVLayerSpec", "KVPiece", "KVLayer",
           "describe_layer", "memory_at", "METADATA_VERSION", "NOTIFY_SLOTS", "AGENT_ENGINES"]

#: the pack engine's staging slot, in bytes (the host emulation's is smaller)
PACK_SLOT_BYTES = 192 << 20
PACK_SLOT_BYTES_EMULATION = 1 << 20


def _notify_value(value) -> int:
    """A notification count to wait for: an int in ``0 .. RELEASE_VALUE - 1`` (the release value a failure or
    close writes must satisfy every wait), else :class:`BadInput`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < RELEASE_VALUE:
        raise BadInput(f"a notification value must be an int in 0..2^62 - 1 (below the release value), got {value!r}")
    return int(value)


class KVAgent(_Routes, _RequestArrays, _PostResources, _Lifetime, Closable, FailsOnTimeout):
    """One process's side of KV transfers: its registered caches, its peers, its stream.

    ``platform``: a :class:`~gpuxfer.platforms.base.Platform` (default: the process's,
    :func:`gpuxfer.platforms.current`); ``device``: the local device every transfer runs on; ``engine``:
    ``"triton"``, ``"pack"`` (both agents of a pair run it) or ``"copy_engine"``; ``"auto"``: ``triton``, but
    ``copy_engine`` with a peer whose caches this process cannot address (``peer.engine`` says which);
    ``timeout_s``: the default of every wait; ``rank``: how errors name this side;
    ``slot_bytes``: the pack engine's staging slot (192 MiB; 1 MiB on the host emulation); a request's chunks are
    32 MiB or about a sixteenth of the request, whichever is larger, up to the slot.

    **Failure.** When a wait on a peer times out -- a ``pack`` transfer's handle (its streams wait on
    flags the peer writes) or :meth:`wait_notification` -- the agent fails, as a benchmark side does
    (:class:`~gpuxfer.kv.failure.FailsOnTimeout`): it writes a release value into its own flag words
    (:class:`~gpuxfer.flaglink.FlagWords`: the pack flags and every notification slot a stream was made to wait on), so none of its streams
    stays blocked, and raises the error from every later call; ``close`` still works.
    ``on_timeout="exit"`` (or ``GPUXFER_KV_ON_TIMEOUT=exit``) then ends the process. A ``triton``
    transfer queues no wait on the peer: its handle's timeout only raises.
    """

    def __init__(self, name: str, *, platform: Platform | None = None, device: int = 0, engine: str = "auto",
                 timeout_s: float = 60.0, rank: int = 0, slot_bytes: int | None = None,
                 on_timeout: str | None = None, remote: str | None = None):
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME:
            raise BadInput(f"agent name must be a string of 1..{_MAX_NAME} characters, got {name!r}")
        self.auto_engine = engine == "auto"        # then each peer gets the engine that reaches it
        engine = "triton" if engine == "auto" else engine
        if engine not in AGENT_ENGINES:
            raise BadInput(f"KVAgent runs engine(s) {', '.join(AGENT_ENGINES)}; got {engine!r}")
        self._closed = False
        self.failed = None
        self.on_timeout = on_timeout_from_env(on_timeout)
        timeout_s = check_timeout(timeout_s, "KVAgent timeout_s")
        self._waited_slots: set[int] = set()        # notification slots a stream was made to wait on
        self._stream_waits: dict[Stream, Event] = {}  # per stream made to wait on a slot: an event after its wait
        if platform is None:
            from ..platforms import current
            platform = current()
        self.platform, self.name, self.engine = platform, name, engine
        self.device = int(device)
        self.timeout_s, self.rank = timeout_s, int(rank)
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
        self._lane: Stream | None = None                            # a pack source's copies (beside its packs)
        self._lane_event: Event | None = None
        self._requests = _RequestPool(pinned=not platform.host_memory)     # host arrays of requests
        self._post_lock = threading.Lock()                          # a route's ring, one post at a time
        self._capture_stream: Stream | None = None                  # where slots' graphs are captured
        self.graphs = True                                          # capture slots' launches as graphs
        self._slot_uses = itertools.count(1)
        self.flags: FlagWords | None = None
        self.staging: DeviceBuffer | None = None
        self._status = None                 # a pack agent's refusal (control.STATUS), copied to the host by posts
        self._device_status = None          # device-ID posts' status words (device_ids._StatusWords)
        self.stream: Stream | None = None
        self.nixl: nixl_route.NixlSide | None = None                # the NIXL route's side (remote="nixl")
        if slot_bytes is None:
            slot_bytes = PACK_SLOT_BYTES_EMULATION if platform.kernels_interpreted else PACK_SLOT_BYTES
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes < 256 or slot_bytes % 256:
            raise BadInput(f"slot_bytes must be a positive multiple of 256, got {slot_bytes!r}")
        self.slot_bytes = slot_bytes
        try:
            if engine == "pack":
                self.staging = platform.alloc(PACK_SLOTS * slot_bytes, self.device)
                self._status_mirror = _torch().zeros(2, dtype=_torch().int64, pin_memory=not platform.host_memory)
                self._status, self._status_ptr = self._status_mirror.numpy(), self._status_mirror.data_ptr()
            self.flags = FlagWords(platform, self.device, AGENT_WORDS, rank=self.rank, name=f"agent {name!r}",
                                   timeout_s=self.timeout_s)
            self._shared = _Shared(self.flags, self.staging)    # held by peer links of this process's agents
            self.stream = platform.create_stream(self.device)
            self._calls = platform.stream_calls(self.stream)        # the stream's flag, graph and copy calls
            if self._calls.copy is None:
                self._calls.copy = functools.partial(platform.copy_async, self.stream)
            self.nixl = nixl_route.side_for(self, remote)
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
        check_disjoint(name, described, [(g.name, g.layers) for g in self._groups.values()])
        refs = []
        for (_, t), lay in zip(items, described):
            st = (t.tensor if isinstance(t, KVLayerSpec) else t).untyped_storage()
            ex = self.platform.export_range(lay.ptr, lay.extent, self.device, within=(st.data_ptr(), st.nbytes()))
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

    def layer_at(self, ptr: int, nbytes: int, page_bytes: int, *, pieces: Sequence[Any] | None = None,
                 token_major: bool = True, index: int | None = None) -> KVLayerSpec:
        """A layer known only by its memory (SGLang's ``KVArgs``: a pointer, a length and the bytes of a
        page): pages of ``page_bytes`` back to back from ``ptr``, as many as ``nbytes`` holds, each one piece
        (or ``pieces``). The memory is this process's, on this agent's device; the caller keeps it alive
        while the agent uses it. Pass the result to :meth:`register_group` (which exports it as a tensor)."""
        for v, what in ((nbytes, "length"), (page_bytes, "page_bytes")):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or int(v) < 1:
                raise BadInput(f"layer_at: the {what} must be a positive int, got {v!r}")
        if nbytes < page_bytes:
            raise BadInput(f"layer_at: {nbytes} bytes at 0x{int(ptr):x} hold no whole {page_bytes}-byte page")
        view = memory_at(ptr, nbytes, self._torch_device())
        return KVLayerSpec(view, int(nbytes) // int(page_bytes), int(page_bytes),
                           pieces if pieces is not None else [(0, int(page_bytes))], token_major=token_major,
                           index=index)

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
        flags, staging = self._hold()
        try:
            ctrl = flags.export()
            staging_meta = None if staging is None else dict(
                self._handle_meta(self.platform.export_handle(staging)), slot_bytes=self.slot_bytes)
        finally:
            self._shared.release()
        body = {
            "agent": self.name, "uid": self.uid, "pid": os.getpid(), "namespace": process_namespace(),
            "host": socket.gethostname() or "unknown",
            "platform": self.platform.name, "device": self.device,
            "control": {"payload": ctrl.payload.hex(), "nbytes": ctrl.nbytes, "device": ctrl.device},
            "staging": staging_meta,
            "allocations": [{"payload": h.payload.hex(), "nbytes": h.nbytes, "device": h.device}
                            for h in self._allocs],
            "groups": [{"name": g.name, "block_tokens": g.block_tokens,
                        "layers": [lay.as_meta(*self._layer_refs[(g.name, lay.name)]) for lay in g.layers]}
                       for g in self._groups.values()],
        }
        if self.nixl is not None:
            body["nixl"] = self.nixl.metadata()
        return encode_metadata(body)

    @staticmethod
    def _handle_meta(h: IpcHandle) -> dict:
        return {"payload": h.payload.hex(), "nbytes": h.nbytes, "device": h.device}

    def add_peer(self, metadata: bytes, *, route: str = "auto") -> KVPeer:
        """Add the agent whose :meth:`metadata` these bytes are: map its caches and notification words.

        ``route``: ``"auto"`` (IPC on this host, NIXL to another), ``"ipc"`` or ``"nixl"`` (both agents made
        with ``remote="nixl"``; :mod:`gpuxfer.kv.nixl_route`). The peer's :attr:`~KVPeer.route` says which."""
        self._check_open()
        meta = decode_metadata(metadata)
        if meta.platform != self.platform.name:
            raise BadMetadata(f"peer {meta.agent!r} runs on platform {meta.platform!r}, this agent on "
                              f"{self.platform.name!r}")
        route = nixl_route.choose_route(self, meta, route)
        if meta.uid == self.uid:
            raise BadInput("an agent cannot be its own peer")
        if meta.agent in self._peers:
            raise BadInput(f"peer {meta.agent!r} is already added (remove_peer first)")
        if route == "nixl":
            return nixl_route.add_peer(self, meta)
        if self.staging is not None and meta.staging is not None and meta.slot_bytes != self.slot_bytes:
            # each side addresses the pair's staging slots by its own slot size
            raise LayoutMismatch(f"peer {meta.agent!r} has {meta.slot_bytes}-byte staging slots, agent "
                                 f"{self.name!r} {self.slot_bytes}-byte ones: the pack engine needs equal slot_bytes")
        peer = KVPeer(self, meta)
        try:        # the peer is the agent's only once every step that can fail is behind it
            peer.engine = peer_engine(self.engine, self.auto_engine, peer.name, peer.addressable)
            if self.engine == "pack":
                peer.flags.probe_one_sided(self.timeout_s)
            routes = self._warm(peer)
            with self._lock:
                if meta.agent in self._peers:
                    raise BadInput(f"peer {meta.agent!r} is already added (remove_peer first)")
                self._peers[meta.agent] = peer
                self._routes.update(routes)
        except BaseException:
            peer.close()
            raise
        return peer

    def _warm(self, peer: KVPeer) -> dict:
        """The routes of whole requests (every shared group, every layer) in both directions, built now so a
        request's setup finds them: ``{route key: route}``; a layout the peer does not match raises when a
        request names it."""
        from ..kernels import blocks, launch  # noqa: F401 - loaded here, not in the first request's setup
        shared = tuple(g for g in self._groups if g in peer.groups)
        routes = {}
        for op in DIRECTIONS if shared else ():
            try:
                routes[(peer, op, None, shared)] = self._build_route(peer, op, None, shared)
            except (LayoutMismatch, BadInput) as exc:
                log.debug("agent %s: no %s route with peer %s yet: %s", self.name, op, peer.name, exc)
        return routes

    def warm_up(self, block: int = 0) -> float:
        """Load now what this agent's requests run (compiled kernels, a route's slot and graph), so the first
        request after startup pays none of it; engines call it once their caches are registered.

        A mirror agent in this process registers the same memory, and each group's block ``block`` is pulled
        onto itself, a group at a time: every byte written is the byte already there. So call it before the engine writes its
        caches, or name a block nothing writes (vLLM's null block 0). Returns the seconds it took. A ``pack``
        agent returns 0 at once, since its requests need the peer's post."""
        self._check_open()
        if self.engine == "pack" or not self._groups:
            return 0.0
        t0 = time.perf_counter()
        mirror = KVAgent(f"{self.name[:_MAX_NAME - 5]}~warm", platform=self.platform, device=self.device,
                         engine=self.engine, timeout_s=self.timeout_s, rank=self.rank)
        try:
            for g in list(self._groups.values()):
                mirror.register_group(g.name, g.block_tokens, {
                    lay.name: KVLayerSpec(flat, lay.num_blocks, lay.block_stride, lay.pieces, lay.token_major, lay.index)
                    for lay, flat in zip(g.layers, g.flats)})
            peer = self.add_peer(mirror.metadata())
            try:
                for g in self._groups:          # one group at a time: groups may share memory (vLLM's hybrid ones)
                    ids = {g: [block]}
                    self.prepare(peer, "pull", local_blocks=ids, remote_blocks=ids, name="warm-up").post().wait()
            finally:
                self.remove_peer(peer)
        finally:
            mirror.close()
        return time.perf_counter() - t0

    def peer(self, name: str) -> KVPeer:
        p = self._peers.get(name)
        if p is None:
            raise NotRegistered(f"agent {self.name!r} has no peer {name!r}; peers: {', '.join(self._peers) or 'none'}")
        return p

    # ------------------------------------------------------------------ transfers

    def prepare(self, peer: "KVPeer | str", op: str, *, local_blocks: Mapping[str, Any],
                remote_blocks: Mapping[str, Any], layers: tuple[int, int] | None = None,
                notify_slot: int | None = None, name: str | None = None, device_ids: bool | None = None
                ) -> KVTransfer:
        """Per-request setup: check the block IDs, stage them for upload, size the launches.

        ``op``: ``"pull"`` (the peer's blocks -> ours) or ``"push"`` (ours -> the peer's).
        ``local_blocks`` / ``remote_blocks``: ``{group: block IDs}`` on each side, the same groups;
        where block sizes differ, the side with larger blocks lists ``ceil(n / ratio)`` of them for
        the other side's ``n``. ``layers``: ``(first, stop)`` model layer numbers to move (default:
        all). ``notify_slot``: bump this word of the peer's notification area after the data
        (0..63). ``name``: how errors and timeouts name the request. ``device_ids``: the IDs are tensors on
        the agent's device, checked there at each post (:mod:`gpuxfer.kv.device_ids`; the ``triton``
        engine); default: when the first group's IDs are a GPU tensor.
        """
        if type(peer) is not KVPeer and isinstance(peer, str):
            self._check_open()
            peer = self.peer(peer)
        self._check_usable(peer)            # (the agent's own state too)
        if op not in DIRECTIONS:
            raise BadInput(f"op must be one of {', '.join(DIRECTIONS)}, got {op!r}")
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
        if not (type(local_blocks) is dict or isinstance(local_blocks, Mapping)) or \
                not (type(remote_blocks) is dict or isinstance(remote_blocks, Mapping)):
            raise BlockIdError(f"request {name!r}: local_blocks and remote_blocks must map group -> block IDs")
        if peer.route == "nixl":
            if device_ids:
                raise BadInput(f"request {name!r}: the NIXL route takes block IDs on the host")
            return peer.prepare(op, layers, name, local_blocks, remote_blocks, notify_slot)
        # the route of a request naming these groups in this order (cached beside the route's own key)
        key = (peer, op, layers, tuple(local_blocks))
        route = self._routes.get(key)
        if route is None or local_blocks.keys() != remote_blocks.keys():
            route = self._request_route(peer, op, layers, name, local_blocks, remote_blocks)
            self._keep_route(key, route)
        if wants_device_ids(local_blocks, device_ids):
            return prepare_device(self, peer, route, op, name, local_blocks, remote_blocks, notify_slot)
        return self._stage(peer, route, op, name, route.ids.check(name, op == "push", local_blocks, remote_blocks),
                           notify_slot)

    def _request_route(self, peer: KVPeer, op: str, layers, name: str, local_blocks: Mapping,
                       remote_blocks: Mapping) -> _Route:
        """The route of a request's groups, which must be the same on both sides and registered on both."""
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
        return self._route(peer, op, layers, tuple(g for g in self._groups if g in local_blocks))

    def post_many(self, transfers: Sequence[KVTransfer], stream: Stream | None = None) -> list[KVTransferHandle]:
        """Post several prepared transfers on ``stream`` (default: the agent's own) at once: the ``triton``
        transfers of one route (same peer, direction, groups and layers) as one request -- one upload, one graph
        launch, one event for all of them (:mod:`gpuxfer.kv.batch`) --, the others one by one. Returns their
        handles in order (those merged share one event). Every transfer's peer is checked before anything is
        queued; an error after some were queued carries their handles in its ``handles`` attribute (None for
        those not queued): their blocks stay in use until those complete. Two transfers of one route writing
        the same destination block run one after another instead, in order; between routes the order is not
        defined, as between posts on different streams."""
        from .batch import post_many
        return post_many(self, transfers, stream)

    def transfer(self, peer: "KVPeer | str", op: str, *, local_blocks: Mapping[str, Any],
                 remote_blocks: Mapping[str, Any], stream: Stream | None = None, **kw) -> KVTransferHandle:
        """:meth:`prepare` then :meth:`KVTransfer.post`."""
        return self.prepare(peer, op, local_blocks=local_blocks, remote_blocks=remote_blocks, **kw).post(stream)

    # ------------------------------------------------------------------ notifications

    def _slot(self, slot: int) -> int:
        """The flag word of notification slot ``slot``."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < NOTIFY_SLOTS:
            raise BadInput(f"notification slot must be an int in 0..{NOTIFY_SLOTS - 1}, got {slot!r}")
        return NOTIFY + slot

    def notification(self, slot: int = 0) -> int:
        """The value of notification word ``slot`` (how many notifications reached it), read now."""
        self._check_open()
        index = self._slot(slot)
        flags, _ = self._hold()
        try:
            return flags.read(index)
        finally:
            self._shared.release()

    def wait_notification(self, slot: int, value: int, timeout_s: float | None = None) -> int:
        """Poll word ``slot`` until it holds ``value`` or more; :class:`TransferTimeout` past ``timeout_s``
        (default: the agent's; a finite number of seconds > 0, at most :data:`~gpuxfer.sync.MAX_TIMEOUT_S`)."""
        self._check_open()
        t = self.timeout_s if timeout_s is None else check_timeout(timeout_s, "wait_notification's timeout_s")
        value = _notify_value(value)
        index = self._slot(slot)
        flags, _ = self._hold()
        try:
            return flags.wait_host(index, value, t, step=value, flag=f"notification slot {slot} of agent {self.name!r}")
        except TransferTimeout as exc:
            self.fail(exc)
            raise
        finally:
            self._shared.release()

    def stream_wait_notification(self, stream: Stream, slot: int, value: int) -> None:
        """Block ``stream``'s later work (not the host) until word ``slot`` holds ``value`` or more: ``value``
        in ``0 .. RELEASE_VALUE - 1`` (the release value, 2^62, that a failure or close writes must pass it).

        The agent holds ``stream`` (and an event after the wait) until the wait passed: close drains past it."""
        self._check_open()
        index = self._slot(slot)
        value = _notify_value(value)
        if not isinstance(stream, Stream):
            raise BadInput(f"stream_wait_notification needs a Stream of the platform, got {stream!r}")
        with self._post_lock:               # close passes through it: the wait is then in its books
            self._check_open()
            waits = self._stream_waits
            for st in [st for st, e in waits.items() if _ended(self.platform, e)]:
                del waits[st]
            self._waited_slots.add(slot)
            self.flags.wait(stream, index, value)
            waits[stream] = self.platform.record_event(stream)      # close drains past it

    # ------------------------------------------------------------------ failure

    def failure_name(self) -> str:
        return f"KV agent {self.name!r} (rank {self.rank}, {self.platform.name}:{self.device})"

    def check(self) -> None:
        """Raise the error that failed this agent; a refused pack transfer fails it first (waits released, no exit)."""
        if self._status is not None and self._status[0] and self.failed is None and not self._closed:
            from .pack_transfer import mismatch_error
            self.failed = mismatch_error(self, int(self._status[0]), int(self._status[1]))
            self.release_waits()
        super().check()

    def __repr__(self) -> str:
        return (f"KVAgent({self.name!r}, {self.platform.name}:{self.device}, {len(self._groups)} groups, "
                f"{len(self._peers)} peers{', closed' if self._closed else ''})")
