"""The ``pack-table`` engine: pack on the source, one copy-engine copy per chunk, unpack on the destination,
over a burst's descriptor tables uploaded per burst. (The default ``pack`` row runs KVAgent's pack engine,
by block ID: :class:`~gpuxfer.bench.kv.engines.kvagent.AgentPackEngine`.)

Pack the pages into a staging buffer on the source (a local kernel at HBM speed), one copy-engine
transfer per chunk into the destination's staging buffer (opened over IPC), unpack on the destination.
Chunked and pipelined across three streams in two processes: chunk *k* packs while *k-1* is on the
wire and *k-2* unpacks. Cross-process hand-offs are 64-bit stream flags of a peer-flag link
(:mod:`gpuxfer.flaglink`: a remote stream write where the set-up probe saw one arrive, else an 8-byte
copy); a slot is reused only once the peer says it is free. No SM touches the wire.

Flag words (each side's own; a flag counts chunks per lane, so it only grows):
``GO`` on the source (bursts the destination asked for, pull), ``AVAIL[lane]`` on the destination
(chunks landed, push, or packed, pull), ``FREE[lane]`` on the source (chunks unpacked, push, or copied
out, pull). Chunk ``c`` uses slot ``c.slot``, lane ``c.lane``, value ``c.seq`` (:class:`_ChunkSchedule`).

Push, the source initiates (one chunk; its streams: kernel K, lane L)::

    source K: [slot free: own copy of the slot's last chunk done]  pack -> stage[slot]; record packed
    source L: wait packed; [wait FREE[lane'] >= seq' of the slot's last chunk]
              copy stage[slot] -> peer stage[slot]; signal AVAIL[lane] := seq  -------->
    destination K:                                   wait AVAIL[lane] >= seq; unpack stage[slot]
                                          <--------  signal FREE[lane] := seq
    source L (after the burst's last chunk): wait FREE[lane] >= seq; record done

Pull, the destination initiates::

    destination L0: signal GO := burst  -------->  source K: wait GO >= burst
                                                   [wait FREE[lane'] >= seq'] pack -> stage[slot]
    destination L: wait AVAIL[lane] >= seq  <----  signal AVAIL[lane] := seq
                   [own unpack of the slot's last chunk done]
                   copy peer stage[slot] -> stage[slot]; signal FREE[lane] := seq  -------->
    destination K: wait copied; unpack stage[slot]; record done (after the last chunk)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ....errors import BadInput
from ....flaglink import FIRST_WORD, FlagLink
from ....platforms.base import Event, Platform, Stream
from .base import DescriptorBurst, Engine, Prepared, Role, Side
from .chunks import chunk_plan, split_large
from .launch import bind, device_table, kernel_reason, kernels, sync_uploads

log = logging.getLogger("gpuxfer.kv.engines")

_MAX_LANES = 8
# flag words of the pack engine's link (each side's own)
_GO = FIRST_WORD                     # on the source: bursts the destination asked for (pull)
_AVAIL = _GO + 1                     # on the destination: per lane, chunks available (push: landed; pull: packed)
_FREE = _AVAIL + _MAX_LANES          # on the source: per lane, chunks released (push: unpacked; pull: copied out)
_STAGE = _FREE + _MAX_LANES          # on either side: a signal's stage word: lanes 0..7, kernel stream 8, GO 9
_WORDS = _STAGE + _MAX_LANES + 2 - FIRST_WORD


class _Chunk(NamedTuple):
    k: int                              # chunk number over the engine's life
    slot: int                           # staging slot
    lane: int                           # copy lane
    seq: int                            # its number on that lane (1, 2, ...): the value its flags carry
    before: tuple[int, int] | None      # (lane, seq) of the slot's previous chunk in this burst, if any


class _ChunkSchedule:
    """Which staging slot and copy lane each chunk of the pack engine uses.

    Chunks are counted over the engine's life; both sides build the same schedule
    from the same plans. Chunk ``k`` uses slot ``k % S`` and lane ``k % L``, except a
    burst's last chunk, which takes the lane of the chunk before it: on two lanes, a
    command queued after a chunk copy on one lane (the event that releases its unpack,
    its flag) completes only after the other lane's next copy (measured on 2x H200),
    so a burst ending on alternating lanes drains in two unpacks; with the other lane
    idle at the end, in one. On a lane, flags count that lane's chunks, so a flag only ever
    grows even when lanes finish out of order.
    """

    def __init__(self, nslots: int, nlanes: int):
        self.nslots, self.nlanes = nslots, nlanes
        self.k = 0                          # chunks scheduled so far
        self.burst_first = 0                # the first chunk of the burst being scheduled
        self._lane_seq = [0] * nlanes       # chunks scheduled per lane
        self._lane = 0                      # the lane of the last chunk
        self._slot_user: list[_Chunk | None] = [None] * nslots

    def start_burst(self) -> None:
        self.burst_first = self.k

    def next(self, last: bool) -> _Chunk:
        """The next chunk (``last``: the burst's last). ``before`` is None where the slot is fresh in
        this burst: every earlier burst has completed on both sides before this one is armed."""
        k, slot = self.k, self.k % self.nslots
        self.k += 1
        lane = self._lane if last and k > self.burst_first else k % self.nlanes
        self._lane = lane
        self._lane_seq[lane] += 1
        prev = self._slot_user[slot]
        before = (prev.lane, prev.seq) if prev is not None and prev.k >= self.burst_first else None
        c = self._slot_user[slot] = _Chunk(k, slot, lane, self._lane_seq[lane], before)
        return c


@dataclass
class _PackPlan:
    chunks: list[tuple[int, int, int]]      # (start, stop, nbytes) rows of the (split) descriptor table
    table: Any                              # the table on this side's device
    offsets: Any                            # its pack offsets (exclusive cumsum of sizes)
    configs: dict[int, tuple[Any, int, int]]   # chunk start -> (kernel tiling, programs, programs of a pack
                                               # after the burst's first), from the chunk's sizes


class PackEngine(Engine):
    name = "pack-table"
    needs_peer_mapping = True
    launches_kernels = True
    armable = True
    description = ("descriptor tables uploaded per burst: pack on the source, one copy-engine copy per chunk into "
                   "the destination's staging, unpack on the destination; chunked and pipelined over three "
                   "streams, SMs only on local memory")
    uses_sms = "both GPUs, local HBM only"

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        return kernel_reason(platform)

    def __init__(self, side: Side):
        super().__init__(side)
        o = self.options
        if o.pack_lanes > _MAX_LANES:
            raise BadInput(f"pack_lanes must be <= {_MAX_LANES}, got {o.pack_lanes}")
        plat = self.platform
        self.slot_bytes = o.pack_chunk_bytes
        self.nslots, self.nlanes = o.pack_slots, o.pack_lanes
        self._owned: list[Any] = []
        try:
            self.flags = FlagLink(plat, side.device, _WORDS, rank=side.rank, peer=side.peer_rank, name="pack")
            self._owned.append(self.flags)
            self.flags.connect(side.exchange)
            side.on_release(self._release_flag_waits)      # a failing side releases our waits too
            self.stage = plat.alloc(self.slot_bytes * self.nslots, side.device)
            self._owned.append(self.stage)
            handles = side.exchange(self.stage.export())
            self.peer_stage = plat.open_handle(handles[side.peer_rank], side.device)
            self._owned.append(self.peer_stage)
        except BaseException:
            self._release()
            raise
        self.kernel_stream = side.stream("pack-kernel")               # pack (source) or unpack (destination)
        self.copy_streams = [side.stream(f"pack-lane{i}") for i in range(self.nlanes)]
        self._stage_t = None
        self._pool_t = None
        self._chunks = _ChunkSchedule(self.nslots, self.nlanes)
        self._bursts = 0            # pull bursts posted so far (the GO flag)
        self._slot_event: list[Event | None] = [None] * self.nslots

    def row_extra(self) -> dict:
        return {"flag_path": self.flags.path}

    def _views(self):
        if self._stage_t is None:
            self._stage_t = self.platform.as_tensor(self.stage)
            self._pool_t = self.platform.as_tensor(self.side.pool)
        return self._stage_t, self._pool_t

    def prepare(self, burst: DescriptorBurst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction, active=True)     # both sides work
        d = split_large(burst.concatenated(), self.slot_bytes)
        # Largest descriptors first, each size class together, so that each chunk's kernels get a
        # tiling for its own sizes: tiled for the burst's largest, the 528 B indexer pages at the
        # end of a page-16 burst unpack at 0.36 TB/s, after the last copy (measured on 2x H200).
        d = d[np.argsort(-d[:, 2], kind="stable")]
        chunks = chunk_plan(d, self.slot_bytes, self.options.pack_first_chunk_bytes)
        _, pool_t = self._views()
        configs = {a: self._geometry(pool_t.device, b - a, int(d[a:b, 2].max())) for a, b, _ in chunks}
        table = device_table(pool_t, d)
        offsets = kernels().pack_offsets(table)
        sync_uploads(self.platform, self.side.device, self.side.timeout_s, self.side.rank)
        p.state = _PackPlan(chunks, table, offsets, configs)
        return p

    @staticmethod
    def _geometry(device, rows: int, largest: int) -> tuple[Any, int, int]:
        """The tiling for a chunk's largest descriptor; at most one program per group of rows: a
        chunk with fewer row groups than the default grid would split its descriptors' columns across
        programs (``slices`` > 1), and that path gives wrong bytes in pack/unpack on H200 (36 KiB
        pages); whole groups per program stay exact. The tiling is passed to the launcher, so
        the groups counted here are the ones it runs.

        And the grid of a pack after a burst's first: one program per two SMs. Those packs run beside
        earlier chunks' copies, off the critical path, and on every SM they take HBM from the copies
        (2xH200, ``gpuxfer bench kv``: 0.4-1.4 points of the ceiling at batches 1-64; the contention
        itself: scripts/ce_overlap_probe.py)."""
        k = kernels()
        cfg = k.choose_config(largest, local=True)
        full, groups = k.default_programs(device, cfg), -(-rows // cfg.rows)
        return cfg, max(1, min(full, groups)), max(1, min(full // cfg.programs_per_sm // 2, groups))

    def _pack(self, stream: Stream, plan: _PackPlan, a: int, b: int, slot: int) -> None:
        stage_t, pool_t = self._views()
        cfg, programs, later = plan.configs[a]
        if a != plan.chunks[0][0]:
            programs = later
        self.platform.launch(stream, bind(kernels().pack, pool_t, stage_t, plan.table, plan.offsets, start=a,
                                           end=b, staging_offset=slot * self.slot_bytes, validate=False,
                                           config=cfg, num_programs=programs))

    def _unpack(self, stream: Stream, plan: _PackPlan, a: int, b: int, slot: int) -> None:
        stage_t, pool_t = self._views()
        cfg, programs, _ = plan.configs[a]
        self.platform.launch(stream, bind(kernels().unpack, stage_t, pool_t, plan.table, plan.offsets, start=a,
                                           end=b, staging_offset=slot * self.slot_bytes, validate=False,
                                           config=cfg, num_programs=programs))

    def _entry_streams(self, p: Prepared) -> list[Stream]:
        # push: the source's pack stream; pull: the destination's lane 0 (it sends GO to the source)
        return [self.kernel_stream if p.direction == "push" else self.copy_streams[0]]

    def _enqueue(self, p: Prepared) -> None:
        plan: _PackPlan = p.state
        source = self.side.role is Role.SOURCE
        self._chunks.start_burst()
        if p.direction == "push":
            (self._post_push_source if source else self._post_push_destination)(plan, p)
        else:
            self._bursts += 1
            (self._post_pull_source if source else self._post_pull_destination)(plan, p)

    def _burst_chunks(self, plan: _PackPlan):
        """``(chunk, a, b, nbytes)`` for each chunk of the burst being enqueued (rows ``a:b`` of the table)."""
        n = len(plan.chunks)
        return [(self._chunks.next(i == n - 1), a, b, nbytes) for i, (a, b, nbytes) in enumerate(plan.chunks)]

    def _wait_slot_free(self, stream: Stream, c: _Chunk) -> None:
        """``stream`` waits until the peer released the slot's previous chunk in this burst, if any."""
        if c.before is not None:
            self.flags.wait(stream, _FREE + c.before[0], c.before[1])

    def _slot_busy(self, c: _Chunk) -> Event | None:
        """The local event after which this side may reuse ``c``'s slot (None: fresh in this burst)."""
        return self._slot_event[c.slot] if c.before is not None else None

    def _copy_chunk(self, stream: Stream, slot: int, nbytes: int, *, pull: bool) -> None:
        off = slot * self.slot_bytes
        if pull:   # destination reads the source's slot into its own
            self.platform.copy_async(stream, self.stage.ptr + off, self.peer_stage.ptr + off, nbytes)
        else:      # source writes its slot into the destination's
            self.platform.copy_async(stream, self.peer_stage.ptr + off, self.stage.ptr + off, nbytes)

    def _post_push_source(self, plan: _PackPlan, p: Prepared) -> None:
        plat, fl = self.platform, self.flags
        last = None
        for c, a, b, nbytes in self._burst_chunks(plan):
            busy = self._slot_busy(c)
            if busy is not None:                         # our copy of the slot's previous chunk is done
                plat.stream_wait_event(self.kernel_stream, busy)
            self._pack(self.kernel_stream, plan, a, b, c.slot)
            packed = plat.record_event(self.kernel_stream)
            cs = self.copy_streams[c.lane]
            plat.stream_wait_event(cs, packed)
            self._wait_slot_free(cs, c)                  # the destination unpacked the slot's previous chunk
            self._copy_chunk(cs, c.slot, nbytes, pull=False)
            fl.signal(cs, _AVAIL + c.lane, c.seq, _STAGE + c.lane)
            self._slot_event[c.slot] = plat.record_event(cs)
            last = (cs, c)
        if last is None:
            p.done = plat.record_event(self.kernel_stream)
            return
        cs, c = last                                     # the last chunk is unpacked: all are
        fl.wait(cs, _FREE + c.lane, c.seq)
        p.done = plat.record_event(cs)

    def _post_push_destination(self, plan: _PackPlan, p: Prepared) -> None:
        plat, fl = self.platform, self.flags
        ks = self.kernel_stream
        for c, a, b, nbytes in self._burst_chunks(plan):
            fl.wait(ks, _AVAIL + c.lane, c.seq)
            self._unpack(ks, plan, a, b, c.slot)
            fl.signal(ks, _FREE + c.lane, c.seq, _STAGE + _MAX_LANES)
        p.done = plat.record_event(ks)

    def _post_pull_source(self, plan: _PackPlan, p: Prepared) -> None:
        plat, fl = self.platform, self.flags
        ks = self.kernel_stream
        fl.wait(ks, _GO, self._bursts)                    # nothing runs before the destination starts its timer
        for c, a, b, nbytes in self._burst_chunks(plan):
            self._wait_slot_free(ks, c)                   # the destination copied the slot's previous chunk out
            self._pack(ks, plan, a, b, c.slot)
            fl.signal(ks, _AVAIL + c.lane, c.seq, _STAGE + _MAX_LANES)
        p.done = plat.record_event(ks)

    def _post_pull_destination(self, plan: _PackPlan, p: Prepared) -> None:
        plat, fl = self.platform, self.flags
        ks = self.kernel_stream
        fl.signal(self.copy_streams[0], _GO, self._bursts, _STAGE + _MAX_LANES + 1)
        for c, a, b, nbytes in self._burst_chunks(plan):
            cs = self.copy_streams[c.lane]
            fl.wait(cs, _AVAIL + c.lane, c.seq)           # packed on the source
            busy = self._slot_busy(c)
            if busy is not None:                          # our unpack of the slot's previous chunk is done
                plat.stream_wait_event(cs, busy)
            self._copy_chunk(cs, c.slot, nbytes, pull=True)
            fl.signal(cs, _FREE + c.lane, c.seq, _STAGE + c.lane)
            landed = plat.record_event(cs)
            plat.stream_wait_event(ks, landed)
            self._unpack(ks, plan, a, b, c.slot)
            self._slot_event[c.slot] = plat.record_event(ks)
        p.done = plat.record_event(ks)

    def _release_flag_waits(self) -> None:
        self.flags.release_waits(range(FIRST_WORD, _STAGE))

    def _release(self) -> None:
        self._stage_t = self._pool_t = None
        self.side.forget_release(self._release_flag_waits)
        for r in reversed(getattr(self, "_owned", [])):
            try:
                r.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing
                log.warning("pack engine: closing %r failed: %s", r, exc)
        self._owned = []
