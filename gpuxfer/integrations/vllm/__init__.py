"""vLLM 0.33 KV connector: ``--kv-transfer-config '{"kv_connector": "GpuxferConnector",
"kv_connector_module_path": "gpuxfer.integrations.vllm", "kv_role": "kv_both"}'`` (docs/VLLM.md).

vLLM is imported when vLLM (or anyone) reads ``GpuxferConnector`` from this module, not before: the
parameter, handshake, side-channel, scheduler-side and worker-side modules beside it import no vLLM.
"""
from __future__ import annotations

__all__ = ["GpuxferConnector", "GpuxferConnectorMetadata", "GpuxferStats"]


def __getattr__(name: str):
    if name in __all__:
        from . import connector
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
