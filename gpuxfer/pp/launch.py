"""The gloo CPU group :func:`gpuxfer.pp.connect` exchanges handles over, for processes started
by :func:`gpuxfer.spawn.run_ranks` (a file rendezvous) or by ``torchrun`` (``env://``).
"""
from __future__ import annotations

import datetime

from ..sync import check_timeout


def init_cpu_group(rank: int, world: int, init_method: str, timeout_s: float = 120.0) -> None:
    """Initialise torch.distributed with gloo (the CPU group connect() uses). ``timeout_s``: the group's
    bound on each collective, a finite number of seconds (:func:`gpuxfer.sync.check_timeout`: else BadInput)."""
    timeout_s = check_timeout(timeout_s, "init_cpu_group's timeout_s")
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))


def close_cpu_group() -> None:
    """Stop the transports' watchdog, then leave the group (before the interpreter goes: see
    :meth:`gpuxfer.pp.watchdog._Watchdog.stop`). Idempotent; never raises."""
    try:
        import torch.distributed as dist

        from .watchdog import WATCHDOG
        WATCHDOG.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown
        pass
