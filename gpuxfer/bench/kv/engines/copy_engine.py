"""Engines on the copy engines alone, no SM: ``copy_engine`` and ``bulk``.

* ``copy_engine-table`` -- ``copy_batch_async`` (``cuMemcpyBatchAsync`` on CUDA) over a burst's descriptor
  tables, handed in per burst, on a created stream; a fixed cost per descriptor. (The default ``copy_engine``
  row runs the same copies through KVAgent: :class:`~gpuxfer.bench.kv.engines.kvagent.AgentCopyEngine`.) Capped
  per burst (``EngineOptions.copy_engine_max_descs``, :func:`copy_engine_cap_reason`); bigger bursts are
  shed, with the reason. Never armed: its bursts hold more commands than a blocked stream's queue takes,
  so it posts inside the timed region.
* ``bulk`` -- one descriptor of the same total bytes on the copy engines: the ceiling every row is divided by.
"""
from __future__ import annotations

import numpy as np

from ....errors import BadInput
from .base import BurstShape, DescriptorBurst, Engine, Prepared
from .chunks import bulk_descriptors


def copy_engine_cap_reason(name: str, cap: int, shape: BurstShape) -> str | None:
    """Why an engine posting one copy-engine copy per descriptor does not run a burst of ``shape`` (past
    ``cap`` descriptors), or None."""
    if shape.descriptors > cap:
        return (f"{name} is capped at {cap:,} descriptors per burst (this burst has {shape.descriptors:,}; "
                f"at ~1 us per descriptor it would take ~{shape.descriptors * 1e-6:.1f} s); raise "
                f"--copy-engine-max-descs to measure it")
    return None


class CopyEngineEngine(Engine):
    name = "copy_engine-table"
    needs_peer_mapping = True
    # Not armed: a burst is up to 140k copies, far more commands than a stream's queue holds while it
    # is blocked on the gate -- the host would block enqueueing, before the trigger. Its posting is
    # timed (host mode), which is also what a copy-engine connector pays.
    armable = False
    description = ("copy_batch_async (cuMemcpyBatchAsync) over the burst's descriptor tables, handed in per "
                   "burst, on a created stream; no SM, a fixed cost per descriptor")
    uses_sms = "none"

    def shed_reason(self, shape: BurstShape) -> str | None:
        return copy_engine_cap_reason(self.name, self.options.copy_engine_max_descs, shape)

    def prepare(self, burst: DescriptorBurst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction)
        if not p.active:
            return p
        d = burst.concatenated()
        srcs = d[:, 0] + np.int64(self.side.src_mem.ptr)
        dsts = d[:, 1] + np.int64(self.side.dst_mem.ptr)
        sizes = np.ascontiguousarray(d[:, 2])
        step = self.options.copy_batch_descs
        p.state = [(np.ascontiguousarray(dsts[i:i + step]), np.ascontiguousarray(srcs[i:i + step]),
                    sizes[i:i + step]) for i in range(0, len(sizes), step)]
        return p

    def _enqueue(self, p: Prepared) -> None:
        for dsts, srcs, sizes in p.state:
            self.platform.copy_batch_async(self.stream, dsts, srcs, sizes)
        p.done = self.platform.record_event(self.stream)


class BulkEngine(Engine):
    name = "bulk"
    needs_peer_mapping = True
    armable = True
    description = "one copy-engine descriptor of the burst's total bytes: the ceiling"
    uses_sms = "none"
    ceiling = True

    def prepare(self, burst: DescriptorBurst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction)
        n = burst.nbytes                  # every size is checked positive and at most a pool's
        limit = min(self.side.src_mem.nbytes, self.side.dst_mem.nbytes)
        if n > limit:
            raise BadInput(f"bulk: the burst's {n} bytes do not fit the {limit}-byte pools")
        p.state = n
        return p

    def _enqueue(self, p: Prepared) -> None:
        self.platform.copy_async(self.stream, self.side.dst_mem.ptr, self.side.src_mem.ptr, p.state)
        p.done = self.platform.record_event(self.stream)

    def verify_descriptors(self, burst: DescriptorBurst) -> np.ndarray:
        return bulk_descriptors(burst.nbytes, self.options.verify_chunk_bytes)
