"""The ROCm platform on a machine without ROCm: detection reasons, the error checker, IPC handle bytes,
and the hip-python calls each hook makes (checked against a fake ``hip`` module).

Nothing here needs an AMD GPU; tests that use the real hip-python bindings
(importable without ROCm) skip where it is not installed.
"""
from __future__ import annotations

import ctypes
import enum
import os
import pickle
import subprocess
import sys
import types

import pytest

from fake_hsa import FakeHsaLib
from gpuxfer.errors import BadInput, DriverError, PlatformUnavailable
from gpuxfer.platforms import rocm as R
from gpuxfer.platforms import rocm_hip as RH
from gpuxfer.platforms import rocm_memory as RM
from gpuxfer.platforms import views
from gpuxfer.platforms.base import IpcHandle
from gpuxfer.platforms.hsa import Hsa
from gpuxfer.platforms.rocm import RocmPlatform, RocmStream


# --------------------------------------------------------------------------- a fake hip-python


class _Err(enum.IntEnum):
    hipSuccess = 0
    hipErrorInvalidValue = 1
    hipErrorOutOfMemory = 2
    hipErrorInvalidDevice = 101
    hipErrorInvalidContext = 201
    hipErrorNotReady = 600


class _Kind(enum.IntEnum):
    hipMemcpyHostToDevice = 1
    hipMemcpyDeviceToHost = 2
    hipMemcpyDeviceToDevice = 3
    hipMemcpyDefault = 4
    hipMemcpyDeviceToDeviceNoCU = 1024


class _Attr(enum.IntEnum):
    hipDeviceAttributeMultiprocessorCount = 63
    hipDeviceAttributeCanUseStreamWaitValue = 10013


class _Ptr:
    def __init__(self, addr):
        self.addr = addr

    def __int__(self):
        return self.addr


class _Handle:
    """Stands for hipIpcMemHandle_st: 64 bytes at int(handle)."""

    def __init__(self, raw=None):
        self.buf = (ctypes.c_char * 64).from_buffer_copy(bytes(raw) if raw is not None else bytes(64))

    def __int__(self):
        return ctypes.addressof(self.buf)

    @classmethod
    def fromObj(cls, obj):
        return cls(obj)


