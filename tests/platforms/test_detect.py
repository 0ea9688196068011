"""Platform detection: order, forcing, and reasons for what was skipped."""
from __future__ import annotations

import subprocess
import sys

import pytest

from gpuxfer.errors import BadInput, PlatformUnavailable
from gpuxfer.platforms import PLATFORMS, detect, get_platform, unavailable_reason
from gpuxfer.platforms.host import HostPlatform

from _skips import platform_reason


@pytest.mark.skipif(platform_reason("cuda") is None, reason="this machine has a usable CUDA GPU")
def test_no_gpu_detects_host_with_reasons(monkeypatch):
    monkeypatch.delenv("GPUXFER_PLATFORM", raising=False)
    det = detect()
    try:
        assert isinstance(det.platform, HostPlatform)
        assert set(det.skipped) == set(PLATFORMS) - {"host"}
        for name, why in det.skipped.items():
            assert isinstance(why, str) and why.strip(), f"no reason given for skipping {name}"
    finally:
        det.platform.close()


def test_reasons_never_raise():
    for name in PLATFORMS:
        why = unavailable_reason(name)
        assert why is None or (isinstance(why, str) and why)
    assert unavailable_reason("host") is None


def test_missing_module_is_a_reason(monkeypatch):
    monkeypatch.setitem(PLATFORMS, "rocm", ("gpuxfer.platforms._no_such_module", "RocmPlatform"))
    why = unavailable_reason("rocm")
    assert why is not None and "ModuleNotFoundError" in why and "_no_such_module" in why


def test_broken_probe_is_a_reason(monkeypatch):
    class Broken(HostPlatform):
        @classmethod
        def unavailable_reason(cls):
            raise RuntimeError("driver library is corrupt")

    import gpuxfer.platforms as plats
    monkeypatch.setattr(plats, "platform_class", lambda name: Broken)
    assert unavailable_reason("cuda") == "RuntimeError: driver library is corrupt"


def test_forcing(monkeypatch):
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    with get_platform() as p:
        assert p.name == "host"
    monkeypatch.delenv("GPUXFER_PLATFORM")
    with get_platform("host") as p:
        assert p.name == "host"
    with pytest.raises(BadInput, match="unknown platform"):
        detect("tpu")


def test_forcing_an_unavailable_platform_raises(monkeypatch):
    monkeypatch.setitem(PLATFORMS, "rocm", ("gpuxfer.platforms._no_such_module", "RocmPlatform"))
    with pytest.raises(PlatformUnavailable) as info:
        detect("rocm")
    assert info.value.platform == "rocm" and "ModuleNotFoundError" in info.value.reason


def test_importing_gpuxfer_touches_no_gpu_library():
    code = ("import sys, gpuxfer, gpuxfer.platforms, gpuxfer.platforms.host, gpuxfer.sync; "
            "bad = [m for m in ('cupy', 'cuda.bindings.driver', 'pynvml', 'torch', 'triton') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture
def fresh_shared(monkeypatch):
    """current()'s process state, emptied for one test (and restored after it)."""
    import gpuxfer.platforms as plats
    monkeypatch.setattr(plats, "_shared", {})
    monkeypatch.setattr(plats, "_auto", [])
    yield plats
    plats._close_shared()


def test_one_platform_object_per_process(fresh_shared, monkeypatch):
    plats = fresh_shared
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    p = plats.current()
    assert p.name == "host" and not p.closed
    assert plats.current() is p and plats.current("host") is p and get_platform() is p and get_platform("host") is p
    assert detect("host").platform is not p          # detect() makes one the caller owns
    p.close()                                        # closed by a caller anyway: replaced
    q = plats.current()
    assert q is not p and not q.closed and plats.current() is q
    plats._close_shared()                            # what the exit hook does
    assert q.closed and plats.current() is not q


def test_the_exit_hook_closes_the_process_platform():
    # a hook registered before gpuxfer is imported runs after gpuxfer's (atexit: last in, first out)
    code = ("import atexit; box = []; atexit.register(lambda: print('closed' if box[0].closed else 'open')); "
            "import gpuxfer.platforms as p; box.append(p.current('host')); box[0].create_stream(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "closed"


def test_runtime_library_hook_gives_reasons_and_never_raises():
    from gpuxfer.platforms import platform_class
    assert "no runtime library" in platform_class("host").load_runtime_library(12)
    why = platform_class("cuda").load_runtime_library(99)       # a major version no machine has
    assert "libcudart.so.99" in why and "nvidia-cuda-runtime-cu99" in why
