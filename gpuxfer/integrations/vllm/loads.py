"""The decode role of the connector's worker: :class:`DecodeLoads` starts each load vLLM's scheduler asks for
without blocking (a known prefill engine's read posted at once; a new engine's handshake begun on the side
channel and finished by later polls, its caches then mapped: :class:`~.engines.PrefillEngines`) and reports the
loads done and failed, oldest read first. Everything runs on the engine's thread. No vLLM import.

Soundness of a load against a lease: the prefill frees a held request's blocks at a step after its
``lease_deadline`` (on its host's lease clock); a load counts as good only when its read was seen complete
before that deadline, read on this instance's clock (:meth:`.lease.PeerClock.deadline`: as it is on one host,
the IPC route; bounded by the handshake for a prefill on another host, the NIXL route), and otherwise its
blocks are reported as load errors (vLLM recomputes them). A posted read is never abandoned: a failure is
reported once nothing the read queued can still write the blocks. Reads on the IPC route complete in the order
they were posted (one stream); those on the NIXL route in any order. A NIXL read cannot be recalled once issued
(UCX goes on with a read it was asked to cancel), so one is never reported failed before NIXL reports it done
or failed: past the agent's timeout it is logged, and UCX's own failure detection bounds it.

Soundness of a load against other decode instances: genuine params may reach several (a proxy's retry). Each read,
as it is posted, claims its request on the side channel with its instance's token (:class:`~.holds.ClaimBook`); a
load is reported loaded only once its read completed and the prefill granted the claim (a claim refused, not
answered within the handshake timeout of the post, or a connection gone fails the load). A granted claim means the
hold had not ended when the prefill decided and that no other instance's done or release counts after it, so the
blocks were held from the params' making until this instance's own done. A load whose request another load of
this instance claimed before its params were checked waits for that check (:mod:`.claims`).
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from time import clock_gettime
from typing import Any, Sequence

import numpy as np

from ...errors import BlockIdError, GpuxferError
from . import lease
from .claims import TWICE, settle, unchecked
from .engines import MAX_HANDSHAKES_A_LOAD, PrefillEngines, _Remote, carries_seal, probe
from .params import BadSeal, BadTransferParams, RemotePrefill
from .staging import IdStaging, pair_load, prepare_each_host, prepare_on_device

log = logging.getLogger("gpuxfer.vllm")

#: with ``device_ids`` "auto": a step's reads of one prefill engine go with their block IDs on the device from this
#: many on (one H200: a single read costs the engine thread more that way -- two more driver calls than with host
#: IDs --, a step of 8 reads much less: one ID copy and one checked launch for all, nothing per ID on the host)
AUTO_DEVICE_IDS_FROM = 2
#: the most loads (prefill engine, request) a worker remembers past the prefill's lease (:attr:`DecodeLoads.claims`)
MAX_CLAIMS = 1 << 20


@dataclass
class Load:
    """What the scheduler side asks this worker to load for one request."""

    req_id: str
    remote: RemotePrefill
    local_ids: tuple[np.ndarray, ...]       # manager block IDs per group (0: null block)
    start: int                              # first token to load
    end: int                                # one past the last
    # the seal key its params were found sealed with (staging.pair_load: once a load, whatever its parts)
    sealed: bytes | None = field(default=None, repr=False, compare=False)
    # the load as the loader process receives it (.wire.encode_load: made by the scheduler side where loads go there)
    wire: bytes | None = field(default=None, repr=False, compare=False)


@dataclass(slots=True, init=False)
class _LoadState:
    load: Load
    t_start: float
    remote: "_Remote | None" = None
    handle: Any = None
    t_post: float = 0.0
    nbytes: int = 0
    error: str | None = None
    pairs: tuple | None = None              # (local, remote): {group name: kernel block IDs} once paired
    together: int = 1                       # loads in the read this one was posted in
    device_ids: bool = False                # posted with its block IDs on the device
    host_ids: bool = False                  # post with host IDs (a read of several failed the device check)
    late: bool = False                      # a NIXL read logged as running past the agent's timeout
    part: int = 0                           # which of the load's prefill ranks this reads (a prefill of more ranks)
    forged: bool = False                    # its params failed their seal: nothing of theirs is acted on
    asked: bool = False                     # its claim was queued on the side channel
    granted: bool = False                   # the prefill granted its claim
    refused: bool = False                   # ... refused it: another decode instance reads (or released) it
    key: tuple[str, int]                    # (request, part): how pending and waiting hold it
    held: tuple | None                      # the claim it made (DecodeLoads.claims' entry), if any

    def __init__(self, load: Load, t_start: float, remote: "_Remote | None" = None, handle: Any = None,
                 t_post: float = 0.0, part: int = 0):
        # (written out: a dataclass's __init__ and __post_init__ are two Python calls a load)
        self.load, self.t_start, self.remote, self.handle, self.t_post, self.part = (load, t_start, remote, handle,
                                                                                     t_post, part)
        self.key = load.req_id, part
        self.nbytes, self.error, self.pairs, self.together, self.held = 0, None, None, 1, None
        self.device_ids = self.host_ids = self.late = self.forged = self.asked = self.granted = self.refused = False


class DecodeLoads:
    """A worker's loads: every load not reported yet (``pending``, by request) is waiting (not posted: a
    handshake under way, or the agent busy), in flight (posted, in post order) or ended (nothing to wait for);
    the prefill engines it reads from (``remotes``, by endpoint); the block IDs of failed loads not yet taken
    (``load_errors``). ``group_specs``: per KV-cache group ``(kind, block_size, layer names)``; ``settings``:
    the worker's (:class:`~.worker.Settings`); ``lock``: the worker's, held for posts and ``add_peer`` against
    the agent's close; ``stats``: the worker's counters, updated in place. :meth:`bind` hands it the registered
    agent."""

    def __init__(self, *, engine_id: str, group_specs: list, settings, lock: threading.Lock,
                 stats: dict, tp: tuple[int, int] = (0, 1)):
        self.engine_id, self.group_specs, self.settings = engine_id, group_specs, settings
        self.tp_rank, self.tp_size = tp         # the rank of each prefill engine it reads: params.source_rank
        self._lock, self.stats = lock, stats
        self.agent = None
        self.staging: IdStaging | None = None
        self._group_names = [f"g{g}" for g in range(len(group_specs))]
        self.engines = PrefillEngines(engine_id=engine_id, group_specs=group_specs, settings=settings, lock=lock,
                                      stats=stats, tp=tp, waiting=self._waiting_on)
        self.pending: dict[str, _LoadState] = {}
        self.waiting: dict[str, _LoadState] = {}
        self.inflight: deque[_LoadState] = deque()          # posted on the agent's stream, in post order
        self.unordered: list[_LoadState] = []                # posted on the NIXL route
        self.ended: list[_LoadState] = []
        self.load_errors: set[int] = set()
        # every (prefill endpoint, prefill request) a load started from: (its engine, the lease deadline). The first
        # load's done or release message lets the prefill free the blocks, so a second load of one prefill request
        # (vLLM gives each of a request's n > 1 children the parent's params) fails at once, sending nothing. Kept
        # until the lease ran out on the engine's clock (a read after it fails anyway).
        self.claims: dict[tuple, tuple[_Remote, float]] = {}
        # loads read from several prefill ranks: request -> [reads not reported yet, whether one failed]
        self._parts: dict[str, list] = {}
        self._prune_claims_at = 1024
        self.unanswered: list[_LoadState] = []  # reads ended well whose claim has no answer yet
        # the load that made each claim, until it ends; the loads deferred on a claim whose maker's params were
        # not checked yet (.claims.settle)
        self._claimants: dict[tuple, _LoadState] = {}
        self._deferred: dict[tuple, list[_LoadState]] = {}
        self._read_now: set[int] = set()        # the clients whose answers this poll read

    @property
    def remotes(self) -> dict[tuple, _Remote]:
        """The prefill engines this worker reads from, by endpoint (:class:`.PrefillEngines`)."""
        return self.engines.remotes

    def _waiting_on(self, r: _Remote) -> list[RemotePrefill]:
        return [st.load.remote for st in self.waiting.values() if st.remote is r]

    def bind(self, agent, info: dict, kernel_tokens: list[int], bytes_per_block: list[int],
             staging: IdStaging | None) -> None:
        """The registered agent, this engine's description (checked against each prefill engine's), each group's
        kernel block tokens and bytes per vLLM block, and the device-ID staging where reads take device IDs."""
        self.agent, self.staging = agent, staging
        self.engines.bind(agent, info, kernel_tokens, bytes_per_block, staging)

    def start(self, loads: Sequence[Load]) -> None:
        """Start each load without waiting: a known engine's read is posted now; a new engine's handshake
        starts (a non-blocking connect and hello) and later steps finish it, map the engine's caches and
        post the read."""
        now = time.monotonic()
        ready = []
        pending, parts, claims, remotes = self.pending, self._parts, self.claims, self.engines.remotes
        one_rank = self.tp_size == 1 and self.tp_rank == 0
        for load in loads:
            req = load.req_id
            # a request named again before its load was reported (replayed metadata): that load stands
            if (req, 0) in pending or req in parts:
                log.error("gpuxfer: engine %s: request %s is named for a load while its load is not reported yet "
                          "(metadata replayed?); the second is dropped", self.engine_id, req)
                continue
            if load.remote.token is None:       # (a load not made by the scheduler side: a token of this worker)
                load.remote = dataclasses.replace(load.remote, token=secrets.token_hex(8))
            rp = load.remote
            several, begun = False, 0
            if one_rank and not rp.endpoints:   # (the usual: one prefill rank read by one decode rank)
                keys = ((rp.host, rp.port, rp.engine_id),)
            else:
                try:
                    keys = rp.endpoints_of(self.tp_rank, self.tp_size)
                except BadTransferParams as exc:   # no prefill rank for this one: fails (and is logged) at the poll
                    st = _LoadState(load, now)
                    pending[st.key] = st
                    st.error = f"{type(exc).__name__}: {exc}"
                    self.ended.append(st)
                    continue
                if len(keys) > 1:           # a prefill of more ranks: one read from each, reported together
                    parts[req] = [len(keys), False]
                    several = True
                    begun = self.engines.under_way(keys)    # (params made again, their ranks still under way)
            for part, key in enumerate(keys):
                st = _LoadState(load, now, part=part)
                pending[st.key] = st
                claim = (key, rp.request_id)
                if claim in claims:
                    if unchecked(self._claimants.get(claim)):
                        # its maker's params are not checked yet (forged ones must not refuse genuine ones):
                        # decided once they are (.claims.settle)
                        self._deferred.setdefault(claim, []).append(st)
                        continue
                    st.error = TWICE.format(rp.request_id, key[2])
                # (one key: it begins at most one handshake, never past MAX_HANDSHAKES_A_LOAD)
                elif several and self.engines.begins(key) and (begun := begun + 1) > MAX_HANDSHAKES_A_LOAD:
                    st.error = (f"the params name more than {MAX_HANDSHAKES_A_LOAD} prefill ranks of engine {key[2]} "
                                "not handshaken with yet; a later load handshakes with the rest")
                if st.error:                    # (no connection, record or claim)
                    self.ended.append(st)
                    continue
                self.waiting[st.key] = st
                r = remotes[key] if key in remotes else None
                if r is None or r.state != "ready" or r.client is None or not r.client.alive:
                    r = self.engines.get(key)   # (a ready engine alive is the one get gives: no handshake begins)
                st.remote = r
                claims[claim] = st.held = (r, rp.lease_deadline)
                self._claimants[claim] = st
                r.loads += 1
                if r.state == "pending":
                    self.engines.advance(r)
                if r.state == "ready":
                    ready.append(st)
        if ready:
            self._post(ready, blocking=False)
        if self._deferred:
            settle(self)

    def _post(self, sts: list[_LoadState], blocking: bool) -> None:
        """Pair each request's blocks and post the reads together (:meth:`KVAgent.post_many`: one upload and one
        launch per prefill engine); left waiting for a later step when the agent is busy (a handshake). The
        reads of an engine that takes device IDs become one request whose IDs go to the device in one copy
        (:func:`.staging.prepare_on_device`; with ``device_ids`` "auto", where the step has
        :data:`AUTO_DEVICE_IDS_FROM` or more of them); the others are prepared one by one with host IDs. A
        request whose blocks do not pair fails alone. A posted read goes in flight; one with nothing to move or
        that failed ends (reported at the next poll)."""
        if not sts or not self._lock.acquire(blocking=blocking):
            return
        try:
            t0 = time.perf_counter()
            xs, owners, on_device, unsealed = [], [], {}, {}
            prepare = self.agent.prepare
            for st in sts:
                try:
                    st.pairs = pairs = pair_load(self, st)
                    if pairs is None:
                        st.handle = _Done()
                    elif st.remote.device_ids and not st.host_ids:
                        c = st.remote.client            # (one an engine: pair_load found it alive)
                        if c in on_device:
                            on_device[c].append(st)
                        else:
                            on_device[c] = [st]
                    else:                   # (_prepare_each_host's work, inline: a call less a load)
                        st.device_ids = False
                        xs.append(prepare(st.remote.peer, "pull", local_blocks=pairs[0], remote_blocks=pairs[1],
                                          name=st.load.req_id, device_ids=False))
                        owners.append((st,))
                except BadSeal as exc:
                    # no release with their key (that could end the hold of the params they were altered from), and
                    # no claim: a load of the real params may follow
                    st.error, st.forged = f"{type(exc).__name__}: {exc}", True
                    self._unclaim(st)
                    unsealed[id(st.remote)] = st.remote
                except (GpuxferError, KeyError, IndexError, ValueError) as exc:
                    st.error = f"{type(exc).__name__}: {exc}"
            if unsealed:
                for r in unsealed.values():
                    probe(r)
            if on_device and self.settings.device_ids == "auto":
                for key, batch in list(on_device.items()):
                    if len(batch) < AUTO_DEVICE_IDS_FROM:
                        del on_device[key]
                        prepare_each_host(self, batch, xs, owners)
            entry = prepare_on_device(self, list(on_device.values()), xs, owners) if on_device else None
            handles = []
            try:
                handles = self.agent.post_many(xs) if xs else []
            except GpuxferError as exc:
                # the reads queued before the error keep their handles (their blocks are in use until they
                # complete); only the others fail
                handles = getattr(exc, "handles", None) or [None] * len(xs)
                for group, h in zip(owners, handles):
                    if h is None:
                        for st in group:
                            st.error = f"{type(exc).__name__}: {exc}"
            finally:
                if entry is not None:       # the staged IDs are read until the step's last post completed
                    last = None
                    for last in reversed(handles):
                        if last is not None:
                            break
                    if last is not None:
                        entry.fence = last.event
                    else:
                        self.staging.fence_now(entry)
            t1 = time.perf_counter()
            inflight, unordered = self.inflight, self.unordered
            for group, h in zip(owners, handles):
                if h is not None:
                    for st in group:
                        st.handle = h
                        st.remote.inflight += 1
                        (inflight if st.remote.ordered else unordered).append(st)
            n = len(sts)
            share = (t1 - t0) / n               # the step's host time, per request it started
            waiting, ended, shares = self.waiting, self.ended, 0
            claims: dict[Any, list] = {}        # per prefill engine (by its client): the params it is asked for
            for st in sts:
                key = st.key
                if key in waiting and waiting[key] is st:
                    del waiting[key]
                if st.handle is not None:
                    shares += 1
                    st.t_post = t1
                    client = st.remote.client
                    if not st.asked and st.error is None and client is not None:
                        st.asked = True
                        rp = st.load.remote
                        if n == 1:          # (one load: its claim goes as it is, nothing gathered)
                            client.claim([rp.request_id], [rp.key], [rp.token])
                        elif client in claims:
                            claims[client].append(rp)
                        else:
                            claims[client] = [rp]
                    if st.error is None and type(st.handle) is _Done:
                        ended.append(st)
                if st.error is not None:
                    ended.append(st)
            if shares:
                self.stats["post_host_s"].extend([share] * shares)
            if claims:
                for client, rps in claims.items():      # one message per engine (its sender thread's)
                    client.claim([rp.request_id for rp in rps], [rp.key for rp in rps], [rp.token for rp in rps])
        finally:
            self._lock.release()

    def finished(self, now: float) -> tuple[set[str], set[str]]:
        """Loads done and failed since the last poll. Reads complete in the order they were posted (all on the
        agent's stream), so the in-flight ones are asked oldest first up to the first not done: O(1) when
        nothing finished. A read of several loads that failed the device check is posted again load by load with
        host IDs, so only the load at fault fails. Loads still waiting (handshakes under way, those reposts) are
        looked at each poll."""
        done, failed = set(), set()
        read: dict = {}                         # per prefill engine (its client): the params of the loads read
        if self._deferred:
            settle(self)
        if self._read_now:
            self._read_now.clear()
        inflight = self.inflight
        done_h = ()             # the handle last found done: the loads of one read share it, asked once a poll
        while inflight:
            st = inflight[0]
            if st.handle is not done_h:
                try:
                    if not st.handle.done():
                        break
                    done_h = st.handle
                except BlockIdError as exc:
                    if st.together > 1:
                        st.host_ids, st.together, st.handle = True, 1, None
                    else:
                        st.error = f"{type(exc).__name__}: {exc}"
                except GpuxferError as exc:
                    st.error = f"{type(exc).__name__}: {exc}"
            inflight.popleft()
            st.remote.inflight -= 1
            if st.host_ids and st.handle is None:
                self.waiting[st.key] = st
            else:
                self._complete(st, done, failed, read)
        if self.unordered:
            self._finish_unordered(done, failed, read)
        if self.waiting:
            self.engines.advance_all()
            ready = []
            for st in list(self.waiting.values()):
                r = st.remote
                if r.state == "failed":
                    st.error = f"handshake failed: {r.error}"
                elif r.state == "ready" and not (r.client and r.client.alive):
                    st.error = f"prefill engine {r.key[2]} is gone: {r.client.closed_reason if r.client else ''}"
                elif r.state == "ready":
                    ready.append(st)
                elif now - st.t_start > self.settings.handshake_timeout_s:
                    st.error = f"no handshake with {r.key[0]}:{r.key[1]} within {self.settings.handshake_timeout_s:g} s"
                    # the handshake ends with it (else, begun later in the step than the load, it would stay
                    # pending with its socket open: handshakes advance only while loads wait)
                    self.engines.failed(r, TimeoutError(st.error))
                if st.error is not None:
                    del self.waiting[st.key]
                    self.ended.append(st)
            self._post(ready, blocking=False)
        if self.ended:
            ended, self.ended = self.ended, []
            for st in ended:
                self._complete(st, done, failed, read)
        if self.unanswered:
            unanswered, self.unanswered = self.unanswered, []
            for st in unanswered:
                self._complete(st, done, failed, read)
        if read:
            for client, rps in read.items():     # one message per engine for the step's reads
                if len(rps) == 1:
                    rp = rps[0]
                    client.notify("done", [rp.request_id], [rp.key], [rp.token])
                else:
                    client.notify("done", [rp.request_id for rp in rps], [rp.key for rp in rps],
                                  [rp.token for rp in rps])
        if done:
            # forget the claims past their lease, and the engines gone or failed (.PrefillEngines.reap): looked at
            # in a poll that reported loads (an engine gone or failed meanwhile is only kept a little longer)
            if len(self.claims) > self._prune_claims_at:
                self._prune_claims()
            self.engines.reap()
        return done, failed

    def _finish_unordered(self, done: set, failed: set, read: dict) -> None:
        """The NIXL route's reads: each asked, in any order, and reported once NIXL says it completed or failed.
        One still running past the agent's timeout is logged once and asked again at later polls (it cannot be
        recalled: its load is reported when NIXL has its verdict)."""
        ended, limit, t = [], self.agent.timeout_s, time.perf_counter()
        for st in self.unordered:
            try:
                if not st.handle.done():
                    if t - st.t_post > limit and not st.late:
                        st.late = True
                        log.warning("gpuxfer: engine %s: the read of request %s from engine %s is still running "
                                    "after %.0f s; its load is reported when NIXL ends it", self.engine_id,
                                    st.load.req_id, st.load.remote.engine_id, t - st.t_post)
                    continue
            except GpuxferError as exc:
                st.error = f"{type(exc).__name__}: {exc}"
            ended.append(st)
        if ended:
            gone = set(map(id, ended))
            self.unordered = [st for st in self.unordered if id(st) not in gone]
            for st in ended:
                st.remote.inflight -= 1
                self._complete(st, done, failed, read)

    def _complete(self, st: _LoadState, done: set, failed: set, read: dict) -> None:
        """Report a load whose read completed (or that had nothing to move, or failed); a load read from several
        prefill ranks once all its reads ended, failed where one did (its blocks are then written by nothing)."""
        load, r, key = st.load, st.remote, st.key
        req, rp = load.req_id, load.remote
        if st.error is None and not st.granted and r is not None:
            client = r.client
            got = None if client is None else client.answers.pop((rp.request_id, rp.token), None)
            if got is True:                     # (the usual: _answered's first look, inline)
                st.granted = True
            elif not self._answered(st, got):
                self.unanswered.append(st)      # asked again at the next poll
                return
        if st.error is None:
            clock = lease.SAME_HOST if r is None else r.clock
            deadline = rp.lease_deadline if clock.same else clock.deadline(rp.lease_deadline)
            if not clock_gettime(lease.RAW) + lease.SHIFT < deadline:       # (lease.now())
                st.error = "the read completed after the prefill instance's lease ran out"
        pending = self.pending
        if key in pending and pending[key] is st:
            del pending[key]
        if r is not None:
            r.loads -= 1
            claim = (r.key, rp.request_id)
            if self._claimants.get(claim) is st:
                del self._claimants[claim]
        if st.error is not None:
            self._fail(st)
        else:
            stats = self.stats
            stats["transfers"] += 1
            stats["bytes"] += st.nbytes
            if type(st.handle) is not _Done:
                stats["device_id_loads" if st.device_ids else "host_id_loads"] += 1
            stats["xfer_s"].append(time.perf_counter() - st.t_post)
            client = r.client
            if client is not None:
                if client in read:
                    read[client].append(rp)
                else:
                    read[client] = [rp]
        bad = st.error is not None
        parts = self._parts.get(req) if self._parts else None
        if parts is not None:
            parts[0] -= 1
            parts[1] = bad = parts[1] or bad
            if parts[0]:
                return
            del self._parts[req]
        done.add(req)
        if bad:
            failed.add(req)
            if len(self.group_specs) == 1:
                ids = load.local_ids[0][load.start // self.group_specs[0][1]:]
                self.load_errors.update(ids[ids != 0].tolist())

    def _answered(self, st: _LoadState, got: bool | None = None) -> bool:
        """Whether the claim of a load whose read ended well is decided: granted (``st.granted``), or the load failed
        (``st.error``): its claim refused, the connection gone, or no answer within the handshake timeout of the
        post. False: not yet. ``got``: the answer taken from the client's already, if any."""
        client, rp = st.remote.client, st.load.remote
        if client is None:
            st.error = "no side channel to claim the request on"
            return True
        claim = (rp.request_id, rp.token)
        if got is None:
            got = client.answers.pop(claim, None)
        if got is None and id(client) not in self._read_now:       # (one read of a client's answers a poll)
            self._read_now.add(id(client))
            client.read_answers()
            got = client.answers.pop(claim, None)
        if got is True:
            st.granted = True
        elif got is False:
            st.refused = True
            st.error = (f"prefill engine {rp.engine_id} refused the claim on request {rp.request_id!r}: another "
                        "decode instance claimed or released it, or its hold ended (its params were handed out twice)")
        elif not client.alive:
            st.error = f"prefill engine {rp.engine_id} is gone before it answered the claim: {client.closed_reason}"
        elif time.perf_counter() - st.t_post > self.settings.handshake_timeout_s:      # (t_post: perf_counter's)
            st.error = (f"prefill engine {rp.engine_id} did not answer the claim on request {rp.request_id!r} within "
                        f"{self.settings.handshake_timeout_s:g} s")
        else:
            return False
        return True

    def _fail(self, st: _LoadState) -> None:
        """A failed read: logged; its prefill rank told this instance will not read it where its params carry that
        engine's seal, and its claim dropped where they do not (:meth:`_unclaim`)."""
        load = st.load
        self.stats["failed"] += 1
        log.warning("gpuxfer: engine %s: loading request %s from engine %s failed (%s); vLLM recomputes it",
                    self.engine_id, load.req_id, load.remote.engine_id, st.error)
        r = st.remote
        if r is None:               # refused before it claimed anything
            return
        if r.client is not None and st.asked:
            r.client.answers.pop((load.remote.request_id, load.remote.token), None)
        if st.refused:              # another instance reads it: nothing of this one's counts at the prefill
            return
        if st.forged or not (load.sealed is not None and load.sealed == r.seal_key or carries_seal(load.remote, r)):
            self._unclaim(st)
        elif r.client is not None:
            r.client.notify("release", [load.remote.request_id], [load.remote.key], [load.remote.token])

    def _unclaim(self, st: _LoadState) -> None:
        """Drop the claim of a load whose params do not carry their engine's seal (or that nothing checked): a claim
        lasts as long as the params' lease deadline says and refuses every other load of their request meanwhile, so
        only a sealed deadline is kept."""
        claim = (st.remote.key, st.load.remote.request_id)
        if st.held is not None and self.claims.get(claim) is st.held:     # (its own, not a later load's)
            del self.claims[claim]

    def _prune_claims(self) -> None:
        """Forget the loads whose lease ran out on their engine's clock (once the claims doubled: O(1) a load);
        past :data:`MAX_CLAIMS` the oldest go too."""
        t = lease.now()
        kept = {}
        for claim, held in self.claims.items():
            # the lease on the clock of the handshake the load went by (a remote that never finished one sent
            # nothing the prefill could free the blocks by, and reads nothing: its claim may go)
            r = held[0]
            pending = r.state == "pending" and self.remotes.get(r.key) is r
            if pending or t < r.clock.deadline(held[1]):        # (NaN: ran out; the entry itself kept: _unclaim)
                kept[claim] = held
        if len(kept) > MAX_CLAIMS:
            kept = dict(list(kept.items())[-(MAX_CLAIMS // 2):])
        self.claims = kept
        self._prune_claims_at = max(1024, 2 * len(kept))

    def release(self, releases: Sequence[RemotePrefill]) -> None:
        """Tell prefill engines this instance will not read these requests (:meth:`.PrefillEngines.release`)."""
        self.engines.release(releases, self.claims)

    # ------------------------------------------------------------------ both

    def flush_late(self, now: float) -> None:
        """The claims queued, and the done messages a busy engine kept from the side channel's sender threads, sent
        now (:meth:`.engines.PrefillEngines.flush_late`)."""
        self.engines.flush_late(now)

    def take_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out

    def close(self) -> None:
        """Close every engine's side channel (from any thread)."""
        self.engines.close()


class _Done:
    """The handle of a load with nothing to move."""

    def done(self) -> bool:
        return True

