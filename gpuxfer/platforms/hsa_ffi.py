"""ROCr's C interface as gpuxfer declares it: the enum values it passes and reads, the ctypes types, every
C function once with its prototype (:data:`FUNCTIONS`), where to look for ``libhsa-runtime64``, and the
argument check a fake library's calls go through. :class:`~gpuxfer.platforms.hsa.Hsa` binds these.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Callable

from .. import config

# --------------------------------------------------------------------------- constants
# hsa.h / hsa_ext_amd.h (ROCm/rocm-systems projects/rocr-runtime/runtime/hsa-runtime/inc)

HSA_STATUS_SUCCESS = 0x0
HSA_STATUS_INFO_BREAK = 0x1
HSA_STATUS_ERROR_INVALID_ARGUMENT = 0x1001
HSA_STATUS_ERROR_OUT_OF_RESOURCES = 0x1008

HSA_STATUS_NAMES = {
    0x0: "HSA_STATUS_SUCCESS", 0x1: "HSA_STATUS_INFO_BREAK", 0x1000: "HSA_STATUS_ERROR",
    0x1001: "HSA_STATUS_ERROR_INVALID_ARGUMENT", 0x1002: "HSA_STATUS_ERROR_INVALID_QUEUE_CREATION",
    0x1003: "HSA_STATUS_ERROR_INVALID_ALLOCATION", 0x1004: "HSA_STATUS_ERROR_INVALID_AGENT",
    0x1005: "HSA_STATUS_ERROR_INVALID_REGION", 0x1006: "HSA_STATUS_ERROR_INVALID_SIGNAL",
    0x1007: "HSA_STATUS_ERROR_INVALID_QUEUE", 0x1008: "HSA_STATUS_ERROR_OUT_OF_RESOURCES",
    0x1009: "HSA_STATUS_ERROR_INVALID_PACKET_FORMAT", 0x100A: "HSA_STATUS_ERROR_RESOURCE_FREE",
    0x100B: "HSA_STATUS_ERROR_NOT_INITIALIZED", 0x100C: "HSA_STATUS_ERROR_REFCOUNT_OVERFLOW",
    0x100D: "HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS", 0x100E: "HSA_STATUS_ERROR_INVALID_INDEX",
    0x100F: "HSA_STATUS_ERROR_INVALID_ISA", 0x1010: "HSA_STATUS_ERROR_INVALID_CODE_OBJECT",
    0x1011: "HSA_STATUS_ERROR_INVALID_EXECUTABLE", 0x1012: "HSA_STATUS_ERROR_FROZEN_EXECUTABLE",
    0x1013: "HSA_STATUS_ERROR_INVALID_SYMBOL_NAME", 0x1014: "HSA_STATUS_ERROR_VARIABLE_ALREADY_DEFINED",
    0x1015: "HSA_STATUS_ERROR_VARIABLE_UNDEFINED", 0x1016: "HSA_STATUS_ERROR_EXCEPTION",
    0x1017: "HSA_STATUS_ERROR_INVALID_ISA_NAME", 0x1018: "HSA_STATUS_ERROR_INVALID_CODE_SYMBOL",
    0x1019: "HSA_STATUS_ERROR_INVALID_EXECUTABLE_SYMBOL", 0x1020: "HSA_STATUS_ERROR_INVALID_FILE",
    0x1021: "HSA_STATUS_ERROR_INVALID_CODE_OBJECT_READER", 0x1022: "HSA_STATUS_ERROR_INVALID_CACHE",
    0x1023: "HSA_STATUS_ERROR_INVALID_WAVEFRONT", 0x1024: "HSA_STATUS_ERROR_INVALID_SIGNAL_GROUP",
    0x1025: "HSA_STATUS_ERROR_INVALID_RUNTIME_STATE",
}

HSA_AGENT_INFO_NAME = 0                  # char[64]
HSA_AGENT_INFO_NODE = 16                 # uint32
HSA_AGENT_INFO_DEVICE = 17               # hsa_device_type_t (uint32)
HSA_DEVICE_TYPE_CPU = 0
HSA_DEVICE_TYPE_GPU = 1
HSA_AMD_AGENT_INFO_DRIVER_NODE_ID = 0xA004   # uint32
HSA_AMD_AGENT_INFO_BDFID = 0xA006            # uint32: bus << 8 | device << 3 | function
HSA_AMD_AGENT_INFO_DOMAIN = 0xA00F           # uint32
HSA_AMD_AGENT_INFO_NUM_SDMA_ENG = 0xA10A     # uint32 (PCIe / "paging" engines)
HSA_AMD_AGENT_INFO_NUM_SDMA_XGMI_ENG = 0xA10B

HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY = 3  # uint64, Hz: the unit of a wait's timeout hint

HSA_SIGNAL_CONDITION_EQ = 0
HSA_SIGNAL_CONDITION_NE = 1
HSA_SIGNAL_CONDITION_LT = 2
HSA_SIGNAL_CONDITION_GTE = 3
HSA_WAIT_STATE_BLOCKED = 0
HSA_WAIT_STATE_ACTIVE = 1

HSA_AMD_SIGNAL_AMD_GPU_ONLY = 1   # a plain memory signal, never an interrupt one
HSA_AMD_SIGNAL_IPC = 2

HSA_EXT_POINTER_TYPE_UNKNOWN = 0
HSA_EXT_POINTER_TYPE_HSA = 1
HSA_EXT_POINTER_TYPE_LOCKED = 2
HSA_EXT_POINTER_TYPE_GRAPHICS = 3
HSA_EXT_POINTER_TYPE_IPC = 4

# --------------------------------------------------------------------------- ctypes types


class hsa_agent_t(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_uint64)]


class hsa_signal_t(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_uint64)]


class hsa_amd_pointer_info_t(ctypes.Structure):
    # Fields up to global_flags; `size` tells the runtime how much we have ("can only grow").
    _fields_ = [("size", ctypes.c_uint32), ("type", ctypes.c_uint32),
                ("agentBaseAddress", ctypes.c_void_p), ("hostBaseAddress", ctypes.c_void_p),
                ("sizeInBytes", ctypes.c_size_t), ("userData", ctypes.c_void_p),
                ("agentOwner", hsa_agent_t), ("global_flags", ctypes.c_uint32)]


hsa_status_t = ctypes.c_int
hsa_signal_value_t = ctypes.c_int64
AGENT_CALLBACK = ctypes.CFUNCTYPE(hsa_status_t, hsa_agent_t, ctypes.c_void_p)


@dataclass(frozen=True)
class Function:
    """One C function: its name, return type, argument types; ``optional`` ones may be absent."""

    name: str
    restype: Any
    argtypes: tuple
    optional: bool = False
    returns_status: bool = True


_u32p = ctypes.POINTER(ctypes.c_uint32)
_sigp = ctypes.POINTER(hsa_signal_t)
_agentp = ctypes.POINTER(hsa_agent_t)

FUNCTIONS: tuple[Function, ...] = (
    # hsa_status_t hsa_init(void);
    Function("hsa_init", hsa_status_t, ()),
    # hsa_status_t hsa_shut_down(void);
    Function("hsa_shut_down", hsa_status_t, ()),
    # hsa_status_t hsa_status_string(hsa_status_t status, const char** status_string);
    Function("hsa_status_string", hsa_status_t, (hsa_status_t, ctypes.POINTER(ctypes.c_char_p))),
    # hsa_status_t hsa_system_get_info(hsa_system_info_t attribute, void* value);
    Function("hsa_system_get_info", hsa_status_t, (ctypes.c_int, ctypes.c_void_p)),
    # hsa_status_t hsa_iterate_agents(hsa_status_t (*callback)(hsa_agent_t agent, void* data), void* data);
    Function("hsa_iterate_agents", hsa_status_t, (AGENT_CALLBACK, ctypes.c_void_p)),
    # hsa_status_t hsa_agent_get_info(hsa_agent_t agent, hsa_agent_info_t attribute, void* value);
    Function("hsa_agent_get_info", hsa_status_t, (hsa_agent_t, ctypes.c_int, ctypes.c_void_p)),
    # hsa_status_t hsa_amd_signal_create(hsa_signal_value_t initial_value, uint32_t num_consumers,
    #                                    const hsa_agent_t* consumers, uint64_t attributes, hsa_signal_t* signal);
    Function("hsa_amd_signal_create", hsa_status_t,
             (hsa_signal_value_t, ctypes.c_uint32, _agentp, ctypes.c_uint64, _sigp)),
    # hsa_status_t hsa_signal_destroy(hsa_signal_t signal);
    Function("hsa_signal_destroy", hsa_status_t, (hsa_signal_t,)),
    # hsa_status_t hsa_amd_signal_value_pointer(hsa_signal_t signal, volatile hsa_signal_value_t** value_ptr);
    Function("hsa_amd_signal_value_pointer", hsa_status_t, (hsa_signal_t, ctypes.POINTER(ctypes.c_void_p))),
    # hsa_signal_value_t hsa_signal_load_scacquire(hsa_signal_t signal);
    Function("hsa_signal_load_scacquire", hsa_signal_value_t, (hsa_signal_t,), returns_status=False),
    # void hsa_signal_store_screlease(hsa_signal_t signal, hsa_signal_value_t value);
    Function("hsa_signal_store_screlease", None, (hsa_signal_t, hsa_signal_value_t), returns_status=False),
    # hsa_signal_value_t hsa_signal_wait_scacquire(hsa_signal_t signal, hsa_signal_condition_t condition,
    #     hsa_signal_value_t compare_value, uint64_t timeout_hint, hsa_wait_state_t wait_state_hint);
    Function("hsa_signal_wait_scacquire", hsa_signal_value_t,
             (hsa_signal_t, ctypes.c_int, hsa_signal_value_t, ctypes.c_uint64, ctypes.c_int), returns_status=False),
    # hsa_status_t hsa_amd_memory_async_copy_on_engine(void* dst, hsa_agent_t dst_agent, const void* src,
    #     hsa_agent_t src_agent, size_t size, uint32_t num_dep_signals, const hsa_signal_t* dep_signals,
    #     hsa_signal_t completion_signal, hsa_amd_sdma_engine_id_t engine_id, bool force_copy_on_sdma);
    Function("hsa_amd_memory_async_copy_on_engine", hsa_status_t,
             (ctypes.c_void_p, hsa_agent_t, ctypes.c_void_p, hsa_agent_t, ctypes.c_size_t, ctypes.c_uint32,
              _sigp, hsa_signal_t, ctypes.c_uint, ctypes.c_bool)),
    # hsa_status_t hsa_amd_memory_copy_engine_status(hsa_agent_t dst_agent, hsa_agent_t src_agent,
    #                                                uint32_t* engine_ids_mask);
    Function("hsa_amd_memory_copy_engine_status", hsa_status_t, (hsa_agent_t, hsa_agent_t, _u32p)),
    # hsa_status_t hsa_amd_memory_get_preferred_copy_engine(hsa_agent_t dst_agent, hsa_agent_t src_agent,
    #                                                       uint32_t* recommended_ids_mask);   (ext_amd >= 1.8)
    Function("hsa_amd_memory_get_preferred_copy_engine", hsa_status_t, (hsa_agent_t, hsa_agent_t, _u32p),
             optional=True),
    # hsa_status_t hsa_amd_pointer_info(const void* ptr, hsa_amd_pointer_info_t* info, void* (*alloc)(size_t),
    #                                   uint32_t* num_agents_accessible, hsa_agent_t** accessible);
    Function("hsa_amd_pointer_info", hsa_status_t,
             (ctypes.c_void_p, ctypes.POINTER(hsa_amd_pointer_info_t), ctypes.c_void_p, _u32p,
              ctypes.POINTER(_agentp))),
)

FUNCTIONS_BY_NAME = {f.name: f for f in FUNCTIONS}

LIBRARY_SONAME = "libhsa-runtime64.so.1"


def library_candidates() -> list[str]:
    """Where to look for ROCr, in order.

    The SONAME first: libamdhip64 (torch's) depends on it, so once torch/HIP is up
    the loader hands back the instance already in the process, the one whose
    signals and agents HIP uses.
    """
    out = []
    if config.get("GPUXFER_HSA_LIBRARY"):
        out.append(config.get("GPUXFER_HSA_LIBRARY"))
    out.append(LIBRARY_SONAME)
    for var in ("ROCM_PATH", "ROCM_HOME"):
        if config.get(var):
            out.append(os.path.join(config.get(var), "lib", LIBRARY_SONAME))
    out.append(os.path.join("/opt/rocm/lib", LIBRARY_SONAME))
    return list(dict.fromkeys(out))


def _converting(fn: Callable, f: Function) -> Callable:
    """Wrap a Python stand-in so its arguments are type-checked exactly as a foreign call checks them.

    Each argument goes through its declared type's ``from_param`` (what ctypes
    does before a real call), so an argument the real library would refuse
    raises ``ctypes.ArgumentError`` here too; the stand-in then receives the
    original Python objects (``from_param`` results hide simple values).
    """

    def call(*args):
        if len(args) != len(f.argtypes):
            raise TypeError(f"{f.name} takes {len(f.argtypes)} arguments ({len(args)} given)")
        for i, (a, t) in enumerate(zip(args, f.argtypes)):
            try:
                t.from_param(a)
            except TypeError as exc:
                raise ctypes.ArgumentError(f"argument {i + 1}: {exc}") from None
        return fn(*args)

    call.__name__ = f.name
    return call