class FakeHip(types.SimpleNamespace):
    """The slice of ``hip.hip`` RocmPlatform calls, recording every call."""

    hipError_t = _Err
    hipMemcpyKind = _Kind
    hipDeviceAttribute_t = _Attr
    hipIpcMemHandle_st = _Handle
    S = (_Err.hipSuccess,)

    def __init__(self, devices=2, lib: FakeHsaLib | None = None, new_props=True):
        super().__init__()
        self.devices, self.lib, self.new_props = devices, lib, new_props
        self.calls: list[tuple] = []
        self.mem: dict[int, ctypes.Array] = {}
        self.current = 0
        self.fail: dict[str, int] = {}
        self.linktype = {}

    def _r(self, name, *args):
        self.calls.append((name, *args))
        if name in self.fail:
            return (_Err(self.fail[name]),)
        return None

    def named(self, name):
        return [c for c in self.calls if c[0] == name]

    def hipGetDeviceCount(self):
        return self._r("hipGetDeviceCount") or (_Err.hipSuccess, self.devices)

    def hipGetDevice(self):
        return (_Err.hipSuccess, self.current)

    def hipSetDevice(self, d):
        self.current = d
        return self._r("hipSetDevice", d) or self.S

    def hipStreamDestroy(self, stream):
        return self._r("hipStreamDestroy", stream) or self.S

    def hipRuntimeGetVersion(self):
        return (_Err.hipSuccess, 60443483)

    def hipDriverGetVersion(self):
        return (_Err.hipSuccess, 60443483)

    def hipExtMallocWithFlags(self, n, flags):
        if (e := self._r("hipExtMallocWithFlags", n, flags)):
            return e + (None,)
        if flags == RH.HIP_MALLOC_SIGNAL_MEMORY and self.lib is not None:
            h = self.lib.make_signal(1)
            return (_Err.hipSuccess, _Ptr(h + 8))           # HIP's pointer is the signal's value word
        b = (ctypes.c_uint8 * max(n, 16))()
        self.mem[ctypes.addressof(b)] = b
        return (_Err.hipSuccess, _Ptr(ctypes.addressof(b)))

    def hipFree(self, p):
        self.mem.pop(int(p), None)
        return self._r("hipFree", int(p)) or self.S

    def hipIpcGetMemHandle(self, p):
        raw = b"\x00" + int(p).to_bytes(8, "little") + bytes(range(55))   # starts with NUL on purpose
        return self._r("hipIpcGetMemHandle", int(p)) or (_Err.hipSuccess, _Handle(raw))

    def hipIpcOpenMemHandle(self, h, flags):
        raw = ctypes.string_at(int(h), 64)
        if (e := self._r("hipIpcOpenMemHandle", raw, flags)):
            return e + (None,)
        return (_Err.hipSuccess, _Ptr(int.from_bytes(raw[1:9], "little") + 0x10_0000_0000))

    def hipIpcCloseMemHandle(self, p):
        return self._r("hipIpcCloseMemHandle", int(p)) or self.S

    def hipStreamWriteValue64(self, stream, ptr, value, flags):
        return self._r("hipStreamWriteValue64", stream, ptr, value, flags) or self.S

    def hipStreamWaitValue64(self, stream, ptr, value, flags, mask):
        return self._r("hipStreamWaitValue64", stream, ptr, value, flags, mask) or self.S

    def hipMemcpyAsync(self, dst, src, n, kind, stream):
        assert isinstance(kind, _Kind), "hip-python refuses a plain int for an enum argument"
        return self._r("hipMemcpyAsync", dst, src, n, int(kind), stream) or self.S

    def hipMemsetAsync(self, ptr, value, n, stream):
        return self._r("hipMemsetAsync", ptr, value, n, stream) or self.S

    def hipDeviceCanAccessPeer(self, a, b):
        return (_Err.hipSuccess, 1)

    def hipExtGetLinkTypeAndHopCount(self, a, b):
        if (e := self._r("hipExtGetLinkTypeAndHopCount", a, b)):
            return e + (0, 0)
        return (_Err.hipSuccess, self.linktype.get((a, b), RH.HSA_AMD_LINK_INFO_TYPE_XGMI), 1)

    def hipDeviceGetAttribute(self, attr, dev):
        assert isinstance(attr, _Attr)
        return (_Err.hipSuccess, {63: 256, 10013: 1}[int(attr)])

    def hipDeviceGetPCIBusId(self, n, dev):
        return (_Err.hipSuccess, f"0000:{0xC1 + dev:02X}:00.0")

    class hipDeviceProp_t(types.SimpleNamespace):
        pass

    def hipGetDeviceProperties(self, *args):
        props = dict(name=b"AMD Instinct MI355X\0", gcnArchName="gfx950:sramecc+:xnack-", major=9, minor=5,
                     totalGlobalMem=288 << 30, multiProcessorCount=256, asyncEngineCount=16)
        if self.new_props:
            if len(args) != 1:
                raise TypeError("hipGetDeviceProperties() takes exactly 1 positional argument")
            return (_Err.hipSuccess, FakeHip.hipDeviceProp_t(**props))
        if len(args) != 2:
            raise TypeError("hipGetDeviceProperties() takes exactly 2 positional arguments")
        args[0].__dict__.update(props)
        return self.S


@pytest.fixture
def fhip():
    return FakeHip()


@pytest.fixture
def fake_rocm_plat(fhip):
    p = RocmPlatform(hip=fhip)
    yield p
    p.close()


def _stream(device=0, handle=0xABC):
    return RocmStream(device, types.SimpleNamespace(cuda_stream=handle))


# --------------------------------------------------------------------------- detection


