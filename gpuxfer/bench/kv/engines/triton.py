"""The ``triton-table`` engine: the descriptor-copy kernel on the initiating GPU, over a burst's descriptor
tables uploaded per burst. (The default ``triton`` row runs KVAgent's, by block ID:
:class:`~gpuxfer.bench.kv.engines.kvagent.AgentTritonEngine`.)

Pull runs on the decode GPU reading the peer pool through the IPC mapping, push on the prefill GPU
writing it; SMs of the initiating GPU, none of the other. One launch per descriptor size, so each
size gets its own tiling.
"""
from __future__ import annotations

import numpy as np

from .... import config
from ....platforms.base import Platform
from .base import DescriptorBurst, Engine, Prepared, Side
from .launch import bind, device_table, kernel_reason, kernels, sync_uploads


class TritonEngine(Engine):
    name = "triton-table"
    needs_peer_mapping = True
    launches_kernels = True
    armable = True
    description = ("descriptor tables uploaded per burst: the descriptor-copy Triton kernel on the initiating GPU "
                   "(pull reads the peer pool, push writes it)")
    uses_sms = "initiating GPU"

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        return kernel_reason(platform)

    def __init__(self, side: Side):
        super().__init__(side)
        self._src_t = None
        self._dst_t = None

    def _views(self):
        if self._src_t is None:
            self._src_t = self.platform.as_tensor(self.side.src_mem)
            self._dst_t = self.platform.as_tensor(self.side.dst_mem)
        return self._src_t, self._dst_t

    def prepare(self, burst: DescriptorBurst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction)
        if not p.active:
            return p
        src_t, dst_t = self._views()
        k = kernels()
        tables = []
        for rows in size_classes(burst.concatenated(), order_column(direction)):
            t = device_table(src_t, rows)
            hint = int(rows[0, 2])
            # whole row groups per program (see PackEngine._programs): no column slicing
            cfg = k.choose_config(hint)
            progs = max(1, min(k.default_programs(src_t.device, cfg), -(-rows.shape[0] // cfg.rows)))
            tables.append((t, hint, progs))
        sync_uploads(self.platform, self.side.device, self.side.timeout_s, self.side.rank)
        for t, _, _ in tables:       # every descriptor inside both pools (one host sync each; prep time)
            k.check_copy(src_t, dst_t, t)
        p.state = tables
        return p

    def _enqueue(self, p: Prepared) -> None:
        src_t, dst_t = self._views()
        copy = kernels().copy_descriptors
        for desc_t, hint, progs in p.state:
            self.platform.launch(self.stream, bind(copy, src_t, dst_t, desc_t, validate=False, nbytes_hint=hint,
                                                    num_programs=progs))
        p.done = self.platform.record_event(self.stream)

    def _release(self) -> None:
        self._src_t = self._dst_t = None


def order_column(direction: str) -> int | None:
    """The descriptor column the triton engine sorts by (0 = source offsets, 1 = destination), or None."""
    order = config.get("GPUXFER_KV_TRITON_ORDER")
    if order == "plan":
        return None
    peer = 0 if direction == "pull" else 1       # pull reads the peer's source pool; push writes its destination
    return peer if order == "peer" else 1 - peer


def size_classes(plan: np.ndarray, sort_col: int | None = None) -> list[np.ndarray]:
    """A burst's descriptors split by size, one table per size.

    A request mixes sizes (kv-dsv4 at 16-token pages: 2,304 B compressed entries, 528 B indexer
    entries, 9,216 B window pages); one launch per size lets the kernel pick the tiling for
    that size instead of tiling every descriptor for the largest. Within a class descriptors
    keep their order, or are sorted by column ``sort_col`` (the peer pool's offsets), so that
    programs running at the same time touch neighbouring pages of the peer pool rather than
    pages scattered over all of it. Order does not matter: the descriptors of a burst never
    overlap on the destination.
    """
    if plan.shape[0] == 0:
        return []
    sizes = plan[:, 2]
    order = np.argsort(sizes, kind="stable")
    sorted_sizes = sizes[order]
    cuts = np.flatnonzero(np.diff(sorted_sizes)) + 1
    classes = [plan[idx] for idx in np.split(order, cuts)]
    if sort_col is not None:
        classes = [c[np.argsort(c[:, sort_col], kind="stable")] for c in classes]
    return classes
