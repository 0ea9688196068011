"""The ``nccl`` backend: torch.distributed ``isend``/``irecv`` on a device group.

On CUDA the device group is NCCL; on the host emulation it is gloo on CPU
tensors (a two-rank group of the pair's own, unless ``device_group`` was given),
so CI runs the same code.

Sender: a ring of two send buffers, each sized to the largest packed step. A
step packs the caller's tensors into ring slot ``k % 2`` on the current stream
(so the next forward may overwrite its outputs at once), then ``isend``s the
packed bytes. A send is waited only when its slot comes round again (on CUDA a
stream wait, not a CPU wait).

Receiver: ``recv()`` posts an ``irecv`` into a fresh buffer from torch's
allocator (nothing waits); the first ``.tensors`` access waits the work
(``work.wait()``: on CUDA the current stream waits for NCCL's) and returns
views of the packed buffer (or copies into ``out=`` tensors). The receiver owns
no persistent device memory.

Timeouts: on CUDA the watchdog polls ``work.is_completed()``; on gloo (whose
works complete only inside ``wait``) every wait is bounded by ``timeout_s``.
"""
from __future__ import annotations

import logging
import time
from datetime import timedelta

from ..errors import PeerLost, TransferTimeout
from .spec import as_bytes, copy_bytes, Layout
from .transport import Received, Transport

log = logging.getLogger("gpuxfer.pp")