def test_importing_the_module_loads_no_hip():
    code = ("import sys, gpuxfer.platforms.rocm, gpuxfer.platforms.hsa, gpuxfer.pp.sdma; "
            "print(any(m == 'hip' or m.startswith(('hip.', 'rocm.bindings')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_unavailable_here_with_a_reason():
    why = RocmPlatform.unavailable_reason()
    assert isinstance(why, str) and why
    from gpuxfer.platforms import unavailable_reason
    assert unavailable_reason("rocm") == why
    with pytest.raises(PlatformUnavailable):
        RocmPlatform()


def test_reason_without_hip_python(monkeypatch):
    import torch

    def no_hip():
        raise ImportError("No module named 'hip'")
    monkeypatch.setattr(R, "_import_hip", no_hip)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")     # a ROCm torch: hip-python is what is missing
    assert "hip-python is not installed" in RocmPlatform.unavailable_reason()


def test_a_cpu_torch_is_not_told_to_install_gpuxfer_rocm(monkeypatch):
    import torch

    def no_hip():
        raise ImportError("No module named 'hip'")
    monkeypatch.setattr(R, "_import_hip", no_hip)
    monkeypatch.setattr(torch.version, "hip", None)
    why = RocmPlatform.unavailable_reason()
    assert "not a ROCm build" in why and "install gpuxfer[rocm]" not in why


def test_reason_torch_not_rocm(monkeypatch):
    import torch
    monkeypatch.setattr(R, "_import_hip", lambda: FakeHip())
    monkeypatch.setattr(torch.version, "hip", None)
    assert "not a ROCm build" in RocmPlatform.unavailable_reason()


def test_reason_version_mismatch(monkeypatch):
    import torch
    monkeypatch.setattr(R, "_import_hip", lambda: FakeHip())
    monkeypatch.setattr(torch.version, "hip", "6.4.43482-0f2d60242")
    monkeypatch.setattr(R, "binding_hip_version", lambda: (7, 15))
    why = RocmPlatform.unavailable_reason()
    assert "generated for HIP 7.15" in why and "6.4.43482" in why


def _matching(monkeypatch, hip):
    import torch
    monkeypatch.setattr(R, "_import_hip", lambda: hip)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482-0f2d60242")
    monkeypatch.setattr(R, "binding_hip_version", lambda: (6, 4))


def test_reason_first_call_fails_to_load_the_runtime(monkeypatch):
    hip = FakeHip()

    def no_lib():
        raise RuntimeError("failed to dlopen 'b'libamdhip64.so'': cannot open shared object file")
    hip.hipGetDeviceCount = no_lib
    _matching(monkeypatch, hip)
    why = RocmPlatform.unavailable_reason()
    assert "hipGetDeviceCount" in why and "LIBRARY_NOT_LOADED" in why and "libamdhip64" in why


def test_reason_first_call_with_the_real_bindings(monkeypatch):
    """hip-python imports without ROCm; its first call raises, which becomes the reason."""
    pytest.importorskip("hip")
    import torch
    monkeypatch.setattr(torch.version, "hip", "{}.{}.0".format(*R.binding_hip_version()))
    if R.mapped_hip_runtimes():
        pytest.skip("a HIP runtime is loaded in this process")
    why = RocmPlatform.unavailable_reason()
    assert "hipGetDeviceCount failed with LIBRARY_NOT_LOADED" in why, why


def test_reason_no_devices_two_runtimes_and_runtime_mismatch(monkeypatch):
    hip = FakeHip(devices=0)
    _matching(monkeypatch, hip)
    assert "no AMD GPU" in RocmPlatform.unavailable_reason()
    hip.devices = 2
    monkeypatch.setattr(R, "mapped_hip_runtimes", lambda maps="": {"/opt/rocm/lib/libamdhip64.so.6",
                                                                   "/venv/torch/lib/libamdhip64.so"})
    assert "two HIP runtimes" in RocmPlatform.unavailable_reason()
    monkeypatch.setattr(R, "mapped_hip_runtimes", lambda maps="": set())
    hip.hipRuntimeGetVersion = lambda: (_Err.hipSuccess, 70051831)
    assert "the HIP runtime hip-python reached is 7.0" in RocmPlatform.unavailable_reason()
    hip.hipRuntimeGetVersion = lambda: (_Err.hipSuccess, 60443483)
    why = RocmPlatform.unavailable_reason()          # this torch (CPU) sees no GPU
    assert why is None or "torch.cuda.is_available" in why


def test_probe_never_raises(monkeypatch):
    import torch

    def boom():
        raise ValueError("corrupt install")
    monkeypatch.setattr(R, "_import_hip", boom)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")     # past the torch-build check, into the import
    assert "ValueError" in RocmPlatform.unavailable_reason()


def test_mapped_hip_runtimes_reads_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f0-7f1 r-xp 0 08:01 1 /opt/rocm/lib/libamdhip64.so.6.4.0\n"
                    "7f2-7f3 r--p 0 08:01 1 /opt/rocm/lib/libamdhip64.so.6.4.0\n"
                    "7f4-7f5 r-xp 0 08:01 2 /usr/lib/libc.so.6\n")
    assert RH.mapped_hip_runtimes(str(maps)) == {"/opt/rocm/lib/libamdhip64.so.6.4.0"}


