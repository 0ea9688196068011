"""The benchmark's ``triton`` engine: bursts moved through the public KV API (:class:`~gpuxfer.kv.agent.KVAgent`).

So ``gpuxfer bench kv`` measures what a user of the API gets: each side registers the
grid point's workload as KV-cache groups laid over its pool
(:func:`~gpuxfer.kv.layers.layout_groups`), the two swap metadata bytes over the
benchmark's CPU group, and every request of a burst becomes one transfer by block ID
(the seeded block tables are the block IDs). Per burst, the initiator posts one
transfer per request on the agent's stream; the descriptors are expanded on its
device. ``setup_us`` is the host time of a steady-state ``KVAgent.prepare`` per request
(block IDs in hand -> ready to post), ``first_setup_us`` the route's first one (it loads
the kernels and makes the slots); ``register_ms`` the registration and metadata exchange of
the point's layout (once per point, inside the first row's ``prep_ms``; every row of the point reports it).
"""
from __future__ import annotations

import time

from ...errors import BadInput
from ..agent import KVAgent
from ..blocktable import burst_tables
from ..layers import layout_groups
from ..transfer import KVTransfer
from .base import DescriptorBurst, Role, Side
from .triton import TritonEngine

__all__ = ["AgentTritonEngine", "AgentPackEngine"]


class AgentTritonEngine(TritonEngine):
    """Bursts of block tables (``DescriptorBurst.from_plan``) go through a :class:`KVAgent`; a burst given only as
    descriptor tables takes :class:`~gpuxfer.kv.engines.triton.TritonEngine`'s path (tables uploaded per burst)."""

    description = ("KVAgent (the public KV API): transfers by block ID, descriptors expanded on the initiating GPU, "
                   "the descriptor-copy kernel reading (pull) or writing (push) the peer's caches")

    def __init__(self, side: Side):
        super().__init__(side)
        self.agent: KVAgent | None = None
        self.peer = None
        self._layout = None
        self._register_ms: float | None = None
        self._extra: dict = {}

    agent_engine = "triton"

    def _agent_for(self, layout) -> None:
        """An agent whose groups are ``layout`` over this side's pool, paired with the peer's (collective)."""
        if self._layout is layout or (self._layout is not None and self._layout.as_dict() == layout.as_dict()):
            return
        t0 = time.perf_counter()
        if self.agent is not None:
            self.agent.close()
            self.agent = self.peer = None
        side = self.side
        agent = KVAgent(f"bench-{side.role.serving_name}", platform=self.platform, device=side.device,
                        timeout_s=side.timeout_s, rank=side.rank, engine=self.agent_engine,
                        slot_bytes=self.options.pack_chunk_bytes)
        try:
            for name, block_tokens, layers in layout_groups(layout, self.platform.as_tensor(side.pool)):
                agent.register_group(name, block_tokens, layers)
            blobs = side.exchange(agent.metadata())
            self.peer = agent.add_peer(blobs[side.peer_rank])
        except BaseException:
            agent.close()
            raise
        self.agent, self._layout = agent, layout
        self._register_ms = (time.perf_counter() - t0) * 1e3

    def prepare(self, burst: DescriptorBurst, direction: str):
        pb = getattr(burst, "source", None)
        if pb is None:
            return super().prepare(burst, direction)
        p = self._new_prepared(burst, direction)
        self._agent_for(pb.src_layout)          # both sides, every row: the exchange pairs up
        self._extra = {"register_ms": self._register_ms}
        if pb.dst_layout is not pb.src_layout and pb.dst_layout.as_dict() != pb.src_layout.as_dict():
            raise BadInput("the triton engine registers one layout on both sides")
        if not p.active:
            return p
        src = burst_tables(pb.src_layout, pb.isl_tokens, pb.batch, seed=pb.seed, side="src", order=pb.order)
        dst = burst_tables(pb.dst_layout, pb.isl_tokens, pb.batch, seed=pb.seed, side="dst", order=pb.order)
        mine, theirs = (dst, src) if direction == "pull" else (src, dst)
        p.state = self._timed_prepare(direction, mine, theirs, pb.batch)
        return p

    def _timed_prepare(self, op: str, mine, theirs, batch: int) -> list:
        """The row's requests, prepared; ``setup_us`` is a steady-state prepare per request. The first prepare
        of a route loads its kernels and makes its slots or graphs (``first_setup_us``, untimed in
        ``setup_us``): that one is made once more and dropped before the timed ones."""
        t0 = time.perf_counter()
        self.agent.prepare(self.peer, op, local_blocks=mine[0], remote_blocks=theirs[0], name="warm-up")
        self._extra["first_setup_us"] = (time.perf_counter() - t0) * 1e6
        t0 = time.perf_counter()
        xfers = [self.agent.prepare(self.peer, op, local_blocks=mine[r], remote_blocks=theirs[r],
                                    name=f"request {r}") for r in range(batch)]
        self._extra["setup_us"] = (time.perf_counter() - t0) * 1e6 / batch
        return xfers

    def _by_id(self, p) -> bool:
        return isinstance(p.state, list) and bool(p.state) and isinstance(p.state[0], KVTransfer)

    def _entry_streams(self, p):
        return [self.agent.stream] if self._by_id(p) else super()._entry_streams(p)

    def _enqueue(self, p) -> None:
        if not self._by_id(p):
            super()._enqueue(p)
            return
        handle = None
        for x in p.state:
            handle = x.post()
        p.done = handle.event if handle is not None else self.platform.record_event(self.agent.stream)

    def row_extra(self) -> dict:
        return dict(self._extra)

    def _release(self) -> None:
        super()._release()
        if self.agent is not None:
            self.agent.close()
        self.agent = self.peer = self._layout = None


class AgentPackEngine(AgentTritonEngine):
    """``pack-api``: the KV API's two-sided pack engine (:class:`~gpuxfer.kv.pack_transfer._PackTransfer`):
    both sides post every request, the source ``push``, the destination ``pull``; the source waits for the
    destination's post before it moves anything. One stream per side (``pack`` pipelines over three)."""

    name = "pack-api"
    agent_engine = "pack"
    description = ("KVAgent's pack engine: both sides post by block ID; pack into a staging slot, one copy-engine copy "
                   "per chunk into the peer's slot, unpack; one stream per side")
    uses_sms = "both GPUs, local HBM only"

    def prepare(self, burst: DescriptorBurst, direction: str):
        pb = getattr(burst, "source", None)
        if pb is None:
            raise BadInput("pack-api moves bursts by block ID: build the burst with DescriptorBurst.from_plan")
        p = self._new_prepared(burst, direction, active=True)       # both sides work
        self._agent_for(pb.src_layout)
        self._extra = {"register_ms": self._register_ms}
        src = burst_tables(pb.src_layout, pb.isl_tokens, pb.batch, seed=pb.seed, side="src", order=pb.order)
        dst = burst_tables(pb.dst_layout, pb.isl_tokens, pb.batch, seed=pb.seed, side="dst", order=pb.order)
        source = self.side.role is Role.SOURCE
        mine, theirs = (src, dst) if source else (dst, src)
        p.state = self._timed_prepare("push" if source else "pull", mine, theirs, pb.batch)
        return p
