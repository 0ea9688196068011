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
from .verdict_kernel import verdict_kernel

__all__ = ["PLANE_FIELDS", "EXPAND_BLOCK", "default_programs_per_plane", "expand_blocks", "expand_launcher",
           "request_header_len", "verdict_launcher"]

EXPAND_BLOCK = 1024           # segments per chunk (one loop step of a program)
_MAX_GRID_Y = 65535           # CUDA's limit on the second grid dimension
_INT64_MAX = (1 << 63) - 1
_MAX_BLOCK = 1 << 20          # Triton's most elements in one block (a tl.arange)


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
                  max_segments: int | None = None, programs_per_plane: int | None = None,
                  block: int = EXPAND_BLOCK) -> None:
    """Launch now (see :func:`expand_launcher`)."""
    launch = expand_launcher(planes, request, out, n_groups=n_groups, max_segments=max_segments,
                             programs_per_plane=programs_per_plane, block=block)
    if launch is not None:
        launch()


def default_programs_per_plane(device, n_planes: int) -> int:
    """The grid's second dimension when the request is not known: about eight programs per SM in all (one
    on the CPU interpreter); each loops over its plane's chunks."""
    device = torch.device(device)
    if device.type == "cpu" or n_planes < 1:
        return 1
    from .tiling import sm_count
    return max(1, min(_MAX_GRID_Y, -(-8 * sm_count(device) // n_planes)))


def expand_launcher(planes: torch.Tensor, request: torch.Tensor, out: torch.Tensor, *, n_groups: int,
                    max_segments: int | None = None, programs_per_plane: int | None = None,
                    block: int = EXPAND_BLOCK):
    """A function of no arguments (or of a driver stream handle) that writes the descriptors of the request
    in ``request`` over the ``planes`` layout into ``out`` (``(N, 3)`` int64) on torch's current stream (or
    that stream); None when there is nothing to expand. The checks run here, once: the launch reads
    everything request-dependent from ``request`` on the device, so one launcher serves every request
    written there whose rows fit ``out`` (a launcher for a buffer reused by request after request).

    ``planes``: ``(P, PLANE_FIELDS)``; ``request``: 1-D, laid out as the kernel module says;
    ``n_groups``: G. The grid is ``(P, programs_per_plane)``; by default ``ceil(max_segments / block)``
    when ``max_segments`` (the most segments of any group) is given -- 0 means nothing to expand --,
    else :func:`default_programs_per_plane`. Rows of ``out`` no plane covers are left as they are.
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
    block = _int(block, "block", 1)
    if block & (block - 1) or block > _MAX_BLOCK:
        raise BadInput(f"block must be a power of two <= {_MAX_BLOCK} (a Triton block's elements), got {block}")
    n_planes = int(planes.shape[0])
    need = request_header_len(n_planes, n_groups)
    if request.shape[0] < need:
        raise BadInput(f"request holds {request.shape[0]} entries; {n_planes} planes and {n_groups} groups need "
                       f"at least {need} before the block IDs")
    if out.shape[0] > _INT64_MAX // 3:
        raise BadInput(f"out has {out.shape[0]} rows: row offsets would overflow int64")
    if programs_per_plane is None:
        if max_segments is None:
            programs_per_plane = default_programs_per_plane(dev, n_planes)
        else:
            programs_per_plane = -(-_int(max_segments, "max_segments") // block)
    programs_per_plane = _int(programs_per_plane, "programs_per_plane")
    if programs_per_plane > _MAX_GRID_Y:
        raise BadInput(f"{programs_per_plane} programs per plane exceed the grid's limit {_MAX_GRID_Y}")
    if n_planes == 0 or programs_per_plane == 0 or out.shape[0] == 0:
        return None
    return expand_kernel.launcher(dev, (n_planes, programs_per_plane), planes, request, out, n_planes, n_groups,
                                  int(request.shape[0]), int(out.shape[0]), BLOCK=block, num_warps=4)


VERDICT_BLOCK = 256           # descriptor rows (and signal values) per program of the verdict kernel


def verdict_launcher(word: torch.Tensor, fp: torch.Tensor, status: torch.Tensor, sig: torch.Tensor, n_sig: int,
                     out: torch.Tensor | None, n_rows: int, *, equal: bool, refused: int, only_refused: bool = False):
    """A function of no arguments (or of a driver stream handle) launching :mod:`~gpuxfer.kernels.verdict_kernel`
    with fixed arguments: ``word`` (the flag word the peer wrote), ``fp`` (this side's fingerprint), ``status``
    (2 entries), ``sig`` (at least ``n_sig`` entries), ``out`` (``(N, 3)`` descriptors, ``n_rows <= N`` of them
    zeroed on a refusal; None: none), all int64 on one device; ``equal``: refused when the word differs from
    the fingerprint, else when it is ``refused`` or more; ``only_refused``: ``sig`` is written only when refused."""
    dev = sig.device
    n_sig, n_rows = _int(n_sig, "n_sig"), _int(n_rows, "n_rows")
    if isinstance(refused, bool) or not isinstance(refused, int) or not -(1 << 63) <= refused <= _INT64_MAX:
        raise BadInput(f"refused must be an int64, got {refused!r}")
    for name, t, n in (("word", word, 1), ("fp", fp, 1), ("status", status, 2), ("sig", sig, max(n_sig, 1))):
        _tensor(t, name, 1, dev)
        if t.shape[0] < n:
            raise BadInput(f"{name} holds {t.shape[0]} entries, needs {n}")
    if out is None:
        if n_rows:
            raise BadInput("n_rows descriptor rows without out")
        out = sig
    elif _tensor(out, "out", 2, dev).shape[1] != 3 or out.shape[0] < n_rows:
        raise BadInput(f"out must have shape (N >= {n_rows}, 3), got {tuple(out.shape)}")
    grid = (max(1, -(-n_rows // VERDICT_BLOCK)),)
    return verdict_kernel.launcher(dev, grid, word, fp, sig, n_sig, status, out, n_rows, EQUAL=bool(equal),
                                   REFUSED=refused, BLOCK=VERDICT_BLOCK, ONLY_REFUSED=bool(only_refused),
                                   num_warps=4)


CHECK_BLOCK = 1024            # IDs per chunk of the device ID check (one loop step of a program)
CHECK_PROGRAMS = 32           # programs per group of the check by default (each loops over its chunks)


def check_ids_launchers(request: torch.Tensor, gtab: torch.Tensor, marks: torch.Tensor, *, n_planes: int,
                        n_groups: int, programs_per_group: int | None = None):
    """The two launches of a request whose block IDs are checked on the device
    (:mod:`gpuxfer.kernels.id_check_kernel`): ``(check, settle)``, each a function of no arguments (or of a
    driver stream handle), or None when the route has no group. Checked here, once: ``request`` (int64),
    ``gtab`` (``(G, 3)`` int64), ``marks`` (int32 bitmap), one device."""
    from .id_check_kernel import (CHECK_FIELDS_FIXED, CHECK_FIELDS_PER_GROUP, GROUP_TABLE_FIELDS, check_ids_kernel,
                                  settle_ids_kernel)
    request = _tensor(request, "request", 1)
    dev = request.device
    gtab = _tensor(gtab, "gtab", 2, dev)
    if not isinstance(marks, torch.Tensor) or marks.dtype != torch.int32 or marks.dim() != 1 \
            or not marks.is_contiguous() or marks.device != dev:
        raise BadInput(f"marks must be a contiguous 1-D int32 tensor on {dev}")
    n_planes, n_groups = _int(n_planes, "n_planes"), _int(n_groups, "n_groups")
    if tuple(gtab.shape) != (n_groups, GROUP_TABLE_FIELDS):
        raise BadInput(f"gtab must have shape ({n_groups}, {GROUP_TABLE_FIELDS}), got {tuple(gtab.shape)}")
    head = request_header_len(n_planes, n_groups)
    need = head + CHECK_FIELDS_FIXED + CHECK_FIELDS_PER_GROUP * n_groups
    if request.shape[0] < need:
        raise BadInput(f"request holds {request.shape[0]} entries; the header and check fields need {need}")
    if n_groups == 0:
        return None
    if programs_per_group is None:
        programs_per_group = 1 if dev.type == "cpu" else min(CHECK_PROGRAMS, default_programs_per_plane(dev, n_groups))
    programs_per_group = _int(programs_per_group, "programs_per_group", 1)
    if programs_per_group > _MAX_GRID_Y:
        raise BadInput(f"{programs_per_group} programs per group exceed the grid's limit {_MAX_GRID_Y}")
    grid = (n_groups, programs_per_group)
    req_len, n_words = int(request.shape[0]), int(marks.shape[0])
    check = check_ids_kernel.launcher(dev, grid, request, gtab, marks, n_groups, head, req_len, n_words,
                                      BLOCK=CHECK_BLOCK, num_warps=4)
    settle = settle_ids_kernel.launcher(dev, grid, request, gtab, marks, n_groups, head, req_len, n_words,
                                        n_planes + 1 + n_groups, BLOCK=CHECK_BLOCK, num_warps=4)
    return check, settle
