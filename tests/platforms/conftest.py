"""Fixtures of the platform tests: real CUDA and ROCm platforms, each skipped with the reason where it is
unusable and closed after the test."""
from __future__ import annotations

import functools

import pytest

from gpuxfer.platforms import cuda as cm


@pytest.fixture(scope="module")
def cuda_reason():
    """Why the CUDA platform is unusable here (None: it is usable)."""
    return cm.CudaPlatform.unavailable_reason()


@pytest.fixture
def cuda_plat(cuda_reason):
    """A CudaPlatform."""
    if cuda_reason is not None:
        pytest.skip(f"CUDA unavailable: {cuda_reason}")
    p = cm.CudaPlatform()
    try:
        yield p
    finally:
        p.close()


@functools.lru_cache(maxsize=None)
def _rocm_reason():
    from gpuxfer.platforms.rocm import RocmPlatform
    return RocmPlatform.unavailable_reason()


@pytest.fixture
def rocm_plat():
    """A RocmPlatform over the real HIP runtime."""
    if _rocm_reason() is not None:
        pytest.skip(f"ROCm unavailable: {_rocm_reason()}")
    from gpuxfer.platforms.rocm import RocmPlatform
    p = RocmPlatform()
    yield p
    p.close()
