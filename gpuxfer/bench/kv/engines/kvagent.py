"""The benchmark's default kernel and copy-engine engines: bursts moved through the public KV API
(:class:`~gpuxfer.kv.agent.KVAgent`), so ``gpuxfer bench kv`` measures what a user of the API gets.

``triton`` (:class:`AgentTritonEngine`), ``pack`` (:class:`AgentPackEngine`) and ``copy_engine``
(:class:`AgentCopyEngine`) run the agent's engine of the same name. Each side registers its own pool
layout of the burst as KV-cache groups laid over its pool (:func:`~gpuxfer.kv.layers.layout_groups`;
the two sides' layouts may differ where their regions match), the two swap metadata bytes over the
benchmark's CPU group, and every request of a burst becomes one transfer by block ID (the burst's
seeded block tables, :attr:`gpuxfer.bench.kv.model.plan.Burst.src_tables` / ``dst_tables``, are the block IDs)::

    prefill (source)                              decode (destination)
    ----------------                              --------------------
    prepare, first burst of a layout:
      KVAgent(engine), register its layout        KVAgent(engine), register its layout
      metadata()  <------- CPU group: swap ------->  metadata()
      add_peer(theirs)                            add_peer(theirs)
    prepare: agent.prepare(peer, op, ids) per request (op: push on the source, pull on the destination)
    one-sided (triton, copy_engine): only the initiator prepares and posts (pull: decode, push: prefill)
    two-sided (pack): both sides post every request; the source waits for the destination's post

Per burst, a posting side posts one transfer per request on the agent's stream; the descriptors are
expanded on its device (``copy_engine``: on the host, once, at prepare). Row fields: ``api``
(``KVAgent``), ``setup_us`` -- the host time of a steady-state ``KVAgent.prepare`` per request (block
IDs in hand -> ready to post; the median of :data:`SETUP_SAMPLES` preparations of the batch) --, ``first_setup_us`` -- the route's first one (it loads the kernels and
makes the slots) --, ``register_ms`` -- the registration and metadata exchange of the point's layouts
(once per point, inside the first row's ``prep_ms``; every row of the point reports it).

A burst without block tables (a :class:`~gpuxfer.bench.kv.engines.DescriptorBurst` of descriptor tables
only, e.g. ``--suite collectivex``'s one-descriptor bulk rows) cannot be expressed by block ID: it runs
on the engine's descriptor-table twin (``triton-table``, ``pack-table``, ``copy_engine-table``: tables
uploaded per burst), built on first use, and its row says so (``api``: ``descriptor tables``).
"""
from __future__ import annotations

import time
from typing import ClassVar

from ....platforms.base import Platform
from ....kv.agent import KVAgent
from ..model.layout import layout_groups
from .base import BurstShape, DescriptorBurst, Engine, Prepared, Role, Side
from .copy_engine import CopyEngineEngine, copy_engine_cap_reason
from .launch import kernel_reason
from .pack import PackEngine
from .triton import TritonEngine

__all__ = ["AgentTritonEngine", "AgentPackEngine", "AgentCopyEngine", "API", "TABLES"]

#: a row's ``api``: moved by block ID through KVAgent, or as descriptor tables by the engine's twin
API, TABLES = "KVAgent", "descriptor tables"

#: preparations of a row's batch timed for its ``setup_us`` (their median)
SETUP_SAMPLES = 5


