"""Launchers for the kernels: validate, pick a configuration, launch.

Every launcher enqueues its kernel on **torch's current stream of the pools'
device** and returns without waiting (wrap a call in ``torch.cuda.stream(s)`` or
in ``platform.launch(stream, fn)`` to order it elsewhere). Two exceptions, both
documented below: ``validate=True`` reads a few numbers back from the device
(one host sync, *before* the launch) to check every descriptor, and
:func:`verify` waits for its own result.

Pools are flat ``uint8`` tensors: a local buffer, or a peer GPU's buffer opened
over IPC and wrapped by the platform's ``as_tensor`` as a tensor *on the local
device*. Descriptor tables are ``int64`` tensors of shape ``(N, 3)`` --
``(src_offset, dst_offset, nbytes)`` in bytes -- on the same device. On the host
emulation everything is a CPU tensor and the same kernels run in Triton's
interpreter.

For a timed loop, validate once (``validate=True``, or :func:`check_copy`) and
pass ``validate=False`` with an ``nbytes_hint`` afterwards: the launch is then
free of host syncs.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import torch

from ..errors import BadInput, VerificationFailed
from . import reference
from .checks import (DescriptorStats, check_apart, check_descriptors, check_int, check_offsets, check_pool,
                     check_programs, check_range, check_rows, pool_align, validate_rows)
from .copy_kernel import copy_kernel
from .pattern_kernel import fill_kernel, verify_kernel
from .tiling import (CPU_PROGRAMS, CopyConfig, blocks_config, choose_config, default_programs,  # re-exported too
                     sm_count)

MODE_COPY, MODE_PACK, MODE_UNPACK, MODE_PACK_ROWS, MODE_UNPACK_ROWS, MODE_BLOCKS = 0, 1, 2, 3, 4, 5


# --------------------------------------------------------------------------- validation


def _check_packing(pool, staging, descs, offsets, start, end, staging_offset, device, *, packing: bool,
                   validate: bool):
    pool_name = "src_pool" if packing else "dst_pool"
    dev = check_pool(pool, pool_name, device)
    check_pool(staging, "staging", dev)
    n = check_descriptors(descs, "descs", dev)
    start, end = check_range(start, end, n)
    if offsets is None:
        offsets = pack_offsets(descs)
    check_offsets(offsets, n, dev)
    check_int(staging_offset, "staging_offset", 0, staging.numel())
    stats = None
    if validate:
        written, written_name = (staging, "the staging buffer") if packing else (pool, "the dst pool")
        check_apart(descs, "descs", written, written_name)
        check_apart(offsets, "offsets", written, written_name)
    if validate and end > start:
        t = descs[start:end]
        o = offsets[start:end + 1]
        pos = staging_offset + (o[:-1] - o[0])
        extra = (o[1:] - o[:-1]) != t[:, 2]
        why = "offsets[i + 1] - offsets[i] != nbytes (offsets must be pack_offsets(descs))"
        if packing:
            stats = validate_rows(t[:, 0], pos, t[:, 2], pool.numel(), staging.numel(), first_row=start,
                                   src_name="the src pool", dst_name="the staging buffer", extra_bad=extra,
                                   extra_why=why)
        else:
            stats = validate_rows(pos, t[:, 1], t[:, 2], staging.numel(), pool.numel(), first_row=start,
                                   src_name="the staging buffer", dst_name="the dst pool", extra_bad=extra,
                                   extra_why=why)
    return dev, start, end, offsets, stats


# --------------------------------------------------------------------------- copy / pack / unpack


def _grid(rows: int, config: CopyConfig, programs: int) -> tuple[int, int, int]:
    """(programs, n_items, slices) for ``rows`` descriptors."""
    groups = -(-rows // config.rows)
    slices = 1 if groups >= programs else min(-(-programs // groups), 1 << 16)
    n_items = groups * slices
    return max(1, min(programs, n_items)), n_items, slices


def launch_geometry(rows: int, device, *, nbytes_hint: int | None = None, num_programs: int | None = None,
                    config: CopyConfig | None = None, local: bool = False) -> tuple[CopyConfig, int]:
    """The configuration and number of programs a copy/pack/unpack of ``rows``
    descriptors uses on ``device`` (what the launchers do, for reports)."""
    device = torch.device(device)
    check_programs(num_programs)
    if nbytes_hint is not None and (isinstance(nbytes_hint, bool) or not isinstance(nbytes_hint, numbers.Integral)
                                    or nbytes_hint < 0):
        raise BadInput(f"nbytes_hint must be a non-negative integer, got {nbytes_hint!r}")
    if config is not None and not isinstance(config, CopyConfig):
        raise BadInput(f"config must be a CopyConfig, got {type(config).__name__}")
    if config is None:
        few = num_programs is not None and device.type != "cpu" and num_programs <= sm_count(device)
        config = choose_config(nbytes_hint, few_programs=few, local=local)
    if num_programs is None:
        num_programs = default_programs(device, config)
    return config, _grid(max(rows, 1), config, num_programs)[0]


def _launch_copy(mode: int, src, dst, descs, offsets, start: int, end: int, staging_offset: int,
                 stats: DescriptorStats | None, num_programs: int | None, nbytes_hint: int | None,
                 config: CopyConfig | None, local: bool) -> None:
    launch = _copy_launch(mode, src, dst, descs, offsets, start, end, staging_offset, stats, num_programs,
                          nbytes_hint, config, local)
    if launch is not None:
        launch()


def _copy_launch(mode: int, src, dst, descs, offsets, start: int, end: int, staging_offset: int,
                 stats: DescriptorStats | None, num_programs: int | None, nbytes_hint: int | None,
                 config: CopyConfig | None, local: bool, bounds: tuple | None = None, row_bytes: int = 0,
                 blocks: tuple[int, int, int, int, bool] = (0, 0, 0, 0, True)):
    """The kernel launch ``_launch_copy`` makes, as a function of no arguments (None: nothing to copy).

    ``bounds``: ``(tensor, lo_at, hi_at)``: the rows are read on the device at each launch (the kernel's
    ``DEVICE_RANGE``) and clamped into ``[start, end)`` = the whole table; the grid is then fixed. Only the
    modes that read no offsets take them (pack and unpack read ``offsets`` at the range's first row).
    ``blocks``: mode 5's ``(planes, groups, request entries, bisection steps, splits)``
    (:func:`copy_blocks_launcher`)."""
    if bounds is not None and mode in (MODE_PACK, MODE_UNPACK):
        raise BadInput(f"a device-read row range needs a mode that reads no offsets (copy, or pack / unpack "
                       f"with row_bytes), got mode {mode}")
    if mode == MODE_BLOCKS and bounds is None:
        raise BadInput("the block copy (mode 5) reads its row range from the request on the device: bounds needed")
    rows = end - start
    hint = nbytes_hint if nbytes_hint is not None else (stats.max_nbytes if stats is not None else None)
    config, _ = launch_geometry(rows, src.device, nbytes_hint=hint, num_programs=num_programs, config=config,
                                local=local)
    if rows == 0:
        return None
    if num_programs is None:
        num_programs = default_programs(src.device, config)
    align = pool_align(src, dst)
    if stats is not None and stats.align == 4:
        align = min(align, 4)
    if align == 4 and config.rows > 1 and config.step_bytes > 32 * 1024:
        # 4-byte accesses need 4x the registers for addresses: halve the rows (no spills)
        config = dataclasses.replace(config, rows=config.rows // 2)
    device_range = bounds is not None
    if device_range:
        programs, n_items, slices = num_programs, 0, 1
    else:
        programs, n_items, slices = _grid(rows, config, num_programs)
        bounds = (descs, 0, 0)
    args = (src, dst, descs, descs if offsets is None else offsets, start, rows, staging_offset, n_items, slices,
            *bounds, row_bytes, *blocks[:3])
    kw = dict(MODE=mode, ALIGN=align, ROWS=config.rows, W=config.width, UNROLL=config.unroll,
              LOAD_CACHE=config.load_cache, STORE_CACHE=config.store_cache, DEVICE_RANGE=device_range,
              SEARCH=blocks[3], SPLIT=blocks[4], num_warps=config.num_warps)
    return copy_kernel.launcher(src.device, (programs,), *args, **kw)


def copy_launcher(src_pool, dst_pool, descs, *, start: int = 0, end: int | None = None,
                  num_programs: int | None = None, nbytes_hint: int | None = None,
                  config: CopyConfig | None = None, device: torch.device | None = None, local: bool = False):
    """:func:`copy_descriptors` with ``validate=False`` for a table posted again and again: the checks of
    the tensors (not of the descriptors' contents) and the tiling are done here, once; the returned
    function of no arguments only launches (on torch's current stream). None when there is nothing to copy."""
    dev = check_pool(src_pool, "src_pool", device)
    check_pool(dst_pool, "dst_pool", dev)
    n = check_descriptors(descs, "descs", dev)
    start, end = check_range(start, end, n)
    return _copy_launch(MODE_COPY, src_pool, dst_pool, descs, None, start, end, 0, None, num_programs, nbytes_hint,
                        config, local)


def copy_range_launcher(src_pool, dst_pool, descs, bounds, *, lo_at: int, hi_at: int,
                        num_programs: int | None = None, nbytes_hint: int | None = None,
                        device: torch.device | None = None, local: bool = False):
    """A launcher (as :func:`copy_launcher`) of the copy of rows ``[bounds[lo_at], bounds[hi_at])`` of
    ``descs``, the two bounds read on the device at each launch: one launcher, checked once, for a table
    rewritten request after request (the grid is fixed; the kernel derives its work items from the range).

    ``bounds``: a 1-D int64 tensor on the pools' device. A range outside ``[0, N)`` is clamped into it, so the
    launch never reads past ``descs``; the descriptors it reads must lie inside the pools, as for every
    copy. None when ``descs`` has no row."""
    dev = check_pool(src_pool, "src_pool", device)
    check_pool(dst_pool, "dst_pool", dev)
    n = check_descriptors(descs, "descs", dev)
    if (not isinstance(bounds, torch.Tensor) or bounds.dtype != torch.int64 or bounds.dim() != 1
            or not bounds.is_contiguous() or bounds.device != dev):
        raise BadInput(f"bounds must be a contiguous 1-D int64 tensor on {dev}")
    for name, at in (("lo_at", lo_at), ("hi_at", hi_at)):
        if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at < bounds.shape[0]:
            raise BadInput(f"{name} must be an index into the {bounds.shape[0]} entries of bounds, got {at!r}")
    check_programs(num_programs)
    return _copy_launch(MODE_COPY, src_pool, dst_pool, descs, None, 0, n, 0, None, num_programs, nbytes_hint,
                        None, local, bounds=(bounds, lo_at, hi_at))


def copy_blocks_launcher(src_pool, dst_pool, planes, request, *, n_groups: int, plane_lo: int, plane_hi: int,
                         max_rows: int, num_programs: int | None = None, nbytes_hint: int | None = None,
                         device: torch.device | None = None, local: bool = False, splits: bool | None = None,
                         config: CopyConfig | None = None):
    """A launcher (as :func:`copy_range_launcher`) of the copy a request array names, with no descriptor table
    and no expansion launch: the kernel's mode 5 derives each row's ``(src, dst, nbytes)`` from ``request``
    and ``planes`` as the expansion kernel (:mod:`gpuxfer.kernels.block_kernel`) would have written it, for
    the rows ``[request[plane_lo], request[plane_hi])`` (the rows of planes ``[plane_lo, plane_hi)``), read
    on the device at each launch and clamped into ``[0, max_rows)``.

    ``planes``: ``(P, PLANE_FIELDS)`` int64, offsets from ``src_pool`` and ``dst_pool``, trusted (the layout a
    route registered); ``request``: 1-D int64 holding at least the header of P planes and ``n_groups`` groups.
    Whatever the request holds, the launch reads only ``planes[plane_lo:plane_hi]`` and ``request``, and a
    row whose plane, group or block ID is out of range copies nothing: every byte moved is a segment of the
    layout. A row that two planes of a forged header both claim gets the plane the bisection finds (the
    expansion's output for it would depend on which plane's program wrote last). None when the range or
    ``max_rows`` is empty.

    ``splits``: whether a plane of ``[plane_lo, plane_hi)`` splits a block (``src_split`` or ``dst_split``
    above 1). False compiles the launch without the divisions by the splits (the common case: the same block
    size on both sides), and a plane that does split copies nothing; None reads it from ``planes`` as they are
    here (one device-to-host copy, not at each launch), or takes True while torch's current stream captures a
    graph (where a device-to-host copy is refused). ``config``: the tiling (default:
    :func:`~gpuxfer.kernels.tiling.blocks_config`'s for rows of at most 4 KB between pools that are not both
    local on a grid of the default size, else :func:`choose_config` of ``nbytes_hint``)."""
    from .block_kernel import PLANE_FIELDS
    dev = check_pool(src_pool, "src_pool", device)
    check_pool(dst_pool, "dst_pool", dev)
    for name, t, ndim in (("planes", planes, 2), ("request", request, 1)):
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != ndim or not t.is_contiguous()
                or t.device != dev):
            raise BadInput(f"{name} must be a contiguous {ndim}-D int64 tensor on {dev}")
    if planes.shape[1] != PLANE_FIELDS:
        raise BadInput(f"planes must have {PLANE_FIELDS} fields per row, got shape {tuple(planes.shape)}")
    n_planes = int(planes.shape[0])
    n_groups = check_int(n_groups, "n_groups", 0, 1 << 40)
    need = n_planes + 1 + 3 * n_groups              # the header (blocks.request_header_len)
    if request.shape[0] < need:
        raise BadInput(f"request holds {request.shape[0]} entries; {n_planes} planes and {n_groups} groups need "
                       f"at least {need} before the block IDs")
    plane_lo = check_int(plane_lo, "plane_lo", 0, n_planes)
    plane_hi = check_int(plane_hi, "plane_hi", plane_lo, n_planes)
    # rows below 2**62 and first rows at or above -2**62: a segment index row - first row fits int64
    max_rows = check_int(max_rows, "max_rows", 0, 1 << 62)
    check_programs(num_programs)
    if splits is not None and not isinstance(splits, bool):
        raise BadInput(f"splits must be True, False or None, got {splits!r}")
    if plane_hi == plane_lo or max_rows == 0:
        return None
    steps = (plane_hi - plane_lo - 1).bit_length()
    if config is None:
        config = blocks_config(nbytes_hint, local=local, num_programs=num_programs)
    if splits is None:
        capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
        splits = capturing or bool((planes[plane_lo:plane_hi, 6:8] > 1).any())
    return _copy_launch(MODE_BLOCKS, src_pool, dst_pool, request, planes, 0, max_rows, 0, None, num_programs,
                        nbytes_hint, config, local, bounds=(request, plane_lo, plane_hi),
                        blocks=(n_planes, n_groups, int(request.shape[0]), steps, splits))


def copy_descriptors(src_pool, dst_pool, descs, *, start: int = 0, end: int | None = None,
                     num_programs: int | None = None, nbytes_hint: int | None = None,
                     config: CopyConfig | None = None, validate: bool = True,
                     device: torch.device | None = None, local: bool = False) -> None:
    """Copy ``descs[start:end]``: ``dst_pool[d:d+n] = src_pool[s:s+n]`` for each row ``(s, d, n)``.

    Pull: run it on the destination GPU with ``src_pool`` the peer's pool opened
    over IPC. Push: run it on the source GPU with ``dst_pool`` the peer's pool.

    * ``num_programs`` -- the persistent grid; at most the SM count means at most
      that many SMs. Default: ``config.programs_per_sm`` x SM count (the fastest).
    * ``nbytes_hint`` -- typical descriptor size, picks the tiling (:func:`choose_config`);
      by default the largest size seen by validation, else 2,304.
    * ``validate`` -- check dtypes, shapes, devices (always, on the host) and, with one
      host sync, that every descriptor lies inside both pools (BadInput naming the
      first bad row) and that the table does not lie in the dst pool (a row could
      rewrite rows not read yet). ``False`` skips the sync for timed loops.
    * ``device`` -- if given, everything must be on it.
    * ``local`` -- both pools are in this GPU's own memory: use the tiling tuned for HBM
      (pack and unpack always do).

    Destinations must not overlap each other or the sources (the order of the copies
    is unspecified). Enqueued on torch's current stream; returns immediately.
    """
    dev = check_pool(src_pool, "src_pool", device)
    check_pool(dst_pool, "dst_pool", dev)
    n = check_descriptors(descs, "descs", dev)
    start, end = check_range(start, end, n)
    stats = None
    if validate:
        check_apart(descs, "descs", dst_pool, "the dst pool")
    if validate and end > start:
        t = descs[start:end]
        stats = validate_rows(t[:, 0], t[:, 1], t[:, 2], src_pool.numel(), dst_pool.numel(), first_row=start,
                               src_name="the src pool", dst_name="the dst pool")
    _launch_copy(MODE_COPY, src_pool, dst_pool, descs, None, start, end, 0, stats, num_programs, nbytes_hint,
                 config, local)


def pack_launcher(src_pool, staging, descs, offsets=None, *, start: int, end: int, staging_offset: int = 0,
                  nbytes_hint: int | None = None, num_programs: int | None = None,
                  device: torch.device | None = None, row_bytes: int | None = None):
    """:func:`pack` with ``validate=False``, checked once (tensors, not contents): a function of no
    arguments that only launches; None when there is nothing to pack.

    ``row_bytes``: the rows ``[start, end)`` are all of this size (one size class of a KV transfer's
    descriptors): row ``i`` lands at ``staging_offset + (i - start) * row_bytes`` with no offsets
    read (``offsets`` must be None); a row claiming more is cut at ``row_bytes``, so the rows stay in
    ``[staging_offset, staging_offset + (end - start) * row_bytes)``, which must lie in ``staging``."""
    if row_bytes is not None:
        if offsets is not None:
            raise BadInput("pack_launcher: pass offsets or row_bytes, not both")
        start, end = check_rows(src_pool, staging, descs, start, end, staging_offset, row_bytes, device, "src_pool")
        return _copy_launch(MODE_PACK_ROWS, src_pool, staging, descs, None, start, end, staging_offset, None,
                            num_programs, row_bytes if nbytes_hint is None else nbytes_hint, None, True,
                            row_bytes=row_bytes)
    _, start, end, offsets, _ = _check_packing(src_pool, staging, descs, offsets, start, end, staging_offset,
                                               device, packing=True, validate=False)
    return _copy_launch(MODE_PACK, src_pool, staging, descs, offsets, start, end, staging_offset, None,
                        num_programs, nbytes_hint, None, True)


def unpack_launcher(staging, dst_pool, descs, offsets=None, *, start: int, end: int, staging_offset: int = 0,
                    nbytes_hint: int | None = None, num_programs: int | None = None,
                    device: torch.device | None = None, row_bytes: int | None = None):
    """:func:`unpack` with ``validate=False``, checked once: a function of no arguments that only launches.
    ``row_bytes``: as :func:`pack_launcher` (what it packed with the same ``row_bytes``)."""
    if row_bytes is not None:
        if offsets is not None:
            raise BadInput("unpack_launcher: pass offsets or row_bytes, not both")
        start, end = check_rows(dst_pool, staging, descs, start, end, staging_offset, row_bytes, device, "dst_pool")
        return _copy_launch(MODE_UNPACK_ROWS, staging, dst_pool, descs, None, start, end, staging_offset, None,
                            num_programs, row_bytes if nbytes_hint is None else nbytes_hint, None, True,
                            row_bytes=row_bytes)
    _, start, end, offsets, _ = _check_packing(dst_pool, staging, descs, offsets, start, end, staging_offset,
                                               device, packing=False, validate=False)
    return _copy_launch(MODE_UNPACK, staging, dst_pool, descs, offsets, start, end, staging_offset, None,
                        num_programs, nbytes_hint, None, True)


def pack_offsets(descs) -> torch.Tensor:
    """Where each descriptor's bytes go in a packed staging buffer: the exclusive
    cumulative sum of the sizes, N + 1 int64 values on ``descs``' device (the last
    is the total). Asynchronous (a torch cumsum on the current stream)."""
    n = check_descriptors(descs)
    out = torch.zeros(n + 1, dtype=torch.int64, device=descs.device)
    if n:
        torch.cumsum(descs[:, 2], 0, out=out[1:])
    return out


def pack(src_pool, staging, descs, offsets=None, *, start: int = 0, end: int | None = None,
         staging_offset: int = 0, num_programs: int | None = None, nbytes_hint: int | None = None,
         config: CopyConfig | None = None, validate: bool = True, device: torch.device | None = None) -> None:
    """Gather the sources of ``descs[start:end]`` back to back into ``staging``.

    Row ``i``'s bytes land at ``staging[staging_offset + offsets[i] - offsets[start]:][:nbytes_i]``:
    the range occupies ``offsets[end] - offsets[start]`` bytes from ``staging_offset``.
    ``offsets`` is :func:`pack_offsets` of the *whole* table (computed here if None --
    pass it once computed to keep chunked packing cheap). Chunking: pack rows
    ``[a, b)`` while the chunk before is in flight, each into its own staging slot.
    Same stream and validation rules as :func:`copy_descriptors`.
    """
    dev, start, end, offsets, stats = _check_packing(src_pool, staging, descs, offsets, start, end, staging_offset,
                                                     device, packing=True, validate=validate)
    _launch_copy(MODE_PACK, src_pool, staging, descs, offsets, start, end, staging_offset, stats, num_programs,
                 nbytes_hint, config, True)


def unpack(staging, dst_pool, descs, offsets=None, *, start: int = 0, end: int | None = None,
           staging_offset: int = 0, num_programs: int | None = None, nbytes_hint: int | None = None,
           config: CopyConfig | None = None, validate: bool = True, device: torch.device | None = None) -> None:
    """Scatter ``staging`` (laid out as :func:`pack` wrote ``descs[start:end]`` at
    ``staging_offset``) to the destinations of ``descs[start:end]`` in ``dst_pool``."""
    dev, start, end, offsets, stats = _check_packing(dst_pool, staging, descs, offsets, start, end, staging_offset,
                                                     device, packing=False, validate=validate)
    _launch_copy(MODE_UNPACK, staging, dst_pool, descs, offsets, start, end, staging_offset, stats, num_programs,
                 nbytes_hint, config, True)


def packed_descriptors(descs, offsets=None, *, start: int = 0, end: int | None = None,
                       staging_offset: int = 0) -> torch.Tensor:
    """The table ``(src_offset, staging_offset, nbytes)`` that :func:`pack` executes for
    ``descs[start:end]`` -- e.g. to :func:`verify` a staging buffer against the source pattern."""
    n = check_descriptors(descs)
    start, end = check_range(start, end, n)
    check_int(staging_offset, "staging_offset", 0)
    if offsets is None:
        offsets = pack_offsets(descs)
    check_offsets(offsets, n, descs.device)
    t = descs[start:end]
    o = offsets[start:end]
    pos = staging_offset + (o - offsets[start]) if end > start else o
    return torch.stack([t[:, 0], pos, t[:, 2]], dim=1).contiguous()


# --------------------------------------------------------------------------- pattern fill / verify


def fill_pattern(pool, seed: int, *, start: int = 0, nbytes: int | None = None,
                 device: torch.device | None = None) -> None:
    """Write the pattern of ``seed`` over ``pool[start:start + nbytes]`` (the rest of the pool by default).

    Byte ``o`` gets the pattern of pool offset ``o`` (see :mod:`gpuxfer.kernels.reference`).
    Enqueued on torch's current stream.
    """
    dev = check_pool(pool, "pool", device)
    if not isinstance(seed, int):
        raise BadInput(f"seed must be an int, got {seed!r}")
    if (isinstance(start, bool) or not isinstance(start, int) or isinstance(nbytes, bool)
            or not isinstance(nbytes, (int, type(None)))):
        raise BadInput(f"fill range [{start!r}, +{nbytes!r}): start and nbytes must be ints")
    if nbytes is None:
        nbytes = pool.numel() - start
    if not (isinstance(start, int) and isinstance(nbytes, int)) or start < 0 or nbytes < 0 \
            or start + nbytes > pool.numel():
        raise BadInput(f"fill range [{start}, {start}+{nbytes}) is not inside the pool of {pool.numel()} bytes")
    if nbytes == 0:
        return
    block = 1 << 16 if dev.type == "cpu" else 4096
    fill_kernel.launch(dev, (-(-nbytes // block),), pool, start, nbytes, reference.seed_key_i64(seed),
                       BLOCK=block, num_warps=8)


@dataclass(frozen=True)
class VerifyResult:
    """What :func:`verify` found. The ``guard_*`` fields cover the bytes outside every descriptor's
    destination (checked with ``guard_seed`` only; zero otherwise)."""

    wrong_bytes: int
    first_bad: int            # index of the first descriptor holding a wrong byte, -1 if none
    descriptors: int
    nbytes: int               # bytes checked inside the descriptors
    guard_wrong_bytes: int = 0    # bytes outside every descriptor that differ from the pool's own pattern
    guard_first_bad: int = -1     # pool offset of the first such byte, -1 if none
    guard_bytes: int = 0          # bytes checked outside the descriptors

    @property
    def ok(self) -> bool:
        return self.wrong_bytes == 0 and self.guard_wrong_bytes == 0

    def raise_if_failed(self, what: str = "transfer") -> "VerifyResult":
        """Raise :class:`VerificationFailed` unless every byte matched; returns self."""
        if not self.ok:
            parts = []
            if self.wrong_bytes:
                parts.append(f"{self.wrong_bytes} of {self.nbytes} bytes wrong; first wrong descriptor "
                             f"{self.first_bad} of {self.descriptors}")
            if self.guard_wrong_bytes:
                parts.append(f"{self.guard_wrong_bytes} of the {self.guard_bytes} bytes outside every descriptor "
                             f"changed (a stray write); the first at pool offset {self.guard_first_bad}")
            raise VerificationFailed(f"{what}: " + "; ".join(parts),
                                     wrong_bytes=self.wrong_bytes + self.guard_wrong_bytes, first_bad=self.first_bad)
        return self


#: bytes of one guard piece (the stretches between destinations are cut into pieces of at most this)
GUARD_PIECE_BYTES = 1 << 20


def guard_descriptors(descs: torch.Tensor, pool_nbytes: int, piece: int = GUARD_PIECE_BYTES) -> torch.Tensor:
    """The bytes of a pool of ``pool_nbytes`` that no descriptor's destination covers, as descriptors
    ``(o, o, n)`` (each stretch cut into pieces of at most ``piece`` bytes), on ``descs``' device.

    Verified against the destination pool's *own* pattern, they say whether anything wrote
    where no descriptor points. Computed on the device (sort, running maximum); one host
    sync reads the number of pieces. The descriptors must lie inside the pool. ``pool_nbytes`` (an int >= 0)
    or ``piece`` (an int >= 1) out of range: :class:`~gpuxfer.errors.BadInput`.
    """
    pool_nbytes = check_int(pool_nbytes, "guard_descriptors' pool_nbytes", 0, (1 << 62) - 1)
    piece = check_int(piece, "guard_descriptors' piece", 1, (1 << 62) - 1)
    dev = descs.device
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    end = torch.full((1,), int(pool_nbytes), dtype=torch.int64, device=dev)
    if descs.shape[0]:
        starts, order = torch.sort(descs[:, 1])
        reach = torch.cummax(starts + descs[:, 2][order], 0).values
        lo = torch.cat([zero, reach])              # stretch k runs from the furthest end of rows < k ...
        hi = torch.cat([starts, end])              # ... to the start of row k (the pool's end after the last)
    else:
        lo, hi = zero, end
    length = (hi - lo).clamp_min(0)
    counts = -(-length // piece)
    total = int(counts.sum())
    if total == 0:
        return torch.zeros((0, 3), dtype=torch.int64, device=dev)
    which = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts, output_size=total)
    first = torch.cumsum(counts, 0) - counts
    k = torch.arange(total, dtype=torch.int64, device=dev) - first[which]
    start = lo[which] + k * piece
    size = torch.minimum(torch.full_like(start, piece), hi[which] - start)
    return torch.stack([start, start, size], dim=1).contiguous()


def _verify_launch(pool, descs, n: int, seed: int, dev, num_programs: int | None) -> tuple[int, int]:
    """Launch the verify kernel over ``n`` rows of ``descs``; (wrong bytes, first wrong row or ``n``)."""
    if dev.type == "cpu":
        rows, wb, programs = 8, 512, CPU_PROGRAMS
    else:
        rows, wb, programs = 4, 1024, 4 * sm_count(dev)
    if num_programs is not None:
        programs = num_programs
    groups = -(-n // rows)
    slices = 1 if groups >= programs else min(-(-programs // groups), 1 << 16)
    n_items = groups * slices
    result = torch.tensor([0, n], dtype=torch.int64, device=dev)
    verify_kernel.launch(dev, (max(1, min(programs, n_items)),), pool, descs, n, reference.seed_key_i64(seed),
                         result, n_items, slices, ROWS=rows, WB=wb, num_warps=8)
    wrong, first = result.tolist()
    return int(wrong), int(first)


def verify(dst_pool, descs, seed: int, *, guard_seed: int | None = None, num_programs: int | None = None,
           validate: bool = True, device: torch.device | None = None) -> VerifyResult:
    """Check every byte of every descriptor's destination in ``dst_pool`` against the
    pattern of ``seed`` at its *source* offset (the source pool was filled with
    :func:`fill_pattern` ``(src_pool, seed)``).

    ``guard_seed``: ``dst_pool`` was filled with :func:`fill_pattern` ``(dst_pool, guard_seed)``
    before the transfer; every byte outside every descriptor's destination must still hold
    that pattern (a stray write anywhere in the pool is counted in ``guard_wrong_bytes``).
    Checked on the device (:func:`guard_descriptors`, the same kernel); only the first
    wrong piece (at most :data:`GUARD_PIECE_BYTES`) is read back, to name the first wrong byte.

    Runs on torch's current stream and **waits** for its result.
    With ``validate`` every destination must lie inside ``dst_pool`` (BadInput); the guard
    check needs it.
    """
    dev = check_pool(dst_pool, "dst_pool", device)
    n = check_descriptors(descs, "descs", dev)
    for name, v in (("seed", seed), ("guard_seed", guard_seed)):
        if not isinstance(v, int) and not (name == "guard_seed" and v is None):
            raise BadInput(f"{name} must be an int, got {v!r}")
    if guard_seed is not None and not validate:
        raise BadInput("verify: guard_seed needs validate=True (the guard assumes every descriptor in the pool)")
    check_programs(num_programs)
    wrong, first, total = 0, n, 0
    if n:
        if validate:
            total = validate_rows(descs[:, 0], descs[:, 1], descs[:, 2], None, dst_pool.numel(), first_row=0,
                                   src_name="", dst_name="the dst pool").total_bytes
        else:
            total = int(descs[:, 2].sum())
        wrong, first = _verify_launch(dst_pool, descs, n, seed, dev, num_programs)
    res = VerifyResult(wrong, -1 if first >= n else first, n, total)
    if guard_seed is None:
        return res
    guard = guard_descriptors(descs, dst_pool.numel())
    m = int(guard.shape[0])
    if m == 0:
        return res
    g_wrong, g_first = _verify_launch(dst_pool, guard, m, guard_seed, dev, num_programs)
    first_byte = -1
    if g_wrong:
        a, size = (int(v) for v in guard[g_first, 1:].tolist())
        got = dst_pool[a:a + size].cpu().numpy()
        first_byte = a + int((got != reference.pattern(guard_seed, a, size)).argmax())
    return dataclasses.replace(res, guard_wrong_bytes=g_wrong, guard_first_bad=first_byte,
                               guard_bytes=int(guard[:, 2].sum()))
