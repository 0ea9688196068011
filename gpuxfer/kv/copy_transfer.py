"""The ``copy_engine`` engine's transfers: descriptors expanded on the host once per request
(:func:`expand_on_host`), posted as batched copy-engine copies (:class:`_CopyEngineTransfer`)."""
from __future__ import annotations

import numpy as np

from ..platforms.base import Stream
from .transfer import KVTransfer, KVTransferHandle


def expand_on_host(table: np.ndarray, request: np.ndarray, n_groups: int) -> np.ndarray:
    """The expansion kernel's descriptors computed with NumPy, one vector operation per plane (for engines
    whose driver API takes host arrays). ``request`` must be well formed (:meth:`KVAgent.prepare` builds it)."""
    P = table.shape[0]
    head = P + 1
    n_rows = int(request[P])
    out = np.zeros((n_rows, 3), dtype=np.int64)
    for p in range(P):
        sb, ss, db, ds, seg, g, rs, rd, _, _ = (int(v) for v in table[p])
        row0, n = int(request[p]), int(request[head + g])
        if n == 0:
            continue
        soff, doff = int(request[head + n_groups + g]), int(request[head + 2 * n_groups + g])
        j = np.arange(n, dtype=np.int64)
        out[row0:row0 + n, 0] = sb + request[soff + j // rs] * ss + (j % rs) * seg
        out[row0:row0 + n, 1] = db + request[doff + j // rd] * ds + (j % rd) * seg
        out[row0:row0 + n, 2] = seg
    return out


class _CopyEngineTransfer(KVTransfer):
    """The ``copy_engine`` engine: one-sided, no SM. ``cuMemcpyBatchAsync`` takes host arrays of addresses,
    so the descriptors are expanded on the host once, at :meth:`KVAgent.prepare` (the per-request setup:
    one NumPy operation per plane); a post is the batch calls (8,192 copies each) and an event."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        r = self.route
        d = expand_on_host(r.table, self._host_req.numpy(), len(r.groups))
        self._srcs = np.ascontiguousarray(d[:, 0] + np.int64(r.src_base))
        self._dsts = np.ascontiguousarray(d[:, 1] + np.int64(r.dst_base))
        self._sizes = np.ascontiguousarray(d[:, 2])

    def post(self, stream: Stream | None = None) -> KVTransferHandle:
        poster = self.poster
        s = poster.stream(stream)
        with poster.lock:                  # remove_peer and close exclude it: checked under it
            poster.check_usable(self.peer)
            if self._sizes.size:
                self.agent.platform.copy_batch_async(s, self._dsts, self._srcs, self._sizes)
            value, event = self._finish(s)
            poster.track(event, (self,), s)
        return KVTransferHandle(self, event, s, value)

    def expanded_descriptors(self) -> np.ndarray:
        r = self.route
        return np.stack([self._srcs - r.src_base, self._dsts - r.dst_base, self._sizes],
                        axis=1)
