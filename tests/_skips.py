"""Why a platform cannot run here, as plain functions: test modules import them by name (``from _skips import
platform_reason``), which works in every folder since conftest.py files of several folders share one module name."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def platform_reason(name: str) -> str | None:
    """Why platform ``name`` is unusable on this machine (None: it is usable)."""
    from gpuxfer.platforms import unavailable_reason
    return unavailable_reason(name)
