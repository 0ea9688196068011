"""The ``mooncake`` and ``mooncake-rdma`` engines: Mooncake's TransferEngine.

Mooncake (``mooncake-transfer-engine`` wheels) moves KV between serving
processes; SGLang and vLLM ship connectors for it. Inside one node its
``nvlink_intra`` transport (``IntraNodeNvlinkTransport``: CUDA IPC handles,
``cudaMemcpyBatchAsync`` on CUDA >= 12.8) is the path to measure; its ``rdma``
transport would loop through the NIC, and a single engine in one process uses a
plain local ``cudaMemcpy``, so the two benchmark processes each run an engine.

How it runs:

* each process creates a ``TransferEngine`` and ``initialize``\\ s it with
  ``P2PHANDSHAKE`` metadata (no etcd) on ``127.0.0.1:<free port>`` (or
  ``$GPUXFER_MOONCAKE_HOST``) with protocol ``nvlink_intra``; a build without that
  transport fails here and the engine is skipped with the reason;
* pools are registered once (``register_memory``); session ids (``ip:rpc_port``)
  and pool bases are exchanged over the benchmark's CPU group;
* pull calls ``batch_transfer_sync_read`` from the destination, push
  ``batch_transfer_sync_write`` from the source, in chunks of at most
  :data:`BATCH_CAP` descriptors; each request of a burst runs on its own worker
  thread (the binding releases the GIL; SGLang's connector does the same).

``mooncake-rdma`` asks for the ``rdma`` transport instead, with the CollectiveX
suite's settings (``MC_USE_NVLINK_IPC=0``, ``MC_TRANSFER_TIMEOUT=120``, set in the
process environment unless already set; the NIC filter from ``$GPUXFER_MOONCAKE_NIC``):
through the NIC within a host, and across hosts.

Whether the wheel works is probed at run time, in a child process (a failed
transport install can abort the process): :func:`probe_transport`.

Importing this module never imports Mooncake nor touches a GPU.
"""
from __future__ import annotations

import concurrent.futures as cf
import importlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .... import config
from ....common import free_port, package_version
from ....errors import BackendUnavailable, BadInput, DriverError, TransferTimeout
from ....platforms.base import Closable
from ....kv.descriptors import check_bounds
from .base import DescriptorBurst, Engine, Prepared, Role, Side, as_descriptors

log = logging.getLogger("gpuxfer.kv.mooncake")

#: descriptors per batch call (the suite's cap; Mooncake's batch capacity is finite)
BATCH_CAP = 8192
PROTOCOL = "nvlink_intra"
RDMA_PROTOCOL = "rdma"
HOST_ENV = "GPUXFER_MOONCAKE_HOST"
NIC_ENV = "GPUXFER_MOONCAKE_NIC"
#: the mooncake distributions on PyPI (the import name is ``mooncake`` for all of them)
DISTRIBUTIONS = ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13")


# --------------------------------------------------------------------------- finding Mooncake


#: the CUDA runtime major version Mooncake's CUDA wheels link against (``libcudart.so.12``)
CUDART_MAJOR = 12


def _version() -> str:
    for dist in DISTRIBUTIONS:
        v = package_version(dist)
        if v:
            return f"{dist} {v}"
    return "unknown"


_found: dict[str, tuple[Any, str | None]] = {}


def find_mooncake(refresh: bool = False) -> tuple[Any, str | None]:
    """``(TransferEngine class, None)`` or ``(None, why not)``. Never raises; cached."""
    if not refresh and "r" in _found:
        return _found["r"]
    result: tuple[Any, str | None]
    try:
        importlib.import_module("mooncake")
    except ModuleNotFoundError as exc:
        if exc.name == "mooncake":
            result = (None, "mooncake-transfer-engine is not installed (`pip install mooncake-transfer-engine`; "
                            "its CUDA wheel is ~98 MB, too big to carry to a machine without a network)")
        else:
            result = (None, f"mooncake does not import: {type(exc).__name__}: {exc}")
        _found["r"] = result
        return result
    except Exception as exc:
        result = (None, f"mooncake does not import: {type(exc).__name__}: {exc}")
        _found["r"] = result
        return result
    try:
        try:
            mod = importlib.import_module("mooncake.engine")
        except ImportError as first:
            from ..platforms import platform_class
            why = platform_class("cuda").load_runtime_library(CUDART_MAJOR)
            if why is not None:
                raise ImportError(f"{first} (and {why})") from first
            mod = importlib.import_module("mooncake.engine")
        result = (mod.TransferEngine, None)
    except Exception as exc:
        result = (None, f"mooncake.engine does not import: {type(exc).__name__}: {exc}")
    _found["r"] = result
    return result


