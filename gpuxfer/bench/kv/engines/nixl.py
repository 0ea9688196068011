"""NIXL engines: ``nixl``, ``nixl-oneshot`` and ``nixl+pack``.

NIXL (``nixl-cu13`` / ``nixl-cu12`` wheels, UCX backend) is what users take
once KV has to leave the machine: the same calls move GPU memory over UCX's
``cuda_ipc`` inside a node and over RDMA between nodes. These engines measure
it on exactly the descriptors our own engines move.

How it runs (one agent in each of the benchmark's two processes):

* each process creates an agent ``gpuxfer-<role>-<pid>`` and registers its pools
  *once* (``VRAM``; ``DRAM`` on the host emulation, where the pools are shared
  memory);
* agent metadata and pool base addresses are exchanged over the benchmark's
  CPU group, and each side ``add_remote_agent``\\ s the other;
* **pull** (the destination reads) issues ``READ`` from the destination, **push**
  (the source writes) issues ``WRITE`` from the source; the other process only
  keeps its agent alive;
* ``nixl`` takes NIXL's prepared path: both sides' descriptor lists are prepped
  once per descriptor table (``prep_xfer_dlist``, untimed, as a serving system
  preps its block lists at start-up) and each request is
  ``make_prepped_xfer`` + ``transfer`` + polling ``check_xfer_state``;
* ``nixl-oneshot`` takes the one-shot path: each request builds both
  descriptor lists and calls ``initialize_xfer`` (what the CollectiveX suite
  times);
* ``nixl+pack`` packs the pages into a contiguous staging buffer on the source
  with gpuxfer's kernels, moves the staging buffer through NIXL as a few bulk
  descriptors, and unpacks on the destination: a 2 M-descriptor request becomes
  a handful on whatever fabric NIXL reaches.

NIXL's own telemetry (``get_xfer_telemetry``: post and transfer durations, the
descriptor count after merging) is collected when the wheel provides it.

The agent wrapper and the descriptor translation are :mod:`gpuxfer.kv.nixl_ffi`.
Importing this module never imports NIXL nor touches a GPU.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .... import config
from ....errors import BackendUnavailable, BadInput
from ....sync import SPIN_S, wait_event_or_raise
from .base import DescriptorBurst, Engine, Prepared, Role, Side
from .chunks import bulk_descriptors, chunk_plan, split_large
from .launch import bind, device_table, kernel_reason, kernels, sync_uploads
from ....kv.nixl_ffi import (NixlAgent, NixlError, find_nixl, nixl_platform_reason, nixl_unavailable_reason,
                              to_nixl_dlists)

log = logging.getLogger("gpuxfer.kv.nixl")

#: default size of one bulk descriptor of ``nixl+pack`` (the staging buffer is cut into chunks of this)
BULK_CHUNK_BYTES = 256 << 20

OPS = {"pull": "READ", "push": "WRITE"}



@dataclass
class _Batch:
    """One prepared burst of a per-descriptor NIXL engine (initiator side)."""

    op: str
    requests: list = field(default_factory=list)   # per request: what post() needs
    handles: list = field(default_factory=list)    # (xfer handle, state after post, descriptors, bytes)
    dlists: list = field(default_factory=list)


class _NixlEngineBase(Engine):
    """An agent per process, pools registered once, metadata exchanged in the constructor."""

    uses_sms = "none (UCX moves the bytes: cuda_ipc copies inside a node, RDMA between nodes)"

    @classmethod
    def unavailable_reason(cls, platform) -> str | None:
        return nixl_platform_reason(platform) or nixl_unavailable_reason()

    def _extra_registrations(self) -> dict:
        """Register more buffers before the metadata is taken (subclasses); returns what the peer needs."""
        return {}

    def __init__(self, side: Side):
        super().__init__(side)
        self.agent: NixlAgent | None = None
        self.remote: str | None = None
        self.peer: dict = {}
        self._stats: list[dict] = []
        self._recorded: set[int] = set()
        self._current: Any = None
        self.mem_type = "DRAM" if self.platform.host_memory else "VRAM"
        self.nixl_dev = 0 if self.platform.host_memory else side.device
        info: dict = {}
        try:
            mod, why = find_nixl()
            if mod is None:
                raise BackendUnavailable(self.name, {side.rank: why})
            self.platform.set_device(side.device)
            name = f"gpuxfer-{self.name.replace('+', '-')}-{side.role.value}-{os.getpid()}"
            self.agent = NixlAgent(mod, name, mem_type=self.mem_type, rank=side.rank)
            self.agent.register(side.pool.ptr, side.pool.nbytes, self.nixl_dev, "pool")
            info = dict(self._extra_registrations(), pool=int(side.pool.ptr), pool_bytes=int(side.pool.nbytes),
                        dev=self.nixl_dev, md=self.agent.metadata(), module=f"{mod.name} {mod.version}")
        except Exception as exc:  # tell the peer, so both sides fail together instead of one hanging
            info = {"error": f"{type(exc).__name__}: {exc}"}
        self.peer = side.agree(self.name, info, self._release)[side.peer_rank]
        try:
            self.remote = self.agent.add_remote(self.peer["md"])
            try:
                self.agent.connect(self.remote)
            except NixlError as exc:  # optional: the first transfer connects otherwise
                log.info("%s: make_connection failed (%s); connecting on first use", self.name, exc)
        except BaseException:
            self._release()
            raise

    # -- addresses of both pools in their owners' address spaces
    def _bases(self, what: str = "pool") -> tuple[int, int, int, int]:
        """(src_base, dst_base, src_dev, dst_dev) of ``what`` (``pool`` or ``stage``)."""
        mine, theirs = int(getattr(self, "_own_" + what)), int(self.peer[what])
        if self.side.role is Role.SOURCE:
            return mine, theirs, self.nixl_dev, int(self.peer["dev"])
        return theirs, mine, int(self.peer["dev"]), self.nixl_dev

    @property
    def _own_pool(self) -> int:
        return self.side.pool.ptr

    def _pool_limits(self) -> tuple[int, int]:
        """(source pool bytes, destination pool bytes), from this side's pool and what the peer said:
        the peer's pool need not be mapped here (across nodes it cannot be)."""
        mine, theirs = int(self.side.pool.nbytes), int(self.peer["pool_bytes"])
        return (mine, theirs) if self.side.role is Role.SOURCE else (theirs, mine)

    def _rows(self, desc: np.ndarray, op: str, what: str = "pool", nbytes: tuple | None = None):
        src_base, dst_base, src_dev, dst_dev = self._bases(what)
        return to_nixl_dlists(desc, op, src_base=src_base, dst_base=dst_base, src_dev=src_dev, dst_dev=dst_dev,
                              src_nbytes=None if nbytes is None else nbytes[0],
                              dst_nbytes=None if nbytes is None else nbytes[1])

    def _what(self, p: Prepared) -> str:
        return f"{self.name} {OPS[p.direction]} of {p.burst.batch} request(s), {p.burst.descriptors} descriptors"

    def _burst_stats(self, handles) -> None:
        """Record NIXL's telemetry of one completed burst (a list of ``(handle, state, descs, bytes)``), once."""
        if not handles or id(handles[0][0]) in self._recorded:
            return
        self._recorded.add(id(handles[0][0]))
        stats = [self.agent.stats(h, n, b) for h, _state, n, b in handles]
        if not stats:
            return
        post = [s.post_us for s in stats if s.post_us is not None]
        xfer = [s.xfer_us for s in stats if s.xfer_us is not None]
        merged = [s.merged_descriptors for s in stats if s.merged_descriptors is not None]
        self._stats.append({
            "backend": stats[0].backend, "transfers": len(stats),
            "post_us": float(sum(post)) if post else None,          # host time posting, summed
            "xfer_us": float(max(xfer)) if xfer else None,          # the transfers overlap: the longest
            "merged": int(sum(merged)) if merged else None,
        })

    def _finish(self, handles) -> None:
        """Telemetry of a completed burst, then release its handles (errors logged; close() retries)."""
        if not handles or self.agent is None or self.agent.closed:
            return
        try:
            if all(self.agent.state(h) == "DONE" for h, *_ in handles):
                self._burst_stats(handles)
        finally:
            self._recorded.discard(id(handles[0][0]))
            errors = self.agent.release_quietly([h for h, *_ in handles])
            if errors:
                log.warning("%s: releasing a burst's transfers: %s", self.name, "; ".join(errors))

    def _current_handles(self) -> list:
        """The last burst's transfers, still held (released at the next post or at release)."""
        return []

    def row_extra(self) -> dict:
        """NIXL's own telemetry over the row's bursts so far, warm-ups included (empty when the wheel gives none).

        ``nixl_post_us_p50``: host time NIXL spent posting a burst (summed over its transfers);
        ``nixl_xfer_us_p50``: NIXL's transfer time of a burst (the longest of its transfers);
        ``nixl_descriptors_after_merge``: what NIXL actually posted after merging adjacent descriptors.
        """
        if self.agent is None or self.agent.closed:
            return {}
        last = self._current_handles()
        if last and all(self.agent.state(h) == "DONE" for h, *_ in last):
            self._burst_stats(last)
        if not self._stats:
            return {}

        def p50(key):
            v = [s[key] for s in self._stats if s[key] is not None]
            return float(np.median(v)) if v else None
        last = self._stats[-1]
        return {"nixl_module": f"{self.agent.nixl.name} {self.agent.nixl.version}",
                "nixl_backend": last["backend"], "nixl_transfers_per_burst": last["transfers"],
                "nixl_bursts": len(self._stats), "nixl_post_us_p50": p50("post_us"),
                "nixl_xfer_us_p50": p50("xfer_us"), "nixl_descriptors_after_merge": last["merged"]}

    def _release(self) -> None:
        if self.agent is not None:
            self.agent.close()


