"""Launcher of the block-descriptor expansion kernel (:mod:`gpuxfer.kernels.block_kernel`).

:func:`expand_blocks` turns a transfer's block IDs into ``(src_offset, dst_offset,
nbytes)`` copy descriptors on the device, enqueued on torch's current stream, with
no host sync: the host work per transfer is this launch and the upload of the
request array. The launcher checks dtypes, shapes, devices and sizes (int64 ranges,
the grid limits); the kernel keeps every access in bounds whatever the arrays hold.
"""
from __future__ import annotations

import torch

from ..errors import BadInput
from .block_kernel import PLANE_FIELDS, expand_kernel

__all__ = ["PLANE_FIELDS", "EXPAND_BLOCK", "expand_blocks", "expand_launcher", "request_header_len"]

EXPAND_BLOCK = 1024           # segments per program
_MAX_GRID_Y = 65535           # CUDA's limit on the second grid dimension
_INT64_MAX = (1 << 63) - 1


def request_header_len(n_planes: int, n_groups: int) -> int:
    """Entries before the block IDs in a request array: ``n_planes + 1 + 3 * n_groups``."""
    return n_planes + 1 + 3 * n_groups


def _int(value, name: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= _INT64_MAX:
        raise BadInput(f"{name} must be an int in [{lo}, 2**63), got {value!r}")
    return value


def _tensor(t, name: str, ndim: int, device=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise BadInput(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int64 or t.dim() != ndim or not t.is_contiguous():
        raise BadInput(f"{name} must be a contiguous {ndim}-D int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise BadInput(f"{name} is on {t.device}, the planes on {device}")
    return t


def expand_blocks(planes: torch.Tensor, request: torch.Tensor, out: torch.Tensor, *, n_groups: int,
                  max_segments: int) -> None:
    """Launch now (see :func:`expand_launcher`)."""
    launch = expand_launcher(planes, request, out, n_groups=n_groups, max_segments=max_segments)
    if launch is not None:
        launch()


def expand_launcher(planes: torch.Tensor, request: torch.Tensor, out: torch.Tensor, *, n_groups: int,
                    max_segments: int):
    """A function of no arguments that writes the descriptors of ``request`` over the ``planes`` layout into
    ``out`` (``(N, 3)`` int64) on torch's current stream; None when there is nothing to expand. The checks
    run here, once: a transfer posted again and again only launches.

    ``planes``: ``(P, PLANE_FIELDS)``; ``request``: 1-D, laid out as the kernel module says;
    ``n_groups``: G; ``max_segments``: the most segments of any group in the request (sizes the
    grid: segments past it are not expanded). Rows of ``out`` no plane covers are left as they are.
    """
    planes = _tensor(planes, "planes", 2)
    dev = planes.device
    request = _tensor(request, "request", 1, dev)
    out = _tensor(out, "out", 2, dev)
    if planes.shape[1] != PLANE_FIELDS:
        raise BadInput(f"planes must have {PLANE_FIELDS} fields per row, got shape {tuple(planes.shape)}")
    if out.shape[1] != 3:
        raise BadInput(f"out must have shape (N, 3), got {tuple(out.shape)}")
    if dev.type not in ("cuda", "cpu"):
        raise BadInput(f"the expansion runs on CUDA devices (or the CPU interpreter), not {dev}")
    n_groups = _int(n_groups, "n_groups")
    max_segments = _int(max_segments, "max_segments")
    n_planes = int(planes.shape[0])
    need = request_header_len(n_planes, n_groups)
    if request.shape[0] < need:
        raise BadInput(f"request holds {request.shape[0]} entries; {n_planes} planes and {n_groups} groups need "
                       f"at least {need} before the block IDs")
    if out.shape[0] > _INT64_MAX // 3:
        raise BadInput(f"out has {out.shape[0]} rows: row offsets would overflow int64")
    chunks = -(-max_segments // EXPAND_BLOCK)
    if chunks > _MAX_GRID_Y:
        raise BadInput(f"{max_segments} segments per group exceed the kernel's grid "
                       f"({_MAX_GRID_Y} x {EXPAND_BLOCK})")
    if n_planes == 0 or chunks == 0 or out.shape[0] == 0:
        return None
    return expand_kernel.launcher(dev, (n_planes, chunks), planes, request, out, n_planes, n_groups,
                                  int(request.shape[0]), int(out.shape[0]), BLOCK=EXPAND_BLOCK, num_warps=4)
