"""The prefill engines a decode worker reads from: :class:`PrefillEngines` keeps one :class:`_Remote` per prefill
rank it reads (by endpoint: host, port, engine id): its handshake on the side channel, begun by the first load
naming it and moved on by later polls without blocking (the answer checked against this engine's description, its
caches then mapped with ``add_peer`` and its route's first slot made), its client for the done and release
messages (:meth:`PrefillEngines.release` sends the releases of requests this instance will not read), and when it
is forgotten (failed or gone, once no load names it and no read of it is in flight).
:class:`~.loads.DecodeLoads` owns one, counts each engine's loads and reads in flight on it, and names the loads
waiting on an engine (released on its side channel where the engine refuses them). Everything runs on the engine's
thread, :meth:`PrefillEngines.close` from any. No vLLM import.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ...errors import GpuxferError, TransferTimeout
from . import lease
from .client import SideChannelClient, close_all
from .frames import ChannelClosed
from .handshake import agent_name, check_compatible, decode_info, readers
from .params import (BadSeal, BadTransferParams, RemotePrefill, check_seal, keyed_mac, seal_key_from_hex,
                     source_ranks)
from .staging import IdStaging

log = logging.getLogger("gpuxfer.vllm")

#: the most handshakes a worker has under way at once (each a connection until it ends, within its timeout, and
#: up to MAX_INFO and an agent's metadata buffered): past them a new engine's loads fail at once (a handshake takes
#: milliseconds)
MAX_HANDSHAKES = 64
#: the most handshakes under way with the prefill ranks one load's params name (params whose seal only a handshake's
#: answer can check, naming up to params.MAX_TP ranks that may accept and never answer): a load's parts that would
#: begin one more fail at once, with no connection made, and a later load of the same ranks begins the next ones
#: once these ended; so one set of params holds at most this many of the MAX_HANDSHAKES slots, whatever the requests
#: it comes in, and a decode rank reading up to this many prefill ranks handshakes with all in its first request
MAX_HANDSHAKES_A_LOAD = 16


@dataclass
class _Remote:
    """One prefill engine (rank) this worker reads from: its handshake's state and findings, its client, its peer."""

    key: tuple[str, int, str]
    state: str = "pending"                  # pending | ready (caches mapped) | failed
    client: SideChannelClient | None = None
    peer: Any = None
    info: dict | None = None
    groups: tuple = ()                      # per group: (block size, kernel tokens) from its handshake
    views: dict = field(default_factory=dict)   # {group name: (start, stop)}: the pieces (heads) of its blocks read
    local_views: dict = field(default_factory=dict)     # ... of this worker's blocks it writes
    # per group read from it (not from another prefill rank), from its handshake: (index, name, block size here,
    # kernel tokens here, its block size, its kernel tokens, bytes per block here, share of them written)
    reads: tuple = ()
    rank: int = 0                           # its tensor parallel rank and size
    world: int = 1
    sources: tuple = ()                     # the prefill ranks of its size this worker reads (params.source_ranks)
    meta: bytes | None = None
    seal_key: bytes | None = None           # what its engine's params are sealed with, from its handshake
    error: str | None = None
    device_ids: bool = False                # its reads take block IDs on the device
    ordered: bool = True                    # its reads complete in post order (the IPC route: one stream)
    clock: lease.PeerClock = lease.SAME_HOST    # its lease clock read on this one
    inflight: int = 0                       # reads posted and not seen complete
    loads: int = 0                          # loads naming it not reported yet
    warming: Any = None                     # a warm-up read its handshake stopped waiting for (not in ``inflight``)
    t0: float = field(default_factory=time.monotonic)


def _settled(read) -> bool:
    """Whether a warm-up read left in flight (None: none) has ended, completed or failed."""
    if read is None:
        return True
    try:
        return bool(read.done())
    except GpuxferError:
        return True


def carries_seal(rp: RemotePrefill, r: _Remote) -> bool:
    """Whether ``rp`` carries the seal of the engine ``r`` (whose key its handshake gave; none: not): only such
    params' keys are sent (a release with the key of params altered from others' could end those others' hold)."""
    try:
        check_seal(rp, r.seal_key)
    except BadSeal:
        return False
    return True


