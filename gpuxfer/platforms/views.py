"""The checks a tensor view over raw memory makes (the host emulation's and ROCm's ``as_tensor``): the
dtype, the offset (inside the memory, a multiple of the item size), the shape (no negative size, the bytes
inside the memory)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import BadInput
from .base import Memory


def torch_dtype(dtype):
    """A torch dtype from ``None`` (uint8), a ``torch.dtype`` or its name; else :class:`BadInput`."""
    import torch
    if dtype is None:
        return torch.uint8
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise BadInput(f"not a torch dtype: {dtype!r}")


def tensor_view_params(mem: Memory, dtype, shape: Sequence[int] | None, offset: int):
    """Validate an ``as_tensor`` request: returns (torch dtype, shape, bytes)."""
    import torch
    dt = torch_dtype(dtype)
    item = torch.empty((), dtype=dt).element_size()
    if not isinstance(offset, (int, np.integer)) or offset < 0 or offset > mem.nbytes:
        raise BadInput(f"offset {offset!r} lies outside {mem!r}")
    if offset % item:
        raise BadInput(f"offset {offset} is not a multiple of the {dt} item size ({item} bytes)")
    if shape is None:
        shape = ((mem.nbytes - int(offset)) // item,)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise BadInput(f"negative size in shape {shape}")
    count = int(np.prod(shape, dtype=np.int64)) * item
    mem.check_range(int(offset), count, f"a {dt} tensor of shape {shape} at byte offset {offset}")
    return dt, shape, count