def mooncake_unavailable_reason() -> str | None:
    """Why the ``mooncake`` engine cannot run here, before any probe of the transport. Never raises."""
    return find_mooncake()[1]


def local_host() -> str:
    return config.get(HOST_ENV)


_PROBE = r"""
import json, os, sys
sys.path[:0] = json.loads(sys.argv[4])
from gpuxfer.common import free_port
from gpuxfer.bench.kv.engines.mooncake import find_mooncake, local_host
TE, why = find_mooncake()
if TE is None:
    print(json.dumps({"ok": False, "why": why})); sys.exit(0)
dev, protocol, nic = int(sys.argv[1]), sys.argv[2], sys.argv[3]
try:
    import torch
    torch.cuda.set_device(dev)
except Exception:
    pass
e = TE()
host = local_host()
rc = e.initialize(f"{host}:{free_port(host)}", "P2PHANDSHAKE", protocol, nic)
print(json.dumps({"ok": rc == 0, "why": None if rc == 0 else f"initialize(..., {protocol!r}) returned {rc}"}))
"""


def probe_transport(protocol: str, device: int = 0, nic: str | None = None, timeout_s: float = 60.0) -> str | None:
    """Does this Mooncake build install transport ``protocol`` here? None if yes, else why not.

    Runs in a child process (with this process's environment): a build without the
    transport, or a machine without the hardware, can abort the process that asks for it.
    """
    why = mooncake_unavailable_reason()
    if why is not None:
        return why
    nic = f"cuda:{device}" if nic is None else nic
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, str(device), protocol, nic, json.dumps(sys.path)],
                             capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"probing Mooncake's {protocol} transport took longer than {timeout_s:g} s"
    for line in reversed(out.stdout.splitlines()):
        try:
            res = json.loads(line)
        except ValueError:
            continue
        if res.get("ok"):
            return None
        return f"this Mooncake build cannot install its {protocol} transport here ({res.get('why')})"
    tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
    return (f"probing Mooncake's {protocol} transport crashed (exit code {out.returncode}): "
            + " | ".join(tail))


def probe_nvlink_intra(device: int = 0, timeout_s: float = 60.0) -> str | None:
    """Does this Mooncake build install its intra-node NVLink transport? None if yes, else why not."""
    why = probe_transport(PROTOCOL, device, timeout_s=timeout_s)
    if why is not None and why.startswith("this Mooncake build cannot install"):
        why += "; x86 wheels built without USE_INTRA_NVLINK=ON lack it"
    return why


# --------------------------------------------------------------------------- translation


