"""Pattern fill and verify: kernels against the NumPy reference, and that verify
catches what it must (a flipped byte, swapped pages, an unwritten descriptor, a
page copied from its neighbour). CPU (interpreter) always; CUDA marked ``gpu``."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from gpuxfer.errors import BadInput, VerificationFailed
from gpuxfer.kernels import VerifyResult, copy_descriptors, fill_pattern, verify
from gpuxfer.kernels import reference as ref


def host(t: torch.Tensor) -> np.ndarray:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    return t.cpu().numpy().copy()


SRC, DST = 5, 6
PAGE = 528


def copied_pools(dev, npages: int = 24, page: int = PAGE, seed: int = 0):
    """src filled with SRC, dst with DST, every page copied to a random other slot."""
    rng = np.random.default_rng(seed)
    src = torch.empty(npages * page, dtype=torch.uint8, device=dev)
    dst = torch.empty(npages * page, dtype=torch.uint8, device=dev)
    fill_pattern(src, SRC)
    fill_pattern(dst, DST)
    descs = np.stack([rng.permutation(npages) * page, rng.permutation(npages) * page,
                      np.full(npages, page)], 1).astype(np.int64)
    t = torch.from_numpy(descs).to(dev)
    copy_descriptors(src, dst, t)
    return src, dst, descs, t


# --------------------------------------------------------------------------- the pattern itself


def test_reference_pattern_is_a_per_byte_function_of_seed_and_offset():
    whole = ref.pattern(9, 0, 10000)
    for start, n in [(0, 1), (1, 7), (7, 9), (8, 8), (4093, 1000), (9999, 1)]:
        assert np.array_equal(ref.pattern(9, start, n), whole[start:start + n])
    offs = np.random.default_rng(0).integers(0, 10000, size=500)
    assert np.array_equal(ref.pattern_at(9, offs), whole[offs])
    assert np.array_equal(ref.pattern_at(9, offs.reshape(20, 25)), whole[offs].reshape(20, 25))
    assert not np.array_equal(ref.pattern(10, 0, 10000), whole)
    # a big offset (a 100 GiB pool) is fine
    big = 100 << 30
    assert np.array_equal(ref.pattern(9, big, 64), ref.pattern_at(9, np.arange(big, big + 64)))


def test_reference_pattern_never_repeats_a_word_within_a_pool():
    words = ref.pattern(3, 0, 8 << 20).view("<u8")           # 8 MiB: 1 Mi 8-byte words
    assert np.unique(words).size == words.size
    # the byte histogram is flat (no stuck lanes)
    counts = np.bincount(ref.pattern(3, 0, 1 << 20), minlength=256)
    assert counts.min() > 0.8 * (1 << 20) / 256


@pytest.mark.parametrize("page", [8, 132, 528, 576, 2304])
def test_every_whole_page_misroute_is_detected(page):
    """Any page of a pool compared with any other page of the same or another seed's
    pool differs in at least one byte of every 8-byte word (page sizes are multiples of 4;
    for multiples of 8 this is the bijection argument; here it is checked exhaustively)."""
    npages = max(2, min(96, (96 * 528) // page))
    a = ref.pattern(SRC, 0, npages * page).reshape(npages, page)
    b = ref.pattern(DST, 0, npages * page).reshape(npages, page)
    same = (a[:, None, :] == a[None, :, :])                    # [from, to, byte]
    equal_bytes = same.sum(axis=2)
    np.fill_diagonal(equal_bytes, 0)
    # at most ~1/256 of the bytes of a misplaced page can match by chance, never all of it
    assert equal_bytes.max() < page // 2
    if page % 8 == 0:
        # word-level: no 8-byte word of a misplaced page is intact
        wa = a.view("<u8")
        eq_words = (wa[:, None, :] == wa[None, :, :]).sum(axis=2)
        np.fill_diagonal(eq_words, 0)
        assert eq_words.max() == 0
    assert (a[:, None, :] == b[None, :, :]).all(axis=2).sum() == 0


# --------------------------------------------------------------------------- fill


@pytest.mark.parametrize("seed", [0, 1, -7, 2**64 + 5])
def test_fill_matches_reference(dev, seed):
    pool = torch.zeros(70000, dtype=torch.uint8, device=dev)
    fill_pattern(pool, seed)
    assert np.array_equal(host(pool), ref.pattern(seed, 0, 70000))


def test_fill_a_range_leaves_the_rest(dev):
    pool = torch.zeros(9000, dtype=torch.uint8, device=dev)
    fill_pattern(pool, 4, start=1001, nbytes=4003)
    got = host(pool)
    assert np.array_equal(got[1001:5004], ref.pattern(4, 1001, 4003))
    assert not got[:1001].any() and not got[5004:].any()
    fill_pattern(pool, 4, start=9000)                       # empty range at the end
    fill_pattern(pool, 4, start=3, nbytes=0)


def test_fill_rejects_bad_arguments(dev):
    pool = torch.zeros(100, dtype=torch.uint8, device=dev)
    with pytest.raises(BadInput, match="fill range"):
        fill_pattern(pool, 1, start=50, nbytes=51)
    with pytest.raises(BadInput, match="fill range"):
        fill_pattern(pool, 1, start=-1)
    with pytest.raises(BadInput, match="seed must be an int"):
        fill_pattern(pool, 1.5)
    with pytest.raises(BadInput, match="fill range"):
        fill_pattern(pool, 1, start=True, nbytes=1)            # a bool is no offset (Triton's int1)
    with pytest.raises(BadInput, match="fill range"):
        fill_pattern(pool, 1, start=0, nbytes=True)
    with pytest.raises(BadInput, match="pool must be a uint8"):
        fill_pattern(pool.view(torch.int32), 1)


# --------------------------------------------------------------------------- verify


def test_verify_passes_a_correct_copy(dev):
    src, dst, descs, t = copied_pools(dev)
    v = verify(dst, t, SRC)
    assert v == VerifyResult(0, -1, len(descs), int(descs[:, 2].sum()))
    assert v.ok and v.raise_if_failed() is v
    assert ref.verify(host(dst), descs, SRC) == (0, -1)
    # against the wrong seed every byte is checked and nearly all are wrong
    w = verify(dst, t, DST)
    assert w.first_bad == 0 and w.wrong_bytes > 0.99 * w.nbytes


def _both(dev, dst, descs, t, seed=SRC):
    v = verify(dst, t, seed)
    assert (v.wrong_bytes, v.first_bad) == ref.verify(host(dst), descs, seed)
    return v


def test_verify_catches_a_single_flipped_byte(dev):
    src, dst, descs, t = copied_pools(dev)
    i = 9
    pos = int(descs[i, 1]) + 333
    dst[pos] ^= 0x10
    v = _both(dev, dst, descs, t)
    assert (v.wrong_bytes, v.first_bad) == (1, i)
    with pytest.raises(VerificationFailed, match="1 of 12672 bytes wrong; first wrong descriptor 9") as e:
        v.raise_if_failed("pull")
    assert e.value.wrong_bytes == 1 and e.value.first_bad == 9


def test_verify_catches_two_swapped_pages(dev):
    src, dst, descs, t = copied_pools(dev)
    a, b = 4, 15
    pa, pb = (int(descs[k, 1]) for k in (a, b))
    tmp = dst[pa:pa + PAGE].clone()
    dst[pa:pa + PAGE] = dst[pb:pb + PAGE]
    dst[pb:pb + PAGE] = tmp
    v = _both(dev, dst, descs, t)
    assert v.first_bad == a
    assert v.wrong_bytes > 2 * PAGE * 0.98       # all but a few chance matches
    assert v.wrong_bytes >= 2 * PAGE // 8        # deterministic floor: one byte per 8-byte word


def test_verify_catches_an_unwritten_descriptor(dev):
    rng = np.random.default_rng(1)
    src = torch.empty(24 * PAGE, dtype=torch.uint8, device=dev)
    dst = torch.empty(24 * PAGE, dtype=torch.uint8, device=dev)
    fill_pattern(src, SRC)
    fill_pattern(dst, DST)
    descs = np.stack([rng.permutation(24) * PAGE, rng.permutation(24) * PAGE, np.full(24, PAGE)], 1)
    descs = descs.astype(np.int64)
    t = torch.from_numpy(descs).to(dev)
    skipped = 17
    keep = torch.from_numpy(np.delete(descs, skipped, axis=0)).to(dev)
    copy_descriptors(src, dst, keep)
    v = _both(dev, dst, descs, t)
    assert v.first_bad == skipped and v.wrong_bytes > PAGE * 0.98


def test_verify_catches_a_page_copied_from_its_neighbour(dev):
    src, dst, descs, t = copied_pools(dev)
    i = 6
    s, d = int(descs[i, 0]), int(descs[i, 1])
    nb = s + PAGE if s + 2 * PAGE <= src.numel() else s - PAGE   # the next page in the source pool
    dst[d:d + PAGE] = src[nb:nb + PAGE]
    v = _both(dev, dst, descs, t)
    assert v.first_bad == i
    assert v.wrong_bytes >= PAGE // 8 and v.wrong_bytes > PAGE * 0.98


def test_verify_catches_a_page_shifted_by_a_few_bytes(dev):
    src, dst, descs, t = copied_pools(dev)
    i = 20
    s, d = int(descs[i, 0]), int(descs[i, 1])
    off = 4 if s + PAGE + 4 <= src.numel() else -4
    dst[d:d + PAGE] = src[s + off:s + off + PAGE]
    v = _both(dev, dst, descs, t)
    assert v.first_bad == i and v.wrong_bytes > PAGE * 0.95


def test_verify_first_bad_is_the_lowest_index_over_many_programs(dev):
    src, dst, descs, t = copied_pools(dev, npages=60, page=132)
    for i in (41, 7, 55):
        dst[int(descs[i, 1]) + 131] ^= 1
    for programs in (1, 3, 16):
        v = verify(dst, t, SRC, num_programs=programs)
        assert (v.wrong_bytes, v.first_bad) == (3, 7)


def test_verify_unaligned_descriptors_and_big_rows(dev):
    src = torch.empty(40000, dtype=torch.uint8, device=dev)
    dst = torch.empty(40000, dtype=torch.uint8, device=dev)
    fill_pattern(src, SRC)
    fill_pattern(dst, DST)
    descs = np.array([[3, 20001, 9999], [17, 5, 1], [30001, 10007, 9990]], dtype=np.int64)
    t = torch.from_numpy(descs).to(dev)
    copy_descriptors(src, dst, t)
    assert verify(dst, t, SRC).ok
    dst[10007 + 9989] ^= 0xFF
    v = _both(dev, dst, descs, t)
    assert (v.wrong_bytes, v.first_bad) == (1, 2)


def test_verify_validates_without_a_source_pool(dev):
    dst = torch.zeros(1000, dtype=torch.uint8, device=dev)
    fill_pattern(dst, SRC)
    # the source offset only keys the pattern: any non-negative offset is fine
    assert verify(dst, torch.tensor([[0, 0, 1000]], device=dev), SRC).ok
    assert verify(dst, torch.zeros((0, 3), dtype=torch.int64, device=dev), SRC) == VerifyResult(0, -1, 0, 0)
    with pytest.raises(BadInput, match="descriptor 1 .*destination bytes \\[990, 1010\\) lie outside the dst pool"):
        verify(dst, torch.tensor([[0, 0, 10], [5, 990, 20]], device=dev), SRC)
    with pytest.raises(BadInput, match="descriptor 0 .*negative"):
        verify(dst, torch.tensor([[-1, 0, 10]], device=dev), SRC)
    with pytest.raises(BadInput, match="seed must be an int"):
        verify(dst, torch.tensor([[0, 0, 10]], device=dev), "5")
    with pytest.raises(BadInput, match="num_programs"):
        verify(dst, torch.tensor([[0, 0, 10]], device=dev), 5, num_programs=0)
    with pytest.raises(BadInput, match="num_programs"):
        verify(dst, torch.tensor([[0, 0, 10]], device=dev), 5, num_programs=True)
    with pytest.raises(BadInput, match="int64"):
        verify(dst, torch.tensor([[0, 0, 10]], dtype=torch.int32, device=dev), 5)


def test_verify_without_validation_still_counts_bytes(dev):
    src, dst, descs, t = copied_pools(dev, npages=8)
    v = verify(dst, t, SRC, validate=False)
    assert v.ok and v.nbytes == 8 * PAGE


# --------------------------------------------------------------------------- TRITON_INTERPRET=1


def test_kernels_run_with_triton_interpret_set_before_import(tmp_path):
    """The host emulation's documented mode: TRITON_INTERPRET=1 before Triton is imported."""
    code = textwrap.dedent("""
        import os
        assert os.environ["TRITON_INTERPRET"] == "1"
        import numpy as np, torch
        from gpuxfer.kernels import copy_descriptors, fill_pattern, pack, unpack, pack_offsets, verify
        from gpuxfer.kernels import reference as ref
        src = torch.empty(20000, dtype=torch.uint8); dst = torch.empty(20000, dtype=torch.uint8)
        fill_pattern(src, 1); fill_pattern(dst, 2)
        assert np.array_equal(src.numpy(), ref.pattern(1, 0, 20000))
        d = torch.tensor([[0, 10000, 2304], [5000, 0, 528], [13, 3001, 77]])
        copy_descriptors(src, dst, d)
        assert verify(dst, d, 1).ok
        st = torch.zeros(3000, dtype=torch.uint8); o = pack_offsets(d)
        pack(src, st, d, o); dst2 = torch.zeros(20000, dtype=torch.uint8); unpack(st, dst2, d, o)
        assert verify(dst2, d, 1).ok
        print("interpreted ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "interpreted ok" in out.stdout


@pytest.mark.parametrize("kw", [dict(piece=0), dict(piece=-4), dict(piece=2.5), dict(piece=True), dict(piece="64"),
                                dict(piece=None), dict(pool_nbytes=-1), dict(pool_nbytes=1.5),
                                dict(pool_nbytes=True), dict(pool_nbytes=1 << 63)])
def test_guard_descriptors_refuses_a_piece_or_pool_size_out_of_range(kw):
    """``guard_descriptors`` given a piece of no bytes (a division by zero), a negative or fractional piece or pool
    size, a flag or a string: BadInput naming the argument, not torch's division error."""
    from gpuxfer.kernels.launch import guard_descriptors
    descs = torch.tensor([[0, 16, 16]], dtype=torch.int64)
    args = {"pool_nbytes": 64, "piece": 32, **kw}
    with pytest.raises(BadInput, match=next(iter(kw))):
        guard_descriptors(descs, args["pool_nbytes"], piece=args["piece"])
    assert guard_descriptors(descs, 64, piece=32).tolist() == [[0, 0, 16], [32, 32, 32]]
