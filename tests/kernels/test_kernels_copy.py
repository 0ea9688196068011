"""Descriptor copy, pack and unpack kernels against the NumPy reference.

Every test runs on the CPU (Triton's interpreter: the host emulation's path) and,
marked ``gpu``, compiled on a CUDA device. Pools are small: the interpreter runs
each program's loop in Python.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuxfer.errors import BadInput
from gpuxfer.kernels import (CopyConfig, check_copy, choose_config, copy_descriptors, pack,
                             pack_offsets, packed_descriptors, unpack, verify)
from gpuxfer.kernels import reference as ref


SRC_SEED, DST_SEED = 101, 202


def pools(dev, src_bytes: int, dst_bytes: int):
    """Two pattern-filled pools (numpy copies for the reference)."""
    src = torch.from_numpy(ref.pattern(SRC_SEED, 0, src_bytes)).to(dev)
    dst = torch.from_numpy(ref.pattern(DST_SEED, 0, dst_bytes)).to(dev)
    return src, dst


def host(t: torch.Tensor) -> np.ndarray:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    return t.cpu().numpy().copy()


def page_table(rng, pool_bytes: int, page: int, n: int, *, dst_pool_bytes: int | None = None) -> np.ndarray:
    """``n`` random distinct pages of ``page`` bytes, sources and destinations permuted."""
    sp = rng.permutation(pool_bytes // page)[:n]
    dp = rng.permutation((dst_pool_bytes or pool_bytes) // page)[:n]
    n = min(len(sp), len(dp))
    return np.stack([sp[:n] * page, dp[:n] * page, np.full(n, page)], 1).astype(np.int64)


def expect_copy(src: torch.Tensor, dst_before: np.ndarray, descs: np.ndarray) -> np.ndarray:
    want = dst_before.copy()
    ref.copy(host(src), want, descs)
    return want


def run_copy(dev, src, dst, descs: np.ndarray, **kw):
    before = host(dst)
    copy_descriptors(src, dst, torch.from_numpy(descs).to(dev), **kw)
    got = host(dst)
    want = expect_copy(src, before, descs)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} wrong bytes, first at dst offset {bad[0]}"


# --------------------------------------------------------------------------- copy


@pytest.mark.parametrize("page", [528, 576, 2304, 132, 36, 7, 1, 4099])
def test_copy_pages_in_random_order(dev, page):
    rng = np.random.default_rng(page)
    src, dst = pools(dev, 48 * 1024, 40 * 1024)
    descs = page_table(rng, src.numel(), page, 24, dst_pool_bytes=dst.numel())
    run_copy(dev, src, dst, descs)
    v = verify(dst, torch.from_numpy(descs).to(dev), SRC_SEED)
    assert v.ok and v.first_bad == -1 and v.nbytes == int(descs[:, 2].sum())


def test_copy_mixed_sizes_alignments_and_empty_rows(dev):
    # aligned and unaligned rows mixed in one group, zero-size rows, a row at each pool end
    src, dst = pools(dev, 20000, 20000)
    descs = np.array([[0, 19000, 1000],        # aligned, ends at the dst pool end
                      [16, 0, 0],              # empty
                      [19999, 4000, 1],        # last src byte
                      [3, 5001, 1027],         # unaligned
                      [4096, 8192, 3000],
                      [132, 12000, 132],       # 4-byte aligned indexer entry
                      [18500, 14000, 1500],
                      [7000, 16001, 2999]], dtype=np.int64)
    run_copy(dev, src, dst, descs)


@pytest.mark.parametrize("config", [
    CopyConfig(rows=1, width=4, unroll=1, num_warps=4, programs_per_sm=1),
    CopyConfig(rows=4, width=8, unroll=3, num_warps=4, programs_per_sm=1),
    CopyConfig(rows=2, width=16, unroll=2, num_warps=4, programs_per_sm=2),
    CopyConfig(rows=8, width=4, unroll=9, num_warps=4, programs_per_sm=1, load_cache=".cg", store_cache=".cs"),
], ids=lambda c: f"{c.rows}x{c.width}x{c.unroll}")
@pytest.mark.parametrize("programs", [1, 5])
def test_copy_tilings_and_grids(dev, config, programs):
    rng = np.random.default_rng(7)
    src, dst = pools(dev, 24 * 1024, 24 * 1024)
    descs = page_table(rng, src.numel(), 576, 13)
    descs[5, 2] = 100          # one short row
    run_copy(dev, src, dst, descs, config=config, num_programs=programs)


@pytest.mark.parametrize("rows", [1, 2])
def test_copy_few_large_descriptors_spread_over_programs(dev, rows):
    # fewer row groups than programs: each group is split into column slices
    src, dst = pools(dev, 64 * 1024, 64 * 1024)
    descs = np.array([[0, 32768, 30000], [32768, 0, 32768], [62000, 63000, 1536]], dtype=np.int64)
    cfg = CopyConfig(rows=rows, width=8, unroll=2, num_warps=4, programs_per_sm=1)
    run_copy(dev, src, dst, descs, config=cfg, num_programs=16)


def test_copy_row_range_and_validate_false(dev):
    rng = np.random.default_rng(3)
    src, dst = pools(dev, 32 * 1024, 32 * 1024)
    descs = page_table(rng, src.numel(), 1024, 30)
    t = torch.from_numpy(descs).to(dev)
    before = host(dst)
    copy_descriptors(src, dst, t, start=4, end=11)
    copy_descriptors(src, dst, t, start=20, end=30, validate=False, nbytes_hint=1024, local=True)
    copy_descriptors(src, dst, t, start=11, end=11)        # empty range: nothing
    want = expect_copy(src, before, np.concatenate([descs[4:11], descs[20:30]]))
    assert np.array_equal(host(dst), want)


def test_copy_within_one_pool(dev):
    pool, _ = pools(dev, 16 * 1024, 16)
    descs = np.array([[0, 8192, 4096], [4096, 12288, 2304], [7000, 15000, 33]], dtype=np.int64)
    before = host(pool)
    copy_descriptors(pool, pool, torch.from_numpy(descs).to(dev))
    want = before.copy()
    for s, d, n in descs.tolist():
        want[d:d + n] = before[s:s + n]
    assert np.array_equal(host(pool), want)


@pytest.mark.parametrize("shift", [1, 4, 8])
def test_copy_pools_at_unaligned_addresses(dev, shift):
    # views starting `shift` bytes into a buffer: the 16-byte path must not be taken blindly
    rng = np.random.default_rng(shift)
    big_src, big_dst = pools(dev, 20000 + shift, 20000 + shift)
    src, dst = big_src[shift:], big_dst[shift:]
    descs = page_table(rng, 20000, 576, 12)
    run_copy(dev, src, dst, descs)


def test_copy_empty_table_is_a_no_op(dev):
    src, dst = pools(dev, 1024, 1024)
    before = host(dst)
    copy_descriptors(src, dst, torch.zeros((0, 3), dtype=torch.int64, device=dev))
    assert np.array_equal(host(dst), before)


@st.composite
def random_tables(draw):
    """Random sizes (1..3000 B), alignments and offsets; destinations never overlap."""
    unit = draw(st.sampled_from([1, 4, 16]))
    n = draw(st.integers(1, 12))
    sizes = [draw(st.integers(1, 3000)) // unit * unit or unit for _ in range(n)]
    src_bytes = 40000
    srcs = [draw(st.integers(0, (src_bytes - s) // unit)) * unit for s in sizes]
    dsts, pos = [], draw(st.integers(0, 64)) * unit
    for s in sizes:
        dsts.append(pos)
        pos += s + draw(st.integers(0, 200)) * unit
    order = draw(st.permutations(range(n)))
    descs = np.array([[srcs[i], dsts[i], sizes[i]] for i in order], dtype=np.int64)
    return descs, src_bytes, pos + 16


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=random_tables(), programs=st.sampled_from([None, 1, 2, 7]))
def test_copy_matches_reference_hypothesis(dev, case, programs):
    descs, src_bytes, dst_bytes = case
    src, dst = pools(dev, src_bytes, dst_bytes)
    run_copy(dev, src, dst, descs, num_programs=programs)


# --------------------------------------------------------------------------- pack / unpack


@pytest.mark.parametrize("page", [528, 2304, 132, 99])
def test_pack_then_unpack_round_trip(dev, page):
    rng = np.random.default_rng(page + 1)
    src, dst = pools(dev, 40 * 1024, 40 * 1024)
    descs = page_table(rng, src.numel(), page, 14)
    t = torch.from_numpy(descs).to(dev)
    offs = pack_offsets(t)
    assert np.array_equal(host(offs), ref.pack_offsets(descs))
    total = int(descs[:, 2].sum())
    staging = torch.zeros(total + 32, dtype=torch.uint8, device=dev)
    pack(src, staging, t, offs, staging_offset=16)
    st_h = host(staging)
    assert np.array_equal(st_h[16:16 + total], ref.pack(host(src), descs))
    assert not st_h[:16].any() and not st_h[16 + total:].any()       # nothing outside the range
    assert verify(staging, packed_descriptors(t, offs, staging_offset=16), SRC_SEED).ok
    before = host(dst)
    unpack(staging, dst, t, offs, staging_offset=16)
    assert np.array_equal(host(dst), expect_copy(src, before, descs))


def test_pack_and_unpack_in_chunks_through_two_slots(dev):
    """Chunk i is packed into slot i % 2 while chunk i - 1 would be in flight."""
    rng = np.random.default_rng(11)
    src, dst = pools(dev, 64 * 1024, 64 * 1024)
    descs = page_table(rng, src.numel(), 576, 40)
    descs[::7, 2] = 132                         # some shorter rows: chunks differ in size
    t = torch.from_numpy(descs).to(dev)
    offs = pack_offsets(t)
    offs_h = ref.pack_offsets(descs)
    bounds = [0, 9, 17, 30, 40]
    slot_bytes = max(int(offs_h[b] - offs_h[a]) for a, b in zip(bounds, bounds[1:]))
    staging = torch.zeros(2 * slot_bytes, dtype=torch.uint8, device=dev)
    link = torch.zeros_like(staging)            # stands for the peer's staging buffer
    before = host(dst)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        slot = (i % 2) * slot_bytes
        pack(src, staging, t, offs, start=a, end=b, staging_offset=slot)
        n = int(offs_h[b] - offs_h[a])
        link[slot:slot + n].copy_(staging[slot:slot + n])
        unpack(link, dst, t, offs, start=a, end=b, staging_offset=slot)
    assert np.array_equal(host(dst), expect_copy(src, before, descs))


def test_pack_offsets_default_and_empty(dev):
    src, _ = pools(dev, 4096, 16)
    t = torch.tensor([[0, 0, 100], [200, 0, 50]], dtype=torch.int64, device=dev)
    staging = torch.zeros(150, dtype=torch.uint8, device=dev)
    pack(src, staging, t)                         # offsets computed here
    assert np.array_equal(host(staging), ref.pack(host(src), t.cpu().numpy()))
    empty = torch.zeros((0, 3), dtype=torch.int64, device=dev)
    assert host(pack_offsets(empty)).tolist() == [0]
    pack(src, staging, empty)
    unpack(staging, src, empty)


# --------------------------------------------------------------------------- configuration


def test_choose_config_covers_every_size():
    for hint in (None, 1, 132, 528, 576, 1024, 2304, 4096, 9216, 36864, 1 << 30):
        for few, local in ((False, False), (True, False), (False, True)):
            c = choose_config(hint, few_programs=few, local=local)
            assert c.rows * c.width >= 32 * c.num_warps or c.num_warps == 4   # 16-byte vectors per thread
            assert c.step_bytes >= 4096
            if few:
                assert c.programs_per_sm == 1 and c.step_bytes >= 32 * 1024


def test_copy_config_rejects_bad_values():
    with pytest.raises(BadInput, match="power of two"):
        CopyConfig(rows=3, width=4, unroll=1, num_warps=4, programs_per_sm=1)
    with pytest.raises(BadInput, match="unroll"):
        CopyConfig(rows=4, width=4, unroll=0, num_warps=4, programs_per_sm=1)
    with pytest.raises(BadInput, match="num_warps"):
        CopyConfig(rows=4, width=4, unroll=1, num_warps=3, programs_per_sm=1)
    with pytest.raises(BadInput, match="programs_per_sm"):
        CopyConfig(rows=4, width=4, unroll=1, num_warps=4, programs_per_sm=0)


@pytest.mark.parametrize("kw", [dict(rows=2.0), dict(width="4"), dict(unroll=1.5), dict(num_warps=4.0),
                                dict(programs_per_sm=None), dict(rows=True), dict(width=1 << 40),
                                dict(rows=1 << 10, width=1 << 10), dict(load_cache="zz"), dict(store_cache=".ca"),
                                dict(load_cache=None)])
def test_copy_config_of_other_types_or_beyond_a_kernel_block_is_bad_input(kw):
    """Fields that are not ints (or a bool), a tile of more elements than a Triton block holds, a cache modifier
    Triton has not: BadInput when the config is made, not a TypeError or a compile error at the launch."""
    f = dict(rows=4, width=4, unroll=1, num_warps=4, programs_per_sm=1)
    f.update(kw)
    with pytest.raises(BadInput, match="CopyConfig"):
        CopyConfig(**f)


# --------------------------------------------------------------------------- bad input


def _ok(dev):
    src, dst = pools(dev, 4096, 4096)
    t = torch.tensor([[0, 0, 1024], [1024, 2048, 512]], dtype=torch.int64, device=dev)
    return src, dst, t


@pytest.mark.parametrize("bad, match", [
    (lambda s, d, t: (s.to(torch.int32), d, t), "src_pool must be a uint8"),
    (lambda s, d, t: (s, d.reshape(64, 64), t), "dst_pool must be one-dimensional"),
    (lambda s, d, t: (s.reshape(64, 64).t().reshape(-1)[::2], d, t), "src_pool must be contiguous"),
    (lambda s, d, t: (s.cpu().numpy(), d, t), "src_pool must be a torch.Tensor"),
    (lambda s, d, t: (s, d, t.cpu().numpy()), "descs must be an int64 torch.Tensor"),
    (lambda s, d, t: (s, d, t.to(torch.int32)), "descs must be int64"),
    (lambda s, d, t: (s, d, t[:, :2].contiguous()), r"shape \(N, 3\)"),
    (lambda s, d, t: (s, d, t.t().contiguous().t()), "descs must be contiguous"),
    (lambda s, d, t: (s, d, t.to("meta")), "descs is on meta"),
    (lambda s, d, t: (s, d.to("meta"), t), "dst_pool is on meta"),
])
def test_copy_rejects_bad_pools_and_tables(dev, bad, match):
    src, dst, t = bad(*_ok(dev))
    with pytest.raises(BadInput, match=match):
        copy_descriptors(src, dst, t)


@pytest.mark.parametrize("row, match", [
    ([4000, 0, 100], "descriptor 1 .*source bytes \\[4000, 4100\\) lie outside the src pool of 4096 bytes"),
    ([0, 4095, 2], "descriptor 1 .*destination bytes \\[4095, 4097\\) lie outside the dst pool"),
    ([-16, 0, 10], "descriptor 1 .*negative"),
    ([0, 0, -1], "descriptor 1 .*negative"),
    ([0, 0, 1 << 62], "descriptor 1 .*outside"),
])
def test_copy_rejects_descriptors_outside_the_pools(dev, row, match):
    src, dst, t = _ok(dev)
    t[1] = torch.tensor(row, dtype=torch.int64)
    before = host(dst)
    with pytest.raises(BadInput, match=match):
        copy_descriptors(src, dst, t)
    with pytest.raises(BadInput, match=match):
        check_copy(src, dst, t)
    assert np.array_equal(host(dst), before)               # nothing was launched


def test_copy_rejects_bad_ranges_grids_and_devices(dev):
    src, dst, t = _ok(dev)
    with pytest.raises(BadInput, match="row range"):
        copy_descriptors(src, dst, t, start=1, end=3)
    with pytest.raises(BadInput, match="row range"):
        copy_descriptors(src, dst, t, start=2, end=1)
    with pytest.raises(BadInput, match="num_programs"):
        copy_descriptors(src, dst, t, num_programs=0)
    from gpuxfer.kernels import copy_launcher, launch_geometry
    for programs in (True, 1 << 40):        # a grid past 2**20 programs: the interpreter's (or CUDA's) limit
        with pytest.raises(BadInput, match="num_programs"):
            launch_geometry(1, dev, num_programs=programs)
        with pytest.raises(BadInput, match="num_programs"):
            copy_launcher(src, dst, t, num_programs=programs)
    for start, end in ((True, None), (0, True), (0, 1.0)):      # a bool is no row index
        with pytest.raises(BadInput, match="start/end"):
            copy_launcher(src, dst, t, start=start, end=end)
    with pytest.raises(BadInput, match="expected meta"):
        copy_descriptors(src, dst, t, device="meta")


def test_pack_and_unpack_reject_bad_staging_and_offsets(dev):
    src, dst, t = _ok(dev)
    offs = pack_offsets(t)
    small = torch.zeros(1535, dtype=torch.uint8, device=dev)
    with pytest.raises(BadInput, match="descriptor 1 .*outside the staging buffer of 1535 bytes"):
        pack(src, small, t, offs)
    with pytest.raises(BadInput, match="descriptor 1 .*outside the staging buffer"):
        unpack(small, dst, t, offs)
    staging = torch.zeros(2048, dtype=torch.uint8, device=dev)
    with pytest.raises(BadInput, match="descriptor 0 .*outside the staging buffer"):
        pack(src, staging, t, offs, staging_offset=1100)
    with pytest.raises(BadInput, match="N \\+ 1 = 3 entries"):
        pack(src, staging, t, offs[:2].contiguous())
    with pytest.raises(BadInput, match="offsets must be a contiguous 1-D int64"):
        unpack(staging, dst, t, offs.to(torch.int32))
    wrong = offs.clone()
    wrong[1] += 16
    with pytest.raises(BadInput, match="descriptor 0 .*pack_offsets"):
        pack(src, staging, t, wrong)
    with pytest.raises(BadInput, match="staging_offset"):
        pack(src, staging, t, offs, staging_offset=-1)
    with pytest.raises(BadInput, match="staging must be a uint8"):
        pack(src, staging.to(torch.int16), t, offs)


def test_scalar_arguments_of_the_wrong_type_or_past_the_buffers_are_bad_input(dev):
    from gpuxfer.kernels import fill_pattern
    from gpuxfer.kernels.launch import pack_launcher, unpack_launcher
    src, dst, t = _ok(dev)
    offs = pack_offsets(t)
    staging = torch.zeros(2048, dtype=torch.uint8, device=dev)
    for call in (lambda: pack(src, staging, t, offs, staging_offset=1 << 70),       # past int64
                 lambda: pack(src, staging, t, offs, staging_offset=True),
                 lambda: pack_launcher(src, staging, t, offs, start=0, end=2, staging_offset=2049),   # unchecked rows,
                 lambda: unpack_launcher(staging, dst, t, offs, start=0, end=2, staging_offset=1 << 70),  # checked scalar
                 lambda: packed_descriptors(t, offs, staging_offset="x"),
                 lambda: fill_pattern(src, 1, start="x"),
                 lambda: copy_descriptors(src, dst, t, nbytes_hint="x"),
                 lambda: copy_descriptors(src, dst, t, config="x")):
        with pytest.raises(BadInput):
            call()
    copy_descriptors(src, dst, t, nbytes_hint=np.int64(512))       # any integer type


def test_direct_launcher_binds_arguments_once(monkeypatch):
    """DualKernel.launcher on a CUDA device (driver calls faked): the first launch of a kind goes through
    Triton; later launches -- of this launcher and of a fresh one whose arguments are of the same kind --
    call the compiled kernel's launcher with every argument in order (tensors as addresses, constexprs
    included) and the stream; another kind (a misaligned tensor, an int == 1) goes through Triton again, but
    not a ``do_not_specialize`` int of another value (Triton keys it by its type alone)."""
    import torch
    from gpuxfer.kernels import _jit

    def k(a_ptr, b_ptr, n, m, BLOCK: "tl.constexpr"):
        pass

    kern = _jit.DualKernel(k, do_not_specialize=["n"])
    calls = {"triton": 0, "direct": []}

    class Compiled:
        function, packed_metadata = 77, "meta"

        def run(self, *a):
            calls["direct"].append(a)

    def slow(device, grid, *args, **kwargs):
        calls["triton"] += 1
        return Compiled()

    monkeypatch.setattr(kern, "launch", slow)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_jit, "_current_stream", lambda index: 1234)
    dev = torch.device("cuda", 0)
    buf = torch.zeros(64, dtype=torch.int64)
    a, b = buf[:8], buf[16:24]
    first = kern.launcher(dev, (3, 2), a, b, 100, 5, BLOCK=64, num_warps=4)
    first()
    assert calls == {"triton": 1, "direct": []}
    first()
    first(stream=99)
    fresh = kern.launcher(dev, (7,), b, a, 200, 21, BLOCK=64, num_warps=4)     # same kinds
    fresh()
    assert calls["triton"] == 1
    assert calls["direct"] == [(3, 2, 1, 1234, 77, "meta", None, None, None, a.data_ptr(), b.data_ptr(), 100, 5, 64),
                               (3, 2, 1, 99, 77, "meta", None, None, None, a.data_ptr(), b.data_ptr(), 100, 5, 64),
                               (7, 1, 1, 1234, 77, "meta", None, None, None, b.data_ptr(), a.data_ptr(), 200, 21, 64)]
    kern.launcher(dev, (1,), a, b, 1, 5, BLOCK=64, num_warps=4)()                 # n == 1: not specialised
    kern.launcher(dev, (1,), a, b, 32, 5, BLOCK=64, num_warps=4)()                # n % 16 == 0 likewise
    assert calls["triton"] == 1 and [c[11] for c in calls["direct"][3:]] == [1, 32]
    kern.launcher(dev, (1,), buf[1:9], b, 100, 5, BLOCK=64, num_warps=4)()        # 8-byte aligned only
    kern.launcher(dev, (1,), a, b, 100, 1, BLOCK=64, num_warps=4)()               # m == 1
    kern.launcher(dev, (1,), a, b, 100, 5, BLOCK=128, num_warps=4)()              # another constexpr
    assert calls["triton"] == 4 and len(calls["direct"]) == 5
    monkeypatch.setenv(_jit.ENV_DIRECT_LAUNCH, "0")
    off = kern.launcher(dev, (3, 2), a, b, 100, 5, BLOCK=64, num_warps=4)
    off()
    off()
    assert calls["triton"] == 6 and len(calls["direct"]) == 5


def _tables_inside_written_pools() -> list:
    """Copies whose descriptor table (or offsets) lies in the memory the copy writes, one row rewriting a row read
    later into (0, 2**40, 16): each must be refused before the launch (launched, it writes 2**40 bytes past the pool: SIGSEGV). In a child: what each call raised."""
    from gpuxfer.errors import BadInput
    from gpuxfer.kernels import check_copy, copy_descriptors, pack, unpack
    n = 64
    forged = torch.tensor([0, 1 << 40, 16], dtype=torch.int64).view(torch.uint8)

    def table_in(pool, first_dst: int):
        descs = pool[:n * 24].view(torch.int64).view(n, 3)
        for i in range(n):
            descs[i] = torch.tensor([4096 + 64 * i, first_dst + 64 * i, 64])
        descs[0] = torch.tensor([0, 40 * 24, 24])       # row 0 lands on row 40
        return descs

    def src_pool():
        src = torch.zeros(1 << 16, dtype=torch.uint8)
        src[:24] = forged
        return src

    out = []
    for name in ("copy", "check_copy", "pack", "unpack", "pack offsets"):
        dst, src = torch.zeros(1 << 16, dtype=torch.uint8), src_pool()
        try:
            if name == "copy":
                copy_descriptors(src, dst, table_in(dst, 8192))
            elif name == "check_copy":
                check_copy(src, dst, table_in(dst, 8192))
            elif name == "pack":                # staging (written) holds the table
                pack(src, dst, table_in(dst, 8192))
            elif name == "unpack":              # the dst pool (written) holds the table
                unpack(src, dst, table_in(dst, 8192))
            else:                               # the staging buffer (written) holds the offsets
                descs = torch.tensor([[4096 + 64 * i, 0, 64] for i in range(n)], dtype=torch.int64)
                offs = dst[:(n + 1) * 8].view(torch.int64)
                offs.copy_(torch.arange(n + 1, dtype=torch.int64) * 64)
                pack(src, dst, descs, offs, staging_offset=8192)
            out.append(f"{name}: no error")
        except BadInput as exc:
            out.append(f"{name}: BadInput {exc}")
    return out


def test_a_table_inside_the_memory_the_copy_writes_is_refused(spawner):
    got = spawner.start(_tables_inside_written_pools).result(120)
    assert all(r.split(":")[1].startswith(" BadInput") and "writes" in r for r in got), got
