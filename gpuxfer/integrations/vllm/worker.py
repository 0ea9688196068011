"""The worker side of the connector: one :class:`~gpuxfer.kv.KVAgent` over vLLM's own KV caches, the
prefill role (a side channel that hands out the agent's metadata, blocks held until the decode side
read them or the lease ran out) and the decode role (handshakes, pulls, completions and failures, each
advanced without blocking once a step). Everything runs on the engine's thread: kernels load at
registration, a handshake is a non-blocking exchange on the side channel, and mapping a new engine's
caches takes milliseconds. No vLLM import.

Soundness of a load against a lease: both instances run on one host (the agent maps the peer's
memory over IPC), so they share ``time.monotonic()``. The prefill frees a held request's blocks at
a step after its ``lease_deadline``; the decode side counts a read as good only when it saw the read
complete before that deadline, and otherwise reports the request's blocks as load errors (vLLM
recomputes them). A posted read is never abandoned: a failure is reported once nothing the read
queued can still write the blocks.
"""
from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ...errors import GpuxferError
from ...kv import KVAgent
from .channel import SideChannelClient, SideChannelServer
from .handshake import check_compatible, decode_info, describe_view, encode_info, engine_info
from .params import BadTransferParams, RemotePrefill, pair_group

log = logging.getLogger("gpuxfer.vllm")


@dataclass
class Settings:
    lease_s: float
    host: str
    port: int
    handshake_timeout_s: float
    token_major: bool
    engine: str = "auto"


@dataclass
class Load:
    """What the scheduler side asks this worker to load for one request."""

    req_id: str
    remote: RemotePrefill
    local_ids: tuple[np.ndarray, ...]       # manager block IDs per group (0: null block)
    start: int                              # first token to load
    end: int                                # one past the last


@dataclass
class _LoadState:
    load: Load
    t_start: float
    remote: "_Remote | None" = None
    handle: Any = None
    t_post: float = 0.0
    nbytes: int = 0
    error: str | None = None


@dataclass
class _Remote:
    key: tuple[str, int, str]
    state: str = "pending"                  # pending | ready (caches mapped) | failed
    client: SideChannelClient | None = None
    peer: Any = None
    info: dict | None = None
    groups: tuple = ()                      # per group: (block size, kernel tokens) from its handshake
    meta: bytes | None = None
    error: str | None = None
    inflight: int = 0
    t0: float = field(default_factory=time.monotonic)