class NixlEngine(_NixlEngineBase):
    name = "nixl"
    description = ("NIXL (UCX) prepped path: both sides' descriptor lists prepped once per table "
                   "(prep_xfer_dlist, untimed); per request make_prepped_xfer + transfer; READ pulls, WRITE pushes")

    def shed_reason(self, burst: DescriptorBurst) -> str | None:
        cap = config.get("GPUXFER_NIXL_MAX_DESCS")
        if burst.descriptors > cap:
            return (f"{self.name} is capped at {cap} descriptors per burst (this burst has {burst.descriptors}; "
                    f"at ~8 us per descriptor it would take ~{burst.descriptors * 8e-6:.0f} s); "
                    f"set GPUXFER_NIXL_MAX_DESCS to measure it")
        return None

    def prepare(self, burst: DescriptorBurst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction)
        if not p.active:
            return p
        self._stats = []
        op = OPS[direction]
        reqs = [r for r in burst.requests if r.shape[0]]
        b = _Batch(op)
        self._current = b
        if reqs:
            cat = np.concatenate(reqs) if len(reqs) > 1 else reqs[0]
            local, remote = self._rows(cat, op)
            lh = self.agent.prep(None, local)
            b.dlists.append(lh)
            rh = self.agent.prep(self.remote, remote)
            b.dlists.append(rh)
            start = 0
            for r in reqs:
                idx = np.arange(start, start + r.shape[0], dtype=np.int32)
                b.requests.append((lh, idx, rh, int(r[:, 2].sum())))
                start += r.shape[0]
        p.state = b
        return p

    def _current_handles(self) -> list:
        return self._current.handles if isinstance(self._current, _Batch) else []

    def post(self, p: Prepared) -> None:
        if not p.active:
            return
        b: _Batch = p.state
        what = self._what(p)
        prev, b.handles = b.handles, []
        for lh, idx, rh, nbytes in b.requests:
            h = self.agent.make_prepped(b.op, lh, idx, rh, idx)
            b.handles.append((h, self.agent.post(h, what), len(idx), nbytes))
        self._finish(prev)   # the previous burst's handles, released while this one is on the wire

    def wait(self, p: Prepared) -> None:
        if not p.active:
            return
        what = self._what(p)
        for h, state, _n, _b in p.state.handles:
            self.agent.wait(h, what, timeout_s=self.side.timeout_s, state=state)

    def release(self, p: Prepared) -> None:
        b: _Batch | None = p.state
        if b is not None and self.agent is not None and not self.agent.closed:
            try:
                self._finish(b.handles)
            finally:
                errors = self.agent.release_quietly((), b.dlists)
                b.handles, b.dlists = [], []
                if errors:
                    log.warning("%s: releasing prepped lists: %s", self.name, "; ".join(errors))
        super().release(p)


