"""What both of a decode worker's load runners need of its caches (the engine thread's :class:`~.loads.DecodeLoads`
and the loader process's, :mod:`.loader`): the caches' device, their groups registered with an agent, the decode
role bound to it, the counters it keeps. No vLLM import.
"""
from __future__ import annotations

from typing import Any, Mapping

from ...errors import GpuxferError
from ...kv import KVAgent
from .handshake import describe_view
from .loads import DecodeLoads
from .staging import IdStaging


def cache_device(kv_caches: Mapping[str, Any]) -> int:
    """The CUDA device of vLLM's caches (0 for host memory)."""
    first = next(iter(kv_caches.values()))
    if first.device.type != "cuda":
        return 0
    import torch
    return torch.cuda.current_device() if first.device.index is None else first.device.index


def share_host_caches(kv_caches: Mapping[str, Any]) -> None:
    """Caches in host memory (the host emulation) moved into shared memory in place, so that a loader process can
    map them: torch keeps every view of a storage on it. Nothing for CUDA caches (mapped through IPC)."""
    for t in kv_caches.values():
        if t.device.type == "cpu":
            t.untyped_storage().share_memory_()


def register_groups(agent: KVAgent, group_specs: list, kv_caches: Mapping[str, Any], token_major: bool,
                    kv_heads: list | None, export: bool = True) -> tuple[list[dict], list[int], list[int]]:
    """Every KV-cache group's layers registered with ``agent`` (group ``g<i>``): per group its description for the
    handshake, its kernel block tokens and its bytes per vLLM block."""
    groups, kernel_tokens, bytes_per_block = [], [], []
    for g, (kind, bs, names) in enumerate(group_specs):
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise GpuxferError(f"KV-cache group {g} names layers vLLM registered no cache for: {missing[:4]}")
        specs, tokens, majors = {}, set(), set()
        per_block = 0
        for n in names:
            spec, tok, major = describe_view(kv_caches[n], token_major)
            specs[n] = spec
            tokens.add(tok)
            majors.add(major)
            per_block += sum(p[1] for p in spec.pieces)
        if len(tokens) != 1 or bs % next(iter(tokens)):
            raise GpuxferError(f"KV-cache group {g}: its layers' kernel blocks hold {sorted(tokens)} tokens, "
                               f"which do not split its {bs}-token blocks evenly")
        kt = tokens.pop()
        agent.register_group(f"g{g}", kt, specs, token_major=all(majors), export=export)
        kernel_tokens.append(kt)
        bytes_per_block.append(per_block)
        view = kv_caches[names[0]]
        heads = int(view.shape[1]) if kv_heads is None else kv_heads[g]
        groups.append({"kind": kind, "block_size": bs, "kernel_tokens": kt, "token_major": all(majors),
                       "layers": names, "bytes_per_token": per_block // kt, "pieces": len(specs[names[0]].pieces),
                       "content": [int(view.shape[1]), int(view.shape[3]) * view.element_size()],
                       "kv_heads": heads})
    return groups, kernel_tokens, bytes_per_block


def bind_loads(decode: DecodeLoads, agent: KVAgent, info: dict, kernel_tokens: list[int],
               bytes_per_block: list[int], settings) -> IdStaging | None:
    """``decode`` bound to the registered agent, with the device-ID staging where its reads take device IDs
    (returned; ``settings``: the worker's :class:`~.worker.Settings`)."""
    staging = None
    if settings.device_ids and agent.engine == "triton":
        staging = IdStaging(agent)
        # a step's IDs: each load's local blocks (distinct blocks of these caches) and as many remote ones
        staging.reserve(2 * sum(nb for _, nb, _ in agent.groups.values()))
    decode.bind(agent, info, kernel_tokens, bytes_per_block, staging)
    return staging


def new_stats() -> dict:
    """A worker's counters, zero (what ``get_kv_connector_stats`` reports)."""
    return {"transfers": 0, "failed": 0, "bytes": 0, "handshakes": 0, "leases_expired": 0, "sends_done": 0,
            "forged": 0, "claims_granted": 0, "claims_refused": 0, "device_id_loads": 0, "host_id_loads": 0,
            "post_host_s": [], "xfer_s": [], "handshake_s": []}