class _AgentEngine(Engine):
    """An engine whose bursts go through a :class:`KVAgent` running :attr:`agent_engine`; bursts of
    descriptor tables only go to :attr:`table_engine` (see the module docstring)."""

    agent_engine: ClassVar[str] = ""
    table_engine: ClassVar[type[Engine]] = Engine
    two_sided: ClassVar[bool] = False       # both sides post every request (pack)
    needs_peer_mapping = True
    launches_kernels = True
    armable = True

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        return kernel_reason(platform)      # KVAgent needs torch and the kernels, whatever its engine

    def __init__(self, side: Side):
        super().__init__(side)
        self.agent: KVAgent | None = None
        self.peer = None
        self._layouts: tuple | None = None      # (source layout, destination layout) of the registered agent
        self._register_ms: float | None = None
        self._extra: dict = {}
        self._table: Engine | None = None

    # -- the agent of a pair of layouts
    def _agent_for(self, src_layout, dst_layout) -> None:
        """An agent whose groups are this side's layout over its pool, paired with the peer's. Collective:
        both sides see the same bursts, so both (re)build theirs at the same ones."""
        key = (src_layout.as_dict(), dst_layout.as_dict())
        if self.agent is not None and self._layouts == key:
            return
        t0 = time.perf_counter()
        self._close_agent()
        side = self.side
        mine = src_layout if side.role is Role.SOURCE else dst_layout
        agent = KVAgent(f"bench-{side.role.serving_name}", platform=self.platform, device=side.device,
                        timeout_s=side.timeout_s, rank=side.rank, engine=self.agent_engine,
                        slot_bytes=self.options.pack_chunk_bytes, on_timeout=side.on_timeout)
        try:
            for name, block_tokens, layers in layout_groups(mine, self.platform.as_tensor(side.pool)):
                agent.register_group(name, block_tokens, layers)
            blobs = side.exchange(agent.metadata())
            self.peer = agent.add_peer(blobs[side.peer_rank], route="ipc")      # (the IPC engines are measured)
        except BaseException:
            agent.close()
            raise
        self.agent, self._layouts = agent, key
        side.on_release(self._release_agent_waits)     # a failing side releases the agent's waits too
        self._register_ms = (time.perf_counter() - t0) * 1e3

    def _release_agent_waits(self) -> None:
        if self.agent is not None:
            self.agent.release_waits()

    def _close_agent(self) -> None:
        self.side.forget_release(self._release_agent_waits)
        if self.agent is not None:
            self.agent.close()
        self.agent = self.peer = self._layouts = None

    # -- the burst protocol
    def _mine(self, p: Prepared) -> bool:
        """Whether ``p`` was prepared through the agent (else by the descriptor-table twin)."""
        return p.engine == self.name

    def prepare(self, burst: DescriptorBurst, direction: str) -> Prepared:
        pb = getattr(burst, "source", None)
        if pb is None or pb.src_tables is None or pb.dst_tables is None:
            return self._prepare_tables(burst, direction)
        p = self._new_prepared(burst, direction, active=True if self.two_sided else None)
        self._agent_for(pb.src_layout, pb.dst_layout)       # both sides, active or not: the exchange pairs up
        self._extra = {"api": API, "register_ms": self._register_ms}
        self._add_extra()
        if not p.active:
            return p
        # a posting side's op: the source pushes its blocks, the destination pulls into its own (one-sided,
        # the initiator is the only posting side, and its role matches the direction)
        source = self.side.role is Role.SOURCE
        mine, theirs = (pb.src_tables, pb.dst_tables) if source else (pb.dst_tables, pb.src_tables)
        p.state = self._timed_prepare("push" if source else "pull", mine, theirs, pb.batch)
        return p

    def _prepare_tables(self, burst: DescriptorBurst, direction: str) -> Prepared:
        self._new_prepared(burst, direction)        # a bad burst is refused before a twin is built for it
        if self._table is None:
            self._table = self.table_engine(self.side)      # pack-table: collective (both sides build it)
        p = self._table.prepare(burst, direction)
        self._extra = {"api": TABLES}
        return p

    def _add_extra(self) -> None:
        """Engine-specific row fields of a burst through the agent."""

    def _timed_prepare(self, op: str, mine, theirs, batch: int) -> list:
        """The row's requests, prepared; ``setup_us`` is a steady-state prepare per request: the median of
        :data:`SETUP_SAMPLES` preparations of the batch (the last one kept). The first prepare of a route loads
        its kernels and makes its slots or graphs (``first_setup_us``, untimed in ``setup_us``): that one is
        made once more and dropped before the timed ones."""
        t0 = time.perf_counter()
        self.agent.prepare(self.peer, op, local_blocks=mine[0], remote_blocks=theirs[0], name="warm-up")
        self._extra["first_setup_us"] = (time.perf_counter() - t0) * 1e6
        times = []
        for _ in range(SETUP_SAMPLES):
            xfers = None            # the previous sample's transfers give their host arrays back first
            t0 = time.perf_counter()
            xfers = [self.agent.prepare(self.peer, op, local_blocks=mine[r], remote_blocks=theirs[r],
                                        name=f"request {r}") for r in range(batch)]
            times.append((time.perf_counter() - t0) * 1e6 / batch)
        self._extra["setup_us"] = sorted(times)[len(times) // 2]
        return xfers

    def _entry_streams(self, p: Prepared):
        return [self.agent.stream] if self._mine(p) else self._table._entry_streams(p)

    def _enqueue(self, p: Prepared) -> None:
        if not self._mine(p):
            self._table._enqueue(p)
            return
        handle = None
        for x in p.state:
            handle = x.post()
        p.done = handle.event if handle is not None else self.platform.record_event(self.agent.stream)

    def release(self, p: Prepared) -> None:
        (super() if self._mine(p) else self._table).release(p)

    def row_extra(self) -> dict:
        extra = dict(self._extra)
        if extra.get("api") == TABLES and self._table is not None:
            extra.update(self._table.row_extra())
        return extra

    def abort(self) -> None:
        self._release_agent_waits()
        if self._table is not None:
            self._table.abort()

    def _release(self) -> None:
        self._close_agent()
        if self._table is not None:
            self._table.close()
            self._table = None


class AgentTritonEngine(_AgentEngine):
    """``triton``: KVAgent's copy kernel on the initiating GPU."""

    name = "triton"
    agent_engine = "triton"
    table_engine = TritonEngine
    description = ("KVAgent (the public KV API): transfers by block ID, the copy kernel on the initiating GPU "
                   "deriving each copy from the IDs (GPUXFER_KV_COPY=descriptors: from a descriptor table expanded "
                   "there first), reading (pull) or writing (push) the peer's caches")
    uses_sms = "initiating GPU"


class AgentPackEngine(_AgentEngine):
    """``pack``: KVAgent's two-sided pack engine (:class:`~gpuxfer.kv.pack_transfer._PackTransfer`): both
    sides post every request, the source ``push``, the destination ``pull``; the source waits for the
    destination's post before it moves anything. The source packs on the agent's stream and copies on a
    lane of its own; the destination unpacks on its stream."""

    name = "pack"
    agent_engine = "pack"
    table_engine = PackEngine
    two_sided = True
    description = ("KVAgent's pack engine: both sides post by block ID; the source packs each chunk into a staging "
                   "slot, one copy-engine copy per chunk into the peer's slot, the destination unpacks")
    uses_sms = "both GPUs, local HBM only"

    def _add_extra(self) -> None:
        from ....flaglink import COPY, REMOTE
        self._extra["flag_path"] = REMOTE if self.peer.remote_flags else COPY


class AgentCopyEngine(_AgentEngine):
    """``copy_engine``: KVAgent's copy-engine engine: the descriptors of a request expanded on the host at
    prepare (its driver API takes host arrays), posted as batched copy-engine copies; no SM. Never armed
    (a burst's copies are more commands than a blocked stream's queue takes: its posting is timed), and
    capped per burst as ``copy_engine-table`` is."""

    name = "copy_engine"
    agent_engine = "copy_engine"
    table_engine = CopyEngineEngine
    launches_kernels = False
    armable = False
    description = ("KVAgent's copy_engine engine: transfers by block ID, descriptors expanded on the host at prepare, "
                   "cuMemcpyBatchAsync over them; no SM, a fixed cost per descriptor")
    uses_sms = "none"

    def shed_reason(self, shape: BurstShape) -> str | None:
        return copy_engine_cap_reason(self.name, self.options.copy_engine_max_descs, shape)