def test_version_parsing():
    assert RH._major_minor("6.4.43482-0f2d60242") == (6, 4)
    assert RH._major_minor((7, 15, 26333, "0000000")) == (7, 15)
    assert RH._major_minor(None) is None


# --------------------------------------------------------------------------- the error checker


def test_hip_call_raises_driver_error_with_status_name_and_doing(fhip):
    fhip.fail["hipFree"] = 1
    with pytest.raises(DriverError) as ei:
        RH.hip_call(fhip, "hipFree", 0x1000, doing="freeing the receive slots")
    e = ei.value
    assert (e.api, e.status_name, e.status) == ("hipFree", "hipErrorInvalidValue", 1)
    assert "while freeing the receive slots" in str(e)


def test_hip_call_other_failures(fhip):
    def no_lib(*a):
        raise RuntimeError("failed to dlopen libamdhip64.so")
    fhip.hipFree = no_lib
    with pytest.raises(DriverError) as ei:
        RH.hip_call(fhip, "hipFree", 1, doing="x")
    assert ei.value.status_name == "LIBRARY_NOT_LOADED"
    with pytest.raises(DriverError) as ei:
        RH.hip_call(fhip, "hipNoSuchCall", doing="x")
    assert ei.value.status_name == "NOT_IN_BINDINGS"
    fhip.hipOdd = lambda: 0
    with pytest.raises(DriverError) as ei:
        RH.hip_call(fhip, "hipOdd", doing="x")
    assert ei.value.status_name == "UNEXPECTED_RESULT"
    assert RH.hip_call(fhip, "hipGetDeviceCount", doing="x") == (2,)
    assert RH.hip_error_name(fhip, 99999) == "hipError(99999)"


def test_hip_check_with_the_real_enum():
    hip = pytest.importorskip("hip").hip
    with pytest.raises(DriverError) as ei:
        RH.hip_check(hip, (hip.hipError_t(101),), "hipSetDevice", "making device 9 current")
    assert ei.value.status_name == "hipErrorInvalidDevice" and ei.value.status == 101
    assert RH.hip_check(hip, (hip.hipError_t.hipSuccess, 5), "x", "y") == (5,)


# --------------------------------------------------------------------------- IPC handle bytes


@pytest.mark.parametrize("raw", [bytes(64), b"\x00" + bytes(range(1, 64)), bytes(range(64)),
                                 bytes([255] * 64), os.urandom(64)])
def test_handle_round_trip_real_bindings(raw):
    hip = pytest.importorskip("hip").hip
    h = RH.handle_from_bytes(hip, raw)
    assert RH.handle_bytes(h) == raw
    assert RH.handle_bytes(RH.handle_from_bytes(hip, bytearray(raw))) == raw


def test_handle_wrong_size_is_bad_input(fhip):
    for bad in (b"", bytes(63), bytes(65), "x" * 64):
        with pytest.raises(BadInput):
            RH.handle_from_bytes(fhip, bad)


def test_export_open_round_trip_through_pickle(fake_rocm_plat, fhip):
    buf = fake_rocm_plat.alloc(4096, 1)
    h = buf.export()
    assert h.platform == "rocm" and h.device == 1 and h.nbytes == 4096 and len(h.payload) == 64
    assert h.payload[0] == 0                                   # a leading NUL survives (never .reserved)
    h2 = pickle.loads(pickle.dumps(h))
    assert h2 == h
    foreign = IpcHandle("rocm", 1, 4096, h2.payload, owner_pid=os.getpid() + 1)
    m = fake_rocm_plat.open_handle(foreign, 0)
    (_, raw, flags), = fhip.named("hipIpcOpenMemHandle")
    assert raw == h.payload and flags == RH.HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS == 1
    assert m.nbytes == 4096 and m.device == 0
    assert fake_rocm_plat.is_peer_address(m.ptr + 100)
    m.close()
    m.close()
    assert len(fhip.named("hipIpcCloseMemHandle")) == 1 and not fake_rocm_plat.is_peer_address(m.ptr + 100)
    buf.close()
    buf.close()
    assert len(fhip.named("hipFree")) == 1


