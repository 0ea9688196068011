"""The worker side of the connector: one :class:`~gpuxfer.kv.KVAgent` over vLLM's own KV caches, registered
with their layout described (kernels loaded then), a side channel that hands out the agent's metadata, and the
two roles' parts: :class:`~.holds.PrefillHolds` (blocks held until the decode side read them or the lease ran
out) and :class:`~.loads.DecodeLoads` (handshakes, reads, completions and failures, each advanced without
blocking once a step). Everything runs on the engine's thread. No vLLM import.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ...errors import BadInput, GpuxferError
from ...kv import KVAgent
from .channel import SideChannelServer
from .handshake import agent_name, encode_info, engine_info
from . import lease
from .holds import PrefillHolds
from .loads import DecodeLoads, Load
from .params import RemotePrefill, seal_key
from .registration import bind_loads, cache_device, new_stats, register_groups, share_host_caches

log = logging.getLogger("gpuxfer.vllm")


@dataclass
class Settings:
    lease_s: float
    host: str
    port: int
    handshake_timeout_s: float
    token_major: bool
    engine: str = "auto"
    # pull with block IDs on the device where the peer allows it: True, False, or "auto" (a step's reads of one
    # engine from AUTO_DEVICE_IDS_FROM on)
    device_ids: bool | str = "auto"
    remote: str = "none"            # how the agent reaches other hosts: none, or nixl (KVAgent's ``remote``)
    route: str = "auto"             # the route to a prefill engine (KVAgent.add_peer's ``route``)
    # the prefill side channels a decode worker may handshake with: hosts (any port) and (host, port) pairs, as
    # params spell them; None: any (params naming an endpoint their maker runs carry that endpoint's own seal)
    prefills: frozenset | None = None
    # where the decode side's loads run: "inline" (the engine's thread), "process" (a loader process: .loader) or
    # "auto" (process for caches in GPU memory, inline where it cannot start; inline for host memory)
    loader: str = "auto"


def wants_loader(mode: str, on_gpu: bool) -> bool:
    """Whether a decode worker's loads go to a loader process (``Settings.loader`` ``mode``): asked for, or by
    default for caches in GPU memory. The scheduler side makes the loads' records for it where this holds."""
    return mode == "process" or (mode == "auto" and on_gpu)


#: the most entries of ``kv_connector_extra_config['prefills']``
MAX_PREFILLS = 4096


def prefills_setting(v: Any) -> frozenset | None:
    """``kv_connector_extra_config['prefills']`` checked: None (any prefill), or a list of hosts (any port) and
    ``[host, port]`` pairs, spelled as the prefills' params name them (their ``host`` setting)."""
    if v is None:
        return None
    what = "kv_connector_extra_config['prefills']"
    if not isinstance(v, (list, tuple)) or len(v) > MAX_PREFILLS:
        raise BadInput(f"{what} must be a list of at most {MAX_PREFILLS} hosts or [host, port] pairs, got {v!r:.80}")
    out = set()
    for e in v:
        if isinstance(e, (list, tuple)) and len(e) == 2:
            h, p = e
            if isinstance(h, str) and h and type(p) is int and 1 <= p <= 65535:
                out.add((h, p))
                continue
        elif isinstance(e, str) and e:
            out.add(e)
            continue
        raise BadInput(f"{what}: each entry must be a host or a [host, port] pair (port 1..65535), got {e!r:.80}")
    return frozenset(out)


