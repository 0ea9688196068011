"""The KV transfer API: register an engine's own KV caches, swap metadata bytes, move requests by block ID.

Shaped like NIXL's agent, Mooncake's TransferEngine and vLLM's ``register_kv_caches``::

    agent = KVAgent("decode-0", device=0)                       # one per process (and device)
    agent.register_group("full", block_tokens=16, layers=kv_caches)   # {layer name: torch tensor}
    blob = agent.metadata()                                     # bytes: send them over any channel
    peer = agent.add_peer(blob_from_prefill)                    # opens the peer's caches (IPC on one host)
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
on the local device: the copy kernel reading or writing the peer's memory
through the IPC mapping. With ``pack`` (two-sided, :class:`~gpuxfer.kv.pack_transfer._PackTransfer`) both sides
prepare and post the request -- the source ``push``, the destination ``pull`` -- and
the source's packed chunks travel staging to staging on a copy engine.
Each copy derives its rows from the block IDs and the registered layout on the device
(``GPUXFER_KV_COPY=blocks``, the default; with ``descriptors`` an expansion kernel,
:mod:`gpuxfer.kernels.block_kernel`, writes a descriptor table the copies read).
Everything per (peer, direction, layer range) -- the plane table, the tilings, a ring of device buffers with their launches bound once and
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
      stream: upload IDs -> copy pieces -> notify  --------------+
    h.done() / h.wait()                  <- complete            |  (a flag-link signal into decode's word k)
                                                                +-> wait_notification(k, n) returns, or
                                                                    stream_wait_notification(s, k, n)
                                                                    lets decode's kernels on s go on

Every call validates its input and raises a typed error: :class:`~gpuxfer.errors.BlockIdError`
(out of range, duplicated destination blocks, counts that do not match),
:class:`~gpuxfer.errors.LayoutMismatch` (the two sides' groups, layers or pieces differ),
:class:`~gpuxfer.errors.NotRegistered`, :class:`~gpuxfer.errors.BadMetadata`,
:class:`~gpuxfer.errors.TransferTimeout` naming the request. Block IDs are checked on the
host (vectorised over the IDs, which are few next to the descriptors); the kernels
on the device also mask any ID outside its group, so no access leaves the registered memory
whatever the IDs hold.
"""
from __future__ import annotations

import itertools
import logging
import numbers
import threading
import time
import types
import uuid
from typing import Any, Mapping, Sequence

from ..errors import BackendUnavailable, BadInput, BlockIdError, TransferTimeout
from ..flaglink import FlagWords
from ..platforms.base import RELEASE_VALUE, Closable, DeviceBuffer, Platform, Stream
from ..sync import check_timeout
from .batch import post_many
from .control import AGENT_WORDS, NOTIFY, NOTIFY_SLOTS, PACK_SLOTS, check_slot
from .descriptors import DIRECTIONS
from .device_ids import prepare_device, wants_device_ids
from .engine_choice import AGENT_ENGINES, agent_engine_choice, kernel_reason
from .failure import FailsOnTimeout, on_timeout_from_env
from .host_notify import create as host_notify_words
from .layers import (_MAX_NAME, KVLayer, KVLayerSpec, KVPiece, check_disjoint, checked_flag, describe_layer,
                     memory_at, _torch)
from . import nixl_route
from .metadata import METADATA_VERSION
from .lifetime import Lifetime, _Shared
from .pack_transfer import PackState
from .peering import Peering
from .peers import _LEAKED, _LOCAL_AGENTS, KVPeer, Registry, _Group  # noqa: F401 - _LEAKED: what close kept
from .posting import Poster
from .request_arrays import RequestStaging
from .routes import RouteCache, request_groups
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


