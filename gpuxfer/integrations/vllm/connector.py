"""``GpuxferConnector``: vLLM 0.33's ``KVConnectorBase_V1`` (and ``SupportsHMA``) over gpuxfer's KVAgent.
This module imports vLLM; vLLM imports it through ``kv_connector_module_path``."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorHandshakeMetadata,
                                                              KVConnectorMetadata, KVConnectorRole,
                                                              KVConnectorTransferResults, SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ... import config
from ...errors import BadInput
from .scheduler import SchedulerSide
from .worker import Settings, WorkerSide, prefills_setting, wants_loader

log = logging.getLogger("gpuxfer.vllm")


@dataclass
class GpuxferConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker side: loads to start, finished prefills to hold, releases to send."""

    loads: list = field(default_factory=list)
    holds: dict = field(default_factory=dict)
    releases: list = field(default_factory=list)
    secret: bytes | None = field(default=None, repr=False)     # the holds' keys' secret (holds.make_key)

    def anon_repr(self) -> str:
        """What vLLM logs of a step's metadata when the engine fails: never the secret, with which anyone reading
        the log could end any hold of this engine."""
        return (f"GpuxferConnectorMetadata({len(self.loads)} loads, holds {sorted(self.holds)}, "
                f"{len(self.releases)} releases)")


