"""The launches a KV route binds once and reuses for every request: the expansion over a fixed grid (each
program loops over its plane's chunks) and the copy whose row range is read on the device.

Both against the NumPy reference, on the CPU (Triton's interpreter) and, marked ``gpu``, compiled; forged
ranges and headers stay inside the table, the output and the pools.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuxfer.errors import BadInput
from gpuxfer.kernels import reference as ref
from gpuxfer.kernels.blocks import expand_blocks, expand_launcher
from gpuxfer.kernels import launch
from gpuxfer.kernels.launch import copy_range_launcher


def _host(t: torch.Tensor) -> np.ndarray:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    return t.cpu().numpy().copy()


@pytest.mark.parametrize("lo, hi", [(0, 30), (4, 11), (11, 11), (20, 30), (-5, 7), (25, 99), (9, 3),
                                    (-(1 << 62), 1 << 62)])
def test_copy_range_read_on_the_device(dev, lo, hi):
    """Rows [bounds[lo_at], bounds[hi_at]) are copied, clamped into the table; the same launcher serves the
    next range written into ``bounds``."""
    rng = np.random.default_rng(3)
    n_pool, page = 32 * 1024, 1024
    src = torch.from_numpy(ref.pattern(11, 0, n_pool)).to(dev)
    dst = torch.from_numpy(ref.pattern(22, 0, n_pool)).to(dev)
    sp, dp = rng.permutation(n_pool // page)[:30], rng.permutation(n_pool // page)[:30]
    descs = np.stack([sp * page, dp * page, np.full(30, page)], 1).astype(np.int64)
    table = torch.from_numpy(descs).to(dev)
    bounds = torch.tensor([7, lo, 5, hi], dtype=torch.int64, device=dev)
    launch = copy_range_launcher(src, dst, table, bounds, lo_at=1, hi_at=3, nbytes_hint=page)
    before = _host(dst)
    launch()
    a = min(max(lo, 0), 30)
    b = min(max(hi, a), 30)
    want = before.copy()
    ref.copy(_host(src), want, descs[a:b])
    assert np.array_equal(_host(dst), want)
    bounds.copy_(torch.tensor([7, 0, 5, 30], dtype=torch.int64))     # the whole table, same launcher
    launch()
    ref.copy(_host(src), want, descs)
    assert np.array_equal(_host(dst), want)


def test_copy_range_launcher_rejects_bad_arguments(dev):
    src = torch.zeros(64, dtype=torch.uint8, device=dev)
    table = torch.zeros((4, 3), dtype=torch.int64, device=dev)
    bounds = torch.zeros(3, dtype=torch.int64, device=dev)
    with pytest.raises(BadInput, match="bounds must be"):
        copy_range_launcher(src, src, table, bounds.to(torch.int32), lo_at=0, hi_at=1)
    with pytest.raises(BadInput, match="hi_at"):
        copy_range_launcher(src, src, table, bounds, lo_at=0, hi_at=3)
    with pytest.raises(BadInput, match="lo_at"):
        copy_range_launcher(src, src, table, bounds, lo_at=-1, hi_at=1)
    with pytest.raises(BadInput, match="num_programs"):
        copy_range_launcher(src, src, table, bounds, lo_at=0, hi_at=1, num_programs=0)
    assert copy_range_launcher(src, src, table[:0], bounds, lo_at=0, hi_at=1) is None


@pytest.mark.parametrize("mode", [launch.MODE_PACK, launch.MODE_UNPACK])
def test_device_range_refuses_modes_reading_offsets(mode):
    """Pack and unpack read ``offsets`` at the range's first row, which a device-read range may put one past
    the table: a launch with such a range is refused, whatever its other arguments."""
    src = torch.zeros(64, dtype=torch.uint8)
    table = torch.zeros((4, 3), dtype=torch.int64)
    offsets = torch.zeros(5, dtype=torch.int64)
    bounds = torch.tensor([4, 4], dtype=torch.int64)
    with pytest.raises(BadInput, match="reads no offsets"):
        launch._copy_launch(mode, src, src, table, offsets, 0, 4, 0, None, None, 16, None, True,
                            bounds=(bounds, 0, 1))


def test_expansion_fixed_grid_matches_reference_on_hostile_input():
    """Random planes and requests (IDs, counts, first rows and offsets out of range included) through a fixed
    grid of small chunks (programs loop over several): exactly what the reference writes, nothing outside
    ``out``."""

    @settings(max_examples=20, deadline=None)
    @given(st.data())
    def check(data):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        P, G = data.draw(st.integers(1, 3)), data.draw(st.integers(0, 3))
        planes = rng.integers(-3, 50, (P, 10)).astype(np.int64)
        planes[:, 5] = rng.integers(-1, G + 1, P)
        planes[:, 6:8] = rng.integers(0, 4, (P, 2))
        n_ids = data.draw(st.integers(0, 40))
        head = P + 1 + 3 * G
        req = rng.integers(-2, head + n_ids + 3, head + n_ids).astype(np.int64)
        big_values = G and data.draw(st.booleans())
        if big_values:                             # counts and first rows anywhere, huge ones included
            big = np.array([-(1 << 63), -(1 << 62) - 1, -3, 0, 5, 37, 1 << 40, (1 << 63) - 1], dtype=np.int64)
            req[P + 1:P + 1 + G] = rng.choice(big, G)
            req[:P] = rng.choice(big, P)
        n_rows = data.draw(st.integers(1, 40))
        out = torch.full((n_rows + 2, 3), -7, dtype=torch.int64)
        expand_blocks(torch.from_numpy(planes), torch.from_numpy(req), out[1:-1], n_groups=G,
                      programs_per_plane=data.draw(st.integers(1, 3)), block=4)
        want = _reference(planes, req, G, n_rows)
        if not big_values:
            assert np.array_equal(want, ref.expand_blocks(planes, req, G, n_rows, np.full((n_rows, 3), -7, np.int64)))
        assert np.array_equal(out[1:-1].numpy(), want)
        assert (out[0] == -7).all() and (out[-1] == -7).all()

    check()


def _reference(planes, req, G, n_rows):
    """:func:`ref.expand_blocks`'s rules in Python integers, visiting only the segments whose rows lie in
    ``[0, n_rows)`` (so huge counts cost nothing); checked against it where both are cheap."""
    out = np.full((n_rows, 3), -7, dtype=np.int64)
    P, rl = planes.shape[0], req.shape[0]
    np1 = P + 1
    if np1 + 3 * G > rl:
        return out
    for p in range(P):
        sb, ss, db, ds, seg, g, rs, rd, snb, dnb = (int(v) for v in planes[p])
        if not 0 <= g < G:
            continue
        rs, rd = max(rs, 1), max(rd, 1)
        row0, nseg = int(req[p]), int(req[np1 + g])
        if row0 < -(1 << 62):           # the kernel's rule: such a first row leaves nothing
            continue
        soff, doff = int(req[np1 + G + g]), int(req[np1 + 2 * G + g])
        for j in range(max(0, -row0), max(0, min(nseg, n_rows - row0))):
            si_at, di_at = soff + j // rs, doff + j // rd
            si = int(req[si_at]) if 0 <= si_at < rl else -1
            di = int(req[di_at]) if 0 <= di_at < rl else -1
            ok = 0 <= si < snb and 0 <= di < dnb
            out[row0 + j] = (sb + si * ss + (j % rs) * seg, db + di * ds + (j % rd) * seg, seg) if ok else (0, 0, 0)
    return out


def test_one_expansion_launcher_serves_requests_of_any_size(dev):
    """A launcher bound to a request buffer and an output expands whatever request is written there next:
    more segments than programs x block (the loop), then fewer (no stale rows written)."""
    P, G = 2, 1
    planes = np.array([[0, 100, 0, 10, 10, 0, 1, 1, 50, 50],
                       [5, 100, 7, 10, 3, 0, 1, 1, 50, 50]], dtype=np.int64)
    req = torch.zeros(P + 1 + 3 * G + 80, dtype=torch.int64, device=dev)
    out = torch.zeros((64, 3), dtype=torch.int64, device=dev)
    launch = expand_launcher(torch.from_numpy(planes).to(dev), req, out, n_groups=G, programs_per_plane=2, block=4)
    for n in (23, 5):
        ids = np.arange(n, dtype=np.int64)
        r = np.concatenate([[0, n, 2 * n], [n], [6], [6 + n], ids, ids[::-1]]).astype(np.int64)
        req[:r.size] = torch.from_numpy(r).to(dev)
        out.zero_()
        launch()
        want = ref.expand_blocks(planes, _host(req), G, 64)
        assert np.array_equal(_host(out), want)
        assert (_host(out)[2 * n:] == 0).all()


def test_expand_launcher_rejects_bad_grids():
    planes = torch.zeros((2, 10), dtype=torch.int64)
    req, out = torch.zeros(20, dtype=torch.int64), torch.zeros((4, 3), dtype=torch.int64)
    with pytest.raises(BadInput, match="block must be a power of two"):
        expand_launcher(planes, req, out, n_groups=1, block=3)
    with pytest.raises(BadInput, match="programs per plane"):
        expand_launcher(planes, req, out, n_groups=1, programs_per_plane=1 << 17)
    for block in (1 << 21, 1 << 40):          # past a Triton block's 2**20 elements: BadInput, not a launch error
        with pytest.raises(BadInput, match="block must be a power of two"):
            expand_launcher(planes, req, out, n_groups=1, block=block, programs_per_plane=1)
    assert expand_launcher(planes, req, out, n_groups=1, max_segments=0) is None
    assert expand_launcher(planes, req, out, n_groups=1) is not None


def test_verdict_launcher_rejects_values_of_other_types_or_ranges():
    """A signal count that is not an int, or a refusal value past int64: BadInput at the launcher, not a
    TypeError or an interpreter error at the launch."""
    from gpuxfer.kernels.blocks import verdict_launcher
    z = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(BadInput, match="n_sig"):
        verdict_launcher(z[:1], z[:1], z[:2], z, "x", None, 0, equal=True, refused=1)
    for refused in (1 << 70, -(1 << 64), 1.5, None):
        with pytest.raises(BadInput, match="refused"):
            verdict_launcher(z[:1], z[:1], z[:2], z, 1, None, 0, equal=True, refused=refused)
    verdict_launcher(z[:1], z[:1], z[:2], z, 1, None, 0, equal=True, refused=1)()


def test_verdict_only_refused_writes_signals_only_when_refused():
    """``only_refused`` (the check before a pack side's last signal): a word below ``refused`` leaves the signals
    as they are; at or past it every signal becomes ``refused`` and the status records the first refusal."""
    from gpuxfer.kernels.blocks import verdict_launcher
    release = 1 << 62
    word, status = torch.zeros(1, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    fp = torch.full((1,), 7, dtype=torch.int64)
    sig = torch.full((4,), 9, dtype=torch.int64)          # (a plain verdict would write 1, 2, 3, 0)
    launch = verdict_launcher(word, fp, status, sig, 4, None, 0, equal=False, refused=release, only_refused=True)
    launch()
    assert sig.tolist() == [9] * 4 and status.tolist() == [0, 0]
    word.fill_(release)
    launch()
    assert sig.tolist() == [release] * 4 and status.tolist() == [7, release]