class KVAgent(Closable, FailsOnTimeout):
    """One process's side of KV transfers: its registered caches, its peers, its stream.

    ``platform``: a :class:`~gpuxfer.platforms.base.Platform` (default: the process's,
    :func:`gpuxfer.platforms.current`); ``device``: the local device every transfer runs on; ``engine``:
    ``"triton"``, ``"pack"`` (both agents of a pair run it) or ``"copy_engine"``; ``"auto"``: what
    :func:`~gpuxfer.kv.engine_choice.agent_engine_choice` picks (``triton`` on a GPU, ``copy_engine`` on the
    host emulation; ``engine_reason`` says why), and ``copy_engine`` with a peer whose caches this process
    cannot address (``peer.engine`` says which);
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

    **Parts.** The agent holds what it registered and its peers (:class:`~gpuxfer.kv.peers.Registry`), its routes
    (:class:`~gpuxfer.kv.routes.RouteCache`), what its posts run on (:class:`~gpuxfer.kv.posting.Poster`: the post
    lock, the posted transfers, the host arrays, the slots), how a request becomes its request array and transfer
    (:class:`~gpuxfer.kv.request_arrays.RequestStaging`), its pack transfers' state
    (:class:`~gpuxfer.kv.pack_transfer.PackState`), how it publishes its metadata and adds peers
    (:class:`~gpuxfer.kv.peering.Peering`) and what its memory lives through
    (:class:`~gpuxfer.kv.lifetime.Lifetime`: ``remove_peer``, the release of waits, close's drain); its transfers
    post through the poster.
    """

    def __init__(self, name: str, *, platform: Platform | None = None, device: int = 0, engine: str = "auto",
                 timeout_s: float = 60.0, rank: int = 0, slot_bytes: int | None = None,
                 on_timeout: str | None = None, remote: str | None = None, host_notify: bool = False):
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME:
            raise BadInput(f"agent name must be a string of 1..{_MAX_NAME} characters, got {name!r}")
        if not isinstance(host_notify, bool):
            raise BadInput(f"host_notify must be True or False, got {host_notify!r:.40}")
        self.auto_engine = engine == "auto"        # then each peer gets the engine that reaches it
        if engine not in AGENT_ENGINES and not self.auto_engine:
            raise BadInput(f"KVAgent runs engine(s) {', '.join(AGENT_ENGINES)} or 'auto'; got {engine!r}")
        self._closed = False
        self._closing = threading.RLock()     # a close in progress: a concurrent close returns once it is over
        self.failed = None
        self.on_timeout = on_timeout_from_env(on_timeout)
        timeout_s = check_timeout(timeout_s, "KVAgent timeout_s")
        for v, what in ((device, "device"), (rank, "rank")):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise BadInput(f"KVAgent {what} must be a non-negative int, got {v!r}")
        if platform is None:
            from ..platforms import current
            platform = current()
        self.engine_reason = f"engine={engine!r} asked"
        if self.auto_engine:
            engine, self.engine_reason = agent_engine_choice(platform)
        self.platform, self.name, self.engine = platform, name, engine
        self.device = int(device)
        self.timeout_s, self.rank = timeout_s, int(rank)
        why = kernel_reason(platform)
        if why is not None:
            raise BackendUnavailable(engine, {name: why})
        self.uid = uuid.uuid4().hex
        self._names = itertools.count()
        self.flags: FlagWords | None = None
        self.staging: DeviceBuffer | None = None
        self.stream: Stream | None = None
        self.nixl: nixl_route.NixlSide | None = None                # the NIXL route's side (remote="nixl")
        self.host_words = None          # the notification words' host copy (host_notify: :mod:`.host_notify`)
        self._shared: _Shared | None = None         # flags and staging, held by peer links of this process's agents
        if slot_bytes is None:
            slot_bytes = PACK_SLOT_BYTES_EMULATION if platform.kernels_interpreted else PACK_SLOT_BYTES
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes < 256 or slot_bytes % 256:
            raise BadInput(f"slot_bytes must be a positive multiple of 256, got {slot_bytes!r}")
        self.slot_bytes = slot_bytes
        self._registry = Registry(name, self.device, self.rank, slot_bytes)
        self._routes = RouteCache(self, self._registry)
        self._poster = Poster(self, self._registry)
        self._pack = PackState(self)
        self._lifetime = Lifetime(self, self._registry, self._routes, self._poster, self._pack)
        self._staging = RequestStaging(self._poster, self._pack)
        self._peering = Peering(self, self._registry, self._routes, self._poster, self._lifetime)
        try:
            if engine == "pack":
                self._pack.make_status_words()
                self.staging = platform.alloc(PACK_SLOTS * slot_bytes, self.device)
            self.flags = FlagWords(platform, self.device, AGENT_WORDS, rank=self.rank, name=f"agent {name!r}",
                                   timeout_s=self.timeout_s)
            self._shared = self._registry.shared = _Shared(self.flags, self.staging)
            self.stream = platform.create_stream(self.device)
            self._poster.bind(self.stream)
            self.nixl = nixl_route.side_for(self, self._registry, remote)
            if host_notify:
                self.host_words = host_notify_words(platform, self.device, name, self.uid)
        except BaseException:
            self._release()
            raise
        _LOCAL_AGENTS[self.uid] = self._registry

    @property
    def graphs(self) -> bool:
        """Whether posts capture a route's launches as graphs (where the platform captures; a failed capture turns
        it off); set it to False to launch them one by one."""
        return self._poster.graphs

    @graphs.setter
    def graphs(self, value: bool) -> None:
        self._poster.graphs = value

    @property
    def peers(self) -> Mapping[str, KVPeer]:
        """``{name: peer}``, read-only."""
        return types.MappingProxyType(self._registry.peers)

    # ------------------------------------------------------------------ registration

    def _torch_device(self):
        return self.platform.torch_device(self.device)

    def register_group(self, name: str, block_tokens: int, layers: Mapping[str, Any] | Sequence[Any], *,
                       token_major: bool = True, export: bool = True) -> None:
        """Register a KV-cache group: layers sharing one block table of ``block_tokens``-token blocks.

        ``layers``: ``{layer name: tensor or KVLayerSpec}`` (vLLM's ``kv_caches`` for the group's
        layers) or a sequence (named ``"<group>.<i>"``). Tensors must be on the agent's device, in
        memory the platform can export. Adding a peer or a transfer does not need every group: a
        request names the groups it moves. ``export=False``: the group's memory is this agent's own to read and
        write but is not exported (memory another process mapped here, which cannot be exported again): it is
        left out of :meth:`metadata`, so it is only ever the local side of a transfer.
        """
        self._poster.check_open()
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME:
            raise BadInput(f"group name must be a string of 1..{_MAX_NAME} characters, got {name!r}")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or not 0 < block_tokens < 1 << 32:
            raise BadInput(f"group {name!r}: block_tokens must be a positive int, got {block_tokens!r}")
        checked_flag(f"group {name!r}", token_major)
        checked_flag(f"group {name!r}", export, "export")
        reg = self._registry
        if name in reg.groups:
            raise BadInput(f"group {name!r} is already registered")
        if isinstance(layers, Mapping):
            items = list(layers.items())
        elif isinstance(layers, Sequence) and not isinstance(layers, (str, bytes)):
            items = [(f"{name}.{i}", t) for i, t in enumerate(layers)]
        else:
            raise BadInput(f"group {name!r}: layers must be a mapping of layer names to tensors or a sequence of "
                           f"tensors, got {type(layers).__name__}")
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
        check_disjoint(name, described, [(g.name, g.layers) for g in reg.groups.values()])
        refs = []
        if export:
            for (_, t), lay in zip(items, described):
                st = (t.tensor if isinstance(t, KVLayerSpec) else t).untyped_storage()
                ex = self.platform.export_range(lay.ptr, lay.extent, self.device, within=(st.data_ptr(), st.nbytes()))
                refs.append((reg.allocation(ex.handle, lay.ptr - ex.offset), ex.offset))
        flats = [reg.flat(t.tensor if isinstance(t, KVLayerSpec) else t) for _, t in items]
        with reg.lock:
            if reg.closed:
                raise BadInput(f"agent {self.name!r} is closed")
            if name in reg.groups:
                raise BadInput(f"group {name!r} is already registered")
            # a new dict: a request or add_peer reading the groups meanwhile goes on over the one it holds
            reg.groups = {**reg.groups, name: _Group(name, block_tokens, described, flats)}
            for lay, ref in zip(described, refs):       # (none where not exported)
                reg.layer_refs[(name, lay.name)] = ref
            self._routes.drop_all()

    def layer_at(self, ptr: int, nbytes: int, page_bytes: int, *, pieces: Sequence[Any] | None = None,
                 token_major: bool = True, index: int | None = None) -> KVLayerSpec:
        """A layer known only by its memory (SGLang's ``KVArgs``: a pointer, a length and the bytes of a
        page): pages of ``page_bytes`` back to back from ``ptr``, as many as ``nbytes`` holds, each one piece
        (or ``pieces``). The memory is this process's, on this agent's device; the caller keeps it alive
        while the agent uses it. Pass the result to :meth:`register_group` (which exports it as a tensor)."""
        checked_flag("layer_at", token_major)
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

    @property
    def groups(self) -> dict[str, tuple[int, int, int]]:
        """``{group: (block tokens, blocks, layers)}``."""
        return {g.name: (g.block_tokens, g.num_blocks, len(g.layers)) for g in self._registry.groups.values()}

    def device_bytes(self) -> dict[str, int]:
        """Device memory this agent holds beyond the registered caches and its flag words, in bytes: the routes'
        slots -- descriptor buffers (``(rows, 3)`` int64: 24 bytes per descriptor of the largest request a slot
        ran; where slots copy from the IDs, ``GPUXFER_KV_COPY=blocks``, only the tables ``expanded_descriptors``
        made), request buffers and the device ID check's bitmaps -- and the pack engine's staging slots; with the
        number of routes cached (``routes``), of routes dropped from the cache that a prepared transfer or a post
        not yet completed still holds (``held_routes``: counted until released) and of slots."""
        return {**self._routes.slot_bytes(), "pack_staging": self.staging.nbytes if self.staging is not None else 0}

    # ------------------------------------------------------------------ metadata and peers

    def metadata(self) -> bytes:
        """This agent's caches and notification words, as versioned bytes for :meth:`add_peer` elsewhere."""
        return self._peering.metadata()

    def add_peer(self, metadata: bytes, *, route: str | None = None,
                 pieces: Mapping[str, tuple[int, int]] | None = None,
                 local_pieces: Mapping[str, tuple[int, int]] | None = None,
                 token_slice: Mapping[str, tuple[int, int]] | None = None,
                 local_token_slice: Mapping[str, tuple[int, int]] | None = None) -> KVPeer:
        """Add the agent whose :meth:`metadata` these bytes are: map its caches and notification words.

        ``route``: ``"auto"`` (IPC on this host, NIXL to another), ``"ipc"``, ``"nixl"`` (both agents made with
        ``remote="nixl"``; :mod:`gpuxfer.kv.nixl_route`) or None (``GPUXFER_KV_ROUTE``); see :attr:`KVPeer.route`.
        ``pieces``: ``{group: (start, stop)}``: every layer of the peer's group is seen through its pieces
        ``[start, stop)`` only (e.g. the heads one tensor parallel rank of this side holds, of a peer holding
        several ranks' heads, one piece per head); transfers then pair this side's pieces with those.
        ``local_pieces``: the same for this agent's own layers in transfers with this peer (the heads of this
        side's blocks that a peer holding fewer heads supplies). No view with the ``pack`` engine.
        ``token_slice``: ``{group: (start, stop)}``: every (token-major) piece of the peer's group is seen as its
        block's token rows, each cut to bytes ``[start, stop)`` (a range of heads of a token-major layout,
        ``(blocks, block_tokens, heads, dim)``): ``block_tokens`` pieces per piece, after ``pieces``;
        ``local_token_slice``: the same for this agent's own layers. Both sides' pieces then pair one to one,
        so both are usually cut (the same bytes per token, at different offsets in rows of different sizes), and
        the two sides' blocks must be of the same size. Not the ``pack`` engine; over the ``nixl`` route each token
        row of a block and layer is a descriptor of the route's lists (counted against its cap at ``add_peer``)."""
        return self._peering.add(metadata, route, pieces, local_pieces, token_slice, local_token_slice)

    def warm_up(self, block: int = 0, *, device_ids: bool = False) -> float:
        """Load now what this agent's requests run (compiled kernels, a route's slot and graph), so the first
        request after startup pays none of it; engines call it once their caches are registered.

        A mirror agent in this process registers the same memory, and each group's block ``block`` is pulled
        onto itself, a group at a time: every byte written is the byte already there. So call it before the engine writes its
        caches, or name a block nothing writes (vLLM's null block 0). ``device_ids``: each group's pull once more
        with the ID as a device tensor (the device check's kernels; the ``triton`` engine). Returns the seconds it
        took. A ``pack`` agent returns 0 at once, since its requests need the peer's post."""
        self._poster.check_open()
        groups = self._registry.groups
        if self.engine == "pack" or not groups:
            return 0.0
        t0 = time.perf_counter()
        mirror = KVAgent(f"{self.name[:_MAX_NAME - 5]}~warm", platform=self.platform, device=self.device,
                         engine=self.engine, timeout_s=self.timeout_s, rank=self.rank, remote="none")
        try:
            for g in list(groups.values()):
                mirror.register_group(g.name, g.block_tokens, {
                    lay.name: KVLayerSpec(flat, lay.num_blocks, lay.block_stride, lay.pieces, lay.token_major, lay.index)
                    for lay, flat in zip(g.layers, g.flats)})
            peer = self.add_peer(mirror.metadata(), route="ipc")
            try:
                for g in list(groups):          # one group at a time: groups may share memory (vLLM's hybrid ones)
                    ids = {g: [block]}
                    self.prepare(peer, "pull", local_blocks=ids, remote_blocks=ids, name="warm-up").post().wait()
                    if device_ids:
                        ids = {g: _torch().tensor([block], dtype=_torch().int64, device=self._poster.torch_device())}
                        self.prepare(peer, "pull", local_blocks=ids, remote_blocks=ids, name="warm-up",
                                     device_ids=True).post().wait()
            finally:
                self.remove_peer(peer)
        finally:
            mirror.close()
        return time.perf_counter() - t0

    def peer(self, name: str) -> KVPeer:
        return self._registry.peer(name)

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
            self._poster.check_open()
            peer = self.peer(peer)
        self._poster.check_usable(peer)     # (the agent's own state too)
        if op not in DIRECTIONS:
            raise BadInput(f"op must be one of {', '.join(DIRECTIONS)}, got {op!r}")
        if layers is not None:
            if (not isinstance(layers, (tuple, list)) or len(layers) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
                    or not 0 <= layers[0] < layers[1]):
                raise BadInput(f"layers must be (first, stop) with 0 <= first < stop, got {layers!r}")
            layers = self._routes.clamp(peer, (int(layers[0]), int(layers[1])))
        if notify_slot is not None:
            check_slot(notify_slot, "notify_slot")
        name = f"{self.name}#{next(self._names)}" if name is None else str(name)
        if not (type(local_blocks) is dict or isinstance(local_blocks, Mapping)) or \
                not (type(remote_blocks) is dict or isinstance(remote_blocks, Mapping)):
            raise BlockIdError(f"request {name!r}: local_blocks and remote_blocks must map group -> block IDs")
        if peer.route == "nixl":
            if device_ids:
                raise BadInput(f"request {name!r}: the NIXL route takes block IDs on the host")
            return peer.prepare(op, layers, name, local_blocks, remote_blocks, notify_slot)
        # the route of a request naming these groups, in whatever order
        try:
            route = self._routes.lookup((peer, op, layers, frozenset(local_blocks)))
        except TypeError:           # (a mapping whose keys do not hash: request_groups names it)
            route = None
        if route is None or local_blocks.keys() != remote_blocks.keys():
            groups = request_groups(self._registry, peer, name, local_blocks, remote_blocks)
            route = self._routes.route(peer, op, layers, groups)
        if device_ids is True or (device_ids is not False and wants_device_ids(local_blocks, device_ids)):
            return prepare_device(self._poster, peer, route, op, name, local_blocks, remote_blocks, notify_slot)
        checked = route.ids.check(name, op == "push", local_blocks, remote_blocks)
        return self._staging.stage(peer, route, op, name, checked, notify_slot)

    def post_many(self, transfers: Sequence[KVTransfer], stream: Stream | None = None) -> list[KVTransferHandle]:
        """Post several prepared transfers on ``stream`` (default: the agent's own) at once: the ``triton``
        transfers of one route (same peer, direction, groups and layers) as one request -- one upload, one graph
        launch, one event for all of them (:mod:`gpuxfer.kv.batch`) --, the others one by one. Returns their
        handles in order (those merged share one event). Every transfer's peer is checked before anything is
        queued; an error after some were queued carries their handles in its ``handles`` attribute (None for
        those not queued): their blocks stay in use until those complete. Two transfers of one route writing
        the same destination block run one after another instead, in order; between routes the order is not
        defined, as between posts on different streams."""
        return post_many(self._poster, transfers, stream)

    def transfer(self, peer: "KVPeer | str", op: str, *, local_blocks: Mapping[str, Any],
                 remote_blocks: Mapping[str, Any], stream: Stream | None = None, **kw) -> KVTransferHandle:
        """:meth:`prepare` then :meth:`KVTransfer.post`."""
        return self.prepare(peer, op, local_blocks=local_blocks, remote_blocks=remote_blocks, **kw).post(stream)

    # ------------------------------------------------------------------ notifications

    def notification(self, slot: int = 0) -> int:
        """The value of notification word ``slot`` (how many notifications reached it), read now."""
        self._poster.check_open()
        index = NOTIFY + check_slot(slot)
        flags, _ = self._lifetime.hold()
        try:
            return flags.read(index)
        finally:
            self._shared.release()

    def host_notification(self, slot: int = 0) -> int | None:
        """Word ``slot``'s copy in host memory (a load: no device read), or None where this agent has none
        (:mod:`gpuxfer.kv.host_notify`). It never passes :meth:`notification` and lags it for a peer that does not
        write it."""
        self._poster.check_open()
        index, words = check_slot(slot), self.host_words
        return None if words is None else words.read(index)

    def wait_notification(self, slot: int, value: int, timeout_s: float | None = None) -> int:
        """Poll word ``slot`` until it holds ``value`` or more; :class:`TransferTimeout` past ``timeout_s``
        (default: the agent's; a finite number of seconds > 0, at most :data:`~gpuxfer.sync.MAX_TIMEOUT_S`)."""
        self._poster.check_open()
        t = self.timeout_s if timeout_s is None else check_timeout(timeout_s, "wait_notification's timeout_s")
        value = _notify_value(value)
        index = NOTIFY + check_slot(slot)
        flags, _ = self._lifetime.hold()
        try:
            return flags.wait_host(index, value, t, step=value, flag=f"notification slot {slot} of agent {self.name!r}")
        except TransferTimeout as exc:
            if not self._closed:        # (a closed agent queues nothing more: nothing to fail)
                self.fail(exc)
            raise
        finally:
            self._shared.release()

    def stream_wait_notification(self, stream: Stream, slot: int, value: int) -> None:
        """Block ``stream``'s later work (not the host) until word ``slot`` holds ``value`` or more: ``stream`` an
        open stream of the agent's device, ``value`` in ``0 .. RELEASE_VALUE - 1`` (the release value, 2^62, that a
        failure or close writes must pass it).

        The agent holds ``stream`` (and an event after the wait) until the wait passed: close drains past it."""
        self._poster.check_open()
        index = NOTIFY + check_slot(slot)
        value = _notify_value(value)
        if not isinstance(stream, Stream):
            raise BadInput(f"stream_wait_notification needs a Stream of the platform, got {stream!r}")
        self._poster.stream(stream)     # (an open stream of the agent's device: its flag words are that device's)
        self._lifetime.stream_wait(stream, slot, index, value)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Drain, then close the peers, the streams and the memory (see the module docs). Idempotent; a close called
        while another thread's is in progress returns once that one is over."""
        with self._closing:
            super().close()

    def remove_peer(self, peer: "KVPeer | str") -> None:
        """Forget a peer, then close its mappings and its flag link once every transfer posted with it
        completed (waiting at most the agent's timeout). Posts to it from then on raise
        :class:`~gpuxfer.errors.NotRegistered` having queued nothing.

        Past the timeout the agent fails (:meth:`fail`: its waits are released, its error is raised from
        every later call) and waits once more; what still runs then may touch the peer's mappings and
        flag link's words, so those are kept for the life of the process (logged) instead of freed under it."""
        self._lifetime.remove_peer(peer)

    def release_waits(self) -> None:
        """Write the release value into this agent's words its streams (or the caller's) may wait on: the
        pack flags and the notification slots waited on from a stream. Best effort: the abort path."""
        self._lifetime.release_waits()

    def _release(self) -> None:
        """:meth:`Lifetime.release <gpuxfer.kv.lifetime.Lifetime.release>` (the drain, the peers, the parts), then
        the NIXL side and the stream closed, and the flag words and the staging retired (:class:`_Shared`: freed
        once no peer link of this process holds them; kept for the life of the process where queued work may
        still touch them)."""
        _LOCAL_AGENTS.pop(self.uid, None)
        drained = self._lifetime.release()
        if self.nixl is not None:
            self.nixl.close()
            self.nixl = None
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        if self._shared is not None:
            self._shared.retire(free=drained)
        elif drained:           # a construction that failed before its words were shared
            for b in (self.flags, self.staging):
                if b is not None:
                    b.close()
        self.flags = self.staging = None
        if self.host_words is not None:     # (peers of other processes keep their own mappings)
            self.host_words.close()

    # ------------------------------------------------------------------ failure

    def failure_name(self) -> str:
        return f"KV agent {self.name!r} (rank {self.rank}, {self.platform.name}:{self.device})"

    def check(self) -> None:
        """Raise the error that failed this agent; a refused pack transfer fails it first (waits released, no exit)."""
        status = self._pack.status
        if status is not None and status[0] and self.failed is None and not self._closed:
            # (copies taken at once: posts and add_peer of other threads change both)
            inflight, peers = list(self._poster.inflight), dict(self._registry.peers)
            self.failed = self._pack.mismatch_error(inflight, peers, int(status[0]), int(status[1]))
            self.release_waits()
        super().check()

    def __repr__(self) -> str:
        return (f"KVAgent({self.name!r}, {self.platform.name}:{self.device}, {len(self._registry.groups)} groups, "
                f"{len(self._registry.peers)} peers{', closed' if self._closed else ''})")