@dataclass
class GpuxferHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler: where its side channel listens, and its tensor parallel rank."""

    engine_id: str
    host: str
    port: int
    tp_rank: int = 0


@dataclass
class GpuxferStats(KVConnectorStats):
    """Transfers, bytes, failures, handshakes, expired leases, words ignored (``forged``: no hold key, or another
    decode instance's claim token), claims granted and refused (prefill side); host time of each post, time from post to
    seen-complete, handshake time (seconds, lists)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {"transfers": 0, "failed": 0, "bytes": 0, "handshakes": 0, "leases_expired": 0,
                     "sends_done": 0, "forged": 0, "claims_granted": 0, "claims_refused": 0, "device_id_loads": 0, "host_id_loads": 0, "post_host_s": [],
                     "xfer_s": [], "handshake_s": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if isinstance(v, list):
                self.data.setdefault(k, []).extend(v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: d.get(k, 0) for k in ("transfers", "failed", "bytes", "handshakes",
                                                              "leases_expired", "sends_done", "forged",
                                                              "claims_granted", "claims_refused",
                                                              "device_id_loads", "host_id_loads")}
        for k in ("post_host_s", "xfer_s", "handshake_s"):
            xs = sorted(d.get(k, []))
            if xs:
                out[k.replace("_s", "") + "_avg_ms"] = round(1e3 * sum(xs) / len(xs), 3)
                # the p90 by nearest rank: the ceil(0.9 n)-th smallest (of 10 samples the 9th)
                out[k.replace("_s", "") + "_p90_ms"] = round(1e3 * xs[max(0, math.ceil(0.9 * len(xs) - 1e-9) - 1)], 3)
        return out

    def is_empty(self) -> bool:
        d = self.data
        return not (d.get("transfers") or d.get("failed") or d.get("handshakes") or d.get("leases_expired")
                    or d.get("sends_done") or d.get("forged") or d.get("claims_granted") or d.get("claims_refused"))


def _settings(extra: dict) -> Settings:
    def pick(key: str, var: str):
        return config.resolve(var, extra.get(key), option=f"kv_connector_extra_config[{key!r}]")
    tm, dev = extra.get("token_major"), extra.get("device_ids", "auto")
    if tm is not None and not isinstance(tm, bool):
        raise BadInput(f"kv_connector_extra_config['token_major'] must be true or false, got {tm!r}")
    if not isinstance(dev, bool) and dev != "auto":
        raise BadInput(f"kv_connector_extra_config['device_ids'] must be true, false or \"auto\", got {dev!r}")
    return Settings(prefills=prefills_setting(extra.get("prefills")),
                    lease_s=pick("lease_s", "GPUXFER_VLLM_LEASE_S"), host=pick("host", "GPUXFER_VLLM_HOST"),
                    port=pick("port", "GPUXFER_VLLM_PORT"),
                    handshake_timeout_s=pick("handshake_timeout_s", "GPUXFER_VLLM_HANDSHAKE_TIMEOUT_S"),
                    token_major=tm, engine=pick("engine", "GPUXFER_VLLM_ENGINE"), device_ids=dev,
                    remote=pick("remote", "GPUXFER_KV_REMOTE"), route=pick("route", "GPUXFER_KV_ROUTE"),
                    loader=pick("loader", "GPUXFER_VLLM_LOADER"))


def tensor_parallel_rank(tp_size: int) -> tuple[int, int]:
    """``(rank, world size)`` of this worker in vLLM's tensor parallel group, as vLLM's own connectors read it.
    vLLM makes the group before a worker's connector; without one (an engine of one rank made without
    torch.distributed) the rank is 0. :class:`BadInput` when the group is missing or disagrees with the config."""
    from vllm.distributed import parallel_state as ps
    if ps.model_parallel_is_initialized():
        rank, world = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    elif tp_size == 1:
        return 0, 1
    else:
        raise BadInput(f"GpuxferConnector's worker side runs TP={tp_size} but vLLM's tensor parallel group is not "
                       "made (the connector must be made after vLLM's distributed groups)")
    if world != tp_size or not 0 <= rank < world:
        raise BadInput(f"vLLM's tensor parallel group has rank {rank} of {world}; the engine's config says "
                       f"TP={tp_size}")
    return rank, world


def _kv_heads(spec) -> int | None:
    """The KV heads of a block of a group whose spec is ``spec`` where its logical ``[B, H, N, C]`` page holds one
    slot per KV head, else None: a backend that packs its pages otherwise publishes ``num_head_slots`` (FlashInfer's
    NVFP4 pages: every K head's slot, then every V head's; others: K and V as two slots), and no range of those
    slots is a share of the heads."""
    heads, slots = getattr(spec, "num_kv_heads", None), getattr(spec, "num_head_slots", None)
    return heads if type(heads) is int and slots in (None, heads) else None


class GpuxferConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill/decode KV hand-off through gpuxfer (``kv_role`` kv_both, kv_producer or kv_consumer)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise BadInput("GpuxferConnector needs vLLM's kv_cache_config (vLLM 0.33's three-argument constructor)")
        par = vllm_config.parallel_config
        sizes = {"PP": par.pipeline_parallel_size, "PCP": getattr(par, "prefill_context_parallel_size", 1),
                 "DCP": getattr(par, "decode_context_parallel_size", 1)}
        if any(v != 1 for v in sizes.values()):
            # context parallelism spreads a block's tokens over ranks: rank i's blocks would not pair with rank i's
            raise BadInput("GpuxferConnector supports pipeline and context parallel sizes 1; this engine runs "
                           + ", ".join(f"{k}={v}" for k, v in sizes.items()))
        self.tp_size, self.tp_rank = int(par.tensor_parallel_size), 0
        ktc = vllm_config.kv_transfer_config
        self.engine_id = str(ktc.engine_id)
        extra = dict(ktc.kv_connector_extra_config or {})
        self.settings = _settings(extra)
        groups = kv_cache_config.kv_cache_groups
        block_sizes = [g.kv_cache_spec.block_size for g in groups]
        self._n_groups = len(groups)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        on_cpu = str(vllm_config.device_config.device_type) == "cpu"
        if getattr(ktc, "kv_role", None) == "kv_producer":
            self.settings.loader = "inline"         # (a prefill instance loads nothing: no loader process)
        if role == KVConnectorRole.SCHEDULER:
            # a fixed port: rank r's side channel listens on port + r
            fixed = [(self.settings.host, self.settings.port + r) for r in range(self.tp_size)
                     ] if self.settings.port else None
            self._scheduler = SchedulerSide(engine_id=self.engine_id, block_sizes=block_sizes,
                                            lease_s=self.settings.lease_s, endpoints=fixed,
                                            wire=wants_loader(self.settings.loader, not on_cpu))
        else:
            self.tp_rank, _ = tensor_parallel_rank(self.tp_size)
            if self.settings.token_major is None:
                # the CPU backend keeps a head's keys and values apart in a block; the GPU backends keep a
                # token's K and V together in its content
                self.settings.token_major = not on_cpu
            mc = vllm_config.model_config
            self._worker = WorkerSide(
                engine_id=self.engine_id, model=str(mc.model), dtype=str(vllm_config.cache_config.cache_dtype) +
                "/" + str(mc.dtype), layout=getattr(kv_cache_config, "kv_cache_layout", None),
                groups=[(type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size, list(g.layer_names))
                        for g in groups], settings=self.settings, tp=(self.tp_rank, self.tp_size),
                kv_heads=[_kv_heads(g.kv_cache_spec) for g in groups])

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]):
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or self._worker.server is None:
            return None
        host, port = self._worker.endpoint
        return GpuxferHandshakeMetadata(self.engine_id, host, port, self.tp_rank)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, GpuxferConnectorMetadata):
            return
        w = self._worker
        if meta.secret is not None and meta.secret != w.secret:      # (a step's secret, the same as the last's)
            w.keyed_by(meta.secret)
        if meta.holds:
            w.hold(meta.holds)
        if meta.releases:
            w.release(meta.releases)
        if meta.loads:
            w.decode.start(meta.loads)          # (WorkerSide.start_loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return              # loads are asynchronous: a request runs only after its load finished

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return              # the decode side pulls; nothing to save

    def wait_for_save(self):
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.poll()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        data = self._worker.take_stats()
        return None if data is None else GpuxferStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return GpuxferStats(data=data) if data is not None else GpuxferStats()

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()

    # ------------------------------------------------------------------ scheduler side

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Every tensor parallel rank's side channel (``{rank: metadata}``, gathered from the workers): the
        params of a finished request list them by rank. Without all of them no request is held."""
        if self._scheduler is None:
            return
        ms = [metadata.get(r) for r in range(self.tp_size)]
        if all(isinstance(m, GpuxferHandshakeMetadata) and m.tp_rank == r for r, m in enumerate(ms)):
            self._scheduler.endpoints = [(m.host, m.port) for m in ms]
        else:
            self._scheduler.endpoints = None
            log.error("gpuxfer: engine %s: the workers' handshake metadata names ranks %s, not each of the %d tensor "
                      "parallel ranks; no request is held for a decode instance", self.engine_id,
                      sorted(metadata), self.tp_size)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return tuple(range(self._n_groups))         # a load restores every group of the request

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return GpuxferConnectorMetadata(**self._scheduler.build_payload())

    def update_connector_output(self, connector_output):
        return

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)
