"""How :class:`~gpuxfer.kv.agent.KVAgent` turns a checked request into its request array (a header and the block
IDs, as :mod:`gpuxfer.kernels.block_kernel` lays it out) in a pooled host array, and the transfer of the peer's
engine around it (``pack``: with its chunks, kept with the request's shape): :class:`RequestStaging`."""
from __future__ import annotations

import itertools
import operator

import numpy as np

from ..errors import BadInput
from .copy_transfer import _CopyEngineTransfer
from .ids import request_fingerprint
from .layers import _torch
from .pack_transfer import PackState, _PackTransfer
from .routes import _Route
from .triton_transfer import _SlotTransfer
from .transfer import KVTransfer

#: a request's chunks: at least this many bytes each (where the slot holds them), growing past it so a request
#: takes at most about PACK_MAX_CHUNKS of them -- a graph's launch costs the host time per node, so a post's
#: host time stays near that of a request of PACK_MAX_CHUNKS chunks, while small requests keep small chunks
#: (a short pipeline fill)
PACK_CHUNK_BYTES = 32 << 20
PACK_MAX_CHUNKS = 16


class RequestStaging:
    """An agent's request arrays (and the transfer around each), after :meth:`~gpuxfer.kv.agent.KVAgent.prepare`
    checked the IDs: in host arrays of ``poster``'s pool (:class:`~gpuxfer.kv.posting.Poster`, which the
    transfers post with); ``pack``: the agent's :class:`~gpuxfer.kv.pack_transfer.PackState`."""

    def __init__(self, poster, pack: PackState):
        self.poster, self.pack = poster, pack

    def stage(self, peer, route: _Route, op, name, checked, notify_slot) -> KVTransfer:
        """The request array (header + block IDs, as :mod:`gpuxfer.kernels.block_kernel` lays it out) in a host
        array, and the transfer of the peer's engine (``peer.engine``) around it. ``checked``: the IDs
        (:meth:`_RouteIds.check <gpuxfer.kv.ids._RouteIds.check>`)."""
        n_seg, lens_s, lens_d, ordered = checked
        P, G = route.plane_group.size, len(n_seg)
        head = P + 1 + 3 * G
        if G == 1:
            n = n_seg[0]
            mid = head + lens_s[0]
            total = mid + lens_d[0]
            nbytes = n * route.group_bytes[0]
        else:
            starts = list(itertools.accumulate(lens_s + lens_d, initial=head))
            mid, total = starts[G], starts[-1]
            nbytes = sum(map(operator.mul, n_seg, route.group_bytes))
        engine = peer.engine
        # a pack request ends with its fingerprint, at an even entry (16-byte aligned: a kernel's argument)
        at = total + (total & 1)
        if engine != "copy_engine":
            host, h = self.poster.requests.take(at + 1 if engine == "pack" else total, self.poster.reap_locked)
        else:
            h = np.empty(total, dtype=np.int64)
            host = _torch().from_numpy(h)
        if G == 1:          # every plane's rows are the group's segments: plane p's rows start at p * n
            np.multiply(route.plane_rows, n, out=h[:P + 1])
            h[P + 1], h[P + 2], h[P + 3] = n, head, mid
            n_rows = n * P
        else:
            h[0] = 0
            h[P + 1:head] = n_seg + starts[:-1]
            h[P + 1:P + 1 + G][route.plane_group].cumsum(out=h[1:P + 1])
            n_rows = int(h[P])
        route.ids.write(ordered, h[head:mid], h[mid:total])
        if engine == "pack":
            h[total:at] = 0
            h[at] = request_fingerprint(h[head:total], lens_s + lens_d, route.salts)
        if engine == "triton":
            return _SlotTransfer(self.poster, peer, route, op, name, n_seg, host, h, notify_slot, n_rows, nbytes)
        if engine == "copy_engine":
            return _CopyEngineTransfer(self.poster, peer, route, op, name, n_seg, host, notify_slot, n_rows, nbytes)
        return self._stage_pack(peer, route, op, name, n_seg, host, h, notify_slot, n_rows, nbytes)

    def _stage_pack(self, peer, route: _Route, op, name, n_seg, host, array, notify_slot, n_rows, nbytes
                    ) -> KVTransfer:
        """The pack engine's transfer: its chunks -- those of its shape where the shape was seen before (the
        device buffers and kernels belong to the shape, :class:`_PackShape`, shared by every request of it)."""
        key = (id(route), op == "push", tuple(n_seg))
        shape = self.pack.shapes.get(key)
        chunks = shape.spec if shape is not None else self._pack_chunks(route, name, array, nbytes)
        return _PackTransfer(self.poster, peer, route, op, name, n_seg, host[0], notify_slot, n_rows, nbytes,
                             pack=self.pack, chunks=chunks, pooled=host, entries=int(array.shape[0]), shape_key=key,
                             fingerprint=int(array[-1]))

    def _pack_chunks(self, route: _Route, name: str, array: np.ndarray, nbytes: int) -> list[tuple]:
        """A request's chunks: ``(first row, end row, bytes, segment bytes)``, rows of one segment size each,
        about ``nbytes / PACK_MAX_CHUNKS`` (at least ``PACK_CHUNK_BYTES``, at most a staging slot) each."""
        chunks = []
        row_start = array[:len(route.plane_group) + 1]
        slot = self.poster.agent.slot_bytes
        target = min(slot, max(min(PACK_CHUNK_BYTES, slot), -(-nbytes // PACK_MAX_CHUNKS)))
        for a, b, c in route.classes:
            r0, r1 = int(row_start[a]), int(row_start[b])
            if r1 <= r0:
                continue
            if c > slot:
                raise BadInput(f"request {name!r}: {c}-byte segments do not fit the pack engine's "
                               f"{slot}-byte staging slots")
            per = max(target // c, 1)
            chunks += [(x, min(x + per, r1), (min(x + per, r1) - x) * c, c) for x in range(r0, r1, per)]
        return chunks
