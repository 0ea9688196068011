"""The kernels compile for a GPU (sm_90: Triton's front end, LLVM and its bundled ptxas) on a machine without
one: compiled-mode errors (types, loop-carried values, constexpr branches) show up on the CPU, not first on
a GPU run. The interpreter tests check what the kernels compute; these check that the GPU build exists."""
from __future__ import annotations

import pytest

from gpuxfer.kernels import launch as kl
from gpuxfer.kernels.block_kernel import expand_kernel
from gpuxfer.kernels.copy_kernel import copy_kernel
from gpuxfer.kernels.id_check_kernel import check_ids_kernel, settle_ids_kernel


def _compile(kernel, signature: dict, constexprs: dict, **options):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a Triton without its NVIDIA back end
        pytest.skip(f"Triton's NVIDIA back end is unavailable: {exc}")
    fn = JITFunction(kernel.fn, do_not_specialize=kernel.do_not_specialize)
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm.get("cubin"), "no cubin"


def test_expansion_compiles_for_sm90():
    _compile(expand_kernel, {"planes_ptr": "*i64", "req_ptr": "*i64", "out_ptr": "*i64", "n_planes": "i64",
                             "n_groups": "i64", "req_len": "i64", "n_rows": "i64"}, {"BLOCK": 1024}, num_warps=4)


@pytest.mark.parametrize("align", [16, 1])
def test_copy_with_its_range_on_the_device_compiles_for_sm90(align):
    cfg = kl.choose_config(584)
    sig = {"src_ptr": "*u8", "dst_ptr": "*u8", "desc_ptr": "*i64", "offs_ptr": "*i64", "row_begin": "i32",
           "n_rows": "i64", "staging_base": "i32", "n_items": "i32", "slices": "i32", "bounds_ptr": "*i64",
           "lo_at": "i32", "hi_at": "i32", "row_bytes": "i32", "n_planes": "i32", "n_groups": "i32", "req_len": "i32"}
    _compile(copy_kernel, sig, {"MODE": kl.MODE_COPY, "ALIGN": align, "ROWS": cfg.rows, "W": cfg.width,
                                "UNROLL": cfg.unroll, "LOAD_CACHE": "", "STORE_CACHE": "", "DEVICE_RANGE": True,
                                "SEARCH": 0, "SPLIT": True},
             num_warps=cfg.num_warps)


@pytest.mark.parametrize("mode, nbytes", [(kl.MODE_PACK_ROWS, 2304), (kl.MODE_UNPACK_ROWS, 528)])
def test_pack_of_rows_of_one_size_compiles_for_sm90(mode, nbytes):
    cfg = kl.choose_config(nbytes, local=True)
    sig = {"src_ptr": "*u8", "dst_ptr": "*u8", "desc_ptr": "*i64", "offs_ptr": "*i64", "row_begin": "i32",
           "n_rows": "i32", "staging_base": "i64", "n_items": "i32", "slices": "i32", "bounds_ptr": "*i64",
           "lo_at": "i32", "hi_at": "i32", "row_bytes": "i32", "n_planes": "i32", "n_groups": "i32", "req_len": "i32"}
    _compile(copy_kernel, sig, {"MODE": mode, "ALIGN": 16, "ROWS": cfg.rows, "W": cfg.width, "UNROLL": cfg.unroll,
                                "LOAD_CACHE": "", "STORE_CACHE": "", "DEVICE_RANGE": False, "SEARCH": 0,
                                "SPLIT": True},
             num_warps=cfg.num_warps)


@pytest.mark.parametrize("ints", ["i32", "i64"])     # as Triton types the integers by their values
@pytest.mark.parametrize("kernel", [check_ids_kernel, settle_ids_kernel])
def test_device_id_check_compiles_for_sm90(kernel, ints):
    sig = {"req_ptr": "*i64", "gtab_ptr": "*i64", "marks_ptr": "*i32", "n_groups": ints, "head": ints,
           "req_len": ints, "n_words": ints}
    if kernel is settle_ids_kernel:
        sig["n_zero"] = ints
    _compile(kernel, sig, {"BLOCK": 1024}, num_warps=4)


@pytest.mark.parametrize("align, nbytes, search, split", [(16, 584, 7, True), (16, 584, 7, False), (1, 2304, 0, True),
                                                          (4, 36864, 3, False)])
def test_block_copy_compiles_for_sm90(align, nbytes, search, split):
    """Mode 5: the copy deriving its rows from a request array and the plane table (no descriptor table), with
    and without the divisions by the planes' splits, at the tiling its launcher takes for the row size (its own
    below 4 KB a row)."""
    cfg = kl.blocks_config(nbytes) or kl.choose_config(nbytes)
    sig = {"src_ptr": "*u8", "dst_ptr": "*u8", "desc_ptr": "*i64", "offs_ptr": "*i64", "row_begin": "i32",
           "n_rows": "i64", "staging_base": "i32", "n_items": "i32", "slices": "i32", "bounds_ptr": "*i64",
           "lo_at": "i32", "hi_at": "i32", "row_bytes": "i32", "n_planes": "i32", "n_groups": "i32",
           "req_len": "i64"}
    _compile(copy_kernel, sig, {"MODE": kl.MODE_BLOCKS, "ALIGN": align, "ROWS": cfg.rows, "W": cfg.width,
                                "UNROLL": cfg.unroll, "LOAD_CACHE": "", "STORE_CACHE": "", "DEVICE_RANGE": True,
                                "SEARCH": search, "SPLIT": split}, num_warps=cfg.num_warps)
