"""The launchers' input checks: pools, descriptor tables, row ranges, offsets and descriptor contents.

Each raises :class:`~gpuxfer.errors.BadInput` naming what is wrong; bounds are
compared in int64 without overflow (``d > dst_len - n``, never ``d + n > dst_len``)
and a whole descriptor range is checked with one host sync (:func:`validate_rows`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import BadInput


def check_pool(pool, name: str, device: torch.device | None = None) -> torch.device:
    """A pool must be a 1-D contiguous uint8 torch tensor (on ``device`` if given)."""
    if not isinstance(pool, torch.Tensor):
        raise BadInput(f"{name} must be a torch.Tensor (platform.as_tensor gives one), got {type(pool).__name__}")
    if pool.dtype != torch.uint8:
        raise BadInput(f"{name} must be a uint8 tensor, got {pool.dtype}")
    if pool.dim() != 1:
        raise BadInput(f"{name} must be one-dimensional, got shape {tuple(pool.shape)}")
    if not pool.is_contiguous():
        raise BadInput(f"{name} must be contiguous")
    if pool.device.type not in ("cuda", "cpu"):
        raise BadInput(f"{name} is on {pool.device}; the kernels run on CUDA devices (or the CPU interpreter)")
    if device is not None and pool.device != torch.device(device):
        raise BadInput(f"{name} is on {pool.device}, expected {torch.device(device)}")
    return pool.device


def check_descriptors(descs, name: str = "descs", device: torch.device | None = None) -> int:
    """A descriptor table must be a contiguous int64 tensor of shape (N, 3); returns N."""
    if not isinstance(descs, torch.Tensor):
        raise BadInput(f"{name} must be an int64 torch.Tensor of shape (N, 3) on the pools' device, "
                       f"got {type(descs).__name__} (use torch.as_tensor(array, device=...))")
    if descs.dtype != torch.int64:
        raise BadInput(f"{name} must be int64, got {descs.dtype}")
    if descs.dim() != 2 or descs.shape[1] != 3:
        raise BadInput(f"{name} must have shape (N, 3), got {tuple(descs.shape)}")
    if not descs.is_contiguous():
        raise BadInput(f"{name} must be contiguous")
    if device is not None and descs.device != torch.device(device):
        raise BadInput(f"{name} is on {descs.device}, but the pools are on {torch.device(device)}")
    return int(descs.shape[0])


def check_int(v, name: str, lo: int, hi: int | None = None) -> int:
    """An int argument (not a bool) in ``[lo, hi]`` (no upper bound where ``hi`` is None), or BadInput naming it."""
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise BadInput(f"{name} must be an int in [{lo}, {'...' if hi is None else hi}], got {v!r}")
    return v


MAX_PROGRAMS = 1 << 20      # the most programs a launcher's grid may have


def check_programs(num_programs) -> None:
    """``num_programs``: None (the launcher's default) or an int in ``[1, MAX_PROGRAMS]``."""
    if num_programs is not None and (isinstance(num_programs, bool) or not isinstance(num_programs, int)
                                     or not 1 <= num_programs <= MAX_PROGRAMS):
        raise BadInput(f"num_programs must be an int in 1..2**20, got {num_programs!r}")


def check_range(start: int, end: int | None, n: int, what: str = "descs") -> tuple[int, int]:
    if end is None:
        end = n
    if isinstance(start, bool) or isinstance(end, bool) or not (isinstance(start, int) and isinstance(end, int)):
        raise BadInput(f"start/end must be ints, got {start!r}, {end!r}")
    if not 0 <= start <= end <= n:
        raise BadInput(f"row range [{start}, {end}) is not inside the {n} rows of {what}")
    return start, end


def check_offsets(offsets, n: int, device: torch.device) -> None:
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64 or offsets.dim() != 1 \
            or not offsets.is_contiguous():
        raise BadInput("offsets must be a contiguous 1-D int64 tensor (pack_offsets(descs) gives one)")
    if offsets.shape[0] != n + 1:
        raise BadInput(f"offsets must have N + 1 = {n + 1} entries (exclusive cumsum of sizes plus the total), "
                       f"got {offsets.shape[0]}")
    if offsets.device != device:
        raise BadInput(f"offsets are on {offsets.device}, but the pools are on {device}")


def check_apart(table: torch.Tensor, name: str, pool: torch.Tensor, pool_name: str) -> None:
    """BadInput where ``table`` (descriptors or offsets the kernel reads as it goes) shares bytes with ``pool``,
    which the launch writes: a row could rewrite rows not read yet, past what validation saw."""
    a, n = table.data_ptr(), table.numel() * table.element_size()
    b, m = pool.data_ptr(), pool.numel() * pool.element_size()
    if n and m and a < b + m and b < a + n:
        raise BadInput(f"{name} lies in {pool_name}, which the launch writes: a row could rewrite rows not read "
                       f"yet; pass a {name} of its own")


def pool_align(*pools: torch.Tensor) -> int:
    a = 16
    for p in pools:
        ptr = p.data_ptr()
        a = min(a, 16 if ptr % 16 == 0 else 4 if ptr % 4 == 0 else 1)
    return a


@dataclass(frozen=True)
class DescriptorStats:
    """What one validation pass learned about a descriptor range."""

    rows: int
    max_nbytes: int
    total_bytes: int
    align: int                # 16, 4 or 1: every offset and size is a multiple of it


def validate_rows(s: torch.Tensor, d: torch.Tensor, n: torch.Tensor, src_len: int | None, dst_len: int,
                   *, first_row: int, src_name: str, dst_name: str, extra_bad: torch.Tensor | None = None,
                   extra_why: str = "") -> DescriptorStats:
    """Vectorised bounds check with a single host sync; raises BadInput naming the first bad row."""
    m = int(n.shape[0])
    if m == 0:
        return DescriptorStats(0, 0, 0, 16)
    bad = (s < 0) | (d < 0) | (n < 0) | (n > dst_len) | (d > dst_len - n)
    if src_len is not None:
        bad |= (n > src_len) | (s > src_len - n)
    if extra_bad is not None:
        bad |= extra_bad
    idx = torch.arange(m, device=n.device, dtype=torch.int64)
    first = torch.where(bad, idx, torch.full_like(idx, m)).min()
    mis = s | d | n
    stats = torch.stack([first, n.max(), n.sum(), ((mis & 15) != 0).any().to(torch.int64),
                         ((mis & 3) != 0).any().to(torch.int64)]).tolist()
    if stats[0] < m:
        i = int(stats[0])
        si, di, ni = (int(x) for x in torch.stack([s[i], d[i], n[i]]).tolist())
        row = first_row + i
        if si < 0 or di < 0 or ni < 0:
            why = "negative offset or size"
        elif src_len is not None and si + ni > src_len:
            why = f"source bytes [{si}, {si + ni}) lie outside {src_name} of {src_len} bytes"
        elif di + ni > dst_len:
            why = f"destination bytes [{di}, {di + ni}) lie outside {dst_name} of {dst_len} bytes"
        else:
            why = extra_why or "inconsistent"
        raise BadInput(f"descriptor {row} (src_offset={si}, dst_offset={di}, nbytes={ni}): {why}")
    align = 16 if not stats[3] else 4 if not stats[4] else 1
    return DescriptorStats(m, int(stats[1]), int(stats[2]), align)


def check_copy(src_pool, dst_pool, descs, *, start: int = 0, end: int | None = None,
               device: torch.device | None = None) -> DescriptorStats:
    """Validate a copy without launching it (one host sync). Raises BadInput."""
    dev = check_pool(src_pool, "src_pool", device)
    check_pool(dst_pool, "dst_pool", dev)
    n = check_descriptors(descs, "descs", dev)
    start, end = check_range(start, end, n)
    check_apart(descs, "descs", dst_pool, "the dst pool")
    t = descs[start:end]
    return validate_rows(t[:, 0], t[:, 1], t[:, 2], src_pool.numel(), dst_pool.numel(), first_row=start,
                          src_name="the src pool", dst_name="the dst pool")


def check_rows(pool, staging, descs, start, end, staging_offset, row_bytes, device, pool_name):
    """The checks of a launcher over rows of one size: the range, and its places inside the staging buffer."""
    dev = check_pool(pool, pool_name, device)
    check_pool(staging, "staging", dev)
    n = check_descriptors(descs, "descs", dev)
    start, end = check_range(start, end, n)
    for name, v, lo in (("staging_offset", staging_offset, 0), ("row_bytes", row_bytes, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise BadInput(f"{name} must be an int >= {lo}, got {v!r}")
    if staging_offset + (end - start) * row_bytes > staging.numel():
        raise BadInput(f"{end - start} rows of {row_bytes} bytes from staging byte {staging_offset} pass the end of "
                       f"the staging buffer ({staging.numel()} bytes)")
    return start, end
