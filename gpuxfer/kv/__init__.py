"""Paged KV-cache hand-off: the transfer runtime (:class:`KVAgent`: its peers, routes, transfers by block ID,
metadata, layers and engines).

Pure Python + numpy; importing it touches no device (torch and Triton load when an agent is built).
The benchmark (``gpuxfer bench kv``: its workload model, descriptor-table engines, sweep grid and reports)
lives in :mod:`gpuxfer.bench.kv`.
"""
from __future__ import annotations

from .agent import (NOTIFY_SLOTS, KVAgent, KVLayerSpec, KVPeer, KVPiece, KVTransfer, KVTransferHandle,
                    describe_layer, memory_at)

__all__ = [
    "KVAgent", "KVLayerSpec", "KVPeer", "KVPiece", "KVTransfer", "KVTransferHandle", "NOTIFY_SLOTS",
    "describe_layer", "memory_at",
]
