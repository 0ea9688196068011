"""NIXL's Python agent, wrapped: finding the wheel, one agent with its registrations, and the
translation between gpuxfer's descriptor tables and NIXL's descriptor lists.

NIXL (``nixl-cu13`` / ``nixl-cu12`` wheels, UCX backend) is imported only by :func:`find_nixl`, and
every call into an agent goes through :meth:`NixlAgent._call`, which turns a failure into
:class:`NixlError`. The KV agent's NIXL route (:mod:`gpuxfer.kv.nixl_route`) and the benchmark's NIXL engines
(:mod:`gpuxfer.bench.kv.engines.nixl`) are built on it. Everything here that
does not need NIXL (descriptor translation, module discovery) is a pure function, tested on the CPU with
a fake agent module. Importing this module never imports NIXL nor touches a GPU.
"""
from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import config
from ..common import package_version
from ..errors import BackendUnavailable, BadInput, DriverError, GpuxferError, TransferTimeout
from ..platforms.base import Closable
from .descriptors import as_descriptors, check_bounds

log = logging.getLogger("gpuxfer.kv.nixl")

#: module names the NIXL wheels install, in the order tried when the CUDA major is unknown
NIXL_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
#: forces one module name (e.g. ``nixl_cu12``)
NIXL_MODULE_ENV = "GPUXFER_NIXL_MODULE"
#: NIXL agents closed while operations of theirs may still run: kept, with their registrations, for the life of
#: the process (:meth:`NixlAgent._release`)
_KEPT: list = []


# --------------------------------------------------------------------------- descriptor translation


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
    d = as_descriptors(desc)
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


def nixl_platform_reason(platform) -> str | None:
    """Why the NIXL wheels cannot move ``platform``'s memory (None: they can)."""
    if platform.memory_runtime not in ("cuda", "host"):
        return (f"the NIXL wheels move CUDA device memory (VRAM) or host memory (DRAM); "
                f"platform {platform.name!r} is neither")
    return None


def nixl_unavailable_reason() -> str | None:
    """Why the NIXL engines cannot run here (None when NIXL imports). Never raises."""
    return find_nixl()[1]


# --------------------------------------------------------------------------- one agent


class NixlError(DriverError):
    """A NIXL call failed or a transfer ended in ``ERR``."""

    def __init__(self, api: str, doing: str, detail: str = "", status_name: str = "ERR"):
        super().__init__(api, status_name, -1, doing, detail)


class RemoteHeld(BadInput):
    """:meth:`NixlAgent.add_remote` of an agent it holds already; ``name``: that agent's."""

    def __init__(self, name: str):
        super().__init__(f"NIXL agent {name!r} is added already")
        self.name = name


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

    A posted transfer let go of before NIXL reported it ``DONE`` (it ended in ``ERR``, or was released while
    running) counts in :attr:`unsettled`: NIXL's release does not wait for the operations it handed the backend
    (UCX cancels none of its RMA operations; the release only frees their requests), and nothing reports when
    they stop. While any does, or a transfer NIXL refuses to release, :meth:`close` keeps the agent -- its
    registrations, lists and connections -- for the life of the process (logged) instead of deregistering memory
    those operations may still touch.
    """

    def __init__(self, nixl: NixlModule, name: str, *, mem_type: str = "VRAM", rank: int = 0,
                 backends: Sequence[str] = ("UCX",), telemetry: bool = True, num_threads: int = 0,
                 progress_thread: bool = True):
        self.nixl, self.name, self.mem_type, self.rank = nixl, name, mem_type, rank
        self.progress_thread = bool(progress_thread)
        self._closed = False
        self._regs: list[_Registration] = []
        self._remotes: list[str] = []
        self._dlists: list[Any] = []
        self._xfers: list[Any] = []
        self._active: set[int] = set()      # ids of posted transfers not seen DONE since their last post
        self.unsettled = 0                  # transfers released (or failed) that NIXL never reported DONE
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
            return make(enable_prog_thread=self.progress_thread, enable_listen_thread=False, capture_telemetry=telemetry,
                        num_threads=num_threads, backends=list(backends))
        except TypeError:  # older wheels without capture_telemetry / num_threads
            self.telemetry = False
            return make(self.progress_thread, False, 0, backends=list(backends))

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

    def add_remote(self, metadata: bytes, name: str | None = None) -> str:
        """Add the agent of ``metadata`` (``name``: the name it is expected to have, refused before NIXL loads it
        when held already); one this agent holds already is refused (:class:`RemoteHeld`): NIXL loads it again
        silently, and the two holders would remove it from under each other."""
        if name is not None:
            self._refuse_held(name)
        got = self._call("add_remote_agent", "adding the peer agent", metadata)
        if isinstance(got, bytes):
            got = got.decode()
        self._refuse_held(got)
        self._remotes.append(got)
        return got

    def _refuse_held(self, name: str) -> None:
        if name in self._remotes:
            raise RemoteHeld(name)

    def remove_remote(self, name: str) -> None:
        """Remove (``remove_remote_agent``) an agent :meth:`add_remote` added; forgotten once NIXL removed it."""
        self._call("remove_remote_agent", f"removing the peer agent {name}", name)
        if name in self._remotes:
            self._remotes.remove(name)

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
        self._active.add(id(h))             # from here NIXL may have handed the backend operations of it
        state = self._call("transfer", f"posting {what}", h)
        if state == "ERR":
            raise NixlError("transfer", f"posting {what}", "NIXL returned ERR")
        if state == "DONE":
            self._active.discard(id(h))
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
            state = self.state(h, f"checking {what}")

    def state(self, h, doing: str = "checking a transfer") -> str:
        state = self._call("check_xfer_state", doing, h)
        if state == "DONE":
            self._active.discard(id(h))
        return state

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
        """Release a transfer handle (NIXL raises where it cannot; a posted one not seen DONE counts in
        :attr:`unsettled`: what NIXL handed the backend of it may still run)."""
        self._call("release_xfer_handle", "releasing a transfer handle", h)
        if id(h) in self._active:
            self._active.discard(id(h))
            self.unsettled += 1
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
        """Release transfers, prepped lists, remote agents and registrations, in that order (``close()``); with
        transfers :attr:`unsettled` or unreleased, nothing past the transfers (the agent is kept)."""
        agent = getattr(self, "agent", None)
        if agent is None:
            return
        errors = self.release_quietly(list(self._xfers))
        if self._xfers or self.unsettled:
            _KEPT.append(self)
            self._kept, self.agent = agent, None        # kept alive; calls through this wrapper end here
            log.error("NIXL agent %s closed with %d transfer(s) it never reported done (%d it refuses to release%s):"
                      " operations of theirs may still run, so its registrations, lists and connections are kept "
                      "for the life of the process", self.name, self.unsettled + len(self._xfers), len(self._xfers),
                      f": {'; '.join(errors)}" if errors else "")
            return
        for items, method in ((self._dlists, "release_dlist_handle"), (self._remotes, "remove_remote_agent")):
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
