"""The ``amd-mori`` engine: AMD's MoRI-IO (``amd_mori`` wheels, module ``mori.io``).

MoRI-IO is the KV-transfer engine of AMD's stack (ROCm/mori; SGLang ships a
connector for it) and the CollectiveX suite's AMD lane. It moves registered GPU
(or host) memory one-sidedly: the initiator reads from or writes to a peer's
registered region by offset; the target does nothing per transfer.

How it runs (one ``IOEngine`` per benchmark process)::

    prefill (rank 0)                          decode (rank 1)
    IOEngine(key, IOEngineConfig(host, port)) IOEngine(key, IOEngineConfig(host, port))
    create_backend(RDMA | XGMI, config)       create_backend(RDMA | XGMI, config)
    register_memory(pool) -> MemoryDesc       register_memory(pool) -> MemoryDesc
         |---- EngineDesc.pack(), MemoryDesc.pack() over the CPU group ----|
    register_remote_engine(peer)              register_remote_engine(peer)
    create_session(mine, peer's)              create_session(mine, peer's)
         |---- "session ready" over the CPU group (both fail together) ----|
    push: the prefill side initiates          pull: the decode side initiates
      post: session.batch_write(local offs,     post: session.batch_read(local offs,
            remote offs, sizes, uid) per           remote offs, sizes, uid) per
            chunk of <= 16,384 offsets             chunk of <= 16,384 offsets
      wait: every TransferStatus done           wait: every TransferStatus done
    close: deregister_remote_engine, deregister_memory (idempotent)

Settings are the CollectiveX suite's (from its ``kv_mori_io.py``):
the RDMA backend with one QP per transfer, library-default batching, one worker
thread, CQ polling, no notifications and no chunking; batch calls of at most
16,384 offsets; no work request longer than 1 GiB (a longer descriptor is split).
``GPUXFER_MORI_BACKEND=xgmi`` takes MoRI's intra-node XGMI backend instead.
``GPUXFER_MORI_HOST`` sets the address its control plane binds (default
127.0.0.1; across hosts, this host's address on the fabric).

Every wait is bounded (``TransferStatus.WaitFor`` with the time left, or polling
on builds without it). A failed status raises :class:`DriverError` with MoRI's
code and message. Importing this module never imports MoRI nor touches a GPU;
``GPUXFER_MORI_MODULE`` names another module with MoRI-IO's API (a fake, in tests).
"""
from __future__ import annotations

import importlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .... import config
from ....common import free_port, package_version
from ....errors import BackendUnavailable, BadInput, DriverError, TransferTimeout
from ....kv.descriptors import check_bounds
from .base import DescriptorBurst, Engine, Prepared, Role, Side, as_descriptors
from .chunks import split_large

log = logging.getLogger("gpuxfer.kv.mori")

MODULE_ENV = "GPUXFER_MORI_MODULE"
BACKEND_ENV = "GPUXFER_MORI_BACKEND"
HOST_ENV = "GPUXFER_MORI_HOST"
BACKENDS = ("rdma", "xgmi")
#: offsets per batch call (the suite's cap, bounding send-queue use)
BATCH_CAP = 16384
#: the longest work request (verbs providers cap one message; 1 GiB passes on every provider the suite met)
WR_CAP_BYTES = 1 << 30
#: the RDMA backend's settings (``poll_cq_mode`` names a ``PollCqMode`` member)
RDMA_CONFIG = {"qp_per_transfer": 1, "post_batch_size": -1, "num_worker_threads": 1,
               "poll_cq_mode": "POLLING", "enable_notification": False,
               "enable_transfer_chunking": False, "chunk_bytes": 65536, "max_chunks_per_transfer": 64}
_API = ("IOEngine", "IOEngineConfig", "BackendType", "RdmaBackendConfig", "XgmiBackendConfig",
        "MemoryLocationType", "PollCqMode", "EngineDesc", "MemoryDesc")
#: MoRI's StatusCode names, for messages when a status carries no name
_CODE_NAMES = {0: "SUCCESS", 1: "INIT", 2: "IN_PROGRESS"}


# --------------------------------------------------------------------------- finding MoRI-IO


_found: dict[str, tuple[Any, str | None]] = {}