class WorkerSide:
    """One worker's connector state; ``groups``: per KV-cache group ``(kind, block_size, layer names)``; ``tp``:
    this worker's ``(rank, world size)`` in the engine's tensor parallel group; ``kv_heads``: per group, the KV heads
    of a block where its view's head axis holds one slot per KV head, None where it does not (default: every
    group's head axis is its KV heads). A worker holds its rank's shard of
    the KV heads: decode rank i reads from prefill rank i, and its side channel listens on ``port + i`` where the
    port is fixed."""

    def __init__(self, *, engine_id: str, model: str, dtype: str, layout: str | None,
                 groups: Sequence[tuple[str, int, Sequence[str]]], settings: Settings, platform=None,
                 tp: tuple[int, int] = (0, 1), kv_heads: Sequence[int | None] | None = None):
        self.engine_id, self.model, self.dtype, self.layout = engine_id, model, dtype, layout
        self.kv_heads = None if kv_heads is None else list(kv_heads)
        self.tp_rank, self.tp_size = tp
        self.group_specs = [(k, int(bs), list(names)) for k, bs, names in groups]
        self.settings = settings
        self.platform = platform
        self.agent: KVAgent | None = None
        self.server: SideChannelServer | None = None
        self.info: dict | None = None
        self._lock = threading.Lock()                 # the agent: posts and add_peer against close
        self.stats = new_stats()                     # (one dict, counted into by both roles, reset in place)
        self.secret: bytes | None = None              # the last keyed_by's (the connector calls it when it changes)
        self.prefill = PrefillHolds(engine_id=engine_id, lease_s=settings.lease_s, stats=self.stats)
        self.decode = DecodeLoads(engine_id=engine_id, group_specs=self.group_specs, settings=settings,
                                  lock=self._lock, stats=self.stats, tp=tp)

    # ------------------------------------------------------------------ registration

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        """Register every KV-cache group's layers with a new agent and open the side channel. Kernel
        loading for transfers happens here and at each handshake, not in a request."""
        if self.agent is not None:
            # (a second agent and side channel: the first would stay open, and the peers its handshakes mapped belong
            # to it, so every later load of an engine already known would fail)
            raise BadInput(f"GpuxferConnector of engine {self.engine_id}: register_kv_caches was called again; its "
                           "caches are registered once, for the life of the worker")
        t0 = time.perf_counter()
        from ...platforms import current
        mode = self.settings.loader
        loader = wants_loader(mode, next(iter(kv_caches.values())).device.type == "cuda")
        if loader:
            share_host_caches(kv_caches)        # (before the agent reads their addresses)
        self.agent = KVAgent(agent_name(self.engine_id, self.tp_rank, self.tp_size),
                             platform=self.platform or current(), device=cache_device(kv_caches),
                             engine=self.settings.engine, remote=self.settings.remote)
        groups, kernel_tokens, bytes_per_block = register_groups(self.agent, self.group_specs, kv_caches,
                                                                 self.settings.token_major, self.kv_heads)
        self.info = engine_info(engine_id=self.engine_id, model=self.model, dtype=self.dtype, layout=self.layout,
                                groups=groups, tp=(self.tp_rank, self.tp_size))
        warm_s = 0.0
        if not loader:                  # (the loader process loads the kernels of its reads)
            warm_s = self._inline(kernel_tokens, bytes_per_block)
        self._info_bytes, self._meta_bytes = self._described(), self.agent.metadata()
        port = self.settings.port + self.tp_rank if self.settings.port else 0
        if port > 65535:
            raise BadInput(f"the side channel of tensor parallel rank {self.tp_rank} would listen on port {port} "
                           f"(port {self.settings.port} + rank): past 65535")
        self.server = SideChannelServer(self.settings.host, port,
                                        lambda: (self._info_bytes, self._meta_bytes), self.settings.handshake_timeout_s,
                                        claim=self.prefill.claims.claim)
        if loader:
            from .loader import LoaderClient
            t1 = time.perf_counter()
            try:
                self.decode = LoaderClient(self, kv_caches)
            except GpuxferError as exc:
                if mode != "auto":
                    self.close()
                    raise
                log.warning("gpuxfer: engine %s: the loader process did not start (%s); loads run on the engine's "
                            "thread (kv_connector_extra_config loader: \"inline\" says so; with \"process\" this "
                            "fails the engine's startup)", self.engine_id, exc)
                loader = False
                warm_s = self._inline(kernel_tokens, bytes_per_block)
            else:
                warm_s = time.perf_counter() - t1
        if not all(g["token_major"] for g in groups):
            log.info("gpuxfer: engine %s: the KV layout is not token-major (attention backend's block interior), so "
                     "it pairs only with instances of the same block size", self.engine_id)
        log.info("gpuxfer: engine %s registered %d KV-cache group(s) (%s) with the %s engine in %.2f s (kernels "
                 "loaded in %.2f s%s); side channel on %s:%d", self.engine_id, len(groups),
                 ", ".join(f"{g['kind']} {g['block_size']} tok x {len(g['layers'])} layers" for g in groups), self.agent.engine,
                 time.perf_counter() - t0, warm_s, ", the loader process started" if loader else "",
                 self.server.host, self.server.port)

    def _inline(self, kernel_tokens: list[int], bytes_per_block: list[int]) -> float:
        """Loads on the engine's thread: the decode role bound to this worker's agent, its kernels loaded."""
        staging = bind_loads(self.decode, self.agent, self.info, kernel_tokens, bytes_per_block, self.settings)
        return self._warm_up(staging is not None)

    def _warm_up(self, device_ids: bool) -> float:
        """The agent's kernels loaded now (engine startup), not in the first request: a read of vLLM's null
        block 0 onto itself (:meth:`KVAgent.warm_up`), with device IDs too where reads take them. A failure here
        only moves that cost to the first request."""
        t0 = time.perf_counter()
        try:
            self.agent.warm_up(block=0, device_ids=device_ids)
        except GpuxferError as exc:
            log.warning("gpuxfer: engine %s: loading the transfer kernels at startup failed (%s: %s); the first "
                        "request loads them", self.engine_id, type(exc).__name__, exc)
        return time.perf_counter() - t0

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.server.host, self.server.port

    # ------------------------------------------------------------------ the roles

    def keyed_by(self, secret: bytes) -> None:
        """Prefill: the secret this engine's hold keys are made with (:func:`~.holds.make_key`). The handshake's
        description carries the seal key derived from it from then on: a request's params exist only once its steps
        ran here, each of which brought the secret, so a decode worker handshaking for them finds the key."""
        self.secret = secret
        if secret != self.prefill.secret:
            self.prefill.secret = secret
            if self.info is not None:
                self._info_bytes = self._described()     # (one attribute: the server's thread reads it whole)

    def _described(self) -> bytes:
        """This worker's description as its handshake sends it: with its engine's seal key (hex) once known
        (:func:`~.params.check_seal`). Whoever reaches the side channel may map this worker's caches anyway."""
        secret = self.prefill.secret
        return encode_info(self.info if secret is None else {**self.info, "seal_key": seal_key(secret).hex()})

    def hold(self, holds: Mapping[str, tuple[float, str | None]]) -> None:
        """Prefill: hold these requests' blocks (``{request: (lease deadline, key)}``)."""
        self.prefill.hold(holds)

    def start_loads(self, loads: Sequence[Load]) -> None:
        """Decode: start these loads without waiting (:meth:`DecodeLoads.start`)."""
        self.decode.start(loads)

    def release(self, releases: Sequence[RemotePrefill]) -> None:
        """Decode: tell prefill engines this instance will not read these requests."""
        self.decode.release(releases)

    def poll(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished sending, finished receiving, failed receiving)`` now."""
        now = time.monotonic()
        prefill, decode = self.prefill, self.decode
        if self.server is not None:
            prefill.drain(self.server, now)
        # (nothing let go of and nothing held to expire: nothing PrefillHolds.finished could find)
        sending = prefill.finished(lease.now()) if prefill.let_go or prefill.expiry else set()
        recving, failed = decode.finished(now) if decode.pending else (set(), set())
        for r in decode.remotes.values():         # (DecodeLoads.flush_late, inline; a loader process's: none)
            c = r.client
            # (a client with nothing queued and no claim since its last flush has nothing to do: not called)
            if c is not None and (c.outbox or c.claimed):
                c.flush_late(now)
        return sending, recving, failed

    def take_load_errors(self) -> set[int]:
        return self.decode.take_load_errors()

    def take_stats(self) -> dict | None:
        """The counters since the last call (None when nothing happened), the worker's reset."""
        s = self.stats
        granted, refused = self.prefill.claims.take_counts()
        s["claims_granted"] += granted
        s["claims_refused"] += refused
        if not (s["transfers"] or s["failed"] or s["handshakes"] or s["leases_expired"] or s["sends_done"]
                or s["forged"] or s["claims_granted"] or s["claims_refused"]):
            return None
        out = dict(s)
        s.update(new_stats())
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.decode.close()
        if self.agent is not None:
            with self._lock:
                self.agent.close()