def to_mooncake_lists(desc, op: str, *, local_base: int, remote_base: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Our ``(src_offset, dst_offset, nbytes)`` rows -> Mooncake's local addresses, peer addresses, lengths.

    ``op`` is ``"READ"`` (issued by the destination: local = destination) or
    ``"WRITE"`` (issued by the source: local = source). Arrays are int64.
    """
    if op not in ("READ", "WRITE"):
        raise BadInput(f"op must be 'READ' or 'WRITE', got {op!r}")
    d = as_descriptors(desc)
    check_bounds(d, None, None)          # offsets >= 0, lengths > 0 (the pools are checked by the engine)
    local_col, remote_col = (1, 0) if op == "READ" else (0, 1)
    return (d[:, local_col] + int(local_base), d[:, remote_col] + int(remote_base), d[:, 2].copy())


def chunks(n: int, cap: int | None = None) -> list[tuple[int, int]]:
    """``[0, n)`` as consecutive ``(start, end)`` pieces of at most ``cap`` (default :data:`BATCH_CAP`)."""
    cap = BATCH_CAP if cap is None else cap
    if cap <= 0:
        raise BadInput(f"cap must be positive, got {cap}")
    return [(i, min(i + cap, n)) for i in range(0, n, cap)]


# --------------------------------------------------------------------------- one engine


@dataclass
class MooncakeBatch:
    """One request's lists, built once (untimed), run many times."""

    local: list[int]
    remote: list[int]
    lengths: list[int]
    pieces: list[tuple[int, int]]
    nbytes: int


class MooncakeSide(Closable):
    """One TransferEngine with its registrations and a worker pool. Idempotent ``close()``."""

    def __init__(self, engine_cls, *, device: int, rank: int = 0, workers: int = 1,
                 protocol: str = PROTOCOL, nic: str | None = None):
        self.rank, self.device, self.protocol = rank, device, protocol
        self._closed = False
        self._regs: list[int] = []
        self.engine = engine_cls()
        host = local_host()
        self.host = host
        nic = f"cuda:{device}" if nic is None else nic
        rc = self.engine.initialize(f"{host}:{free_port(host)}", "P2PHANDSHAKE", protocol, nic)
        if rc != 0:
            raise BackendUnavailable("mooncake", {rank: f"TransferEngine.initialize(..., {protocol!r}) returned {rc}"})
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.pool = cf.ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="gpuxfer-mooncake")

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self.engine.register_memory(int(ptr), int(nbytes))
        if rc != 0:
            raise DriverError("TransferEngine.register_memory", "rc", rc, f"registering {nbytes} B at 0x{ptr:x}")
        self._regs.append(int(ptr))

    def batch(self, desc, op: str, *, local_base: int, remote_base: int) -> MooncakeBatch:
        loc, rem, ln = to_mooncake_lists(desc, op, local_base=local_base, remote_base=remote_base)
        return MooncakeBatch(loc.tolist(), rem.tolist(), ln.tolist(), chunks(len(ln)), int(ln.sum()))

    def _run(self, peer_session: str, b: MooncakeBatch, op: str) -> None:
        fn = self.engine.batch_transfer_sync_read if op == "READ" else self.engine.batch_transfer_sync_write
        for i, j in b.pieces:
            rc = fn(peer_session, b.local[i:j], b.remote[i:j], b.lengths[i:j])
            if rc != 0:
                raise DriverError(f"TransferEngine.batch_transfer_sync_{op.lower()}", "rc", rc,
                                  f"moving descriptors {i}..{j} of {len(b.lengths)}")

    def run(self, peer_session: str, batches: Sequence[MooncakeBatch], op: str, *, timeout_s: float,
            step: int = 0) -> None:
        """Run every batch (one worker each) and wait; TransferTimeout past ``timeout_s``."""
        futs = [self.pool.submit(self._run, peer_session, b, op) for b in batches]
        done, pending = cf.wait(futs, timeout=timeout_s)
        if pending:
            raise TransferTimeout(rank=self.rank, step=step, flag="mooncake batch transfer", expected=len(futs),
                                  seen=len(done), timeout_s=timeout_s,
                                  what=f"{len(pending)} of {len(futs)} {op} batches still running")
        for f in futs:
            f.result()

    def _release(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for ptr in self._regs:
            try:
                self.engine.unregister_memory(ptr)
            except Exception as exc:
                log.warning("mooncake unregister_memory(0x%x) failed: %s", ptr, exc)
        self._regs.clear()


# --------------------------------------------------------------------------- the engine


class MooncakeEngine(Engine):
    name = "mooncake"
    description = ("Mooncake TransferEngine, intra-node NVLink transport (nvlink_intra): "
                   "batch_transfer_sync_read pulls, _write pushes; one worker thread per request")
    uses_sms = "none (CUDA IPC copies through the copy engines)"

    @classmethod
    def unavailable_reason(cls, platform) -> str | None:
        if platform.memory_runtime != "cuda":
            return f"Mooncake's intra-node NVLink transport needs CUDA GPUs; platform {platform.name!r}"
        return mooncake_unavailable_reason()

    @classmethod
    def cross_host_reason(cls) -> str | None:
        return ("asks for Mooncake's intra-node NVLink transport (nvlink_intra); the ranks are on different "
                "hosts")

    protocol: str = PROTOCOL

    def _nic(self) -> str | None:
        """The ``device_name`` filter passed to ``initialize`` (None: ``cuda:<device>``)."""
        return None

    def _probe(self) -> str | None:
        return probe_nvlink_intra(self.side.device)

    def __init__(self, side: Side):
        super().__init__(side)
        self.mc: MooncakeSide | None = None
        info: dict
        try:
            why = self._probe()
            if why is not None:
                raise BackendUnavailable(self.name, {side.rank: why})
            engine_cls, why = find_mooncake()
            if engine_cls is None:
                raise BackendUnavailable(self.name, {side.rank: why})
            self.mc = MooncakeSide(engine_cls, device=side.device, rank=side.rank, workers=16,
                                   protocol=self.protocol, nic=self._nic())
            self.mc.register(side.pool.ptr, side.pool.nbytes)
            info = {"session": self.mc.session, "pool": int(side.pool.ptr), "pool_bytes": int(side.pool.nbytes),
                    "version": _version()}
        except Exception as exc:  # tell the peer, so both sides fail together
            info = {"error": f"{type(exc).__name__}: {exc}"}
        self.peer = side.agree(self.name, info, self._release)[side.peer_rank]

    def _pool_limits(self) -> tuple[int, int]:
        """(source, destination) pool bytes, from this side's pool and what the peer said (the peer's
        pool need not be mapped here)."""
        mine, theirs = int(self.side.pool.nbytes), int(self.peer["pool_bytes"])
        return (mine, theirs) if self.side.role is Role.SOURCE else (theirs, mine)

    def prepare(self, burst: DescriptorBurst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction)
        if not p.active:
            return p
        op = "READ" if direction == "pull" else "WRITE"
        batches = [self.mc.batch(r, op, local_base=self.side.pool.ptr, remote_base=self.peer["pool"])
                   for r in burst.requests]
        p.state = (op, [b for b in batches if b.lengths], None)
        return p

    def post(self, p: Prepared) -> None:
        if not p.active:
            return
        op, batches, _ = p.state
        futs = [self.mc.pool.submit(self.mc._run, self.peer["session"], b, op) for b in batches]
        p.state = (op, batches, futs)

    def wait(self, p: Prepared) -> None:
        if not p.active:
            return
        op, batches, futs = p.state
        done, pending = cf.wait(futs, timeout=self.side.timeout_s)
        if pending:
            raise TransferTimeout(rank=self.side.rank, step=0, flag="mooncake batch transfer", expected=len(futs),
                                  seen=len(done), timeout_s=self.side.timeout_s,
                                  what=f"{len(pending)} of {len(futs)} {op} requests still running")
        for f in futs:
            f.result()

    def _release(self) -> None:
        if self.mc is not None:
            self.mc.close()


class MooncakeRdmaEngine(MooncakeEngine):
    """Mooncake over its ``rdma`` transport, with the CollectiveX suite's settings.

    ``MC_USE_NVLINK_IPC=0`` (the NVLink-IPC transport otherwise claims segments it
    cannot open) and ``MC_TRANSFER_TIMEOUT=120`` (the library fails a sync call after
    30 s by default) are set in the process environment unless already set, before
    the engine starts. The NIC filter is ``$GPUXFER_MOONCAKE_NIC`` (``{gpu}`` expands to
    the device index; empty: Mooncake discovers the NICs itself). Runs within a host
    (through the NIC) and across hosts.
    """

    name = "mooncake-rdma"
    description = ("Mooncake TransferEngine, rdma transport (the CollectiveX suite's lane: MC_USE_NVLINK_IPC=0, "
                   "MC_TRANSFER_TIMEOUT=120): batch_transfer_sync_read pulls, _write pushes; one worker per request")
    uses_sms = "none (RDMA NIC DMA)"
    protocol = RDMA_PROTOCOL

    @classmethod
    def unavailable_reason(cls, platform) -> str | None:
        if platform.host_memory:
            return f"Mooncake's rdma transport registers GPU memory; platform {platform.name!r}"
        return mooncake_unavailable_reason()

    @classmethod
    def cross_host_reason(cls) -> str | None:
        return None

    def _nic(self) -> str:
        return config.get(NIC_ENV).replace("{gpu}", str(self.side.device))

    def _probe(self) -> str | None:
        apply_suite_env()
        return probe_transport(self.protocol, self.side.device, self._nic())


#: the CollectiveX suite's Mooncake settings (its ``kv_mooncake.py``)
SUITE_ENV = {"MC_USE_NVLINK_IPC": "0", "MC_TRANSFER_TIMEOUT": "120"}


def apply_suite_env(environ=os.environ) -> dict[str, str]:
    """Set the suite's Mooncake settings where the environment does not already choose; what is in force."""
    for k, v in SUITE_ENV.items():
        environ.setdefault(k, v)
    return {k: environ[k] for k in SUITE_ENV}