def test_a_second_open_shares_the_mapping(fake_rocm_plat, fhip):
    """HIP maps an allocation once per device: a second open of its handle shares the first mapping, and
    only the last close unmaps it."""
    buf = fake_rocm_plat.alloc(4096, 1)
    foreign = IpcHandle("rocm", 1, 4096, buf.export().payload, owner_pid=os.getpid() + 1)
    m1, m2 = fake_rocm_plat.open_handle(foreign, 0), fake_rocm_plat.open_handle(foreign, 0)
    assert m1.ptr == m2.ptr and len(fhip.named("hipIpcOpenMemHandle")) == 1
    m1.close()
    assert not fhip.named("hipIpcCloseMemHandle") and fake_rocm_plat.is_peer_address(m2.ptr + 100)
    m2.close()
    assert len(fhip.named("hipIpcCloseMemHandle")) == 1 and not fake_rocm_plat.is_peer_address(m2.ptr + 100)
    buf.close()


def test_open_own_handle_or_foreign_platform_refused(fake_rocm_plat):
    buf = fake_rocm_plat.alloc(64, 0)
    with pytest.raises(BadInput, match="exported it"):
        fake_rocm_plat.open_handle(buf.export(), 1)
    with pytest.raises(BadInput, match="cannot be opened on ROCm"):
        fake_rocm_plat.open_handle(IpcHandle("cuda", 0, 64, bytes(64), 1), 1)
    buf.close()


def test_open_failure_is_a_driver_error(fake_rocm_plat, fhip):
    fhip.fail["hipIpcOpenMemHandle"] = 201
    with pytest.raises(DriverError) as ei:
        fake_rocm_plat.open_handle(IpcHandle("rocm", 1, 64, bytes(64), os.getpid() + 1), 0)
    assert ei.value.status_name == "hipErrorInvalidContext" and "opening the IPC handle" in ei.value.doing


# --------------------------------------------------------------------------- memory and flags


def test_allocation_flags(fake_rocm_plat, fhip):
    a = fake_rocm_plat.alloc(1024, 0)
    f = fake_rocm_plat.alloc_flags(64, 1)
    flags = [c[2] for c in fhip.named("hipExtMallocWithFlags")]
    assert flags == [RH.HIP_DEVICE_MALLOC_DEFAULT, RH.HIP_DEVICE_MALLOC_UNCACHED] and RH.HIP_DEVICE_MALLOC_UNCACHED == 3
    assert fhip.current == 0                                   # the current device is restored
    with pytest.raises(BadInput):
        fake_rocm_plat.alloc(0, 0)
    with pytest.raises(BadInput):
        fake_rocm_plat.alloc(8, 5)
    a.close()
    f.close()


def test_allocation_failure_names_size_and_device(fake_rocm_plat, fhip):
    fhip.fail["hipExtMallocWithFlags"] = 2
    with pytest.raises(DriverError) as ei:
        fake_rocm_plat.alloc_flags(64, 1)
    assert ei.value.status_name == "hipErrorOutOfMemory" and "64 B of uncached flag memory on device 1" in str(ei.value)


def test_signal_memory_is_checked_against_rocr():
    lib = FakeHsaLib()
    hsa = Hsa(lib=lib).init()
    fhip = FakeHip(lib=lib)
    fake_rocm_plat = RocmPlatform(hip=fhip, hsa=hsa)
    try:
        sig = fake_rocm_plat.alloc_signal(0)
        assert sig.ptr == sig.handle + 8 and lib.signal_value(sig.handle) == 1    # HIP creates it armed
        assert [c[2] for c in fhip.named("hipExtMallocWithFlags")] == [RH.HIP_MALLOC_SIGNAL_MEMORY]
        sig.close()
        # memory that is not a ROCr signal: refused, and freed
        fhip.lib = None
        with pytest.raises(DriverError) as ei:
            fake_rocm_plat.alloc_signal(0)
        assert ei.value.status_name == "HSA_STATUS_ERROR_INVALID_SIGNAL"
        assert len(fhip.named("hipFree")) == 2
    finally:
        fake_rocm_plat.close()
    assert lib.init_count == 0


