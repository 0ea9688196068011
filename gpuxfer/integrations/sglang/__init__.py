"""SGLang 0.5.23 disaggregation transfer backend: ``--disaggregation-transfer-backend gpuxfer`` on both the
prefill and the decode server (docs/SGLANG.md). SGLang finds it through the ``sglang.srt.plugins`` entry
point ``gpuxfer`` (:func:`gpuxfer.integrations.sglang.plugin.register`); nothing in SGLang changes.

SGLang is imported when SGLang (or anyone) reads one of the classes below from this module, not before: the
plugin module and :mod:`.layout` beside it import no SGLang, and importing gpuxfer imports no engine.
"""
from __future__ import annotations

__all__ = ["GpuxferKVManager", "GpuxferKVSender", "GpuxferKVReceiver", "GpuxferKVBootstrapServer"]


def __getattr__(name: str):
    if name in __all__:
        from . import conn
        return getattr(conn, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