class NixlOneshotEngine(NixlEngine):
    name = "nixl-oneshot"
    description = ("NIXL (UCX) one-shot path: per request both descriptor lists are built and "
                   "initialize_xfer + transfer is called (what the CollectiveX suite times)")

    def prepare(self, burst: DescriptorBurst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction)
        if not p.active:
            return p
        self._stats = []
        b = _Batch(OPS[direction])
        self._current = b
        for r in burst.requests:
            if r.shape[0]:
                local, remote = self._rows(r, b.op)
                b.requests.append((local, remote, int(r[:, 2].sum())))
        p.state = b
        return p

    def post(self, p: Prepared) -> None:
        if not p.active:
            return
        b: _Batch = p.state
        what = self._what(p)
        prev, b.handles = b.handles, []
        for local, remote, nbytes in b.requests:
            h = self.agent.oneshot(b.op, local, remote, self.remote)
            b.handles.append((h, self.agent.post(h, what), len(local), nbytes))
        self._finish(prev)   # the previous burst's handles, released while this one is on the wire


class NixlBulkEngine(NixlEngine):
    name = "nixl-bulk"
    ceiling_across_hosts = True
    description = ("NIXL's own ceiling: the burst's total bytes as a few bulk descriptors pool to pool "
                   "(READ pulls, WRITE pushes); across nodes, where the copy-engine bulk cannot run, the ceiling")

    def shed_reason(self, burst) -> str | None:
        return None

    def prepare(self, burst: DescriptorBurst, direction: str) -> Prepared:
        burst.check_bounds(*self._pool_limits())     # the burst's own descriptors, before its size is used
        n = burst.nbytes
        src_bytes, dst_bytes = self._pool_limits()
        if n > min(src_bytes, dst_bytes):
            raise BadInput(f"{self.name}: the burst's {n} bytes do not fit the pools ({src_bytes}, {dst_bytes} B)")
        bulk = DescriptorBurst([bulk_descriptors(n, BULK_CHUNK_BYTES)]) if n else burst
        p = super().prepare(bulk, direction)
        p.burst = burst
        return p

    def verify_descriptors(self, burst: DescriptorBurst) -> np.ndarray:
        return bulk_descriptors(burst.nbytes, self.options.verify_chunk_bytes)