def test_flag_write_and_wait_arguments(fake_rocm_plat, fhip):
    s = _stream(0, 0x5000)
    fake_rocm_plat.write_flag(s, 0x1000, 7)
    fake_rocm_plat.wait_flag(s, 0x1008, 9)
    fake_rocm_plat.write_flag(s, 0x1010, -1)
    assert fhip.named("hipStreamWriteValue64")[0] == ("hipStreamWriteValue64", 0x5000, 0x1000, 7, 0)
    assert fhip.named("hipStreamWaitValue64")[0] == ("hipStreamWaitValue64", 0x5000, 0x1008, 9,
                                                     RH.HIP_STREAM_WAIT_VALUE_GTE, (1 << 64) - 1)
    assert RH.HIP_STREAM_WAIT_VALUE_GTE == 0
    assert fhip.named("hipStreamWriteValue64")[1][3] == (1 << 64) - 1
    with pytest.raises(BadInput):
        fake_rocm_plat.write_flag(s, 0x1004, 1)                          # not 8-byte aligned
    with pytest.raises(BadInput):
        fake_rocm_plat.wait_flag(object(), 0x1000, 1)


def test_copy_kind_uses_sdma_for_peer_memory(fake_rocm_plat, fhip):
    s = _stream(0, 0x77)
    local = fake_rocm_plat.alloc(256, 0)
    other = fake_rocm_plat.alloc(256, 1)
    m = fake_rocm_plat.open_handle(IpcHandle("rocm", 1, 4096, bytes(64), os.getpid() + 1), 0)
    fake_rocm_plat.copy_async(s, m.ptr + 64, local.ptr, 128)             # to a peer: SDMA, no CU
    fake_rocm_plat.copy_async(s, local.ptr, other.ptr + 8, 8)            # from another device's buffer: SDMA
    fake_rocm_plat.copy_async(s, local.ptr, local.ptr + 128, 64)         # local: HIP decides
    fake_rocm_plat.copy_async(s, local.ptr, local.ptr + 128, 64, force_nocu=True)
    fake_rocm_plat.copy_async(s, local.ptr, local.ptr + 128, 0)          # nothing queued
    kinds = [c[4] for c in fhip.named("hipMemcpyAsync")]
    nocu = RH.HIP_MEMCPY_DEVICE_TO_DEVICE_NOCU
    assert kinds == [nocu, nocu, RH.HIP_MEMCPY_DEFAULT, nocu] and nocu == 1024
    assert all(c[5] == 0x77 for c in fhip.named("hipMemcpyAsync"))
    m.close()
    local.close()
    other.close()


def test_memset_arguments(fake_rocm_plat, fhip):
    fake_rocm_plat.memset_async(_stream(), 0x2000, 0, 64)
    assert fhip.named("hipMemsetAsync") == [("hipMemsetAsync", 0x2000, 0, 64, 0xABC)]
    with pytest.raises(BadInput):
        fake_rocm_plat.memset_async(_stream(), 0x2000, 300, 64)


# --------------------------------------------------------------------------- devices and links


@pytest.mark.parametrize("new_props", [True, False])
def test_device_properties_shim(new_props, monkeypatch):
    fhip = FakeHip(new_props=new_props)
    api = RH.HipApi(fhip)
    props = api.device_properties(0)
    assert RH._s(props.name) == "AMD Instinct MI355X" and props.gcnArchName.startswith("gfx950")
    api._new_props = not new_props                              # a wrong first guess falls back on TypeError
    assert RH._s(api.device_properties(1).gcnArchName).startswith("gfx950")


def test_pci_bus_id_and_link_kinds(fake_rocm_plat, fhip):
    assert fake_rocm_plat.pci_bus_id(1) == "0000:c2:00.0"
    assert fake_rocm_plat.link(0, 0).kind == "same-device"
    l01 = fake_rocm_plat.link(0, 1)
    assert l01.kind == "xgmi" and l01.peer_access and l01.is_fast
    fhip.linktype[(1, 0)] = RH.HSA_AMD_LINK_INFO_TYPE_PCIE
    assert fake_rocm_plat.link(1, 0).kind == "pcie" and not fake_rocm_plat.link(1, 0).is_fast
    fhip.fail["hipExtGetLinkTypeAndHopCount"] = 1
    l = fake_rocm_plat.link(0, 1)
    assert l.kind == "unknown" and "unreadable" in l.detail


