"""A fake of MoRI-IO's Python API (``mori.io``), moving bytes with ``ctypes.memmove``.

What it mirrors (ROCm/mori ``python/mori/io/engine.py``, ``src/pybind/pybind_io.cpp``):
``IOEngine(key, config)`` with ``create_backend``, ``register_memory(ptr, size, device_id,
mem_loc) -> MemoryDesc``, ``get_engine_desc()``, ``register_remote_engine``,
``deregister_remote_engine``, ``deregister_memory``, ``allocate_transfer_uid``,
``create_session(local_mem, remote_mem) -> session`` whose ``batch_read`` / ``batch_write``
``(local_offsets, remote_offsets, sizes, uid)`` return a ``TransferStatus`` (``Code``,
``Succeeded``, ``Failed``, ``InProgress``, ``Message``, ``WaitFor``); ``EngineDesc`` and
``MemoryDesc`` ``pack()`` / ``unpack()`` to bytes; the enums and config classes.

A registered region records the file behind it when it lies in a shared mapping (the host
emulation's pools), so a session to another process's memory maps that file, as a network
transport reaches the peer's memory without the benchmark's IPC mapping. Every call is
checked (offsets inside the registrations, sizes > 0, a remote engine registered before a
session) and logged in ``calls``. ``stuck`` leaves statuses IN_PROGRESS forever; ``fail``
ends them in ERR_RDMA_OP; ``flip`` flips the first byte of the first descriptor of each call
(``"first"``, or True) or of every descriptor (``"every"``). In spawned processes,
``FAKE_MORI_FLIP=first|every`` sets ``flip``.

Install it as ``GPUXFER_MORI_MODULE=fake_mori`` (``tests/`` on ``sys.path``).
"""
from __future__ import annotations

import ctypes
import enum
import itertools
import mmap
import os
import pickle
import threading

calls: list[tuple] = []
behaviour = {"stuck": False, "fail": False, "flip": os.environ.get("FAKE_MORI_FLIP") or False,
             "fail_session": False}
_lock = threading.Lock()
_uids = itertools.count(1)


class BackendType(enum.Enum):
    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3
    FABRIC = 4


class MemoryLocationType(enum.Enum):
    Unknown = 0
    CPU = 1
    GPU = 2


class PollCqMode(enum.Enum):
    POLLING = 0
    EVENT = 1


class StatusCode(enum.IntEnum):
    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_BEGIN = 3
    ERR_INVALID_ARGS = 4
    ERR_NOT_FOUND = 5
    ERR_RDMA_OP = 6
    ERR_BAD_STATE = 7
    ERR_GPU_OP = 8


class IOEngineConfig:
    def __init__(self, host: str = "", port: int = 0):
        self.host, self.port = host, port


class RdmaBackendConfig:
    def __init__(self, qp_per_transfer=1, post_batch_size=-1, num_worker_threads=-1,
                 poll_cq_mode=PollCqMode.POLLING, enable_notification=True, notif_per_qp=1024,
                 enable_transfer_chunking=False, chunk_bytes=65536, max_chunks_per_transfer=64,
                 num_nics_per_transfer=1):
        assert isinstance(poll_cq_mode, PollCqMode)
        self.__dict__.update({k: v for k, v in locals().items() if k != "self"})


class XgmiBackendConfig:
    def __init__(self, num_streams=64, num_events=64):
        self.num_streams, self.num_events = num_streams, num_events


class TransferStatus:
    def __init__(self):
        self.code, self.msg = StatusCode.INIT, ""

    def Code(self):  # noqa: N802 - MoRI's names
        return self.code

    def Message(self):  # noqa: N802
        return self.msg

    def Succeeded(self):  # noqa: N802
        return self.code == StatusCode.SUCCESS

    def InProgress(self):  # noqa: N802
        return self.code == StatusCode.IN_PROGRESS

    def Failed(self):  # noqa: N802
        return self.code > StatusCode.ERR_BEGIN

    def WaitFor(self, timeout_ms=-1):  # noqa: N802
        assert timeout_ms >= 0, "the engine must never wait unbounded"
        if self.code == StatusCode.IN_PROGRESS:
            import time
            time.sleep(min(timeout_ms, 5) / 1e3)
        return self.code


class EngineDesc:
    def __init__(self, key: str, host: str, port: int, pid: int):
        self.key, self.host, self.port, self.pid = key, host, port, pid

    def pack(self) -> bytes:
        return pickle.dumps(("engine", self.key, self.host, self.port, self.pid))

    @staticmethod
    def unpack(b: bytes) -> "EngineDesc":
        tag, *rest = pickle.loads(b)
        assert tag == "engine"
        return EngineDesc(*rest)

    def __eq__(self, other):
        return isinstance(other, EngineDesc) and (self.key, self.pid) == (other.key, other.pid)


