"""The checks a tensor view over raw memory makes (the host emulation's and ROCm's ``as_tensor``): the
dtype, the offset (inside the memory, a multiple of the item size), the shape (integers, none negative,
strides within int64, the bytes inside the memory; CUDA's ``as_tensor`` checks its shape here too)."""
from __future__ import annotations

import math
import operator
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
    shape, count = view_shape(shape, item)
    mem.check_range(int(offset), count, f"a {dt} tensor of shape {shape} at byte offset {offset}")
    return dt, shape, count


_INT64_MAX = (1 << 63) - 1


def view_shape(shape, item: int) -> tuple[tuple[int, ...], int]:
    """A view's shape as a tuple of ints and its bytes, counted in Python integers: BadInput where ``shape`` is not
    a sequence of non-negative integers (a bool or a float is none) or its strides would pass int64 (each empty
    dimension counted as 1: torch computes them even for a view of no element)."""
    try:
        if isinstance(shape, (str, bytes)):
            raise TypeError
        dims = tuple(_dim(s) for s in shape)
    except TypeError:
        raise BadInput(f"shape {shape!r} is not a sequence of integers") from None
    if any(s < 0 for s in dims):
        raise BadInput(f"negative size in shape {dims}")
    if math.prod(max(s, 1) for s in dims) * item > _INT64_MAX:
        raise BadInput(f"shape {dims} of {item}-byte items spans more than 2**63 bytes")
    return dims, math.prod(dims) * item


def _dim(s) -> int:
    """One dimension as an int: any integer type (numpy's, a 0-d integer tensor), never a bool or a float."""
    if isinstance(s, bool):
        raise TypeError
    return operator.index(s)
