"""The ``pack`` engine: pack on the source, one copy-engine copy per chunk, unpack on the destination.

Pack the pages into a staging buffer on the source (a local kernel at HBM speed), one copy-engine
transfer per chunk into the destination's staging buffer (opened over IPC), unpack on the destination.
Chunked and pipelined across three streams in two processes: chunk *k* packs while *k-1* is on the
wire and *k-2* unpacks. Cross-process hand-offs are 64-bit stream flags, written by a remote stream
write where a set-up probe saw one arrive, else by an 8-byte copy-engine copy (``_FlagLink``); a slot
is reused only once the peer says it is free. No SM touches the wire.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ...errors import BackendUnavailable, BadInput, TransferTimeout
from ...platforms.base import RELEASE_VALUE, Event, Platform, Stream
from ...sync import flag_path_from_env, wait_flag_or_raise
from .base import DescriptorBurst, Engine, Prepared, Role, Side
from .chunks import chunk_plan, split_large
from .launch import bind, device_table, kernel_reason, kernels, sync_uploads

log = logging.getLogger("gpuxfer.kv.engines")


_GO = 0            # on the source: burst number the destination asked for (pull)
_AVAIL = 8         # on the destination: per lane, chunks available (push: landed; pull: packed)
_FREE = 24         # on the source: per lane, chunks released (push: unpacked; pull: copied out)
_SCRATCH = 40      # on either side: the value a flag copy sends: lanes 0..7, kernel stream 8, GO 9
_PROBE = 56        # on either side: the peer's set-up remote write lands here
_CTRL_WORDS = 64
_PROBE_VALUE = 0x5EED_F1A6
_PROBE_TIMEOUT_S = 10.0
ENV_KV_FLAG_PATH = "GPUXFER_KV_FLAG_PATH"
_MAX_LANES = 8


class _FlagLink:
    """A few 64-bit flags in each process's memory, written by the peer; every wait is on local memory.

    A signal reaches the peer's flag by a remote stream write where a set-up
    probe saw one arrive (no copy engine: the signal cannot queue behind
    another stream's chunk copy), else by ``write_flag`` on a local scratch word
    followed, on the same stream, by an 8-byte copy-engine copy of it (CUDA
    13.1+ refuses remote stream writes). ``GPUXFER_KV_FLAG_PATH=remote|copy``
    forces one path; ``path`` says which one this side uses.
    """

    def __init__(self, side: Side):
        want = flag_path_from_env(None, ENV_KV_FLAG_PATH)      # bad input fails here, on both sides alike
        self.side = side
        plat = side.platform
        self.local = plat.alloc(_CTRL_WORDS * 8, side.device)
        self.peer = None
        self.remote = False
        try:
            s = side.stream("setup")
            plat.memset_async(s, self.local.ptr, 0, _CTRL_WORDS * 8)
            if not plat.synchronize(s, side.timeout_s):
                raise TransferTimeout(rank=side.rank, step=0, flag="pack control words (memset)", expected=1,
                                      seen=0, timeout_s=side.timeout_s)
            handles = side.exchange(self.local.export())
            self.peer = plat.open_handle(handles[side.peer_rank], side.device)
            self.remote = self._probe_remote(want)
        except BaseException:
            self.close()
            raise
        side._releasers.append(self.release_waits)     # a failing side releases our waits too

    @property
    def path(self) -> str:
        return "remote stream writes" if self.remote else "8-byte copies"

    def _probe_remote(self, want: str) -> bool:
        """Whether this side's remote stream writes reach the peer: each side writes ``_PROBE_VALUE`` into
        the peer's probe word and reports it sent; each polls its own word and reports it seen."""
        side, plat = self.side, self.side.platform
        sent, why = False, f"{ENV_KV_FLAG_PATH}=copy"
        if want != "copy":
            try:
                s = side.stream("setup")
                plat.write_flag(s, self.peer.ptr + 8 * _PROBE, _PROBE_VALUE)
                if not plat.synchronize(s, _PROBE_TIMEOUT_S):
                    raise TransferTimeout(rank=side.rank, step=0, flag="pack flag probe (remote write)",
                                          expected=_PROBE_VALUE, seen=None, timeout_s=_PROBE_TIMEOUT_S)
                sent = True
            except Exception as exc:  # noqa: BLE001 - the remote path is optional: the probe says so
                why = f"{type(exc).__name__}: {exc}"
                side.discard_stream("setup")        # a failed stream op may leave the stream unusable
        seen = False
        if side.exchange(sent)[side.peer_rank]:
            try:    # a write the sender saw complete lands in microseconds
                seen = wait_flag_or_raise(plat, self.word(_PROBE), _PROBE_VALUE, 2.0, rank=side.rank, step=0,
                                          flag="pack flag probe", device=side.device) == _PROBE_VALUE
            except TransferTimeout:
                pass
        reports = side.exchange((seen, None if sent else why))    # rank r: (saw its peer's write, why not sent)
        remote = reports[side.peer_rank][0]
        if want == "remote" and not all(saw for saw, _ in reports):    # every side raises, with every reason
            raise BackendUnavailable("pack", {
                1 - r: f"{ENV_KV_FLAG_PATH}=remote, but its remote stream write did not reach rank {r}"
                       + (f" ({reports[1 - r][1]})" if reports[1 - r][1] else "")
                for r, (saw, _) in enumerate(reports) if not saw})
        if not remote:
            log.info("pack engine, rank %d: flags go to rank %d by 8-byte copies (%s)", side.rank,
                     side.peer_rank, why if not sent else "the peer did not see the remote write")
        return remote

    def word(self, index: int) -> int:
        return self.local.ptr + 8 * index

    def signal(self, stream: Stream, scratch: int, peer_index: int, value: int) -> None:
        """Make the peer's word ``peer_index`` hold ``value`` once earlier work on ``stream`` is done
        (``scratch``: this stream's own staging word on the copy path)."""
        plat = self.side.platform
        if self.remote:
            plat.write_flag(stream, self.peer.ptr + 8 * peer_index, value)
        else:
            plat.write_flag(stream, self.word(_SCRATCH + scratch), value)
            plat.copy_async(stream, self.peer.ptr + 8 * peer_index, self.word(_SCRATCH + scratch), 8)

    def wait(self, stream: Stream, index: int, value: int) -> None:
        if value > 0:
            self.side.platform.wait_flag(stream, self.word(index), value)

    def read(self, index: int) -> int:
        return self.side.platform.read_flag(self.word(index), self.side.device)

    def release_waits(self) -> None:
        """Abort: satisfy every local wait, so no stream of ours stays blocked."""
        for i in range(_SCRATCH):
            try:
                self.side.platform.host_write_flag(self.word(i), RELEASE_VALUE, self.side.device)
            except Exception:  # noqa: BLE001 - best effort on the abort path
                pass

    def close(self) -> None:
        if self.release_waits in self.side._releasers:
            self.side._releasers.remove(self.release_waits)
        for m in (getattr(self, "peer", None), self.local):
            if m is not None:
                m.close()


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
    name = "pack"
    needs_peer_mapping = True
    launches_kernels = True
    armable = True
    description = ("pack on the source, one copy-engine copy per chunk into the destination's staging, unpack "
                   "on the destination; chunked and pipelined, SMs only on local memory")
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
            self.flags = _FlagLink(side)
            self._owned.append(self.flags)
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
            fl.signal(cs, c.lane, _AVAIL + c.lane, c.seq)
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
            fl.signal(ks, _MAX_LANES, _FREE + c.lane, c.seq)
        p.done = plat.record_event(ks)

    def _post_pull_source(self, plan: _PackPlan, p: Prepared) -> None:
        plat, fl = self.platform, self.flags
        ks = self.kernel_stream
        fl.wait(ks, _GO, self._bursts)                    # nothing runs before the destination starts its timer
        for c, a, b, nbytes in self._burst_chunks(plan):
            self._wait_slot_free(ks, c)                   # the destination copied the slot's previous chunk out
            self._pack(ks, plan, a, b, c.slot)
            fl.signal(ks, _MAX_LANES, _AVAIL + c.lane, c.seq)
        p.done = plat.record_event(ks)

    def _post_pull_destination(self, plan: _PackPlan, p: Prepared) -> None:
        plat, fl = self.platform, self.flags
        ks = self.kernel_stream
        fl.signal(self.copy_streams[0], _MAX_LANES + 1, _GO, self._bursts)
        for c, a, b, nbytes in self._burst_chunks(plan):
            cs = self.copy_streams[c.lane]
            fl.wait(cs, _AVAIL + c.lane, c.seq)           # packed on the source
            busy = self._slot_busy(c)
            if busy is not None:                          # our unpack of the slot's previous chunk is done
                plat.stream_wait_event(cs, busy)
            self._copy_chunk(cs, c.slot, nbytes, pull=True)
            fl.signal(cs, c.lane, _FREE + c.lane, c.seq)
            landed = plat.record_event(cs)
            plat.stream_wait_event(ks, landed)
            self._unpack(ks, plan, a, b, c.slot)
            self._slot_event[c.slot] = plat.record_event(ks)
        p.done = plat.record_event(ks)

    def _release(self) -> None:
        self._stage_t = self._pool_t = None
        for r in reversed(getattr(self, "_owned", [])):
            try:
                r.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing
                log.warning("pack engine: closing %r failed: %s", r, exc)
        self._owned = []