def _backing(addr: int):
    """(file, offset) of a shared file mapping holding ``addr``, or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi and len(parts) == 6 and parts[5].strip().startswith("/"):
                return parts[5].strip(), int(parts[2], 16) + (addr - lo)
    return None


class MemoryDesc:
    def __init__(self, engine_key: str, pid: int, addr: int, size: int, device: int, loc, backing):
        self.engine_key, self.pid, self.addr, self.size = engine_key, pid, addr, size
        self.device, self.loc, self.backing = device, loc, backing

    def pack(self) -> bytes:
        return pickle.dumps(("mem", self.engine_key, self.pid, self.addr, self.size, self.device,
                             self.loc.name, self.backing))

    @staticmethod
    def unpack(b: bytes) -> "MemoryDesc":
        tag, key, pid, addr, size, dev, loc, backing = pickle.loads(b)
        assert tag == "mem"
        return MemoryDesc(key, pid, addr, size, dev, MemoryLocationType[loc], backing)


class IOEngineSession:
    def __init__(self, engine: "IOEngine", local: MemoryDesc, remote: MemoryDesc):
        self.engine, self.local, self.remote = engine, local, remote
        if remote.pid == os.getpid():
            self.remote_base = remote.addr
        else:
            assert remote.backing is not None, "the peer's memory is not in a shared mapping"
            path, off = remote.backing
            with open(path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), off + remote.size)
            self.remote_base = ctypes.addressof(ctypes.c_char.from_buffer(self._map)) + off

    def allocate_transfer_uid(self):
        return next(_uids)

    def _move(self, what, local_offsets, remote_offsets, sizes, uid, read: bool):
        calls.append((what, len(sizes), uid))
        assert isinstance(uid, int)
        assert len(local_offsets) == len(remote_offsets) == len(sizes) <= 16384
        assert all(isinstance(x, int) for x in (*local_offsets, *remote_offsets, *sizes))
        st = TransferStatus()
        first = True
        for lo, ro, n in zip(local_offsets, remote_offsets, sizes):
            assert 0 < n <= 1 << 30 and lo >= 0 and ro >= 0
            assert lo + n <= self.local.size and ro + n <= self.remote.size, "outside a registration"
            src, dst = (self.remote_base + ro, self.local.addr + lo) if read else \
                (self.local.addr + lo, self.remote_base + ro)
            ctypes.memmove(dst, src, n)
            if behaviour["flip"] and (first or behaviour["flip"] == "every"):
                b = (ctypes.c_uint8 * 1).from_address(dst)
                b[0] ^= 0xFF
            first = False
        if behaviour["stuck"]:
            st.code = StatusCode.IN_PROGRESS
        elif behaviour["fail"]:
            st.code, st.msg = StatusCode.ERR_RDMA_OP, "ibv_post_send: EINVAL (fake)"
        else:
            st.code = StatusCode.SUCCESS
        return st

    def batch_read(self, local_offsets, remote_offsets, sizes, uid):
        return self._move("batch_read", local_offsets, remote_offsets, sizes, uid, True)

    def batch_write(self, local_offsets, remote_offsets, sizes, uid):
        return self._move("batch_write", local_offsets, remote_offsets, sizes, uid, False)

    def read(self, local_offset, remote_offset, size, uid):
        return self._move("read", [local_offset], [remote_offset], [size], uid, True)

    def write(self, local_offset, remote_offset, size, uid):
        return self._move("write", [local_offset], [remote_offset], [size], uid, False)

    def alive(self):
        return True


class IOEngine:
    def __init__(self, key, config: IOEngineConfig):
        assert isinstance(config, IOEngineConfig) and config.port > 0
        self.key, self.config = key, config
        self.backends: dict = {}
        self.mems: list[MemoryDesc] = []
        self.remotes: list[EngineDesc] = []
        calls.append(("IOEngine", key, config.host))

    def get_engine_desc(self):
        return EngineDesc(self.key, self.config.host, self.config.port, os.getpid())

    def create_backend(self, type, config=None):
        assert isinstance(type, BackendType)
        if type is BackendType.RDMA:
            assert isinstance(config, RdmaBackendConfig)
        calls.append(("create_backend", type.name, dict(getattr(config, "__dict__", {}))))
        self.backends[type] = config

    def register_memory(self, ptr, size, device_id, mem_loc):
        assert self.backends, "create a backend first"
        assert isinstance(mem_loc, MemoryLocationType) and size > 0
        md = MemoryDesc(self.key, os.getpid(), int(ptr), int(size), int(device_id), mem_loc, _backing(int(ptr)))
        self.mems.append(md)
        calls.append(("register_memory", size, mem_loc.name))
        return md

    def deregister_memory(self, mem_desc):
        assert mem_desc in self.mems
        self.mems.remove(mem_desc)
        calls.append(("deregister_memory",))

    def register_remote_engine(self, engine_desc):
        assert isinstance(engine_desc, EngineDesc) and engine_desc.key != self.key
        self.remotes.append(engine_desc)
        calls.append(("register_remote_engine", engine_desc.key))

    def deregister_remote_engine(self, engine_desc):
        self.remotes.remove(engine_desc)
        calls.append(("deregister_remote_engine",))

    def allocate_transfer_uid(self):
        return next(_uids)

    def create_session(self, local_mem, remote_mem):
        assert local_mem in self.mems
        assert any(r.key == remote_mem.engine_key for r in self.remotes), "register the remote engine first"
        calls.append(("create_session",))
        if behaviour["fail_session"]:
            return None
        return IOEngineSession(self, local_mem, remote_mem)


def reset() -> None:
    calls.clear()
    behaviour.update(stuck=False, fail=False, flip=False, fail_session=False)