class NcclTransport(Transport):
    name = "nccl"

    def __init__(self, *, device_group, data_tag: int, **kw):
        super().__init__(**kw)
        import torch
        self.device_group, self.data_tag = device_group, data_tag
        self._gloo = not self.torch_device.type == "cuda"   # works complete only inside wait()
        self._ring: list = []
        self._works: list = [None, None]
        self._views: dict = {}
        self._last_recv = None
        self._pair: tuple | None = None     # (a two-rank gloo group of the pair's own, the peer's rank in it)
        if self.role == "send":
            n = self.specs.slot_bytes
            self._ring = [torch.empty(n, dtype=torch.uint8, device=self.torch_device) for _ in range(2)]
        self._state = "open"

    @property
    def wants_pair_group(self) -> bool:
        """On the host emulation with the CPU group as device group: data goes through a group of the
        pair's own instead (a gloo wait that times out closes the pair it waited on)."""
        return self._gloo and self.device_group is self.group

    def use_pair_group(self, pg, peer_rank: int) -> None:
        self._pair = (pg, peer_rank)

    def _isend(self, buf):
        import torch.distributed as dist
        if self._pair is not None:
            return self._pair[0].send([buf], self._pair[1], self.data_tag)
        return dist.isend(buf, dst=self.peer, group=self.device_group, tag=self.data_tag)

    def _irecv(self, buf):
        import torch.distributed as dist
        if self._pair is not None:
            return self._pair[0].recv([buf], self._pair[1], self.data_tag)
        return dist.irecv(buf, src=self.peer, group=self.device_group, tag=self.data_tag)

    # ---- send ----
    def _pack_views(self, s: int, layout: Layout) -> list:
        key = (s, layout.shapes)
        views = self._views.get(key)
        if views is None:
            slot = self._ring[s]
            views = [slot[o:o + n].view(b) for o, n, b in zip(layout.offsets, layout.nbytes, layout.bshapes)]
            if len(self._views) > 1024:
                self._views.clear()
            self._views[key] = views
        return views

    def _wait_work(self, work, *, step: int, flag: str, what: str) -> None:
        if self._gloo:
            t0 = time.monotonic()
            try:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                elapsed = time.monotonic() - t0
                if elapsed < 0.9 * self.timeout_s:    # gloo saw the connection close: not a timeout
                    raise PeerLost(rank=self.rank, peer=self.peer, step=step, flag=flag, after_s=elapsed,
                                   detail=f"nccl {what} ({exc})") from None
                raise self._timeout(step=step, flag=flag, expected=step, seen=None,
                                    what=f"{what} ({exc})") from None
        else:
            work.wait()

    def _send_impl(self, step: int, tensors, layout: Layout) -> None:
        s = step & 1
        prev = self._works[s]
        if prev is not None:
            self._wait_work(prev[1], step=prev[0], flag="nccl send", what=f"send to rank {self.peer}")
            self._works[s] = None
        if layout.total == 0:
            return
        copy_bytes(self._pack_views(s, layout), [as_bytes(tensors[n]) for n in self.specs.names])
        work = self._isend(self._ring[s][:layout.total])
        self._works[s] = (step, work)
        if not self._gloo:
            self._wd.append((step, work, time.monotonic(), "nccl send"))

    # ---- receive ----
    def _recv_impl(self, rcv: Received) -> None:
        import torch
        total = rcv.layout.total
        buf = torch.empty(rcv.layout.buffer_bytes, dtype=torch.uint8, device=self.torch_device)
        work = None
        if total:
            work = self._irecv(buf[:total])
            if not self._gloo:
                self._wd.append((rcv.step, work, time.monotonic(), "nccl recv"))
        rcv._state = (buf, work)

    def _materialize_impl(self, rcv: Received) -> None:
        buf, work = rcv._state
        if work is not None:
            self._wait_work(work, step=rcv.step, flag="nccl recv", what=f"receive from rank {self.peer}")
        lay, specs = rcv.layout, self.specs
        views = specs.views(buf, lay)
        if rcv.out is not None:
            res, dsts, srcs = {}, [], []
            for (name, v), o, n in zip(views.items(), lay.offsets, lay.nbytes):
                flat = rcv.out[name].view(-1)[:v.numel()]
                res[name] = flat.view(v.shape)
                dsts.append(as_bytes(flat))       # 1-D bytes on both sides
                srcs.append(buf[o:o + n])
            copy_bytes(dsts, srcs)
            views = res
        rcv._state = None
        self._last_recv = None if self._gloo else work    # a gloo work is complete once waited
        rcv._tensors = views

    # ---- watchdog and teardown ----
    def _wait_label(self, entry) -> str:
        return f"{entry[3]} of step {entry[0]}"

    def _watch(self, now: float, force: bool = False):
        wd = self._wd
        while wd and wd[0][1].is_completed():
            wd.popleft()
        if wd and (force or now - wd[0][2] > self.timeout_s):
            step, _work, t0, flag = wd[0]
            return TransferTimeout(rank=self.rank, step=step, flag=flag, expected=step, seen=None,
                                   timeout_s=self.timeout_s,
                                   what=f"nccl {'send to' if self.role == 'send' else 'receive from'} rank "
                                        f"{self.peer}: not completed after {now - t0:.1f} s")
        return None

    def _drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        works = [w[1] for w in self._works if w is not None]
        if self._last_recv is not None:
            works.append(self._last_recv)
        for w in works:
            if self._gloo:
                try:
                    w.wait(timeout=timedelta(seconds=max(0.05, deadline - time.monotonic())))
                except RuntimeError:
                    return False
            else:
                delay = 1e-4
                while not w.is_completed():
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(delay)
                    delay = min(delay * 2, 0.01)
        self._works = [None, None]
        self._last_recv = None
        return True

    def _release_waits(self) -> None:
        if self._gloo:
            return
        try:  # a pending NCCL kernel cannot be released otherwise
            from torch.distributed.distributed_c10d import _abort_process_group
            _abort_process_group(self.device_group)
        except Exception as exc:  # noqa: BLE001 - best effort
            log.debug("abort of the NCCL group: %s", exc)

    def _close_mappings(self) -> None:
        pass

    def _free(self) -> None:
        self._pair = None
        self._views.clear()
        self._ring = []
        self._works = [None, None]

    def _allocated(self) -> int:
        return sum(t.numel() for t in self._ring)
