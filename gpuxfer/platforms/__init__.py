"""Platform detection.

``detect()`` tries CUDA, then ROCm, then the host emulation, and records why
each one it skipped could not be used. ``GPUXFER_PLATFORM`` (or the ``name``
argument) forces one. Nothing here touches a device at import.
"""
from __future__ import annotations

import importlib
import logging

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
           "detect", "get_platform"]


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


def get_platform(name: str | None = None) -> Platform:
    """The platform :func:`detect` picks."""
    return detect(name).platform