class PrefillEngines:
    """The prefill engines (ranks) a decode worker reads from, by endpoint (``remotes``). ``group_specs``,
    ``settings``, ``lock``, ``stats``, ``tp``: the worker's (:class:`~.loads.DecodeLoads`); ``waiting``: the params
    of the loads waiting on an engine. :meth:`bind` hands it the registered agent."""

    def __init__(self, *, engine_id: str, group_specs: list, settings, lock: threading.Lock, stats: dict,
                 tp: tuple[int, int], waiting: Callable[[_Remote], list[RemotePrefill]]):
        self.engine_id, self.group_specs, self.settings = engine_id, group_specs, settings
        self.tp_rank, self.tp_size = tp         # the rank of each prefill engine it reads: params.source_rank
        self._lock, self.stats, self._waiting = lock, stats, waiting
        self.agent = self.info = None
        self.staging: IdStaging | None = None
        self._group_names = [f"g{g}" for g in range(len(group_specs))]
        self._kernel_tokens: list[int] = []
        self._bytes_per_block: list[int] = []
        self.remotes: dict[tuple, _Remote] = {}
        self.closed = False                                  # shut down: no new side channel is opened

    def bind(self, agent, info: dict, kernel_tokens: list[int], bytes_per_block: list[int],
             staging: IdStaging | None) -> None:
        """The registered agent, this engine's description (checked against each prefill engine's), each group's
        kernel block tokens and bytes per vLLM block, and the device-ID staging where reads take device IDs."""
        self.agent, self.info, self.staging = agent, info, staging
        self._kernel_tokens, self._bytes_per_block = list(kernel_tokens), list(bytes_per_block)

    def begins(self, key: tuple[str, int, str]) -> bool:
        """Whether :meth:`get` of ``key`` begins a handshake: no engine known there, or one failed or gone with no
        read of it in flight (a warm-up read left in flight included: the new handshake's mapping would remove the
        old peer, waiting for it on the engine thread, and the record replaced is no longer looked at)."""
        r = self.remotes.get(key)
        gone = r is not None and r.state == "ready" and not (r.client and r.client.alive)
        return r is None or ((r.state == "failed" or gone) and r.inflight == 0 and _settled(r.warming))

    def under_way(self, keys) -> int:
        """How many of the engines at ``keys`` have a handshake under way."""
        return sum(r is not None and r.state == "pending" for r in map(self.remotes.get, set(keys)))

    def get(self, key: tuple[str, int, str]) -> _Remote:
        """The engine at ``key`` (host, port, engine id): the one known, or a new one whose handshake begins now
        (failed at once past :data:`MAX_HANDSHAKES` under way, or once :meth:`close` was called)."""
        r = self.remotes.get(key)
        if self.begins(key):
            r = self.remotes[key] = _Remote(key)
            if self.closed:
                self.failed(r, ChannelClosed("the connector is shut down"))
                return r
            allowed = self.settings.prefills
            if allowed is not None and key[0] not in allowed and key[:2] not in allowed:
                # (a prefill's seal key comes from its own handshake: params naming a side channel their maker runs
                # carry its seal, and their KV would land in this instance's prefix cache under their prompt)
                self.failed(r, BadTransferParams(f"{key[0]}:{key[1]} is not one of the prefill side channels this "
                                                 "instance reads from (kv_connector_extra_config['prefills'])"))
                return r
            if sum(x.state == "pending" for x in self.remotes.values()) > MAX_HANDSHAKES:       # (r is one)
                self.failed(r, ChannelClosed(f"{MAX_HANDSHAKES} handshakes are under way already"))
                return r
            try:
                r.client = SideChannelClient(r.key[0], r.key[1], self.settings.handshake_timeout_s)
            except (OSError, ValueError) as exc:
                self.failed(r, exc)
        return r

    def advance_all(self) -> None:
        """:meth:`advance` every handshake under way (a poll while loads wait)."""
        for r in list(self.remotes.values()):
            self.advance(r)

    def advance(self, r: _Remote) -> None:
        """Move a pending handshake on, on the engine's thread and without blocking: read what the prefill
        sent; once its description and metadata are in, check they pair and map its caches (:meth:`_attach`)."""
        if r.state != "pending":
            return
        host, port, engine_id = r.key
        try:
            got = r.client.pump()
            if got is None:
                return
            info_raw, r.meta = got
            info = decode_info(info_raw)
            if info.get("engine_id") != engine_id:
                raise BadTransferParams(f"{host}:{port} is engine {info.get('engine_id')!r}, not {engine_id!r} as "
                                        "the request's kv_transfer_params say (stale params?)")
            if info.get("seal_key") is None:
                # (before r.info: the loads waiting on it are not released with keys from params nothing checked)
                raise BadTransferParams(f"{host}:{port}'s handshake carries no seal key, so no params naming it can "
                                        "be checked (a prefill worker that ran none of their request's steps, or "
                                        "another gpuxfer version); a later request handshakes again")
            r.seal_key = seal_key_from_hex(info["seal_key"], "the peer's engine description's seal_key")
            keyed_mac(r.seal_key)                   # (made once here, not in a load's check)
            r.info = info
            r.client.readers = readers(self.info, info)      # (before any message: each names its readers)
            pairing, names = check_compatible(self.info, info), self._group_names
            r.views = {names[g]: v for g, v in pairing.remote.items()}
            r.local_views = {names[g]: v for g, v in pairing.local.items()}
            r.rank, r.world = info.get("tp_rank", 0), info.get("tp_size", 1)      # (checked just now)
            r.groups = tuple((g["block_size"], g["kernel_tokens"]) for g in info["groups"])
            r.reads = tuple(self._read_plan(g, r.groups[g], pairing.local.get(g))
                            for g in range(len(self.group_specs)) if g not in pairing.skip)
            try:
                r.sources = tuple(source_ranks(self.tp_rank, self.tp_size, r.world))
            except BadTransferParams:       # (its loads fail at their pairing: the params name another size)
                r.sources = ()
        except Exception as exc:        # every failure fails this engine's loads, never the worker
            self.failed(r, exc)
            return
        self._attach(r)

    def _read_plan(self, g: int, theirs: tuple[int, int], part: tuple[int, int] | None) -> tuple:
        """What pairing a request's group ``g`` reads from a checked engine (:attr:`_Remote.reads`): ``theirs``,
        its block size and kernel tokens; ``part``, the pieces of this worker's blocks it writes (None: all)."""
        share = 1.0 if part is None else (part[1] - part[0]) / self.info["groups"][g]["pieces"]
        return (g, self._group_names[g], self.group_specs[g][1], self._kernel_tokens[g], *theirs,
                self._bytes_per_block[g], share)

    def failed(self, r: _Remote, exc: Exception) -> None:
        """Fail the engine: its loads fail at the next poll. Where the peer is the engine and rank the params
        name (its description read) but cannot pair, or its caches could not be mapped, the loads waiting on it
        are released on its side channel first, so it frees their blocks now rather than at their lease."""
        host, port, engine_id = r.key
        r.error, r.state = f"{type(exc).__name__}: {exc}", "failed"
        log.error("gpuxfer: engine %s: handshake with prefill engine %s at %s:%d failed: %s; its requests' "
                  "loads fail and vLLM recomputes them", self.engine_id, engine_id, host, port, r.error)
        if r.client is None:
            return
        info = r.info
        if info is not None and info.get("engine_id") == engine_id and self._reads_rank(info):
            rps = [rp for rp in self._waiting(r) if carries_seal(rp, r)]
            if rps:
                r.client.notify("release", [rp.request_id for rp in rps], [rp.key for rp in rps],
                                [rp.token for rp in rps])
        r.client.close()            # (sends what was queued first)

    def _reads_rank(self, info: dict) -> bool:
        """Whether the peer that sent ``info`` is one of the prefill ranks this worker reads."""
        rank, world = info.get("tp_rank", 0), info.get("tp_size", 1)
        if type(rank) is not int or type(world) is not int or world < 1:
            return False
        try:
            return rank in source_ranks(self.tp_rank, self.tp_size, world)
        except BadTransferParams:
            return False

    def _attach(self, r: _Remote) -> None:
        """Map a checked engine's caches (``add_peer``) and make its first read's slot: a few milliseconds
        once the kernels were loaded at registration."""
        t0 = time.perf_counter()
        try:
            with self._lock:
                name = agent_name(r.key[2], r.rank, r.world)
                old = self.agent.peers.get(name)
                twin = old is not None and next((x for x in self.remotes.values() if x is not r and x.peer is old
                                                 and x.state == "ready" and x.client and x.client.alive), None)
                if twin and (twin.meta, twin.views, twin.local_views) == (r.meta, r.views, r.local_views):
                    r.peer = old        # the same prefill rank, its address spelled otherwise: one mapping for both
                else:
                    if old is not None:                        # the same engine again, after it restarted
                        # its reads in flight end first, a warm-up read left in flight included (remove_peer
                        # would wait for it on the engine thread): the handshake stays pending until then
                        if any(x.peer is old and (x.inflight or not _settled(x.warming))
                               for x in self.remotes.values()):
                            return
                        if twin:        # (at another address, its old connection not seen dead): the old record
                            # goes, its loads fail and the next naming it handshakes again (left ready over a
                            # removed peer, every later load of it would fail)
                            twin.state = "failed"
                            twin.error = (f"prefill engine {r.key[2]} rank {r.rank} answered a handshake at "
                                          f"{r.key[0]}:{r.key[1]} with other caches")
                            log.warning("gpuxfer: engine %s: %s; forgetting it at %s:%d", self.engine_id,
                                        twin.error, twin.key[0], twin.key[1])
                        self.agent.remove_peer(name)
                    r.peer = self.agent.add_peer(r.meta, route=self.settings.route, pieces=r.views or None,
                                                 local_pieces=r.local_views or None)
                r.ordered = r.peer.route == "ipc"
                r.clock = lease.SAME_HOST if r.ordered else r.client.peer_clock
                # device IDs: the triton engine over the peer's mapped caches, kernel blocks alike on both sides
                # (a step's reads then merge into one request per engine; other block sizes pair on the host)
                r.device_ids = (self.staging is not None and r.peer.route == "ipc" and r.peer.engine == "triton"
                                and all(rk == lk for (_, rk), lk in zip(r.groups, self._kernel_tokens)))
                r.warming = self._warm(r.peer, r.device_ids, until=r.t0 + self.settings.handshake_timeout_s)
            r.state = "ready"
        except Exception as exc:
            self.failed(r, exc)
            return
        now = time.perf_counter()
        self.stats["handshakes"] += 1
        self.stats["handshake_s"].append(time.monotonic() - r.t0)
        log.info("gpuxfer: engine %s: handshake with prefill engine %s at %s:%d in %.3f s (its caches mapped in "
                 "%.3f s)", self.engine_id, r.key[2], r.key[0], r.key[1], time.monotonic() - r.t0, now - t0)

    def _warm(self, peer, device_ids: bool = False, until: float | None = None) -> Any:
        """One read of the peer's null block into ours per group (vLLM's block 0: a placeholder no request
        reads; a group at a time, as hybrid groups share memory), so the first request finds its route's
        slot made; with ``device_ids`` one more per group with the IDs on the device. The engine thread waits for
        them until ``until`` (monotonic; the handshake's own bound) at most, not the agent's timeout a read: a
        peer whose reads do not complete (a NIXL peer gone quiet) holds the step, and a shutdown waiting for the
        worker's lock, no longer than a handshake may take; the reads left then go on and the first request's
        read makes what they did not. Returns the read it stopped waiting for (None: none), which :meth:`reap` waits
        for before it removes the peer."""
        def left() -> float | None:
            if until is None:
                return None
            t = until - time.monotonic()
            if t <= 0:
                raise TransferTimeout(rank=self.agent.rank, step=0, flag="warm-up", expected=1, seen=0,
                                      timeout_s=0.0, what="the handshake's time ran out before the warm-up reads")
            return t
        h = None
        for name in self._group_names:
            blocks = {name: [0]}
            try:
                h = self.agent.prepare(peer, "pull", local_blocks=blocks, remote_blocks=blocks, name="warm-up").post()
                h.wait(timeout_s=left())
                if device_ids:
                    e = self.staging.take(1)
                    e.array[0] = 0
                    self.staging.send(e, 1)
                    ids = {name: e.device[:1]}
                    h = self.agent.prepare(peer, "pull", local_blocks=ids, remote_blocks=ids, name="warm-up",
                                           device_ids=True).post()
                    e.fence = h.event
                    h.wait(timeout_s=left())
            except TransferTimeout as exc:
                log.warning("gpuxfer: engine %s: the warm-up read of group %s from prefill engine %s did not complete "
                            "(%s); the warm-up ends, and its first request makes what it did not",
                            self.engine_id, name, getattr(peer, "name", peer), exc)
                return h
            except GpuxferError as exc:
                log.debug("gpuxfer: warm-up read of group %s skipped: %s", name, exc)
        return None

    def reap(self) -> None:
        """Forget the engines whose side channel closed or whose handshake failed, once no load names them and
        no read of theirs is in flight (a warm-up read its handshake stopped waiting for included: removing the
        peer would wait for it, up to the agent's timeout, on the engine thread)."""
        for key, r in list(self.remotes.items()):
            gone = r.state == "ready" and not (r.client and r.client.alive)
            if (gone or r.state == "failed") and r.inflight == 0 and r.loads == 0 and _settled(r.warming):
                del self.remotes[key]
                shared = any(x.peer is r.peer for x in self.remotes.values())      # (another address of it)
                if r.peer is not None and not shared and self._lock.acquire(blocking=False):
                    try:
                        self.agent.remove_peer(r.peer)
                    except GpuxferError as exc:
                        log.debug("gpuxfer: removing peer %s: %s", key[2], exc)
                    finally:
                        self._lock.release()
                if r.client is not None:
                    r.client.close()
                log.info("gpuxfer: engine %s: forgot prefill engine %s (%s)", self.engine_id, key[2],
                         r.error or (r.client.closed_reason if r.client else "gone"))

    def release(self, releases: Sequence[RemotePrefill], claims: dict) -> None:
        """Tell prefill engines (the ranks of each this worker reads, those known) this instance will not read these
        requests (best effort): those of params that carry their engine's seal and that no load of this worker
        claims (that load ends the hold itself). A release claims its request, so a later load of the same params
        fails rather than read blocks the release let the prefill free. ``claims``: the worker's
        (:attr:`.loads.DecodeLoads.claims`)."""
        unsealed = {}
        for rp in releases:
            try:
                keys = rp.endpoints_of(self.tp_rank, self.tp_size)
            except BadTransferParams:
                continue
            for key in keys:
                r, claim = self.remotes.get(key), (key, rp.request_id)
                if r is None or r.state != "ready" or r.client is None or claim in claims:
                    continue
                try:
                    check_seal(rp, r.seal_key)
                except BadSeal as exc:
                    log.warning("gpuxfer: engine %s: not releasing request %s of engine %s: %s", self.engine_id,
                                rp.request_id, rp.engine_id, exc)
                    unsealed[id(r)] = r
                    continue
                claims[claim] = (r, rp.lease_deadline)
                r.client.notify("release", [rp.request_id], [rp.key], [rp.token])
        for r in unsealed.values():
            probe(r)

    def flush_late(self, now: float) -> None:
        """The claims queued, and the done messages a busy engine kept from the side channel's sender threads, sent
        now (:meth:`.client.SideChannelClient.flush_late`)."""
        for r in self.remotes.values():
            c = r.client
            # (a client with nothing queued and no claim since its last flush has nothing to do: not called)
            if c is not None and (c.outbox or c.claimed):
                c.flush_late(now)

    def close(self) -> None:
        """Close every engine's side channel (from any thread: the engine thread's steps may still name new
        engines, which then fail without a connection)."""
        self.closed = True
        close_all([r.client for r in list(self.remotes.values()) if r.client is not None])


def probe(r: _Remote) -> None:
    """Params that do not carry engine ``r``'s seal: forged, or made by the engine after it restarted under the same
    engine id and port while the connection to the old one went dead without a word (its host lost: only a send finds
    it dead). An empty release (nothing for the prefill to do) goes on the connection, so a dead one fails, the
    record is forgotten and the next load naming the engine handshakes again for its seal key. (At most one an engine
    each time loads are posted or releases sent; each a few bytes.)"""
    if r.client is not None:
        r.client.notify("release", [])
