"""The KV benchmark's pool checks: the pattern fill, the verify kernel's verdict (wrong bytes inside the
descriptors, stray bytes outside every one), the CollectiveX suite's pattern and sampled reads, and the
fault injection that proves the verifier catches a wrong or a stray byte.

Fault specs: ``ENGINE[:DIRECTION][:stray]`` (``ENGINE`` may be ``all``): ``byte`` flips a byte of the
first descriptor, ``stray`` the first byte past the first descriptor that no descriptor covers.
"""
from __future__ import annotations

import numpy as np

from ...errors import TransferTimeout
from . import engines as E
from .engines.launch import sync_uploads


def inject_parts(spec: str) -> tuple[str, str, str]:
    """``ENGINE[:DIRECTION][:stray]`` -> (engine, direction or '', 'byte' or 'stray')."""
    parts = spec.split(":")
    kind = "stray" if len(parts) > 1 and parts[-1] == "stray" else "byte"
    if kind == "stray":
        parts = parts[:-1]
    return parts[0], ":".join(parts[1:]), kind


def fault_matches(spec: str | None, engine: str, direction: str) -> str | None:
    """The fault to inject in this row: ``byte`` (inside a descriptor), ``stray`` (outside all) or None."""
    if not spec:
        return None
    eng, d, kind = inject_parts(spec)
    return kind if eng in ("all", engine) and (not d or d == direction) else None


def stray_offset(desc: np.ndarray, pool_nbytes: int) -> int | None:
    """The first pool byte at or past the end of ``desc[0]``'s destination that no descriptor covers
    (else the first uncovered byte; None if every byte is covered)."""
    if desc.shape[0] == 0:
        return 0 if pool_nbytes else None
    order = np.argsort(desc[:, 1], kind="stable")
    starts = desc[order, 1]
    reach = np.maximum.accumulate(starts + desc[order, 2])
    lo = np.concatenate([[0], reach])                 # uncovered stretches [lo, hi)
    hi = np.concatenate([starts, [pool_nbytes]])
    past = int(desc[0, 1] + desc[0, 2])
    for want in (past, 0):
        k = np.flatnonzero((hi > lo) & (hi > want))
        if k.size:
            return int(max(lo[k[0]], want))
    return None


def _pool_fill(platform, stream, mem, seed: int) -> None:
    """Paint the pattern of ``seed`` over the whole pool (the fill kernel; on the host emulation the
    NumPy reference, which writes the same bytes a hundred times faster than the interpreter)."""
    t = platform.as_tensor(mem)
    if t.device.type == "cpu":
        from ...kernels import reference
        platform.launch(stream, lambda: reference.fill(t.numpy(), seed))
        return
    from ... import kernels as K
    platform.launch(stream, lambda: K.fill_pattern(t, seed))


def _pool_verify(platform, stream, mem, desc: np.ndarray, seed: int, timeout_s: float, rank: int, *,
                 guard_seed: int | None = None) -> tuple[int, int, int, int]:
    """Check ``mem`` (the destination) after a burst of ``desc``: ``(wrong, first, stray, first_stray)``,
    the wrong bytes inside the descriptors and the first wrong descriptor (-1: none); with
    ``guard_seed`` (the pattern the pool held before the burst), the bytes outside every
    descriptor that changed and the pool offset of the first (-1: none). On a GPU both checks
    run on the device; on the host emulation the guard check is the NumPy reference (the
    interpreter would take seconds per megabyte)."""
    import torch
    from ... import kernels as K
    t = platform.as_tensor(mem)
    cpu = t.device.type == "cpu"
    d = torch.from_numpy(np.array(desc, dtype=np.int64))       # a copy: ``desc`` may be a read-only burst table
    d = d if cpu else d.to(t.device)
    sync_uploads(platform, mem.device, timeout_s, rank)
    out: list = []
    platform.launch(stream, lambda: out.append(K.verify(t, d, seed, guard_seed=None if cpu else guard_seed)))
    _sync(platform, stream, timeout_s, rank, "verification")
    res = out[0]
    stray, first_stray = res.guard_wrong_bytes, res.guard_first_bad
    if cpu and guard_seed is not None:
        from ...kernels import reference
        stray, first_stray, _ = reference.verify_guard(t.numpy(), desc, guard_seed)
    return int(res.wrong_bytes), int(res.first_bad), int(stray), int(first_stray)


def _moves_one_copy(eng: E.Engine) -> bool:
    """A ceiling engine (``bulk``, ``nixl-bulk``): it moves a burst's bytes as one contiguous copy, not the
    paged descriptors (in ``--suite collectivex``, its rows are gpuxfer's ceiling, not the suite's)."""
    return bool(eng.ceiling or eng.ceiling_across_hosts)


def _suite_fill(platform, stream, mem) -> None:
    """Paint the CollectiveX suite's offset pattern over the whole pool."""
    from . import collectivex as CX
    t = platform.as_tensor(mem)
    if t.device.type == "cpu":
        platform.launch(stream, lambda: CX.fill_pattern(t.numpy()))
    else:
        platform.launch(stream, lambda: CX.fill_pattern(t))


def _read8(platform, mem, offsets: np.ndarray) -> np.ndarray:
    """The 8 bytes at each offset of ``mem``, as a (len(offsets), 8) uint8 array (one gather, one copy back)."""
    import torch
    t = platform.as_tensor(mem)
    idx = np.asarray(offsets, dtype=np.int64)[:, None] + np.arange(8, dtype=np.int64)[None, :]
    if t.device.type == "cpu":
        return t.numpy()[idx]
    return t[torch.from_numpy(idx).to(t.device)].cpu().numpy()


def _flip_byte(platform, stream, mem, offset: int) -> None:
    t = platform.as_tensor(mem, shape=(1,), offset=int(offset))
    platform.launch(stream, lambda: t.bitwise_not_())


def _sync(platform, stream, timeout_s: float, rank: int, what: str) -> None:
    if not platform.synchronize(stream, timeout_s):
        raise TransferTimeout(rank=rank, step=0, flag=f"stream: {what}", expected=1, seen=0, timeout_s=timeout_s,
                              what=what)
