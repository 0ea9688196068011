"""NIXL engines for the KV benchmark: ``nixl``, ``nixl-oneshot`` and ``nixl+pack``.

NIXL (``nixl-cu13`` / ``nixl-cu12`` wheels, UCX backend) is what users take
once KV has to leave the machine: the same calls move GPU memory over UCX's
``cuda_ipc`` inside a node and over RDMA between nodes. These engines measure
it on exactly the descriptors our own engines move.

How it runs (one agent in each of the benchmark's two processes):

* each process creates an agent ``gpuxfer-<role>-<pid>`` and registers its pools
  *once* (``VRAM``; ``DRAM`` on the host emulation, where the pools are shared
  memory);
* agent metadata and pool base addresses are exchanged over the benchmark's
  CPU group, and each side ``add_remote_agent``\\ s the other;
* **pull** (the destination reads) issues ``READ`` from the destination, **push**
  (the source writes) issues ``WRITE`` from the source; the other process only
  keeps its agent alive;
* ``nixl`` takes NIXL's prepared path: both sides' descriptor lists are prepped
  once per descriptor table (``prep_xfer_dlist``, untimed, as a serving system
  preps its block lists at start-up) and each request is
  ``make_prepped_xfer`` + ``transfer`` + polling ``check_xfer_state``;
* ``nixl-oneshot`` takes the one-shot path: each request builds both
  descriptor lists and calls ``initialize_xfer`` (what the CollectiveX suite
  times);
* ``nixl+pack`` packs the pages into a contiguous staging buffer on the source
  with gpuxfer's kernels, moves the staging buffer through NIXL as a few bulk
  descriptors, and unpacks on the destination: a 2 M-descriptor request becomes
  a handful on whatever fabric NIXL reaches.

NIXL's own telemetry (``get_xfer_telemetry``: post and transfer durations, the
descriptor count after merging) is collected when the wheel provides it.

Everything that does not need NIXL is a pure function here (descriptor
translation, bulk chunking, module discovery) and is tested on the CPU with a
fake agent module. Importing this module never imports NIXL nor touches a GPU.
"""
from __future__ import annotations

import importlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .. import config
from ..common import package_version
from ..errors import BackendUnavailable, BadInput, DriverError, GpuxferError, TransferTimeout
from ..platforms.base import Closable
from .plan import check_bounds

log = logging.getLogger("gpuxfer.kv.nixl")

#: module names the NIXL wheels install, in the order tried when the CUDA major is unknown
NIXL_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
#: forces one module name (e.g. ``nixl_cu12``)
NIXL_MODULE_ENV = "GPUXFER_NIXL_MODULE"
#: default size of one bulk descriptor of ``nixl+pack`` (the staging buffer is cut into chunks of this)
BULK_CHUNK_BYTES = 256 << 20

OPS = {"pull": "READ", "push": "WRITE"}


# --------------------------------------------------------------------------- descriptor translation