@dataclass
class _PackState:
    rounds: list            # (start, stop, nbytes) into the split table
    tables: list            # per round: this side's kernel table on the device
    dlists: list            # initiator: per round (local prepped, remote prepped, indices)
    tag: int = 0            # burst number (both sides count alike)
    pending: Any = None     # push source: the event of round 0's pack, launched by post()
    done: list = field(default_factory=list)   # initiator: this burst's completed NIXL transfers
    hint: int = 2304        # typical descriptor size (picks the kernel's tiling)


class NixlPackEngine(_NixlEngineBase):
    name = "nixl+pack"
    description = ("pack the pages into a staging buffer on the source (gpuxfer kernel), move the staging "
                   "buffer through NIXL as a few bulk descriptors (READ pulls, WRITE pushes), unpack on the "
                   "destination; rounds of at most the staging size")
    uses_sms = "both GPUs, local HBM only (pack, unpack); UCX moves the bytes"

    @classmethod
    def unavailable_reason(cls, platform) -> str | None:
        return super().unavailable_reason(platform) or kernel_reason(platform)

    def _extra_registrations(self) -> dict:
        want = min(self.side.pool.nbytes, config.get("GPUXFER_NIXL_PACK_STAGE_BYTES"))
        self.stage = self.platform.alloc(want, self.side.device)
        self.agent.register(self.stage.ptr, self.stage.nbytes, self.nixl_dev, "stage")
        return {"stage": int(self.stage.ptr), "stage_bytes": int(self.stage.nbytes)}

    @property
    def _own_stage(self) -> int:
        return self.stage.ptr

    def __init__(self, side: Side):
        self.stage = None
        super().__init__(side)
        self.round_bytes = min(self.stage.nbytes, int(self.peer["stage_bytes"]))
        self.kernel_stream = self.platform.create_stream(side.device)
        self._stage_t = None
        self._pool_t = None
        self._bursts = 0

    def _views(self):
        if self._stage_t is None:
            self._stage_t = self.platform.as_tensor(self.stage, shape=(self.round_bytes,))
            self._pool_t = self.platform.as_tensor(self.side.pool)
        return self._stage_t, self._pool_t

    def prepare(self, burst: DescriptorBurst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction, active=True)   # both sides work
        self._stats = []
        d = split_large(burst.concatenated(), self.round_bytes)
        rounds = chunk_plan(d, self.round_bytes, self.round_bytes) if d.shape[0] else []
        packed = np.empty(d.shape[0], dtype=np.int64)
        for a, b, _ in rounds:
            n = d[a:b, 2]
            packed[a:b] = np.cumsum(n) - n
        if self.side.role is Role.SOURCE:        # pack: pool -> staging
            table = np.stack([d[:, 0], packed, d[:, 2]], axis=1)
        else:                                     # unpack: staging -> pool
            table = np.stack([packed, d[:, 1], d[:, 2]], axis=1)
        stage_t, pool_t = self._views()
        dev_table = device_table(pool_t, table)
        sync_uploads(self.platform, self.side.device, self.side.timeout_s, self.side.rank)
        tables = [dev_table[a:b] for a, b, _ in rounds]
        k = kernels()
        for t in tables:                      # every row inside the pool and the staging (one host sync each)
            src, dst = (pool_t, stage_t) if self.side.role is Role.SOURCE else (stage_t, pool_t)
            k.check_copy(src, dst, t)
        hint = int(d[:, 2].max()) if d.shape[0] else 1
        dlists = []
        if p.initiator:
            op = OPS[direction]
            for _a, _b, nbytes in rounds:
                local, remote = self._rows(bulk_descriptors(nbytes, BULK_CHUNK_BYTES), op, "stage")
                lh = self.agent.prep(None, local)
                rh = self.agent.prep(self.remote, remote)
                dlists.append((lh, rh, np.arange(len(local), dtype=np.int32)))
        p.state = self._current = _PackState(rounds, tables, dlists, hint=hint)
        return p

    def _current_handles(self) -> list:
        return self._current.done if isinstance(self._current, _PackState) else []

    def _launch(self, st: "_PackState", r: int, *, pack: bool):
        stage_t, pool_t = self._views()
        src, dst = (pool_t, stage_t) if pack else (stage_t, pool_t)
        self.platform.launch(self.kernel_stream, bind(kernels().copy_descriptors, src, dst, st.tables[r],
                                                       validate=False, nbytes_hint=st.hint))
        return self.platform.record_event(self.kernel_stream)

    def _sync(self, event, what: str, step: int) -> None:
        wait_event_or_raise(self.platform, event, self.side.timeout_s, rank=self.side.rank, what=what, step=step,
                            spin_s=SPIN_S)

    def _tag(self, kind: str, n: int, r: int) -> bytes:
        return f"gpuxfer:{kind}:{n}:{r}".encode()

    def post(self, p: Prepared) -> None:
        st: _PackState = p.state
        self._bursts += 1
        st.tag = self._bursts
        prev, st.done = st.done, []
        if not st.rounds:
            return
        if p.direction == "pull" and p.initiator:      # destination: start the source's packing
            self.agent.notify(self.remote, self._tag("go", st.tag, 0))
        elif p.direction == "push" and p.initiator:    # source: pack round 0 now
            st.pending = self._launch(st, 0, pack=True)
        self._finish(prev)                             # the previous burst's transfers

    def wait(self, p: Prepared) -> None:
        st: _PackState = p.state
        if not st.rounds:
            return
        source = self.side.role is Role.SOURCE
        if p.direction == "push":
            (self._push_source if source else self._push_destination)(st)
        else:
            (self._pull_source if source else self._pull_destination)(st)

    def _xfer(self, st: _PackState, r: int, op: str, notif: bytes) -> None:
        lh, rh, idx = st.dlists[r]
        h = self.agent.make_prepped(op, lh, idx, rh, idx, notif)
        try:
            self.agent.run(h, f"{self.name} {op} of round {r} ({st.rounds[r][2]} B)",
                           timeout_s=self.side.timeout_s, step=st.tag)
            st.done.append((h, "DONE", len(idx), st.rounds[r][2]))
        except BaseException:
            self.agent.release_quietly([h])
            raise

    def _notif(self, kind: str, st: _PackState, r: int) -> None:
        self.agent.wait_notif(self.remote, self._tag(kind, st.tag, r), timeout_s=self.side.timeout_s, step=st.tag)

    # push: the source packs, WRITEs (the notification rides on the write), the destination unpacks
    def _push_source(self, st: _PackState) -> None:
        for r in range(len(st.rounds)):
            if r:
                self._notif("unpacked", st, r - 1)               # the destination's staging is free again
                st.pending = self._launch(st, r, pack=True)
            self._sync(st.pending, f"{self.name}: pack of round {r}", st.tag)
            self._xfer(st, r, "WRITE", self._tag("written", st.tag, r))
        self._notif("unpacked", st, len(st.rounds) - 1)          # landed in the destination's pool

    def _push_destination(self, st: _PackState) -> None:
        for r in range(len(st.rounds)):
            self._notif("written", st, r)
            self._sync(self._launch(st, r, pack=False), f"{self.name}: unpack of round {r}", st.tag)
            self.agent.notify(self.remote, self._tag("unpacked", st.tag, r))

    # pull: the destination says go, the source packs and says packed, the destination READs and unpacks
    def _pull_source(self, st: _PackState) -> None:
        self._notif("go", st, 0)
        for r in range(len(st.rounds)):
            if r:
                self._notif("read", st, r - 1)                   # our staging has been read
            self._sync(self._launch(st, r, pack=True), f"{self.name}: pack of round {r}", st.tag)
            self.agent.notify(self.remote, self._tag("packed", st.tag, r))
        self._notif("read", st, len(st.rounds) - 1)

    def _pull_destination(self, st: _PackState) -> None:
        for r in range(len(st.rounds)):
            self._notif("packed", st, r)
            self._xfer(st, r, "READ", self._tag("read", st.tag, r))
            self._sync(self._launch(st, r, pack=False), f"{self.name}: unpack of round {r}", st.tag)

    def release(self, p: Prepared) -> None:
        st: _PackState | None = p.state
        if st is not None and self.agent is not None and not self.agent.closed:
            self._finish(st.done)
            st.done = []
            errors = self.agent.release_quietly((), [h for lh, rh, _ in st.dlists for h in (lh, rh)])
            st.dlists.clear()
            if errors:
                log.warning("%s: releasing a burst: %s", self.name, "; ".join(errors))
        super().release(p)

    def _release(self) -> None:
        self._stage_t = self._pool_t = None
        try:
            super()._release()     # the agent deregisters the staging buffer before it is freed
        finally:
            if getattr(self, "kernel_stream", None) is not None:
                self.kernel_stream.close()
            if getattr(self, "stage", None) is not None:
                self.stage.close()