class WorkerSide:
    """One worker's connector state; ``groups``: per KV-cache group ``(kind, block_size, layer names)``."""

    def __init__(self, *, engine_id: str, model: str, dtype: str, layout: str | None,
                 groups: Sequence[tuple[str, int, Sequence[str]]], settings: Settings, platform=None):
        self.engine_id, self.model, self.dtype, self.layout = engine_id, model, dtype, layout
        self.group_specs = [(k, int(bs), list(names)) for k, bs, names in groups]
        self.settings = settings
        self.platform = platform
        self.agent: KVAgent | None = None
        self.server: SideChannelServer | None = None
        self.info: dict | None = None
        self._lock = threading.Lock()                 # the agent: posts and add_peer against close
        self._remotes: dict[tuple, _Remote] = {}
        # decode: every load not reported yet, by request; each is in one of: waiting (not posted: a handshake
        # under way, or the agent busy), in flight (posted, in post order) or ended (nothing to wait for)
        self._loads: dict[str, _LoadState] = {}
        self._waiting: dict[str, _LoadState] = {}
        self._inflight: deque[_LoadState] = deque()
        self._ended: list[_LoadState] = []
        self._holds: dict[str, float] = {}            # prefill: request -> lease deadline
        self._expiry: list[tuple[float, str]] = []    # prefill: heap of (deadline, request) of the holds
        self._released: dict[str, float] = {}         # prefill: request not held (yet) -> when the decode side let go
        self._let_go: list[str] = []                  # prefill: held requests the decode side let go of
        self._group_names = [f"g{g}" for g in range(len(self.group_specs))]
        self._load_errors: set[int] = set()
        self._kernel_tokens: list[int] = []
        self._bytes_per_block: list[int] = []
        self.stats = _new_stats()

    # ------------------------------------------------------------------ registration

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        """Register every KV-cache group's layers with a new agent and open the side channel. Kernel
        loading for transfers happens here and at each handshake, not in a request."""
        t0 = time.perf_counter()
        import torch
        from ...platforms import current
        platform = self.platform or current()
        first = next(iter(kv_caches.values()))
        device = 0
        if first.device.type == "cuda":
            device = torch.cuda.current_device() if first.device.index is None else first.device.index
        engine = self.settings.engine
        if engine == "auto":        # the host emulation runs kernels in Triton's interpreter; memcpy is fast there
            engine = "copy_engine" if platform.kernels_interpreted else "triton"
        self.agent = KVAgent(f"vllm-{self.engine_id}", platform=platform, device=device, engine=engine)
        groups = []
        for g, (kind, bs, names) in enumerate(self.group_specs):
            missing = [n for n in names if n not in kv_caches]
            if missing:
                raise GpuxferError(f"KV-cache group {g} names layers vLLM registered no cache for: {missing[:4]}")
            specs, tokens, majors = {}, set(), set()
            per_block = 0
            for n in names:
                spec, tok, major = describe_view(kv_caches[n], self.settings.token_major)
                specs[n] = spec
                tokens.add(tok)
                majors.add(major)
                per_block += sum(p[1] for p in spec.pieces)
            if len(tokens) != 1 or bs % next(iter(tokens)):
                raise GpuxferError(f"KV-cache group {g}: its layers' kernel blocks hold {sorted(tokens)} tokens, "
                                   f"which do not split its {bs}-token blocks evenly")
            kt = tokens.pop()
            self.agent.register_group(f"g{g}", kt, specs, token_major=all(majors))
            self._kernel_tokens.append(kt)
            self._bytes_per_block.append(per_block)
            view = kv_caches[names[0]]
            groups.append({"kind": kind, "block_size": bs, "kernel_tokens": kt, "token_major": all(majors),
                           "layers": names, "bytes_per_token": per_block // kt,
                           "content": [int(view.shape[1]), int(view.shape[3]) * view.element_size()]})
        self.info = engine_info(engine_id=self.engine_id, model=self.model, dtype=self.dtype, layout=self.layout,
                                groups=groups)
        warm_s = self._warm_up()
        self._info_bytes, self._meta_bytes = encode_info(self.info), self.agent.metadata()
        self.server = SideChannelServer(self.settings.host, self.settings.port,
                                        lambda: (self._info_bytes, self._meta_bytes), self.settings.handshake_timeout_s)
        if not all(g["token_major"] for g in groups):
            log.info("gpuxfer: engine %s: the KV layout is not token-major (attention backend's block interior), so "
                     "it pairs only with instances of the same block size", self.engine_id)
        log.info("gpuxfer: engine %s registered %d KV-cache group(s) (%s) with the %s engine in %.2f s (kernels "
                 "loaded in %.2f s); side channel on %s:%d", self.engine_id, len(groups),
                 ", ".join(f"{g['kind']} {g['block_size']} tok x {len(g['layers'])} layers" for g in groups), engine,
                 time.perf_counter() - t0, warm_s, self.server.host, self.server.port)

    def _warm_up(self) -> float:
        """The agent's kernels loaded now (engine startup), not in the first request: a read of vLLM's null
        block 0 onto itself. A failure here only moves that cost to the first request."""
        try:
            return self.agent.warm_up(block=0)
        except GpuxferError as exc:
            log.warning("gpuxfer: engine %s: loading the transfer kernels at startup failed (%s: %s); the first "
                        "request loads them", self.engine_id, type(exc).__name__, exc)
            return 0.0

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.server.host, self.server.port

    # ------------------------------------------------------------------ prefill role

    def hold(self, holds: Mapping[str, float]) -> None:
        for req, deadline in holds.items():
            self._holds[req] = deadline
            heapq.heappush(self._expiry, (deadline, req))
            if self._released.pop(req, None) is not None:      # let go of before its hold came
                self._let_go.append(req)

    def _drain_events(self, now: float) -> None:
        if self.server is None:
            return
        self.server.pump()
        events = self.server.events
        while not events.empty():               # (this thread is the only one taking events)
            op, req = events.get_nowait()
            if req in self._holds:
                self._let_go.append(req)
            else:
                self._released[req] = now
            if op == "release":
                log.info("gpuxfer: engine %s: decode side released request %s without reading it", self.engine_id, req)
        if len(self._released) > 4 * len(self._holds) + 1024:      # letting go of requests held nowhere
            cutoff = now - 2 * self.settings.lease_s
            self._released = {r: t for r, t in self._released.items() if t >= cutoff or r in self._holds}

    def _finished_sending(self, now: float) -> set[str]:
        """Held requests the decode side let go of, then those whose lease ran out: O(1) when neither (the
        expiries are a heap by deadline; an entry of a request no longer held, or held again, is skipped)."""
        done = set()
        if self._let_go:
            for req in self._let_go:
                if self._holds.pop(req, None) is not None:
                    done.add(req)
                    self.stats["sends_done"] += 1
            self._let_go = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            deadline, req = heapq.heappop(heap)
            if self._holds.get(req) != deadline:
                continue
            del self._holds[req]
            done.add(req)
            self.stats["leases_expired"] += 1
            log.warning("gpuxfer: engine %s: request %s's lease ran out (%.0f s) before a decode instance read "
                        "its blocks; freeing them", self.engine_id, req, self.settings.lease_s)
        return done

    # ------------------------------------------------------------------ decode role

    def start_loads(self, loads: Sequence[Load]) -> None:
        """Start each load without waiting: a known engine's read is posted now; a new engine's handshake
        starts (a non-blocking connect and hello) and later steps finish it, map the engine's caches and
        post the read."""
        now = time.monotonic()
        ready = []
        for load in loads:
            st = self._loads[load.req_id] = self._waiting[load.req_id] = _LoadState(load, now)
            st.remote = self._remote(load.remote)
            self._advance(st.remote)
            if st.remote.state == "ready":
                ready.append(st)
        self._post(ready, blocking=False)

    def _remote(self, rp: RemotePrefill) -> _Remote:
        r = self._remotes.get(rp.endpoint)
        gone = r is not None and r.state == "ready" and not (r.client and r.client.alive)
        if r is None or ((r.state == "failed" or gone) and r.inflight == 0):
            r = self._remotes[rp.endpoint] = _Remote(rp.endpoint)
            try:
                r.client = SideChannelClient(r.key[0], r.key[1], self.settings.handshake_timeout_s)
            except (OSError, ValueError) as exc:
                self._handshake_failed(r, exc)
        return r

    def _advance(self, r: _Remote) -> None:
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
            check_compatible(self.info, info)
            r.info = info
            r.groups = tuple((g["block_size"], g["kernel_tokens"]) for g in info["groups"])
        except Exception as exc:        # every failure fails this engine's loads, never the worker
            self._handshake_failed(r, exc)
            return
        self._attach(r)

    def _handshake_failed(self, r: _Remote, exc: Exception) -> None:
        host, port, engine_id = r.key
        r.error, r.state = f"{type(exc).__name__}: {exc}", "failed"
        log.error("gpuxfer: engine %s: handshake with prefill engine %s at %s:%d failed: %s; its requests' "
                  "loads fail and vLLM recomputes them", self.engine_id, engine_id, host, port, r.error)
        if r.client is not None:
            r.client.close()

    def _attach(self, r: _Remote) -> None:
        """Map a checked engine's caches (``add_peer``) and make its first read's slot: a few milliseconds
        once the kernels were loaded at registration."""
        t0 = time.perf_counter()
        try:
            with self._lock:
                name = f"vllm-{r.key[2]}"
                if name in self.agent.peers:                   # the same engine again, after it restarted
                    self.agent.remove_peer(name)
                r.peer = self.agent.add_peer(r.meta)
                self._warm(r.peer)
            r.state = "ready"
        except Exception as exc:
            self._handshake_failed(r, exc)
            return
        now = time.perf_counter()
        self.stats["handshakes"] += 1
        self.stats["handshake_s"].append(time.monotonic() - r.t0)
        log.info("gpuxfer: engine %s: handshake with prefill engine %s at %s:%d in %.3f s (its caches mapped in "
                 "%.3f s)", self.engine_id, r.key[2], r.key[0], r.key[1], time.monotonic() - r.t0, now - t0)

    def _warm(self, peer) -> None:
        """One read of the peer's null block into ours per group (vLLM's block 0: a placeholder no request
        reads; a group at a time, as hybrid groups share memory), so the first request finds its route's
        slot made."""
        for g in range(len(self.group_specs)):
            blocks = {f"g{g}": [0]}
            try:
                self.agent.prepare(peer, "pull", local_blocks=blocks, remote_blocks=blocks, name="warm-up").post().wait()
            except GpuxferError as exc:
                log.debug("gpuxfer: warm-up read of group %d skipped: %s", g, exc)

    def _post(self, sts: list[_LoadState], blocking: bool) -> None:
        """Pair each request's blocks and post the reads together (:meth:`KVAgent.post_many`: one upload and one
        launch per prefill engine); left waiting for a later step when the agent is busy (a handshake). A
        request whose blocks do not pair fails alone. A posted read goes in flight; one with nothing to move or
        that failed ends (reported at the next poll)."""
        if not sts or not self._lock.acquire(blocking=blocking):
            return
        try:
            t0 = time.perf_counter()
            posts, xs = [], []
            for st in sts:
                try:
                    x = self._prepare(st)
                except (GpuxferError, KeyError, IndexError, ValueError) as exc:
                    st.error = f"{type(exc).__name__}: {exc}"
                    continue
                if x is None:
                    st.handle = _Done()
                else:
                    posts.append(st)
                    xs.append(x)
            try:
                handles = self.agent.post_many(xs) if xs else []
            except GpuxferError as exc:
                # the reads queued before the error keep their handles (their blocks are in use until they
                # complete); only the others fail
                handles = getattr(exc, "handles", None) or [None] * len(posts)
                for st, h in zip(posts, handles):
                    if h is None:
                        st.error = f"{type(exc).__name__}: {exc}"
            t1 = time.perf_counter()
            inflight = self._inflight
            for st, h in zip(posts, handles):
                if h is not None:
                    st.handle = h
                    st.remote.inflight += 1
                    inflight.append(st)
            share = (t1 - t0) / len(sts)            # the step's host time, per request it started
            post_s = self.stats["post_host_s"]
            waiting = self._waiting
            for st in sts:
                if waiting.get(st.load.req_id) is st:
                    del waiting[st.load.req_id]
                if st.handle is not None:
                    post_s.append(share)
                    st.t_post = t1
                    if st.error is None and type(st.handle) is _Done:
                        self._ended.append(st)
                if st.error is not None:
                    self._ended.append(st)
        finally:
            self._lock.release()

    def _prepare(self, st: _LoadState):
        """The request's read, prepared (its blocks paired per group; None: nothing to move)."""
        load, r = st.load, st.remote
        rp = load.remote
        if r.client is None or not r.client.alive:
            raise BadTransferParams(f"prefill engine {r.key[2]} is gone: {r.client and r.client.closed_reason}")
        if time.monotonic() >= rp.lease_deadline:
            raise BadTransferParams("the prefill instance's lease on the blocks ran out before the read started")
        local, remote, nbytes = {}, {}, 0
        for g, (kind, ls, _) in enumerate(self.group_specs):
            rs, rk = r.groups[g]
            if rp.block_sizes[g] != rs:
                raise BadTransferParams(f"group {g}: the params say {rp.block_sizes[g]}-token blocks, "
                                        f"the engine's handshake {rs}")
            li, ri = pair_group(load.local_ids[g], rp.block_ids[g], ls, rs, load.start, load.end,
                                self._kernel_tokens[g], rk)
            if li.size:
                name = self._group_names[g]
                local[name], remote[name] = li, ri
                nbytes += int(li.size) * self._bytes_per_block[g]
        st.nbytes = nbytes
        if not local:
            return None
        return self.agent.prepare(r.peer, "pull", local_blocks=local, remote_blocks=remote, name=load.req_id)

    def _finished_recving(self, now: float) -> tuple[set[str], set[str]]:
        """Loads done and failed since the last poll. Reads complete in the order they were posted (all on the
        agent's stream), so the in-flight ones are asked oldest first up to the first not done: O(1) when
        nothing finished. Loads still waiting (handshakes under way) are looked at each poll."""
        done, failed = set(), set()
        if self._waiting:
            for r in list(self._remotes.values()):
                self._advance(r)
            ready = []
            for st in list(self._waiting.values()):
                r = st.remote
                if r.state == "failed":
                    st.error = f"handshake failed: {r.error}"
                elif r.state == "ready" and not (r.client and r.client.alive):
                    st.error = f"prefill engine {r.key[2]} is gone: {r.client.closed_reason if r.client else ''}"
                elif r.state == "ready":
                    ready.append(st)
                elif now - st.t_start > self.settings.handshake_timeout_s:
                    st.error = f"no handshake with {r.key[0]}:{r.key[1]} within {self.settings.handshake_timeout_s:g} s"
                if st.error is not None:
                    del self._waiting[st.load.req_id]
                    self._ended.append(st)
            self._post(ready, blocking=False)
        read: dict[int, tuple] = {}             # per prefill engine: its client and the requests read
        inflight = self._inflight
        while inflight and inflight[0].handle.done():
            st = inflight.popleft()
            st.remote.inflight -= 1
            self._complete(st, done, failed, read)
        if self._ended:
            ended, self._ended = self._ended, []
            for st in ended:
                self._complete(st, done, failed, read)
        for client, reqs in read.values():      # one message per engine for the step's reads
            client.notify("done", reqs)
        self._reap(now)
        return done, failed

    def _complete(self, st: _LoadState, done: set, failed: set, read: dict) -> None:
        """Report a load whose read completed (or that had nothing to move, or failed)."""
        req = st.load.req_id
        if st.error is None and time.monotonic() >= st.load.remote.lease_deadline:
            st.error = "the read completed after the prefill instance's lease ran out"
        if self._loads.get(req) is st:
            del self._loads[req]
        done.add(req)
        if st.error is not None:
            self._fail(st)
            failed.add(req)
            return
        r = st.remote
        self.stats["transfers"] += 1
        self.stats["bytes"] += st.nbytes
        self.stats["xfer_s"].append(time.perf_counter() - st.t_post)
        if r.client is not None:
            read.setdefault(id(r), (r.client, []))[1].append(st.load.remote.request_id)

    def _fail(self, st: _LoadState) -> None:
        load = st.load
        self.stats["failed"] += 1
        log.warning("gpuxfer: engine %s: loading request %s from engine %s failed (%s); vLLM recomputes it",
                    self.engine_id, load.req_id, load.remote.engine_id, st.error)
        if len(self.group_specs) == 1:
            ids = load.local_ids[0]
            self._load_errors.update(int(b) for b in ids[load.start // self.group_specs[0][1]:] if b)
        r = st.remote
        if r is not None and r.client is not None:
            r.client.notify("release", [load.remote.request_id])

    def _reap(self, now: float) -> None:
        """Forget engines whose side channel closed once no read of theirs is in flight."""
        for key, r in list(self._remotes.items()):
            gone = r.state == "ready" and not (r.client and r.client.alive)
            if (gone or r.state == "failed") and r.inflight == 0 and not any(
                    st.remote is r for st in self._loads.values()):
                del self._remotes[key]
                if r.peer is not None and self._lock.acquire(blocking=False):
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

    def release(self, releases: Sequence[tuple[tuple[str, int, str], str]]) -> None:
        """Tell prefill engines this instance will not read these requests (best effort, known engines)."""
        for key, req in releases:
            r = self._remotes.get(key)
            if r is not None and r.state == "ready" and r.client is not None:
                r.client.notify("release", [req])

    # ------------------------------------------------------------------ both

    def poll(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished sending, finished receiving, failed receiving)`` now."""
        now = time.monotonic()
        self._drain_events(now)
        sending = self._finished_sending(now)
        recving, failed = self._finished_recving(now) if self._loads else (set(), set())
        return sending, recving, failed

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def take_stats(self) -> dict | None:
        s = self.stats
        if not (s["transfers"] or s["failed"] or s["handshakes"] or s["leases_expired"] or s["sends_done"]):
            return None
        self.stats = _new_stats()
        return s

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for r in self._remotes.values():
            if r.client is not None:
                r.client.close()
        if self.agent is not None:
            with self._lock:
                self.agent.close()


class _Done:
    """The handle of a load with nothing to move."""

    def done(self) -> bool:
        return True


def _new_stats() -> dict:
    return {"transfers": 0, "failed": 0, "bytes": 0, "handshakes": 0, "leases_expired": 0, "sends_done": 0,
            "post_host_s": [], "xfer_s": [], "handshake_s": []}
