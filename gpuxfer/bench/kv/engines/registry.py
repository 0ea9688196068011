"""The one engine registry: name -> engine class, or ``"module:Class"`` imported when the engine is built.

Built-in engines come first, in the order rows are measured; the engines over optional libraries (NIXL,
Mooncake, MoRI-IO) are registered by path, so listing them never imports their library, and
:func:`engine_report` says for each whether it can run here (``None``) or why not. A plugin adds its
own with :func:`register_engine`.
"""
from __future__ import annotations

import importlib
from typing import Sequence

from ....errors import BadInput
from ....platforms.base import Platform
from .base import Engine


#: name -> "module:Class"; built-ins first, in the order rows are measured (bulk first: the ceiling)
ENGINES: dict[str, str | type] = {
    "bulk": "gpuxfer.bench.kv.engines.copy_engine:BulkEngine",
    # through the public KV API (KVAgent): what a user of gpuxfer.kv gets
    "triton": "gpuxfer.bench.kv.engines.kvagent:AgentTritonEngine",
    "pack": "gpuxfer.bench.kv.engines.kvagent:AgentPackEngine",
    "copy_engine": "gpuxfer.bench.kv.engines.kvagent:AgentCopyEngine",
    # the same copies over descriptor tables handed in per burst (the engines before the API)
    "triton-table": "gpuxfer.bench.kv.engines.triton:TritonEngine",
    "pack-table": "gpuxfer.bench.kv.engines.pack:PackEngine",
    "copy_engine-table": "gpuxfer.bench.kv.engines.copy_engine:CopyEngineEngine",
    # optional libraries (imported only when the engine is built; engine_report says why one cannot run)
    "nixl": "gpuxfer.bench.kv.engines.nixl:NixlEngine",
    "nixl-bulk": "gpuxfer.bench.kv.engines.nixl:NixlBulkEngine",
    "nixl-oneshot": "gpuxfer.bench.kv.engines.nixl:NixlOneshotEngine",
    "nixl+pack": "gpuxfer.bench.kv.engines.nixl:NixlPackEngine",
    "mooncake": "gpuxfer.bench.kv.engines.mooncake:MooncakeEngine",
    "mooncake-rdma": "gpuxfer.bench.kv.engines.mooncake:MooncakeRdmaEngine",
    "amd-mori": "gpuxfer.bench.kv.engines.mori:MoriEngine",
}
#: the engines a default sweep measures: every one but the ceiling through KVAgent
DEFAULT_ENGINES = ("triton", "pack", "copy_engine", "bulk")


def register_engine(name: str, target: str | type[Engine]) -> None:
    """Add (or replace) an engine: an :class:`Engine` subclass, or ``"module:Class"`` (imported when used)."""
    if not isinstance(name, str) or not name or any(c in name for c in " ,:"):
        raise BadInput(f"bad engine name {name!r}")
    if isinstance(target, type):
        if not issubclass(target, Engine):
            raise BadInput(f"{target!r} is not an Engine subclass")
    elif not isinstance(target, str) or ":" not in target:
        raise BadInput(f"engine target must be an Engine subclass or 'module:Class', got {target!r}")
    ENGINES[name] = target


def engine_class(name: str) -> type[Engine]:
    if name not in ENGINES:
        raise BadInput(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    target = ENGINES[name]
    if isinstance(target, type):
        return target
    module, _, cls = target.partition(":")
    obj = getattr(importlib.import_module(module), cls)
    if not (isinstance(obj, type) and issubclass(obj, Engine)):
        raise BadInput(f"{target} is not an Engine subclass")
    return obj


def engine_unavailable_reason(name: str, platform: Platform) -> str | None:
    """Why engine ``name`` cannot run on ``platform`` (None if it can). Never raises."""
    try:
        return engine_class(name).unavailable_reason(platform)
    except BadInput:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken optional install is a reason
        return f"{type(exc).__name__}: {exc}"


def engine_report(platform: Platform) -> dict[str, str | None]:
    """For ``gpuxfer doctor``: every registered engine -> None (usable here) or why not."""
    return {name: engine_unavailable_reason(name, platform) for name in ENGINES}


def parse_engines(spec: str | Sequence[str]) -> list[str]:
    """``"triton,pack"`` or a list -> engine names (checked; ``all`` = every registered engine)."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s and s.strip()]
    if not names:
        raise BadInput("no engine given")
    if names == ["all"]:
        return list(ENGINES)
    bad = [n for n in names if n not in ENGINES]
    if bad:
        raise BadInput(f"unknown engine(s) {', '.join(map(repr, bad))}; known: {', '.join(ENGINES)}")
    out: list[str] = []
    for n in names:
        if n not in out:
            out.append(n)
    return out


def measurement_order(names: Sequence[str], *, cross_host: bool = False) -> list[str]:
    """Ceiling engines first (their rows divide the others), then the given order. Across hosts the
    ceiling is the engine with ``ceiling_across_hosts`` (``nixl-bulk``)."""
    if cross_host:
        return sorted(names, key=lambda n: 0 if engine_class(n).ceiling_across_hosts else 1)
    return sorted(names, key=lambda n: 0 if engine_class(n).ceiling else 1)


__all__ = ["DEFAULT_ENGINES", "ENGINES", "engine_class", "engine_report", "engine_unavailable_reason",
           "measurement_order", "parse_engines", "register_engine"]
