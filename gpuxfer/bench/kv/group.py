"""The two benchmark ranks' CPU group (gloo: gathers and barriers, with the group timeout) and what tells
their machines apart."""
from __future__ import annotations

import datetime as _dt


def _boot_id() -> str | None:
    """This kernel's boot id (Linux): two ranks with different ones are on different machines even when
    their hostnames agree (e.g. both ``localhost``). None where unreadable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


class _Group:
    """The gloo CPU group of the two ranks: gathers and barriers, with the group timeout."""

    def __init__(self, rank: int, init_method: str, timeout_s: float):
        import torch.distributed as dist
        self.dist = dist
        self.rank = rank
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                                timeout=_dt.timedelta(seconds=timeout_s))

    def gather(self, obj) -> list:
        out = [None, None]
        self.dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        try:
            if self.dist.is_initialized():
                self.dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown
            pass
