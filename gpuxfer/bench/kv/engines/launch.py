"""What the kernel-launching engines share: the Triton launchers (imported when first used), descriptor
tables uploaded to a device, and why the kernels cannot run here (the runtime's
:func:`~gpuxfer.kv.engine_choice.kernel_reason`).

Importing this module never imports torch or Triton.
"""
from __future__ import annotations

import numpy as np

from ....errors import TransferTimeout
from ....kv.engine_choice import kernel_reason  # noqa: F401 - the engines take it from here
from ....platforms.base import Platform


def kernels():
    """The Triton launchers (:mod:`gpuxfer.kernels`), imported lazily: importing the engines never imports Triton."""
    from .... import kernels as launchers
    return launchers


def device_table(like, table: np.ndarray):
    """``table`` as an int64 torch tensor on the device of the torch tensor ``like``."""
    import torch
    a = np.ascontiguousarray(table, dtype=np.int64)
    t = torch.from_numpy(a if a.flags.writeable else a.copy())     # torch wants writable memory
    if like.device.type == "cpu":
        return t.clone()
    return t.to(like.device)


def sync_uploads(platform: Platform, device: int, timeout_s: float, rank: int) -> None:
    """Uploads went through torch's current stream: finish them before other streams use the tables."""
    if platform.host_memory:
        return      # CPU tensors: torch copied them synchronously
    if not platform.synchronize(platform.current_stream(device), timeout_s):
        raise TransferTimeout(rank=rank, step=0, flag="upload of descriptor tables", expected=1, seen=0,
                              timeout_s=timeout_s)


def bind(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` as a no-argument call named after ``fn`` (what ``platform.launch`` runs)."""
    def call():
        return fn(*args, **kwargs)
    call.__name__ = getattr(fn, "__name__", "kernel")
    return call
