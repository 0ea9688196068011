"""The plain ``torch.distributed`` baseline of ``gpuxfer bench pp`` (``--backend nccl-plain``): what a
skeptic would write, with every wait bounded."""
from __future__ import annotations

from . import PLAIN


class _PlainP2P:
    """Plain ``torch.distributed`` point-to-point, the baseline a skeptic would write: ``isend`` of each of
    the step's tensors (waited on at the next step, which on NCCL makes the stream wait, not the host) and,
    per step, ``torch.empty`` + ``irecv`` of each (as vLLM's ``irecv_tensor_dict`` does). No gpuxfer code
    on the path; both directions through one object."""

    name = PLAIN

    def __init__(self, group, peer: int, specs: dict, tdev, timeout_s: float):
        import torch.distributed as dist
        self.group, self.peer, self.tdev = group, peer, tdev
        self.names = sorted(specs)
        self.dtypes = {k: specs[k][1] for k in self.names}
        self._sent: list = []
        self._bound = _WorkBound(dist.get_rank(), dist.get_backend(group) == "gloo", timeout_s)
        self._sends = self._recvs = 0

    def send(self, tensors: dict) -> None:
        import torch.distributed as dist
        self._bound.wait(self._sent, self._sends, "isend")
        self._sends += 1
        self._sent = [dist.isend(tensors[k], dst=self.peer, group=self.group) for k in self.names]

    def recv(self, shapes: dict):
        import torch
        import torch.distributed as dist
        self._recvs += 1
        bufs = {k: torch.empty(shapes[k], dtype=self.dtypes[k], device=self.tdev) for k in self.names}
        works = [dist.irecv(bufs[k], src=self.peer, group=self.group) for k in self.names]
        return _PlainReceived(bufs, works, self._bound, self._recvs)

    def synchronize(self) -> None:
        self._bound.wait(self._sent, self._sends, "isend")
        self._sent = []

    # the Connection-shaped surface the loops use
    @property
    def transports(self) -> list:
        return [self]

    def sender(self):
        return self

    def receiver(self):
        return self

    def close(self) -> None:
        self.synchronize()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _PlainReceived:
    def __init__(self, bufs: dict, works: list, bound: "_WorkBound", step: int):
        self._bufs, self._works, self._bound, self._step = bufs, works, bound, step

    @property
    def tensors(self) -> dict:
        self._bound.wait(self._works, self._step, "irecv")
        self._works = []
        return self._bufs


class _WorkBound:
    """Waits on ``torch.distributed`` works. On gloo the host blocks, so each wait is bounded by ``timeout_s``
    (:class:`~gpuxfer.errors.TransferTimeout`). On NCCL ``wait()`` makes the current stream wait and returns;
    a timeout would make the host block until the work completes and change what the baseline times, so none
    is given there: the bounded device synchronize of the loop catches a hang."""

    def __init__(self, rank: int, gloo: bool, timeout_s: float):
        self.rank, self.gloo, self.timeout_s = rank, gloo, float(timeout_s)

    def wait(self, works: list, step: int, what: str) -> None:
        from datetime import timedelta

        from ...errors import TransferTimeout
        for w in works:
            if not self.gloo:
                w.wait()
                continue
            try:
                w.wait(timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                raise TransferTimeout(rank=self.rank, step=step, flag=what, expected=step, seen=None,
                                      timeout_s=self.timeout_s, what=f"plain torch.distributed {what} ({exc})") from None