def find_mori(refresh: bool = False) -> tuple[Any, str | None]:
    """``(module, None)`` or ``(None, why not)``. Never raises; cached per module name."""
    name = config.get(MODULE_ENV)
    if not refresh and name in _found:
        return _found[name]
    try:
        mod = importlib.import_module(name)
        missing = [a for a in _API if not hasattr(mod, a)]
        result = ((None, f"{name} lacks {', '.join(missing)} (not MoRI-IO's Python API?)") if missing
                  else (mod, None))
    except ModuleNotFoundError as exc:
        if exc.name in (name, name.split(".")[0]):
            result = (None, f"MoRI-IO is not installed (no module {name!r}): `pip install amd_mori` on a ROCm "
                            "machine (it builds against the ROCm toolchain and links the RDMA verbs libraries)")
        else:
            result = (None, f"{name} does not import: {type(exc).__name__}: {exc}")
    except Exception as exc:  # a broken install: a missing .so, no HIP runtime...
        result = (None, f"{name} does not import: {type(exc).__name__}: {exc}")
    _found[name] = result
    return result


def mori_unavailable_reason() -> str | None:
    return find_mori()[1]


def backend_choice() -> str:
    return config.get(BACKEND_ENV)


def _version(mod) -> str:
    return (getattr(mod, "__version__", None) or package_version("amd_mori", "amd-mori", "amd-mori-nightly")
            or "unknown")


# --------------------------------------------------------------------------- translation