def _as_desc_table(desc, name: str = "descriptors") -> np.ndarray:
    arr = np.asarray(desc)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise BadInput(f"{name} must have shape (N, 3), got {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise BadInput(f"{name} must be integers, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def to_nixl_dlists(desc, op: str, *, src_base: int, dst_base: int, src_dev: int, dst_dev: int,
                   src_nbytes: int | None = None, dst_nbytes: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Our int64 ``(N, 3)`` descriptors -> NIXL's local and remote ``(N, 3)`` uint64 arrays.

    ``desc`` columns are ``(src_offset, dst_offset, nbytes)``; NIXL rows are
    ``(address, length, device id)``. The initiator's side is *local*:
    ``READ`` (pull) is issued by the destination, so local = destination and
    remote = source; ``WRITE`` (push) is issued by the source, so local = source
    and remote = destination. Row ``i`` of both arrays is descriptor ``i``.
    """
    if op not in ("READ", "WRITE"):
        raise BadInput(f"op must be 'READ' or 'WRITE', got {op!r}")
    d = _as_desc_table(desc)
    check_bounds(d, src_nbytes, dst_nbytes)
    for what, v in (("src_base", src_base), ("dst_base", dst_base)):
        if int(v) < 0:
            raise BadInput(f"{what} must be a non-negative address, got {v}")
    n = d.shape[0]
    src = np.empty((n, 3), dtype=np.uint64)
    dst = np.empty((n, 3), dtype=np.uint64)
    src[:, 0] = np.uint64(src_base) + d[:, 0].astype(np.uint64)
    dst[:, 0] = np.uint64(dst_base) + d[:, 1].astype(np.uint64)
    src[:, 1] = d[:, 2]
    dst[:, 1] = d[:, 2]
    src[:, 2] = src_dev
    dst[:, 2] = dst_dev
    return (dst, src) if op == "READ" else (src, dst)


def from_nixl_dlists(local, remote, op: str, *, src_base: int, dst_base: int) -> np.ndarray:
    """The inverse of :func:`to_nixl_dlists`: NIXL local/remote arrays -> our int64 descriptors."""
    if op not in ("READ", "WRITE"):
        raise BadInput(f"op must be 'READ' or 'WRITE', got {op!r}")
    loc = np.asarray(local)
    rem = np.asarray(remote)
    for name, a in (("local", loc), ("remote", rem)):
        if a.ndim != 2 or a.shape[1] != 3:
            raise BadInput(f"{name} NIXL list must have shape (N, 3), got {a.shape}")
    if loc.shape != rem.shape:
        raise BadInput(f"local and remote NIXL lists differ in shape: {loc.shape} vs {rem.shape}")
    loc = loc.astype(np.uint64, copy=False)
    rem = rem.astype(np.uint64, copy=False)
    if (loc[:, 1] != rem[:, 1]).any():
        i = int(np.flatnonzero(loc[:, 1] != rem[:, 1])[0])
        raise BadInput(f"NIXL row {i}: local length {int(loc[i, 1])} != remote length {int(rem[i, 1])}")
    src, dst = (rem, loc) if op == "READ" else (loc, rem)
    out = np.empty((loc.shape[0], 3), dtype=np.int64)
    for col, side, base, what in ((0, src, src_base, "source"), (1, dst, dst_base, "destination")):
        if (side[:, 0] < np.uint64(base)).any():
            raise BadInput(f"a {what} address lies below the {what} pool base 0x{int(base):x}")
        out[:, col] = (side[:, 0] - np.uint64(base)).astype(np.int64)
    out[:, 2] = loc[:, 1].astype(np.int64)
    return out


def bulk_descriptors(nbytes: int, chunk_bytes: int = BULK_CHUNK_BYTES, *,
                     src_offset: int = 0, dst_offset: int = 0) -> np.ndarray:
    """``[0, nbytes)`` cut into descriptors of at most ``chunk_bytes`` (the last may be shorter)."""
    nbytes, chunk_bytes = int(nbytes), int(chunk_bytes)
    if nbytes < 0 or chunk_bytes <= 0:
        raise BadInput(f"bulk_descriptors needs nbytes >= 0 and chunk_bytes > 0, got {nbytes}, {chunk_bytes}")
    starts = np.arange(0, nbytes, chunk_bytes, dtype=np.int64)
    sizes = np.minimum(chunk_bytes, nbytes - starts)
    return np.stack([starts + src_offset, starts + dst_offset, sizes], axis=1).astype(np.int64).reshape(-1, 3)


# --------------------------------------------------------------------------- finding NIXL


@dataclass
class NixlModule:
    """An imported NIXL Python package (or a fake with the same API, for tests)."""

    name: str
    module: Any
    version: str = "unknown"

    @property
    def nixl_agent(self):
        return self.module.nixl_agent

    @property
    def nixl_agent_config(self):
        return self.module.nixl_agent_config


_found: dict[tuple, tuple[NixlModule | None, str | None]] = {}


def _cuda_major() -> int | None:
    try:
        import torch
        v = torch.version.cuda
        return int(v.split(".")[0]) if v else None
    except Exception:
        return None


def _module_order() -> tuple[str, ...]:
    forced = config.get(NIXL_MODULE_ENV)
    if forced:
        return (forced,)
    major = _cuda_major()
    order = list(NIXL_MODULES)
    if major is not None and f"nixl_cu{major}" in order:
        order.remove(f"nixl_cu{major}")
        order.insert(0, f"nixl_cu{major}")
    return tuple(order)


def find_nixl(refresh: bool = False) -> tuple[NixlModule | None, str | None]:
    """Import NIXL: ``(module, None)``, or ``(None, why not)``. Never raises; cached."""
    order = _module_order()
    if not refresh and order in _found:
        return _found[order]
    reasons = []
    result: tuple[NixlModule | None, str | None] | None = None
    for name in order:
        try:
            mod = importlib.import_module(name)
            getattr(mod, "nixl_agent")
            getattr(mod, "nixl_agent_config")
        except ModuleNotFoundError as exc:
            reasons.append(f"{name}: not installed" if exc.name == name
                           else f"{name}: {type(exc).__name__}: {exc}")
            continue
        except Exception as exc:  # broken install: missing .so, bad plugin dir...
            reasons.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        result = (NixlModule(name, mod, package_version(name.replace("_", "-")) or "unknown"), None)
        break
    if result is None:
        hint = ("pip install nixl-cu13 (or nixl-cu12); on a machine without a network, "
                "the slim tree of docs/MULTINODE.md")
        if all(r.endswith(": not installed") for r in reasons):
            result = (None, f"NIXL is not installed (tried {', '.join(order)}): {hint}")
        else:
            result = (None, "NIXL is not importable (" + "; ".join(reasons) + f"): {hint}")
    _found[order] = result
    return result


def nixl_unavailable_reason() -> str | None:
    """Why the NIXL engines cannot run here (None when NIXL imports). Never raises."""
    return find_nixl()[1]


# --------------------------------------------------------------------------- one agent


class NixlError(DriverError):
    """A NIXL call failed or a transfer ended in ``ERR``."""

    def __init__(self, api: str, doing: str, detail: str = "", status_name: str = "ERR"):
        super().__init__(api, status_name, -1, doing, detail)


@dataclass
class XferStats:
    """One transfer as NIXL saw it (``None`` fields: the wheel gave no telemetry)."""

    descriptors: int
    nbytes: int
    post_us: float | None = None
    xfer_us: float | None = None
    merged_descriptors: int | None = None
    backend: str | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Registration:
    ptr: int
    nbytes: int
    device: int
    handle: Any


class NixlAgent(Closable):
    """One NIXL agent with its registrations, remote agents and prepped lists.

    Owns everything it creates and releases it in the documented order on
    :meth:`close` (idempotent): transfer handles, prepped lists, remote agents,
    registrations.
    """

    def __init__(self, nixl: NixlModule, name: str, *, mem_type: str = "VRAM", rank: int = 0,
                 backends: Sequence[str] = ("UCX",), telemetry: bool = True, num_threads: int = 0):
        self.nixl, self.name, self.mem_type, self.rank = nixl, name, mem_type, rank
        self._closed = False
        self._regs: list[_Registration] = []
        self._remotes: list[str] = []
        self._dlists: list[Any] = []
        self._xfers: list[Any] = []
        self.telemetry = telemetry
        cfg = self._config(backends, telemetry, num_threads)
        try:
            self.agent = nixl.nixl_agent(name, cfg)
        except Exception as exc:
            raise NixlError("nixl_agent", f"creating NIXL agent {name!r}", f"{type(exc).__name__}: {exc}") from exc
        plugins = list(self._call("get_plugin_list", "listing plugins"))
        missing = [b for b in backends if b not in plugins]
        if missing:
            self.close()
            raise BackendUnavailable("nixl", {rank: f"NIXL plugin(s) {missing} not found (plugins found: {plugins}); "
                                              "check NIXL_PLUGIN_DIR"})

    def _config(self, backends, telemetry, num_threads):
        make = self.nixl.nixl_agent_config
        try:
            return make(enable_prog_thread=True, enable_listen_thread=False, capture_telemetry=telemetry,
                        num_threads=num_threads, backends=list(backends))
        except TypeError:  # older wheels without capture_telemetry / num_threads
            self.telemetry = False
            return make(True, False, 0, backends=list(backends))

    def _call(self, method: str, doing: str, *args, **kwargs):
        try:
            return getattr(self.agent, method)(*args, **kwargs)
        except GpuxferError:
            raise
        except Exception as exc:
            raise NixlError(method, doing, f"{type(exc).__name__}: {exc}") from exc

    # ---- memory and peers ----
    def register(self, ptr: int, nbytes: int, device: int, label: str = "pool") -> None:
        """Register ``[ptr, ptr + nbytes)`` on ``device`` with every backend that takes ``mem_type``."""
        if nbytes <= 0:
            raise BadInput(f"cannot register {nbytes} bytes")
        h = self._call("register_memory", f"registering {label} ({nbytes} B at 0x{ptr:x})",
                       [(int(ptr), int(nbytes), int(device), label)], self.mem_type)
        if h is None:
            raise NixlError("register_memory", f"registering {label}", "NIXL returned no descriptor list")
        self._regs.append(_Registration(int(ptr), int(nbytes), int(device), h))

    def metadata(self) -> bytes:
        return self._call("get_agent_metadata", "reading this agent's metadata")

    def add_remote(self, metadata: bytes) -> str:
        name = self._call("add_remote_agent", "adding the peer agent", metadata)
        if isinstance(name, bytes):
            name = name.decode()
        self._remotes.append(name)
        return name

    def connect(self, remote: str) -> None:
        """Pre-connect (optional in NIXL; keeps connection set-up out of the first timed transfer)."""
        if hasattr(self.agent, "make_connection"):
            self._call("make_connection", f"connecting to {remote}", remote)

    # ---- descriptor lists ----
    def prep(self, remote: str | None, rows: np.ndarray):
        """Prep ``rows`` (NIXL ``(N, 3)`` uint64) for the local side (``remote=None``) or a peer's side."""
        agent_name = "NIXL_INIT_AGENT" if remote is None else remote
        h = self._call("prep_xfer_dlist", f"prepping {len(rows)} descriptors for {agent_name}",
                       agent_name, np.ascontiguousarray(rows, dtype=np.uint64), self.mem_type)
        self._dlists.append(h)
        return h

    def release_dlist(self, h) -> None:
        self._call("release_dlist_handle", "releasing a prepped list", h)
        if h in self._dlists:   # forgotten only once released (close() retries the others)
            self._dlists.remove(h)

    def make_prepped(self, op: str, local_h, local_idx, remote_h, remote_idx, notif: bytes = b""):
        h = self._call("make_prepped_xfer", f"making a prepped {op} of {len(local_idx)} descriptors",
                       op, local_h, np.ascontiguousarray(local_idx, dtype=np.int32), remote_h,
                       np.ascontiguousarray(remote_idx, dtype=np.int32), notif)
        self._xfers.append(h)
        return h

    def oneshot(self, op: str, local_rows: np.ndarray, remote_rows: np.ndarray, remote: str, notif: bytes = b""):
        loc = self._call("get_xfer_descs", "building the local list",
                         np.ascontiguousarray(local_rows, dtype=np.uint64), self.mem_type)
        rem = self._call("get_xfer_descs", "building the remote list",
                         np.ascontiguousarray(remote_rows, dtype=np.uint64), self.mem_type)
        h = self._call("initialize_xfer", f"initializing a {op} of {len(local_rows)} descriptors",
                       op, loc, rem, remote, notif)
        self._xfers.append(h)
        return h

    # ---- transfers ----
    def post(self, h, what: str) -> str:
        state = self._call("transfer", f"posting {what}", h)
        if state == "ERR":
            raise NixlError("transfer", f"posting {what}", "NIXL returned ERR")
        return state

    def wait(self, h, what: str, *, timeout_s: float, step: int = 0, state: str = "PROC") -> None:
        """Poll ``check_xfer_state`` until ``DONE``; :class:`TransferTimeout` past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        spins = 0
        while state != "DONE":
            if state == "ERR":
                raise NixlError("check_xfer_state", f"waiting for {what}", "the transfer ended in ERR")
            if time.monotonic() > deadline:
                raise TransferTimeout(rank=self.rank, step=step, flag="nixl transfer state", expected=1, seen=0,
                                      timeout_s=timeout_s, what=f"{what}: still {state} (1 = DONE, 0 = PROC)")
            spins += 1
            if spins > 1000:  # a long transfer: stop burning the core the progress thread wants
                time.sleep(2e-5)
            state = self._call("check_xfer_state", f"checking {what}", h)

    def state(self, h) -> str:
        return self._call("check_xfer_state", "checking a transfer", h)

    def run(self, h, what: str, *, timeout_s: float, step: int = 0) -> None:
        self.wait(h, what, timeout_s=timeout_s, step=step, state=self.post(h, what))

    def stats(self, h, descriptors: int, nbytes: int) -> XferStats:
        st = XferStats(descriptors, nbytes)
        if self.telemetry and hasattr(self.agent, "get_xfer_telemetry"):
            try:
                t = self.agent.get_xfer_telemetry(h)
                st.post_us = float(t.postDuration)
                st.xfer_us = float(t.xferDuration)
                st.merged_descriptors = int(t.descCount)
            except Exception as exc:  # telemetry is optional: NIXL raises when it was not captured
                log.debug("no NIXL telemetry: %s", exc)
        try:
            st.backend = self.agent.query_xfer_backend(h)
        except Exception:
            pass
        return st

    def release_xfer(self, h) -> None:
        """Release a transfer handle (NIXL cancels an active transfer, or raises if it cannot)."""
        self._call("release_xfer_handle", "releasing a transfer handle", h)
        if h in self._xfers:   # forgotten only once released (close() retries the others)
            self._xfers.remove(h)

    def release_quietly(self, handles=(), dlists=()) -> list[str]:
        """Release what can be released; the errors, as text (close() retries what stays)."""
        errors = []
        for fn, items in ((self.release_xfer, handles), (self.release_dlist, dlists)):
            for h in items:
                try:
                    fn(h)
                except GpuxferError as exc:
                    errors.append(str(exc))
        return errors

    # ---- notifications (used by nixl+pack to hand over "packed" / "landed") ----
    def notify(self, remote: str, msg: bytes) -> None:
        self._call("send_notif", f"notifying {remote}", remote, msg)

    def wait_notif(self, remote: str, tag: bytes, *, timeout_s: float, step: int = 0) -> None:
        deadline = time.monotonic() + timeout_s
        delay = 1e-5
        while not self._call("check_remote_xfer_done", f"waiting for {tag!r} from {remote}", remote, tag):
            if time.monotonic() > deadline:
                raise TransferTimeout(rank=self.rank, step=step, flag=f"nixl notification {tag.decode(errors='replace')}",
                                      expected=1, seen=0, timeout_s=timeout_s, what=f"from agent {remote}")
            time.sleep(delay)
            delay = min(delay * 2, 5e-4)

    # ---- lifetime ----
    def _release(self) -> None:
        """Release transfers, prepped lists, remote agents and registrations, in that order (``close()``)."""
        agent = getattr(self, "agent", None)
        if agent is None:
            return
        errors = []
        for items, method in ((self._xfers, "release_xfer_handle"), (self._dlists, "release_dlist_handle"),
                              (self._remotes, "remove_remote_agent")):
            for h in list(items):
                try:
                    getattr(agent, method)(h)
                except Exception as exc:  # keep going: release what can be released
                    errors.append(f"{method}: {exc}")
            items.clear()
        for reg in self._regs:
            try:
                agent.deregister_memory(reg.handle)
            except Exception as exc:
                errors.append(f"deregister_memory: {exc}")
        self._regs.clear()
        self.agent = None
        if errors:
            log.warning("NIXL agent %s closed with errors: %s", self.name, "; ".join(errors))


# --------------------------------------------------------------------------- the engines

from .engines import (Burst, Engine, Prepared, Role, Side, _bind, _device_table, _kernel_reason,  # noqa: E402
                      _kernels, _sync_uploads, chunk_plan, split_large, wait_event)


def _platform_reason(platform) -> str | None:
    if platform.name not in ("cuda", "host"):
        return (f"the NIXL wheels move CUDA device memory (VRAM) or host memory (DRAM); "
                f"platform {platform.name!r} is neither")
    return None


@dataclass
class _Batch:
    """One prepared burst of a per-descriptor NIXL engine (initiator side)."""

    op: str
    requests: list = field(default_factory=list)   # per request: what post() needs
    handles: list = field(default_factory=list)    # (xfer handle, state after post, descriptors, bytes)
    dlists: list = field(default_factory=list)


class _NixlEngineBase(Engine):
    """An agent per process, pools registered once, metadata exchanged in the constructor."""

    uses_sms = "none (UCX moves the bytes: cuda_ipc copies inside a node, RDMA between nodes)"

    @classmethod
    def unavailable_reason(cls, platform) -> str | None:
        return _platform_reason(platform) or nixl_unavailable_reason()

    def _extra_registrations(self) -> dict:
        """Register more buffers before the metadata is taken (subclasses); returns what the peer needs."""
        return {}

    def __init__(self, side: Side):
        super().__init__(side)
        self.agent: NixlAgent | None = None
        self.remote: str | None = None
        self.peer: dict = {}
        self._stats: list[dict] = []
        self._recorded: set[int] = set()
        self._current: Any = None
        self.mem_type = "DRAM" if self.platform.is_emulation else "VRAM"
        self.nixl_dev = 0 if self.platform.is_emulation else side.device
        info: dict = {}
        try:
            mod, why = find_nixl()
            if mod is None:
                raise BackendUnavailable(self.name, {side.rank: why})
            self.platform.set_device(side.device)
            name = f"gpuxfer-{self.name.replace('+', '-')}-{side.role.value}-{os.getpid()}"
            self.agent = NixlAgent(mod, name, mem_type=self.mem_type, rank=side.rank)
            self.agent.register(side.pool.ptr, side.pool.nbytes, self.nixl_dev, "pool")
            info = dict(self._extra_registrations(), pool=int(side.pool.ptr), pool_bytes=int(side.pool.nbytes),
                        dev=self.nixl_dev, md=self.agent.metadata(), module=f"{mod.name} {mod.version}")
        except Exception as exc:  # tell the peer, so both sides fail together instead of one hanging
            info = {"error": f"{type(exc).__name__}: {exc}"}
        self.peer = side.agree(self.name, info, self._release)[side.peer_rank]
        try:
            self.remote = self.agent.add_remote(self.peer["md"])
            try:
                self.agent.connect(self.remote)
            except NixlError as exc:  # optional: the first transfer connects otherwise
                log.info("%s: make_connection failed (%s); connecting on first use", self.name, exc)
        except BaseException:
            self._release()
            raise

    # -- addresses of both pools in their owners' address spaces
    def _bases(self, what: str = "pool") -> tuple[int, int, int, int]:
        """(src_base, dst_base, src_dev, dst_dev) of ``what`` (``pool`` or ``stage``)."""
        mine, theirs = int(getattr(self, "_own_" + what)), int(self.peer[what])
        if self.side.role is Role.SOURCE:
            return mine, theirs, self.nixl_dev, int(self.peer["dev"])
        return theirs, mine, int(self.peer["dev"]), self.nixl_dev

    @property
    def _own_pool(self) -> int:
        return self.side.pool.ptr

    def _pool_limits(self) -> tuple[int, int]:
        """(source pool bytes, destination pool bytes), from this side's pool and what the peer said:
        the peer's pool need not be mapped here (across nodes it cannot be)."""
        mine, theirs = int(self.side.pool.nbytes), int(self.peer["pool_bytes"])
        return (mine, theirs) if self.side.role is Role.SOURCE else (theirs, mine)

    def _rows(self, desc: np.ndarray, op: str, what: str = "pool", nbytes: tuple | None = None):
        src_base, dst_base, src_dev, dst_dev = self._bases(what)
        return to_nixl_dlists(desc, op, src_base=src_base, dst_base=dst_base, src_dev=src_dev, dst_dev=dst_dev,
                              src_nbytes=None if nbytes is None else nbytes[0],
                              dst_nbytes=None if nbytes is None else nbytes[1])

    def _what(self, p: Prepared) -> str:
        return f"{self.name} {OPS[p.direction]} of {p.burst.batch} request(s), {p.burst.descriptors} descriptors"

    def _burst_stats(self, handles) -> None:
        """Record NIXL's telemetry of one completed burst (a list of ``(handle, state, descs, bytes)``), once."""
        if not handles or id(handles[0][0]) in self._recorded:
            return
        self._recorded.add(id(handles[0][0]))
        stats = [self.agent.stats(h, n, b) for h, _state, n, b in handles]
        if not stats:
            return
        post = [s.post_us for s in stats if s.post_us is not None]
        xfer = [s.xfer_us for s in stats if s.xfer_us is not None]
        merged = [s.merged_descriptors for s in stats if s.merged_descriptors is not None]
        self._stats.append({
            "backend": stats[0].backend, "transfers": len(stats),
            "post_us": float(sum(post)) if post else None,          # host time posting, summed
            "xfer_us": float(max(xfer)) if xfer else None,          # the transfers overlap: the longest
            "merged": int(sum(merged)) if merged else None,
        })

    def _finish(self, handles) -> None:
        """Telemetry of a completed burst, then release its handles (errors logged; close() retries)."""
        if not handles or self.agent is None or self.agent.closed:
            return
        try:
            if all(self.agent.state(h) == "DONE" for h, *_ in handles):
                self._burst_stats(handles)
        finally:
            self._recorded.discard(id(handles[0][0]))
            errors = self.agent.release_quietly([h for h, *_ in handles])
            if errors:
                log.warning("%s: releasing a burst's transfers: %s", self.name, "; ".join(errors))

    def _current_handles(self) -> list:
        """The last burst's transfers, still held (released at the next post or at release)."""
        return []

    def row_extra(self) -> dict:
        """NIXL's own telemetry over the row's bursts so far, warm-ups included (empty when the wheel gives none).

        ``nixl_post_us_p50``: host time NIXL spent posting a burst (summed over its transfers);
        ``nixl_xfer_us_p50``: NIXL's transfer time of a burst (the longest of its transfers);
        ``nixl_descriptors_after_merge``: what NIXL actually posted after merging adjacent descriptors.
        """
        if self.agent is None or self.agent.closed:
            return {}
        last = self._current_handles()
        if last and all(self.agent.state(h) == "DONE" for h, *_ in last):
            self._burst_stats(last)
        if not self._stats:
            return {}

        def p50(key):
            v = [s[key] for s in self._stats if s[key] is not None]
            return float(np.median(v)) if v else None
        last = self._stats[-1]
        return {"nixl_module": f"{self.agent.nixl.name} {self.agent.nixl.version}",
                "nixl_backend": last["backend"], "nixl_transfers_per_burst": last["transfers"],
                "nixl_bursts": len(self._stats), "nixl_post_us_p50": p50("post_us"),
                "nixl_xfer_us_p50": p50("xfer_us"), "nixl_descriptors_after_merge": last["merged"]}

    def _release(self) -> None:
        if self.agent is not None:
            self.agent.close()


class NixlEngine(_NixlEngineBase):
    name = "nixl"
    description = ("NIXL (UCX) prepped path: both sides' descriptor lists prepped once per table "
                   "(prep_xfer_dlist, untimed); per request make_prepped_xfer + transfer; READ pulls, WRITE pushes")

    def shed_reason(self, burst: Burst) -> str | None:
        cap = config.get("GPUXFER_NIXL_MAX_DESCS")
        if burst.descriptors > cap:
            return (f"{self.name} is capped at {cap} descriptors per burst (this burst has {burst.descriptors}; "
                    f"at ~8 us per descriptor it would take ~{burst.descriptors * 8e-6:.0f} s); "
                    f"set GPUXFER_NIXL_MAX_DESCS to measure it")
        return None

    def prepare(self, burst: Burst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction)
        if not p.active:
            return p
        self._stats = []
        op = OPS[direction]
        reqs = [r for r in burst.requests if r.shape[0]]
        b = _Batch(op)
        self._current = b
        if reqs:
            cat = np.concatenate(reqs) if len(reqs) > 1 else reqs[0]
            local, remote = self._rows(cat, op)
            lh = self.agent.prep(None, local)
            b.dlists.append(lh)
            rh = self.agent.prep(self.remote, remote)
            b.dlists.append(rh)
            start = 0
            for r in reqs:
                idx = np.arange(start, start + r.shape[0], dtype=np.int32)
                b.requests.append((lh, idx, rh, int(r[:, 2].sum())))
                start += r.shape[0]
        p.state = b
        return p

    def _current_handles(self) -> list:
        return self._current.handles if isinstance(self._current, _Batch) else []

    def post(self, p: Prepared) -> None:
        if not p.active:
            return
        b: _Batch = p.state
        what = self._what(p)
        prev, b.handles = b.handles, []
        for lh, idx, rh, nbytes in b.requests:
            h = self.agent.make_prepped(b.op, lh, idx, rh, idx)
            b.handles.append((h, self.agent.post(h, what), len(idx), nbytes))
        self._finish(prev)   # the previous burst's handles, released while this one is on the wire

    def wait(self, p: Prepared) -> None:
        if not p.active:
            return
        what = self._what(p)
        for h, state, _n, _b in p.state.handles:
            self.agent.wait(h, what, timeout_s=self.side.timeout_s, state=state)

    def release(self, p: Prepared) -> None:
        b: _Batch | None = p.state
        if b is not None and self.agent is not None and not self.agent.closed:
            try:
                self._finish(b.handles)
            finally:
                errors = self.agent.release_quietly((), b.dlists)
                b.handles, b.dlists = [], []
                if errors:
                    log.warning("%s: releasing prepped lists: %s", self.name, "; ".join(errors))
        super().release(p)


class NixlOneshotEngine(NixlEngine):
    name = "nixl-oneshot"
    description = ("NIXL (UCX) one-shot path: per request both descriptor lists are built and "
                   "initialize_xfer + transfer is called (what the CollectiveX suite times)")

    def prepare(self, burst: Burst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction)
        if not p.active:
            return p
        self._stats = []
        b = _Batch(OPS[direction])
        self._current = b
        for r in burst.requests:
            if r.shape[0]:
                local, remote = self._rows(r, b.op)
                b.requests.append((local, remote, int(r[:, 2].sum())))
        p.state = b
        return p

    def post(self, p: Prepared) -> None:
        if not p.active:
            return
        b: _Batch = p.state
        what = self._what(p)
        prev, b.handles = b.handles, []
        for local, remote, nbytes in b.requests:
            h = self.agent.oneshot(b.op, local, remote, self.remote)
            b.handles.append((h, self.agent.post(h, what), len(local), nbytes))
        self._finish(prev)   # the previous burst's handles, released while this one is on the wire


class NixlBulkEngine(NixlEngine):
    name = "nixl-bulk"
    ceiling_across_hosts = True
    description = ("NIXL's own ceiling: the burst's total bytes as a few bulk descriptors pool to pool "
                   "(READ pulls, WRITE pushes); across nodes, where the copy-engine bulk cannot run, the ceiling")

    def shed_reason(self, burst) -> str | None:
        return None

    def prepare(self, burst: Burst, direction: str) -> Prepared:
        burst.check_bounds(*self._pool_limits())     # the burst's own descriptors, before its size is used
        n = burst.nbytes
        src_bytes, dst_bytes = self._pool_limits()
        if n > min(src_bytes, dst_bytes):
            raise BadInput(f"{self.name}: the burst's {n} bytes do not fit the pools ({src_bytes}, {dst_bytes} B)")
        bulk = Burst([bulk_descriptors(n)]) if n else burst
        p = super().prepare(bulk, direction)
        p.burst = burst
        return p

    def verify_descriptors(self, burst: Burst) -> np.ndarray:
        return bulk_descriptors(burst.nbytes, self.options.verify_chunk_bytes)


@dataclass
class _PackState:
    rounds: list            # (start, stop, nbytes) into the split table
    tables: list            # per round: this side's kernel table on the device
    dlists: list            # initiator: per round (local prepped, remote prepped, indices)
    tag: int = 0            # burst number (both sides count alike)
    pending: Any = None     # push source: the event of round 0's pack, launched by post()
    done: list = field(default_factory=list)   # initiator: this burst's completed NIXL transfers
    hint: int = 2304        # typical descriptor size (picks the kernel's tiling)


class NixlPackEngine(_NixlEngineBase):
    name = "nixl+pack"
    description = ("pack the pages into a staging buffer on the source (gpuxfer kernel), move the staging "
                   "buffer through NIXL as a few bulk descriptors (READ pulls, WRITE pushes), unpack on the "
                   "destination; rounds of at most the staging size")
    uses_sms = "both GPUs, local HBM only (pack, unpack); UCX moves the bytes"

    @classmethod
    def unavailable_reason(cls, platform) -> str | None:
        return super().unavailable_reason(platform) or _kernel_reason(platform)

    def _extra_registrations(self) -> dict:
        want = min(self.side.pool.nbytes, config.get("GPUXFER_NIXL_PACK_STAGE_BYTES"))
        self.stage = self.platform.alloc(want, self.side.device)
        self.agent.register(self.stage.ptr, self.stage.nbytes, self.nixl_dev, "stage")
        return {"stage": int(self.stage.ptr), "stage_bytes": int(self.stage.nbytes)}

    @property
    def _own_stage(self) -> int:
        return self.stage.ptr

    def __init__(self, side: Side):
        self.stage = None
        super().__init__(side)
        self.round_bytes = min(self.stage.nbytes, int(self.peer["stage_bytes"]))
        self.kernel_stream = self.platform.create_stream(side.device)
        self._stage_t = None
        self._pool_t = None
        self._bursts = 0

    def _views(self):
        if self._stage_t is None:
            self._stage_t = self.platform.as_tensor(self.stage, shape=(self.round_bytes,))
            self._pool_t = self.platform.as_tensor(self.side.pool)
        return self._stage_t, self._pool_t

    def prepare(self, burst: Burst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction, active=True)   # both sides work
        self._stats = []
        d = split_large(burst.concatenated(), self.round_bytes)
        rounds = chunk_plan(d, self.round_bytes, self.round_bytes) if d.shape[0] else []
        packed = np.empty(d.shape[0], dtype=np.int64)
        for a, b, _ in rounds:
            n = d[a:b, 2]
            packed[a:b] = np.cumsum(n) - n
        if self.side.role is Role.SOURCE:        # pack: pool -> staging
            table = np.stack([d[:, 0], packed, d[:, 2]], axis=1)
        else:                                     # unpack: staging -> pool
            table = np.stack([packed, d[:, 1], d[:, 2]], axis=1)
        stage_t, pool_t = self._views()
        dev_table = _device_table(self.side, pool_t, table)
        _sync_uploads(self.side)
        tables = [dev_table[a:b] for a, b, _ in rounds]
        k = _kernels()
        for t in tables:                      # every row inside the pool and the staging (one host sync each)
            src, dst = (pool_t, stage_t) if self.side.role is Role.SOURCE else (stage_t, pool_t)
            k.check_copy(src, dst, t)
        hint = int(d[:, 2].max()) if d.shape[0] else 1
        dlists = []
        if p.initiator:
            op = OPS[direction]
            for _a, _b, nbytes in rounds:
                local, remote = self._rows(bulk_descriptors(nbytes), op, "stage")
                lh = self.agent.prep(None, local)
                rh = self.agent.prep(self.remote, remote)
                dlists.append((lh, rh, np.arange(len(local), dtype=np.int32)))
        p.state = self._current = _PackState(rounds, tables, dlists, hint=hint)
        return p

    def _current_handles(self) -> list:
        return self._current.done if isinstance(self._current, _PackState) else []

    def _launch(self, st: "_PackState", r: int, *, pack: bool):
        stage_t, pool_t = self._views()
        src, dst = (pool_t, stage_t) if pack else (stage_t, pool_t)
        self.platform.launch(self.kernel_stream, _bind(_kernels().copy_descriptors, src, dst, st.tables[r],
                                                       validate=False, nbytes_hint=st.hint))
        return self.platform.record_event(self.kernel_stream)

    def _sync(self, event, what: str, step: int) -> None:
        wait_event(self.platform, event, self.side.timeout_s, rank=self.side.rank, what=what, step=step)

    def _tag(self, kind: str, n: int, r: int) -> bytes:
        return f"gpuxfer:{kind}:{n}:{r}".encode()

    def post(self, p: Prepared) -> None:
        st: _PackState = p.state
        self._bursts += 1
        st.tag = self._bursts
        prev, st.done = st.done, []
        if not st.rounds:
            return
        if p.direction == "pull" and p.initiator:      # destination: start the source's packing
            self.agent.notify(self.remote, self._tag("go", st.tag, 0))
        elif p.direction == "push" and p.initiator:    # source: pack round 0 now
            st.pending = self._launch(st, 0, pack=True)
        self._finish(prev)                             # the previous burst's transfers

    def wait(self, p: Prepared) -> None:
        st: _PackState = p.state
        if not st.rounds:
            return
        source = self.side.role is Role.SOURCE
        if p.direction == "push":
            (self._push_source if source else self._push_destination)(st)
        else:
            (self._pull_source if source else self._pull_destination)(st)

    def _xfer(self, st: _PackState, r: int, op: str, notif: bytes) -> None:
        lh, rh, idx = st.dlists[r]
        h = self.agent.make_prepped(op, lh, idx, rh, idx, notif)
        try:
            self.agent.run(h, f"{self.name} {op} of round {r} ({st.rounds[r][2]} B)",
                           timeout_s=self.side.timeout_s, step=st.tag)
            st.done.append((h, "DONE", len(idx), st.rounds[r][2]))
        except BaseException:
            self.agent.release_quietly([h])
            raise

    def _notif(self, kind: str, st: _PackState, r: int) -> None:
        self.agent.wait_notif(self.remote, self._tag(kind, st.tag, r), timeout_s=self.side.timeout_s, step=st.tag)

    # push: the source packs, WRITEs (the notification rides on the write), the destination unpacks
    def _push_source(self, st: _PackState) -> None:
        for r in range(len(st.rounds)):
            if r:
                self._notif("unpacked", st, r - 1)               # the destination's staging is free again
                st.pending = self._launch(st, r, pack=True)
            self._sync(st.pending, f"{self.name}: pack of round {r}", st.tag)
            self._xfer(st, r, "WRITE", self._tag("written", st.tag, r))
        self._notif("unpacked", st, len(st.rounds) - 1)          # landed in the destination's pool

    def _push_destination(self, st: _PackState) -> None:
        for r in range(len(st.rounds)):
            self._notif("written", st, r)
            self._sync(self._launch(st, r, pack=False), f"{self.name}: unpack of round {r}", st.tag)
            self.agent.notify(self.remote, self._tag("unpacked", st.tag, r))

    # pull: the destination says go, the source packs and says packed, the destination READs and unpacks
    def _pull_source(self, st: _PackState) -> None:
        self._notif("go", st, 0)
        for r in range(len(st.rounds)):
            if r:
                self._notif("read", st, r - 1)                   # our staging has been read
            self._sync(self._launch(st, r, pack=True), f"{self.name}: pack of round {r}", st.tag)
            self.agent.notify(self.remote, self._tag("packed", st.tag, r))
        self._notif("read", st, len(st.rounds) - 1)

    def _pull_destination(self, st: _PackState) -> None:
        for r in range(len(st.rounds)):
            self._notif("packed", st, r)
            self._xfer(st, r, "READ", self._tag("read", st.tag, r))
            self._sync(self._launch(st, r, pack=False), f"{self.name}: unpack of round {r}", st.tag)

    def release(self, p: Prepared) -> None:
        st: _PackState | None = p.state
        if st is not None and self.agent is not None and not self.agent.closed:
            self._finish(st.done)
            st.done = []
            errors = self.agent.release_quietly((), [h for lh, rh, _ in st.dlists for h in (lh, rh)])
            st.dlists.clear()
            if errors:
                log.warning("%s: releasing a burst: %s", self.name, "; ".join(errors))
        super().release(p)

    def _release(self) -> None:
        self._stage_t = self._pool_t = None
        try:
            super()._release()     # the agent deregisters the staging buffer before it is freed
        finally:
            if getattr(self, "kernel_stream", None) is not None:
                self.kernel_stream.close()
            if getattr(self, "stage", None) is not None:
                self.stage.close()


#: the engines of this module, as the registry names them
NIXL_ENGINES = {
    "nixl": "gpuxfer.kv.nixl_engine:NixlEngine",
    "nixl-bulk": "gpuxfer.kv.nixl_engine:NixlBulkEngine",
    "nixl-oneshot": "gpuxfer.kv.nixl_engine:NixlOneshotEngine",
    "nixl+pack": "gpuxfer.kv.nixl_engine:NixlPackEngine",
}


def register() -> None:
    """Add the NIXL engines to :data:`gpuxfer.kv.engines.ENGINES` (idempotent; imports no NIXL)."""
    from .engines import register_engine
    for name, target in NIXL_ENGINES.items():
        register_engine(name, target)
