"""Triton kernels for paged KV pools: descriptor copy (pull/push), pack/unpack, pattern fill/verify.

Importing this package imports neither torch nor Triton; the names below load
:mod:`gpuxfer.kernels.launch` (and Triton) on first use.

* :func:`copy_descriptors` -- copy ``(src_offset, dst_offset, nbytes)`` descriptors
  between two uint8 pools (either may be a peer GPU's pool opened over IPC).
* :func:`pack` / :func:`unpack` -- gather descriptors into a contiguous staging
  buffer and scatter it back, by row ranges (chunkable); :func:`pack_offsets`.
* :func:`fill_pattern` / :func:`verify` -- a per-byte pattern keyed by
  (seed, pool offset) and a full check of every transferred byte.
* :func:`expand_blocks` -- a KV transfer's block IDs and registered layout expanded into
  copy descriptors on the device (:mod:`gpuxfer.kernels.block_kernel`).

All launch on torch's current stream. :mod:`gpuxfer.kernels.reference` is the
NumPy reference (no Triton). Kernels run compiled on GPU tensors and in Triton's
interpreter on CPU tensors (the host emulation) -- no environment variable needed.
"""
from __future__ import annotations

import importlib

_LAUNCH_NAMES = ("CopyConfig", "VerifyResult", "choose_config", "copy_blocks_launcher", "copy_descriptors",
                 "copy_launcher", "copy_range_launcher", "default_programs", "fill_pattern", "launch_geometry", "pack",
                 "pack_launcher", "pack_offsets", "packed_descriptors", "sm_count", "unpack", "unpack_launcher", "verify")

_CHECK_NAMES = ("DescriptorStats", "check_copy")

_BLOCK_NAMES = ("PLANE_FIELDS", "expand_blocks", "request_header_len")

__all__ = list(_LAUNCH_NAMES) + list(_CHECK_NAMES) + list(_BLOCK_NAMES)


def __getattr__(name: str):
    if name in _LAUNCH_NAMES:
        return getattr(importlib.import_module(".launch", __name__), name)
    if name in _CHECK_NAMES:
        return getattr(importlib.import_module(".checks", __name__), name)
    if name in _BLOCK_NAMES:
        return getattr(importlib.import_module(".blocks", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAUNCH_NAMES) + list(_CHECK_NAMES) + list(_BLOCK_NAMES))