def to_mori_offsets(desc, op: str, *, wr_cap: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Our ``(src_offset, dst_offset, nbytes)`` rows -> MoRI's local offsets, remote offsets, sizes.

    ``READ`` (pull) is issued by the destination (local = destination), ``WRITE`` (push) by
    the source. Descriptors longer than ``wr_cap`` are split. Arrays are int64.
    """
    if op not in ("READ", "WRITE"):
        raise BadInput(f"op must be 'READ' or 'WRITE', got {op!r}")
    d = as_descriptors(desc)
    check_bounds(d, None, None)          # offsets >= 0, lengths > 0 (the pools are checked by the engine)
    wr_cap = WR_CAP_BYTES if wr_cap is None else wr_cap
    if wr_cap <= 0:
        raise BadInput(f"wr_cap must be positive, got {wr_cap}")
    d = split_large(d, wr_cap)
    local_col, remote_col = (1, 0) if op == "READ" else (0, 1)
    return d[:, local_col].copy(), d[:, remote_col].copy(), d[:, 2].copy()


@dataclass
class MoriBatch:
    """One request's offset lists in chunks of at most :data:`BATCH_CAP`, built once (untimed)."""

    chunks: list[tuple[list[int], list[int], list[int]]]
    nbytes: int


def mori_batch(desc, op: str, *, cap: int | None = None) -> MoriBatch:
    loc, rem, size = to_mori_offsets(desc, op)
    cap = BATCH_CAP if cap is None else cap
    if cap <= 0:
        raise BadInput(f"cap must be positive, got {cap}")
    chunks = [(loc[i:i + cap].tolist(), rem[i:i + cap].tolist(), size[i:i + cap].tolist())
              for i in range(0, len(size), cap)]
    return MoriBatch(chunks, int(size.sum()))


def _code(status) -> tuple[str, int]:
    try:
        c = status.Code()
    except Exception:  # noqa: BLE001
        return "UNKNOWN", -1
    return getattr(c, "name", None) or _CODE_NAMES.get(int(c), str(c)), int(c)


def wait_statuses(statuses, *, timeout_s: float, rank: int, what: str) -> None:
    """Wait for every ``TransferStatus``; DriverError on a failed one, TransferTimeout past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for k, st in enumerate(statuses):
        while True:
            if st.Succeeded():
                break
            if st.Failed():
                name, code = _code(st)
                raise DriverError("mori.io TransferStatus", name, code, f"{what} (batch call {k})", st.Message())
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(rank=rank, step=0, flag="mori.io TransferStatus", expected=len(statuses),
                                      seen=k, timeout_s=timeout_s, what=f"{what}: batch call {k} still in progress")
            if hasattr(st, "WaitFor"):
                st.WaitFor(max(1, min(int(left * 1e3), 1000)))
            else:
                time.sleep(min(left, 1e-4))


# --------------------------------------------------------------------------- the engine


class MoriEngine(Engine):
    name = "amd-mori"
    description = ("MoRI-IO (AMD, ROCm): one IOEngine per process, one session between the pools; pull issues "
                   "session.batch_read from the decode side, push batch_write from the prefill side "
                   f"(<= {BATCH_CAP:,} offsets per call); the suite's RDMA settings")
    uses_sms = "none (RDMA NIC DMA; XGMI: copy engines)"

    @classmethod
    def unavailable_reason(cls, platform) -> str | None:
        if platform.memory_runtime not in ("hip", "host"):
            return (f"MoRI-IO is AMD's engine: it registers ROCm GPU memory (or host memory on the host "
                    f"emulation); platform {platform.name!r}")
        return mori_unavailable_reason()

    @classmethod
    def cross_host_reason(cls) -> str | None:
        try:
            b = backend_choice()
        except BadInput as exc:
            return str(exc)
        return "MoRI-IO's XGMI backend reaches GPUs of one host only" if b == "xgmi" else None

    def __init__(self, side: Side):
        super().__init__(side)
        self.mod = None
        self.io = None
        self.mem = None
        self.session = None
        self._remote = None
        info: dict
        try:
            mod, why = find_mori()
            if mod is None:
                raise BackendUnavailable(self.name, {side.rank: why})
            self.mod = mod
            self.backend = backend_choice()
            host = config.get(HOST_ENV)
            key = f"gpuxfer-{side.role.serving_name}-{os.getpid()}"
            self.io = mod.IOEngine(key=key, config=mod.IOEngineConfig(host=host, port=free_port(host)))
            if self.backend == "rdma":
                cfg = {**RDMA_CONFIG, "poll_cq_mode": getattr(mod.PollCqMode, RDMA_CONFIG["poll_cq_mode"])}
                self.io.create_backend(mod.BackendType.RDMA, mod.RdmaBackendConfig(**cfg))
            else:
                self.io.create_backend(mod.BackendType.XGMI, mod.XgmiBackendConfig())
            loc = mod.MemoryLocationType.CPU if self.platform.host_memory else mod.MemoryLocationType.GPU
            dev = -1 if self.platform.host_memory else side.device
            self.mem = self.io.register_memory(int(side.pool.ptr), int(side.pool.nbytes), dev, loc)
            info = {"engine": bytes(self.io.get_engine_desc().pack()), "mem": bytes(self.mem.pack()),
                    "pool_bytes": int(side.pool.nbytes), "version": _version(mod), "backend": self.backend}
        except Exception as exc:  # tell the peer, so both sides fail together
            info = {"error": f"{type(exc).__name__}: {exc}"}
        self.peer = side.agree(self.name, info, self._release)[side.peer_rank]
        try:
            if self.peer["backend"] != self.backend:
                raise BadInput(f"the ranks chose different MoRI-IO backends ({self.backend} here, "
                               f"{self.peer['backend']} on the peer): set {BACKEND_ENV} alike")
            self._remote = self.mod.EngineDesc.unpack(self.peer["engine"])
            self.io.register_remote_engine(self._remote)
            self.session = self.io.create_session(self.mem, self.mod.MemoryDesc.unpack(self.peer["mem"]))
            if self.session is None:
                raise DriverError("mori.io IOEngine.create_session", "None", -1, "opening a session to the peer pool")
            ready: dict = {"ready": True}
        except Exception as exc:
            ready = {"error": f"{type(exc).__name__}: {exc}"}
        side.agree(self.name, ready, self._release)
        self.version = self.peer["version"]

    def _pool_limits(self) -> tuple[int, int]:
        """(source, destination) pool bytes, from this side's pool and what the peer said (the peer's
        pool need not be mapped here)."""
        mine, theirs = int(self.side.pool.nbytes), int(self.peer["pool_bytes"])
        return (mine, theirs) if self.side.role is Role.SOURCE else (theirs, mine)

    def prepare(self, burst: DescriptorBurst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction)      # every descriptor checked against both pools
        self._initiating = p.active
        if not p.active:
            return p
        op = "READ" if direction == "pull" else "WRITE"
        batches = [mori_batch(r, op) for r in burst.requests]
        p.state = (op, [b for b in batches if b.chunks], [])
        return p

    def post(self, p: Prepared) -> None:
        if not p.active:
            return
        op, batches, statuses = p.state
        call = self.session.batch_read if op == "READ" else self.session.batch_write
        statuses.clear()
        for b in batches:
            for loc, rem, size in b.chunks:
                statuses.append(call(loc, rem, size, self.io.allocate_transfer_uid()))

    def wait(self, p: Prepared) -> None:
        if not p.active:
            return
        op, batches, statuses = p.state
        wait_statuses(statuses, timeout_s=self.side.timeout_s, rank=self.side.rank,
                      what=f"{self.name} {op} burst of {len(batches)} request(s)")

    def row_extra(self) -> dict:
        """The initiator's MoRI-IO backend and version, for the row."""
        if not getattr(self, "_initiating", False):
            return {}
        return {"mori_backend": self.backend, "mori_version": self.version}

    def _release(self) -> None:
        io, self.session = self.io, None
        if io is None:
            return
        if self._remote is not None:
            try:
                io.deregister_remote_engine(self._remote)
            except Exception as exc:  # noqa: BLE001 - teardown
                log.warning("mori deregister_remote_engine failed: %s", exc)
            self._remote = None
        if self.mem is not None:
            try:
                io.deregister_memory(self.mem)
            except Exception as exc:  # noqa: BLE001 - teardown
                log.warning("mori deregister_memory failed: %s", exc)
            self.mem = None
        self.io = None
