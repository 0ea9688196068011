"""Shared fixtures: one contract suite over every platform present.

``platform_name`` is parametrised over ``host`` (always) and ``cuda`` (marked
``gpu``: deselected by default, and skipped with the reason where CUDA is
unusable). ``platform`` is a fresh platform object, closed after the test.
"""
from __future__ import annotations

import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # for _spawn, _skips and the fakes, also in spawned children

from _skips import platform_reason  # noqa: E402
from _spawn import Spawner  # noqa: E402


PLATFORM_PARAMS = [
    pytest.param("host", id="host"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=PLATFORM_PARAMS)
def platform_name(request) -> str:
    why = platform_reason(request.param)
    if why is not None:
        pytest.skip(f"platform {request.param} unavailable: {why}")
    return request.param


@functools.lru_cache(maxsize=None)
def device_count(name: str) -> int:
    from gpuxfer.bench.cliutil import device_count as count
    return count(name)


@pytest.fixture
def nccl_pairs(platform_name) -> str:
    """For a test whose ranks talk over NCCL, each on ``rank % devices``: skipped (with the reason) where the
    platform shows one device, since NCCL refuses two ranks on one device. The emulation has no such limit."""
    if platform_name != "host" and device_count(platform_name) < 2:
        pytest.skip(f"needs 2 {platform_name} devices (this machine shows 1): NCCL refuses two ranks on one device")
    return platform_name


@pytest.fixture
def platform(platform_name):
    from gpuxfer.platforms import get_platform
    p = get_platform(platform_name)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def host():
    from gpuxfer.platforms.host import HostPlatform
    p = HostPlatform()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def spawner():
    s = Spawner()
    try:
        yield s
    finally:
        s.cleanup()


# --------------------------------------------------------------------------- Triton kernels: cpu and cuda


@functools.lru_cache(maxsize=None)
def kernel_cuda_reason() -> str | None:
    """Why the kernel tests' cuda parameter cannot run here (None: it can)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 forces the interpreter"
    try:
        import torch
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
    except Exception as exc:  # pragma: no cover
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(params=[pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def dev(request):
    """The device a kernel test runs on: the CPU (Triton's interpreter) and, with -m gpu, a CUDA GPU."""
    import torch
    if request.param == "cuda":
        why = kernel_cuda_reason()
        if why:
            pytest.skip(why)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