def test_versions_and_attributes(fake_rocm_plat):
    v = fake_rocm_plat.versions()
    assert v["HIP runtime"].startswith("6.4") and "hip-python" in v
    assert fake_rocm_plat.attribute("CanUseStreamWaitValue", 0) == 1
    assert fake_rocm_plat.device_count() == 2


def test_agent_is_matched_by_pci_bus_id():
    lib = FakeHsaLib()
    fake_rocm_plat = RocmPlatform(hip=FakeHip(), hsa=Hsa(lib=lib).init())
    try:
        assert fake_rocm_plat.agent(1).handle == lib.gpus[1].handle
        assert fake_rocm_plat.agent(0).handle == lib.gpus[0].handle
    finally:
        fake_rocm_plat.close()


def test_tensor_view_params_validate():
    import torch

    class M:
        nbytes = 1024

        def check_range(self, off, n, what):
            if off + n > self.nbytes:
                raise BadInput(what)

    assert views.tensor_view_params(M(), torch.bfloat16, None, 0)[1:] == ((512,), 1024)
    assert views.tensor_view_params(M(), "float32", (4, 8), 512)[1:] == ((4, 8), 128)
    with pytest.raises(BadInput):
        views.tensor_view_params(M(), torch.float32, None, 2)
    with pytest.raises(BadInput):
        views.tensor_view_params(M(), torch.float32, (300,), 0)
    cai = RM._CudaArrayInterface(0x1000, 64).__cuda_array_interface__
    assert cai["data"] == (0x1000, False) and cai["shape"] == (64,) and cai["typestr"] == "|u1"


def test_owned_streams_are_destroyed_once_and_refused_when_closed(fhip):
    p = RocmPlatform(hip=fhip)
    own = RocmStream(0, types.SimpleNamespace(cuda_stream=0x5000), hip_stream=0x5000, dedicated=True, platform=p)
    pooled = RocmStream(0, types.SimpleNamespace(cuda_stream=0x6000), platform=p)
    left = RocmStream(1, types.SimpleNamespace(cuda_stream=0x7000), hip_stream=0x7000, dedicated=True, platform=p)
    p._streams._owned += [own, left]
    borrowed = _stream(0, 0x8000)
    for s in (own, pooled, borrowed):
        s.close()
        s.close()
    assert [c[1] for c in fhip.named("hipStreamDestroy")] == [0x5000]
    assert own.closed and pooled.closed and not borrowed.closed
    for s in (own, pooled):
        with pytest.raises(BadInput, match="closed"):
            p.write_flag(s, 0x2000, 1)
    p.write_flag(borrowed, 0x2000, 1)
    p.close()                          # destroys the streams still open, once
    left.close()
    assert [c[1] for c in fhip.named("hipStreamDestroy")] == [0x5000, 0x7000] and left.closed


def test_close_is_idempotent(fhip):
    p = RocmPlatform(hip=fhip)
    p.close()
    p.close()
    with pytest.raises(BadInput):
        p.alloc(8, 0)


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan"])
def test_bad_host_flag_timeout_is_a_configuration_error_naming_the_variable(fhip, monkeypatch, value):
    """Read when the platform is built (importing never fails on it), and never reported as 'ROCm unavailable'."""
    monkeypatch.setenv(R.HOST_FLAG_TIMEOUT_ENV, value)
    code = "import gpuxfer.platforms.rocm as r; print(r.HOST_FLAG_TIMEOUT_S)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "10.0", out.stderr
    from gpuxfer.platforms import unavailable_reason
    assert "GPUXFER_ROCM_HOST_FLAG_TIMEOUT_S" not in (unavailable_reason("rocm") or "")
    with pytest.raises(BadInput, match=f"GPUXFER_ROCM_HOST_FLAG_TIMEOUT_S must be .*got '{value}'"):
        RocmPlatform(hip=fhip)


def test_host_flag_timeout_from_the_environment(fhip, monkeypatch):
    monkeypatch.setenv(R.HOST_FLAG_TIMEOUT_ENV, " 2.5 ")
    p = RocmPlatform(hip=fhip)
    try:
        assert p.host_flag_timeout_s == 2.5
    finally:
        p.close()
    monkeypatch.delenv(R.HOST_FLAG_TIMEOUT_ENV)
    with RocmPlatform(hip=fhip) as p:
        assert p.host_flag_timeout_s == R.HOST_FLAG_TIMEOUT_S
