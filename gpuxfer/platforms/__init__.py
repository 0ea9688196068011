"""Platform detection, and the process's platform object.

``detect()`` tries CUDA, then ROCm, then the host emulation, and records why
each one it skipped could not be used. ``GPUXFER_PLATFORM`` (or the ``name``
argument) forces one. Nothing here touches a device at import.

:func:`current` is the one platform object of the process that everything not
handed a platform uses (``get_platform()``, ``pp.connect()``, ``KVAgent``, the
benchmarks): built on first use, closed at interpreter exit. Its exit hook is
registered when this package is imported -- before any transport or agent can
register one -- so it runs after theirs (``atexit`` runs hooks last-in first-out).
"""
from __future__ import annotations

import atexit
import importlib
import logging
import os
import threading

from .. import config
from ..errors import BadInput, PlatformUnavailable
from .base import (RELEASE_VALUE, Detection, DeviceBuffer, DeviceInfo, Event, IpcHandle, LinkInfo, Memory, PeerMapping,
                   Platform, Stream)

log = logging.getLogger("gpuxfer.platforms")

# name -> (module, class); order is detection priority
PLATFORMS: dict[str, tuple[str, str]] = {
    "cuda": ("gpuxfer.platforms.cuda", "CudaPlatform"),
    "rocm": ("gpuxfer.platforms.rocm", "RocmPlatform"),
    "host": ("gpuxfer.platforms.host", "HostPlatform"),
}

__all__ = ["Detection", "DeviceBuffer", "DeviceInfo", "Event", "IpcHandle", "LinkInfo", "Memory",
           "PeerMapping", "Platform", "Stream", "RELEASE_VALUE", "PLATFORMS", "platform_class", "unavailable_reason",
           "detect", "current", "get_platform"]


def platform_class(name: str) -> type[Platform]:
    if name not in PLATFORMS:
        raise BadInput(f"unknown platform {name!r}; known: {', '.join(PLATFORMS)}")
    module, cls = PLATFORMS[name]
    return getattr(importlib.import_module(module), cls)


def unavailable_reason(name: str) -> str | None:
    """Why platform ``name`` cannot run here (None if it can). Never raises."""
    try:
        return platform_class(name).unavailable_reason()
    except BadInput:
        raise
    except Exception as exc:  # a broken optional install is a reason, not a crash
        return f"{type(exc).__name__}: {exc}"


def detect(name: str | None = None) -> Detection:
    """Pick a platform: ``name``, else ``$GPUXFER_PLATFORM``, else the first usable of cuda, rocm, host."""
    forced = name or config.get("GPUXFER_PLATFORM")
    if forced and forced != "auto":
        why = unavailable_reason(forced)
        if why is not None:
            raise PlatformUnavailable(forced, why)
        return Detection(platform_class(forced)(), {})
    skipped: dict[str, str] = {}
    for cand in PLATFORMS:
        why = unavailable_reason(cand)
        if why is None:
            plat = platform_class(cand)()
            for k, v in skipped.items():
                log.info("platform %s skipped: %s", k, v)
            return Detection(plat, skipped)
        skipped[cand] = why
    raise PlatformUnavailable("any", "; ".join(f"{k}: {v}" for k, v in skipped.items()))


_lock = threading.Lock()
_shared: dict[str, Platform] = {}      # platform name -> the process's object of that platform
_auto: list[str] = []                  # the name detect() chose for current() without a name


def current(name: str | None = None) -> Platform:
    """The process's platform object: ``name``'s (else the one :func:`detect` picks), built once and shared.

    Callers use it without closing it: it is closed at interpreter exit. One that a caller closed
    anyway is replaced by a new one on the next call. A forked child starts without the parent's.
    """
    with _lock:
        if not name or name == "auto":
            name = config.get("GPUXFER_PLATFORM") or None
            if name in (None, "auto"):
                name = _auto[0] if _auto else None
        plat = _shared.get(name) if name else None
        if plat is None or plat.closed:
            plat = detect(name).platform
            _shared[plat.name] = plat
            if not name and not _auto:
                _auto.append(plat.name)
        return plat


def get_platform(name: str | None = None) -> Platform:
    """The process's platform object (:func:`current`); :func:`detect` makes a new one a caller owns."""
    return current(name)


def _close_shared() -> None:
    """At exit: close every shared platform (errors are logged: the process is leaving)."""
    with _lock:
        plats = list(_shared.values())
        _shared.clear()
    for plat in plats:
        try:
            plat.close()
        except Exception as exc:  # noqa: BLE001
            log.warning("closing %r at exit: %s", plat, exc)


def _forget_shared() -> None:
    """In a forked child: the parent's platform objects are the parent's to close."""
    global _lock
    _lock = threading.Lock()
    _shared.clear()
    _auto.clear()


atexit.register(_close_shared)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_shared)
