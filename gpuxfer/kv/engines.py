"""KV transfer engines: one interface, measured on the same descriptors.

An *engine* moves a *burst* (the requests of one batch; each request an int64
``(N, 3)`` table of ``(src_offset, dst_offset, nbytes)`` into the source and
destination pools) from the prefill side's pool to the decode side's pool.
The two sides are two processes; each builds the same engines, in the same
order, over a :class:`Side` (its platform, its pool, the peer's pool opened
over IPC, a CPU-group exchange).

The interface, per burst::

    p = engine.prepare(burst, direction)   # both sides, once per row; timed apart ("prep ms")
    engine.arm(p)         # both sides, untimed: enqueue device work that waits on a GPU flag
    # ... a CPU-group barrier ...
    engine.post(p)        # the initiator, timed: trigger (or, unarmed, enqueue) the transfer
    engine.wait(p)        # the initiator, timed: every byte has landed; the passive side: its part is done
    engine.release(p)

``direction`` is ``pull`` (the decode side initiates: it reads, or pulls the
data towards itself) or ``push`` (the prefill side initiates and writes).
:func:`initiator_of` says which side times the burst.

Armed and host posting. With ``Side.armed`` (the benchmark's default), an
engine that can (``armable``) enqueues all of the initiator's device work in
:meth:`Engine.arm`, behind a wait on a GPU flag (the side's :class:`Gate`);
:meth:`Engine.post` is then one stream write of that flag, and the timer runs
from that trigger to the last byte landed -- the transfer as a serving engine
runs it when it enqueues the pull (or push) as soon as the blocks are
allocated and fires it when the KV is ready. The host cost of enqueueing is
measured apart (``arm ms``). Unarmed (``host``), the initiator enqueues
everything inside :meth:`Engine.post`, in the timed region. A passive side
always arms: its work waits for flags the initiator's work sets, so nothing it
does runs before the timer starts.

Built-in engines (``ENGINES``):

* ``triton`` -- the descriptor-copy kernel: pull runs on the decode GPU reading
  the peer pool through the IPC mapping, push on the prefill GPU writing it.
  Uses SMs of the initiating GPU, none of the other.
* ``pack`` -- pack the pages into a staging buffer on the source (a local
  kernel at HBM speed), one copy-engine transfer per chunk into the
  destination's staging buffer (opened over IPC), unpack on the destination.
  Chunked and pipelined across three streams in two processes: chunk *k*
  packs while *k-1* is on the wire and *k-2* unpacks. Cross-process hand-offs
  are 64-bit stream flags, written by a remote stream write where a set-up
  probe saw one arrive, else by an 8-byte copy-engine copy (``_FlagLink``); a
  slot is reused only once the peer says it is free. No SM touches the wire.
* ``copy_engine`` -- ``copy_batch_async`` (``cuMemcpyBatchAsync`` on CUDA) over
  the descriptors on a created stream, no SM at all; the baseline that shows
  why packing matters (a fixed cost per descriptor). Capped per burst
  (``EngineOptions.copy_engine_max_descs``); bigger bursts are shed, with the
  reason. Never armed: its bursts hold more commands than a blocked stream's
  queue takes, so it posts inside the timed region.
* ``bulk`` -- one descriptor of the same total bytes on the copy engines: the
  ceiling every row is divided by.

Failure. Every host wait is bounded (``Side.timeout_s``). When one times out, the
side *fails*: it releases every GPU-side wait its streams hold (the gate and every
flag link's local words get a value past anything awaited), stores the error and
raises it from every later ``prepare`` / ``arm`` / ``post`` / ``wait`` of every
engine on the side; ``release`` and ``close`` still work. With
``on_timeout="exit"`` (``GPUXFER_KV_ON_TIMEOUT=exit``) it then logs the rank,
the flag and what was waiting, and ends the process with :data:`EXIT_CODE`::

    decode (initiator)                  its streams                    prefill (stuck)
    ------------------                  -----------                    ---------------
    arm: lane 0 waits gate >= g         lane 0: wait gate              (never arms)
    post: gate := g  ---------------->  lane 0: wait AVAIL[0] >= 1
    wait: t = timeout_s, no event       (blocked: no chunk comes)
    fail: gate, GO/AVAIL/FREE := 2**62  lane 0: released, drains
    raise TransferTimeout               (no stream of the side waits any more)
    prepare/arm/post/wait: raise it

More engines (NIXL, Mooncake, MoRI-IO) register with :func:`register_engine` under a
``"module:Class"`` path, so listing them never imports their library;
:func:`engine_report` says for each whether it can run here (``None``) or why not.
"""
from __future__ import annotations

import abc
import enum
import importlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import numpy as np

from .. import config
from ..errors import BackendUnavailable, BadInput, TransferTimeout
from ..platforms.base import Closable, DeviceBuffer, Event, Memory, PeerMapping, Platform, Stream
from ..sync import flag_path_from_env, wait_flag_or_raise
from .plan import check_bounds

log = logging.getLogger("gpuxfer.kv.engines")

DIRECTIONS = ("pull", "push")
ENV_KV_ON_TIMEOUT = "GPUXFER_KV_ON_TIMEOUT"
EXIT_CODE = 70          # the process exit code of on_timeout="exit" (EX_SOFTWARE)
#: written into a local flag word to release every GPU wait on it (larger than any value awaited)
RELEASE_VALUE = 1 << 62
#: why an engine with ``needs_peer_mapping`` cannot run when the ranks are on different hosts
CROSS_HOST_PEER_MAPPING = "needs the peer pool mapped over IPC; the ranks are on different hosts"


class Role(str, enum.Enum):
    """Which pool a process holds."""

    SOURCE = "source"             # the prefill side
    DESTINATION = "destination"   # the decode side

    @property
    def serving_name(self) -> str:
        return "prefill" if self is Role.SOURCE else "decode"


def on_timeout_from_env(value: str | None) -> str:
    """``value``, else ``$GPUXFER_KV_ON_TIMEOUT``, else ``raise``: what a side does when a bounded wait
    times out (``raise``: store the error, release every GPU wait, raise on every later call; ``exit``: the
    same, then log and end the process with :data:`EXIT_CODE`)."""
    return config.resolve(ENV_KV_ON_TIMEOUT, value, option="on_timeout")


def check_direction(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise BadInput(f"unknown direction {direction!r}; use one of {', '.join(DIRECTIONS)}")
    return direction


def initiator_of(direction: str) -> Role:
    """``pull``: the decode (destination) side initiates and times; ``push``: the prefill (source) side."""
    return Role.DESTINATION if check_direction(direction) == "pull" else Role.SOURCE


# ----------------------------------------------------------------------------- options, sides, bursts


@dataclass
class EngineOptions:
    """Engine tuning knobs (the benchmark's defaults; the emulation shrinks the sizes)."""

    copy_batch_descs: int = 8192               # descriptors per copy_batch_async call
    copy_engine_max_descs: int = 140_000       # per-burst cap of copy_engine (~0.6-1 us/descriptor on H200)
    pack_chunk_bytes: int = 32 << 20           # staging slot size = the largest chunk (the runner may raise it)
    pack_max_chunks: int = 96                  # the runner sizes slots so a burst has about this many chunks
    pack_first_chunk_bytes: int = 16 << 20     # chunks ramp up from this (smaller copies run below the link rate)
    pack_slots: int = 4                        # staging slots per side (a multiple of pack_lanes)
    pack_lanes: int = 2                        # copy streams used round-robin by the chunks
    verify_chunk_bytes: int = 1 << 30          # bulk rows are verified in pieces of this

    def validate(self) -> "EngineOptions":
        for k in ("copy_batch_descs", "copy_engine_max_descs", "pack_chunk_bytes", "pack_first_chunk_bytes",
                  "pack_slots", "pack_lanes", "verify_chunk_bytes"):
            v = getattr(self, k)
            if not isinstance(v, int) or v <= 0:
                raise BadInput(f"engine option {k} must be a positive integer, got {v!r}")
        if self.pack_slots % self.pack_lanes:
            raise BadInput(f"pack_slots ({self.pack_slots}) must be a multiple of pack_lanes ({self.pack_lanes})")
        if self.pack_slots < 2:
            raise BadInput(f"pack_slots must be >= 2 to pipeline, got {self.pack_slots}")
        if self.pack_first_chunk_bytes > self.pack_chunk_bytes:
            self.pack_first_chunk_bytes = self.pack_chunk_bytes
        return self


class FailsOnTimeout:
    """What a party (a benchmark :class:`Side`, a :class:`~gpuxfer.kv.agent.KVAgent`) does when one of its
    bounded waits times out: :meth:`fail` releases every GPU-side wait it queued (its
    :meth:`release_waits` writes :data:`RELEASE_VALUE` into its local flag words), keeps the first
    error, which :meth:`check` raises from every later call, and with ``on_timeout == "exit"`` logs it
    and ends the process with :data:`EXIT_CODE`. Subclasses set ``failed`` (None) and ``on_timeout``
    (:func:`on_timeout_from_env`) and name themselves in :meth:`failure_name`."""

    failed: BaseException | None = None
    on_timeout: str | None = None

    def release_waits(self) -> None:
        """Satisfy every GPU wait this party queued (best effort: the abort path)."""

    def failure_name(self) -> str:
        return type(self).__name__

    def fail(self, exc: BaseException) -> None:
        """A bounded wait timed out: release every GPU wait, keep ``exc`` (the first error) for every later
        call, and with ``on_timeout="exit"`` log and end the process."""
        if self.failed is None:
            self.failed = exc
        self.release_waits()
        if self.on_timeout == "exit":
            msg = (f"gpuxfer kv: {self.failure_name()} failed: {type(self.failed).__name__}: {self.failed}; "
                   f"on_timeout=exit: every GPU wait released, exiting with code {EXIT_CODE}")
            log.critical("%s", msg)
            try:
                print(msg, file=sys.stderr, flush=True)
            finally:
                os._exit(EXIT_CODE)

    def check(self) -> None:
        """Raise the error that failed this party, if any."""
        if self.failed is not None:
            raise self.failed


@dataclass
class Side(FailsOnTimeout):
    """What one of the two processes holds; every engine is built over one.

    ``exchange(obj)`` is an all-gather over the CPU group (index = rank); an
    engine may call it only from its constructor (both sides build engines in
    the same order, so the calls pair up).
    """

    platform: Platform
    device: int
    rank: int
    role: Role
    pool: DeviceBuffer
    peer_pool: PeerMapping | None      # None when the ranks are on different hosts (no IPC mapping)
    exchange: Callable[[Any], list]
    timeout_s: float = 60.0
    options: EngineOptions = field(default_factory=EngineOptions)
    armed: bool = True
    on_timeout: str | None = None      # raise | exit; None: $GPUXFER_KV_ON_TIMEOUT, else raise
    failed: BaseException | None = field(default=None, repr=False)   # the error that failed the side
    _streams: dict = field(default_factory=dict, repr=False)
    _gate: "Gate | None" = field(default=None, repr=False)
    _releasers: list = field(default_factory=list, repr=False)       # release_waits of the side's flag links

    def __post_init__(self) -> None:
        self.on_timeout = on_timeout_from_env(self.on_timeout)

    def agree(self, engine: str, info: dict, on_failure: Callable[[], None]) -> list[dict]:
        """Collective set-up exchange: every side's record, or, if any side's record is
        ``{"error": ...}``, ``on_failure()`` and :class:`BackendUnavailable` with every
        failing side's reason, raised on both sides together (neither is left waiting)."""
        infos = self.exchange(info)
        errors = {r: i["error"] for r, i in enumerate(infos) if "error" in i}
        if errors:
            on_failure()
            raise BackendUnavailable(engine, errors)
        return infos

    def stream(self, name: str) -> Stream:
        """A stream of this process, created once per name and shared by the engines (one burst at a time).

        Few streams on purpose: a stream blocked in a flag wait must never share a
        hardware queue with the stream that releases it.
        """
        s = self._streams.get(name)
        if s is None:
            s = self._streams[name] = self.platform.create_stream(self.device)
        return s

    def open_streams(self) -> None:
        """Create every stream the built-in engines use, and the gate, up front.

        Creating a stream (or allocating) while another stream of the process is blocked
        in a flag wait can block until that wait ends: nothing of the kind may happen
        while a burst is armed.
        """
        for name in ("engine", "gate-trigger", "setup", "pack-kernel",
                     *(f"pack-lane{i}" for i in range(self.options.pack_lanes))):
            self.stream(name)
        _ = self.gate

    @property
    def gate(self) -> "Gate":
        if self._gate is None:
            self._gate = Gate(self)
        return self._gate

    def release_waits(self) -> None:
        """Abort path: satisfy the gate and every flag link's words, so no stream of ours stays blocked."""
        if self._gate is not None:
            self._gate.release_waits()
        for release in list(self._releasers):
            release()

    def failure_name(self) -> str:
        return f"rank {self.rank} ({self.role.serving_name}, device {self.device})"

    def close(self) -> None:
        if self._gate is not None:
            self._gate.close()
            self._gate = None
        streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.close()

    @property
    def src_mem(self) -> Memory:
        return self.pool if self.role is Role.SOURCE else self.peer_pool

    @property
    def dst_mem(self) -> Memory:
        return self.pool if self.role is Role.DESTINATION else self.peer_pool

    @property
    def peer_rank(self) -> int:
        return 1 - self.rank


def as_descriptors(table, name: str = "descriptors") -> np.ndarray:
    arr = np.asarray(table)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise BadInput(f"{name} must have shape (N, 3), got {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise BadInput(f"{name} must be integers, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


class BurstShape(NamedTuple):
    """What a cap needs to know about a burst, without materialising it."""

    batch: int
    descriptors: int
    nbytes: int


class Burst:
    """The descriptors of one batch's requests, posted together and awaited together.

    ``requests[r]`` is request r's ``(N_r, 3)`` table; ``plan`` (optional) is their
    concatenation when the caller already has it (e.g. :class:`gpuxfer.kv.plan.Burst`'s
    ``plan``, whose ``requests`` are views into it).

    The burst holds its own read-only copy of the descriptors (``requests`` are views
    into it): what :meth:`check_bounds` checked is what every engine moves, whatever the
    caller does to its arrays afterwards.
    """

    def __init__(self, requests: Sequence[np.ndarray], plan: np.ndarray | None = None, source=None):
        #: the :class:`gpuxfer.kv.plan.Burst` (layouts, seeded block tables) these descriptors come from, if any:
        #: engines that move blocks by ID (``triton``, through the KV API) need it
        self.source = source
        if not len(requests):
            raise BadInput("a burst needs at least one request")
        reqs = [as_descriptors(r, f"request {i}") for i, r in enumerate(requests)]
        ends = np.cumsum([r.shape[0] for r in reqs])
        if plan is None:
            cat = np.concatenate(reqs, axis=0)
        else:
            cat = np.array(as_descriptors(plan, "plan"))
            if cat.shape[0] != int(ends[-1]):
                raise BadInput("plan and requests differ in length")
            for i, (r, end) in enumerate(zip(reqs, ends)):
                if not np.array_equal(cat[end - r.shape[0]:end], r):
                    raise BadInput(f"plan is not the concatenation of the requests (request {i} differs)")
        cat.setflags(write=False)
        self._cat = cat
        self.requests = [cat[end - r.shape[0]:end] for r, end in zip(reqs, ends)]
        self._checked: tuple | None = None

    @classmethod
    def from_plan(cls, plan_burst) -> "Burst":
        """From a :class:`gpuxfer.kv.plan.Burst`."""
        return cls(plan_burst.requests, plan=plan_burst.plan, source=plan_burst)

    @property
    def shape(self) -> BurstShape:
        return BurstShape(self.batch, self.descriptors, self.nbytes)

    @property
    def batch(self) -> int:
        return len(self.requests)

    @property
    def descriptors(self) -> int:
        return sum(int(r.shape[0]) for r in self.requests)

    @property
    def nbytes(self) -> int:
        return sum(int(r[:, 2].sum()) for r in self.requests)

    def concatenated(self) -> np.ndarray:
        return self._cat

    def describe_row(self, row: int) -> str:
        """'descriptor 12 (request 1, row 3 of the request)'."""
        ends = np.cumsum([r.shape[0] for r in self.requests])
        req = int(np.searchsorted(ends, row, side="right"))
        if req >= len(self.requests):
            return f"descriptor {row}"
        first = int(ends[req - 1]) if req else 0
        return f"descriptor {row} (request {req}, row {row - first} of the request)"

    def check_bounds(self, src_nbytes: int | None, dst_nbytes: int | None) -> None:
        """Every descriptor moves at least one byte and lies inside both pools (``None``: a pool whose
        size is not known here). :class:`BadInput` names the first that does not; see
        :func:`gpuxfer.kv.plan.check_bounds` (overflow-safe). Checked once per pair of sizes (the
        descriptors are the burst's own, read-only)."""
        if self._checked == (src_nbytes, dst_nbytes):
            return
        check_bounds(self._cat, src_nbytes, dst_nbytes, describe=self.describe_row)
        self._checked = (src_nbytes, dst_nbytes)


@dataclass
class Prepared:
    """A prepared burst: what :meth:`Engine.post` needs, built outside the timed region."""

    engine: str
    direction: str
    burst: Burst
    active: bool                 # this side posts work for this burst
    initiator: bool              # this side times the burst
    state: Any = None
    done: Event | None = None
    gate: int | None = None      # the gate value this burst's armed work waits for (None: not armed)
    released: bool = False


# ----------------------------------------------------------------------------- waiting


def wait_event(platform: Platform, event: Event, timeout_s: float, *, rank: int, what: str, step: int = 0,
               spin_s: float = 0.25) -> None:
    """Wait on the host for ``event``; spin first on a GPU (a sleep would inflate short bursts).

    Raises :class:`TransferTimeout` past ``timeout_s``.
    """
    start = time.perf_counter()
    if not platform.is_emulation:
        spin_until = start + min(spin_s, timeout_s)
        while True:
            if platform.event_query(event):
                return
            if time.perf_counter() > spin_until:
                break
    left = timeout_s - (time.perf_counter() - start)
    if left > 0 and platform.event_wait(event, left):
        return
    raise TransferTimeout(rank=rank, step=step, flag=f"event: {what}", expected=1, seen=0, timeout_s=timeout_s,
                          what=what)


class Gate:
    """A 64-bit flag in this process's device memory that armed work waits on; posting writes it.

    Values only grow (one per armed burst of the process). The trigger is a stream
    write on a stream that never waits for anything, so it cannot be held up.
    """

    def __init__(self, side: "Side"):
        self.side = side
        plat = side.platform
        self.buf = plat.alloc(256, side.device)
        s = side.stream("gate-trigger")
        plat.memset_async(s, self.buf.ptr, 0, 256)
        if not plat.synchronize(s, side.timeout_s):
            self.buf.close()
            raise TransferTimeout(rank=side.rank, step=0, flag="gate (memset)", expected=1, seen=0,
                                  timeout_s=side.timeout_s)
        self.value = 0

    def next(self) -> int:
        self.value += 1
        return self.value

    def wait(self, stream: Stream, value: int) -> None:
        self.side.platform.wait_flag(stream, self.buf.ptr, value)

    def trigger(self, value: int) -> None:
        self.side.platform.write_flag(self.side.stream("gate-trigger"), self.buf.ptr, value)

    def release_waits(self) -> None:
        try:
            self.side.platform.host_write_flag(self.buf.ptr, RELEASE_VALUE, self.side.device)
        except Exception:  # noqa: BLE001 - best effort on the abort path
            pass

    def close(self) -> None:
        self.buf.close()


# ----------------------------------------------------------------------------- kernels


def _kernels():
    """The Triton launchers (imported lazily: importing the engines never imports Triton)."""
    from .. import kernels
    return kernels


def _device_table(side: Side, like, table: np.ndarray):
    """``table`` as an int64 torch tensor on the device of the torch tensor ``like``."""
    import torch
    a = np.ascontiguousarray(table, dtype=np.int64)
    t = torch.from_numpy(a if a.flags.writeable else a.copy())     # torch wants writable memory
    if like.device.type == "cpu":
        return t.clone()
    return t.to(like.device)


def _sync_uploads(side: Side) -> None:
    _sync_uploads_plat(side.platform, side.device, side.timeout_s, side.rank)


def _sync_uploads_plat(platform: Platform, device: int, timeout_s: float, rank: int) -> None:
    """Uploads went through torch's current stream: finish them before other streams use the tables."""
    if platform.is_emulation:
        return      # CPU tensors: torch copied them synchronously
    if not platform.synchronize(platform.current_stream(device), timeout_s):
        raise TransferTimeout(rank=rank, step=0, flag="upload of descriptor tables", expected=1, seen=0,
                              timeout_s=timeout_s)


# ----------------------------------------------------------------------------- the interface


class Engine(Closable, abc.ABC):
    """One way to move a burst. Built on both sides (collectively), used one burst at a time.

    Subclasses set ``name``, ``description`` and ``uses_sms`` and implement
    :meth:`prepare` and :meth:`_enqueue` (this side's device work for a burst,
    ending with ``p.done`` = an event recorded after it); an engine that is not
    stream-ordered (a host library) sets ``armable = False`` and may override
    :meth:`post` / :meth:`wait` instead. Every owned resource is released by
    :meth:`close` (idempotent).
    """

    name: ClassVar[str] = "abstract"
    description: ClassVar[str] = ""
    uses_sms: ClassVar[str] = ""        # where SMs are used, in words ("none", "initiator", ...)
    ceiling: ClassVar[bool] = False     # this engine's rows are the ceiling of the others
    armable: ClassVar[bool] = False     # its initiator's work is stream-ordered: it can wait behind a GPU flag
    launches_kernels: ClassVar[bool] = False   # the runner loads its kernels in an unarmed burst first
    needs_peer_mapping: ClassVar[bool] = False  # reads or writes the peer's memory through an IPC mapping
    ceiling_across_hosts: ClassVar[bool] = False  # the ceiling when the ranks are on different hosts

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        """Why this engine cannot run on ``platform`` (None if it can). Never raises, never touches a device."""
        return None

    @classmethod
    def cross_host_reason(cls) -> str | None:
        """Why this engine cannot run when the two ranks are on different hosts (None if it can)."""
        return CROSS_HOST_PEER_MAPPING if cls.needs_peer_mapping else None

    def __init__(self, side: Side):
        self.side = side
        self.platform = side.platform
        self.options = side.options
        self._closed = False

    # -- helpers
    @property
    def stream(self) -> Stream:
        """The stream of the simple engines (shared: one burst at a time)."""
        return self.side.stream("engine")

    def initiator(self, direction: str) -> Role:
        return initiator_of(direction)

    def is_initiator(self, direction: str) -> bool:
        return self.initiator(direction) is self.side.role

    def shed_reason(self, shape: BurstShape) -> str | None:
        """Why this engine does not run a burst of this shape (a cap), or None."""
        return None

    def verify_descriptors(self, burst: Burst) -> np.ndarray:
        """The descriptors whose destination bytes the verifier checks after this engine's transfer."""
        return burst.concatenated()

    # -- the burst protocol
    @abc.abstractmethod
    def prepare(self, burst: Burst, direction: str) -> Prepared:
        """Everything a post needs (descriptor uploads, pointer arrays, chunk plans). Not timed as transfer."""

    def _enqueue(self, p: Prepared) -> None:
        """Enqueue this side's device work for ``p`` and set ``p.done``. Non-blocking.

        Stream-ordered engines implement this; host-driven ones override :meth:`post`
        (and :meth:`wait`) instead."""
        raise NotImplementedError(f"{type(self).__name__} implements neither _enqueue nor post")

    def _entry_streams(self, p: Prepared) -> list[Stream]:
        """The streams the initiator's work starts on (gated when armed); the rest depends on them."""
        return [self.stream]

    def arm(self, p: Prepared) -> None:
        """Untimed, on both sides, before the start barrier.

        The passive side posts its part (which waits for flags the initiator's work
        sets); an armed initiator (``Side.armed`` and ``armable``) enqueues its whole
        transfer behind the gate, so that :meth:`post` only fires it.
        """
        self.side.check()
        p.gate = None
        if not p.active:
            return
        if not p.initiator:
            self.post(p)
            return
        if self.side.armed and self.armable:
            p.gate = self.side.gate.next()
            for s in self._entry_streams(p):
                self.side.gate.wait(s, p.gate)
            self._enqueue(p)

    def post(self, p: Prepared) -> None:
        """On the initiator, timed: fire the armed transfer, or enqueue it now. On the passive side
        (called by :meth:`arm`): enqueue its flag-gated part."""
        self.side.check()
        if not p.active:
            return
        if p.gate is not None:
            self.side.gate.trigger(p.gate)
        else:
            self._enqueue(p)

    def row_extra(self) -> dict:
        """Engine-specific fields for the row just measured (e.g. a library's own telemetry)."""
        return {}

    def wait(self, p: Prepared) -> None:
        """Block until this side's part of ``p`` is done (the initiator: until the data has landed).
        Past ``timeout_s`` the side fails (see the module docstring) and :class:`TransferTimeout` is raised."""
        self.side.check()
        if p.active and p.done is not None:
            try:
                wait_event(self.platform, p.done, self.side.timeout_s, rank=self.side.rank,
                           what=f"{self.name} {p.direction} burst of {p.burst.batch} request(s)")
            except TransferTimeout as exc:
                self.side.fail(exc)
                raise

    def release(self, p: Prepared) -> None:
        p.state = None
        p.done = None
        p.released = True

    def abort(self) -> None:
        """Failure path: release whatever this side's streams wait for (best effort)."""

    # -- lifetime (close(), closed and the context manager come from Closable)
    def _release(self) -> None:
        """Free what the engine owns (streams belong to the side)."""

    def _pool_limits(self) -> tuple[int | None, int | None]:
        """(source pool bytes, destination pool bytes) that every descriptor must lie inside (None: unknown)."""
        src, dst = self.side.src_mem, self.side.dst_mem
        return (None if src is None else int(src.nbytes), None if dst is None else int(dst.nbytes))

    def _new_prepared(self, burst: Burst, direction: str, *, active: bool | None = None) -> Prepared:
        """The start of every :meth:`prepare`: checks the direction and every descriptor's bounds
        (on both sides, active or not), so no engine moves a byte of a hostile burst."""
        check_direction(direction)
        if self._closed:
            raise BadInput(f"engine {self.name} is closed")
        self.side.check()
        if not isinstance(burst, Burst):
            raise BadInput(f"{self.name}: prepare takes a gpuxfer.kv.engines.Burst, got {type(burst).__name__}")
        burst.check_bounds(*self._pool_limits())
        ini = self.is_initiator(direction)
        return Prepared(self.name, direction, burst, active=ini if active is None else active, initiator=ini)


# ----------------------------------------------------------------------------- triton


class TritonEngine(Engine):
    name = "triton"
    needs_peer_mapping = True
    launches_kernels = True
    armable = True
    description = "descriptor-copy Triton kernel on the initiating GPU (pull reads the peer pool, push writes it)"
    uses_sms = "initiating GPU"

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        return _kernel_reason(platform)

    def __init__(self, side: Side):
        super().__init__(side)
        self._src_t = None
        self._dst_t = None

    def _views(self):
        if self._src_t is None:
            self._src_t = self.platform.as_tensor(self.side.src_mem)
            self._dst_t = self.platform.as_tensor(self.side.dst_mem)
        return self._src_t, self._dst_t

    def prepare(self, burst: Burst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction)
        if not p.active:
            return p
        src_t, dst_t = self._views()
        k = _kernels()
        tables = []
        for rows in _size_classes(burst.concatenated(), _order_col(direction)):
            t = _device_table(self.side, src_t, rows)
            hint = int(rows[0, 2])
            # whole row groups per program (see PackEngine._programs): no column slicing
            cfg = k.choose_config(hint)
            progs = max(1, min(k.default_programs(src_t.device, cfg), -(-rows.shape[0] // cfg.rows)))
            tables.append((t, hint, progs))
        _sync_uploads(self.side)
        for t, _, _ in tables:       # every descriptor inside both pools (one host sync each; prep time)
            k.check_copy(src_t, dst_t, t)
        p.state = tables
        return p

    def _enqueue(self, p: Prepared) -> None:
        src_t, dst_t = self._views()
        copy = _kernels().copy_descriptors
        for desc_t, hint, progs in p.state:
            self.platform.launch(self.stream, _bind(copy, src_t, dst_t, desc_t, validate=False, nbytes_hint=hint,
                                                    num_programs=progs))
        p.done = self.platform.record_event(self.stream)

    def _release(self) -> None:
        self._src_t = self._dst_t = None


def _order_col(direction: str) -> int | None:
    """The descriptor column the triton engine sorts by (0 = source offsets, 1 = destination), or None."""
    order = config.get("GPUXFER_KV_TRITON_ORDER")
    if order == "plan":
        return None
    peer = 0 if direction == "pull" else 1       # pull reads the peer's source pool; push writes its destination
    return peer if order == "peer" else 1 - peer


def _size_classes(plan: np.ndarray, sort_col: int | None = None) -> list[np.ndarray]:
    """A burst's descriptors split by size, one table per size.

    A request mixes sizes (kv-dsv4 at 16-token pages: 2,304 B compressed entries, 528 B indexer
    entries, 9,216 B window pages); one launch per size lets the kernel pick the tiling for
    that size instead of tiling every descriptor for the largest. Within a class descriptors
    keep their order, or are sorted by column ``sort_col`` (the peer pool's offsets), so that
    programs running at the same time touch neighbouring pages of the peer pool rather than
    pages scattered over all of it. Order does not matter: the descriptors of a burst never
    overlap on the destination.
    """
    if plan.shape[0] == 0:
        return []
    sizes = plan[:, 2]
    order = np.argsort(sizes, kind="stable")
    sorted_sizes = sizes[order]
    cuts = np.flatnonzero(np.diff(sorted_sizes)) + 1
    classes = [plan[idx] for idx in np.split(order, cuts)]
    if sort_col is not None:
        classes = [c[np.argsort(c[:, sort_col], kind="stable")] for c in classes]
    return classes


def _bind(fn, *args, **kwargs):
    def call():
        return fn(*args, **kwargs)
    call.__name__ = getattr(fn, "__name__", "kernel")
    return call


def _kernel_reason(platform: Platform) -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a reason, not a crash
        return f"triton is not importable: {type(exc).__name__}: {exc}"
    try:
        importlib.import_module("gpuxfer.kernels")
    except Exception as exc:  # noqa: BLE001
        return f"gpuxfer.kernels is not importable: {type(exc).__name__}: {exc}"
    return None


# ----------------------------------------------------------------------------- copy engines


class CopyEngineEngine(Engine):
    name = "copy_engine"
    needs_peer_mapping = True
    # Not armed: a burst is up to 140k copies, far more commands than a stream's queue holds while it
    # is blocked on the gate -- the host would block enqueueing, before the trigger. Its posting is
    # timed (host mode), which is also what a copy-engine connector pays.
    armable = False
    description = ("copy_batch_async (cuMemcpyBatchAsync) over every descriptor on a created stream, no SM; "
                   "a fixed cost per descriptor")
    uses_sms = "none"

    def shed_reason(self, shape: BurstShape) -> str | None:
        cap = self.options.copy_engine_max_descs
        if shape.descriptors > cap:
            return (f"copy_engine is capped at {cap:,} descriptors per burst (this burst has {shape.descriptors:,}; "
                    f"at ~1 us per descriptor it would take ~{shape.descriptors * 1e-6:.1f} s); raise "
                    f"--copy-engine-max-descs to measure it")
        return None

    def prepare(self, burst: Burst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction)
        if not p.active:
            return p
        d = burst.concatenated()
        srcs = d[:, 0] + np.int64(self.side.src_mem.ptr)
        dsts = d[:, 1] + np.int64(self.side.dst_mem.ptr)
        sizes = np.ascontiguousarray(d[:, 2])
        step = self.options.copy_batch_descs
        p.state = [(np.ascontiguousarray(dsts[i:i + step]), np.ascontiguousarray(srcs[i:i + step]),
                    sizes[i:i + step]) for i in range(0, len(sizes), step)]
        return p

    def _enqueue(self, p: Prepared) -> None:
        for dsts, srcs, sizes in p.state:
            self.platform.copy_batch_async(self.stream, dsts, srcs, sizes)
        p.done = self.platform.record_event(self.stream)


class BulkEngine(Engine):
    name = "bulk"
    needs_peer_mapping = True
    armable = True
    description = "one copy-engine descriptor of the burst's total bytes: the ceiling"
    uses_sms = "none"
    ceiling = True

    def prepare(self, burst: Burst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction)
        n = burst.nbytes                  # every size is checked positive and at most a pool's
        limit = min(self.side.src_mem.nbytes, self.side.dst_mem.nbytes)
        if n > limit:
            raise BadInput(f"bulk: the burst's {n} bytes do not fit the {limit}-byte pools")
        p.state = n
        return p

    def _enqueue(self, p: Prepared) -> None:
        self.platform.copy_async(self.stream, self.side.dst_mem.ptr, self.side.src_mem.ptr, p.state)
        p.done = self.platform.record_event(self.stream)

    def verify_descriptors(self, burst: Burst) -> np.ndarray:
        return contiguous_descriptors(burst.nbytes, self.options.verify_chunk_bytes)


def contiguous_descriptors(nbytes: int, piece: int) -> np.ndarray:
    """``[0, nbytes)`` of the source onto ``[0, nbytes)`` of the destination, in pieces of at most ``piece``."""
    starts = np.arange(0, int(nbytes), int(piece), dtype=np.int64)
    sizes = np.minimum(int(piece), int(nbytes) - starts)
    return np.stack([starts, starts, sizes], axis=1).reshape(-1, 3)


# ----------------------------------------------------------------------------- pack


def split_large(desc: np.ndarray, max_bytes: int) -> np.ndarray:
    """Split every descriptor longer than ``max_bytes`` into pieces of at most ``max_bytes`` (order kept)."""
    d = as_descriptors(desc)
    n = d[:, 2]
    if d.shape[0] == 0 or int(n.max()) <= max_bytes:
        return d
    pieces = np.maximum(1, -(-n // max_bytes))
    idx = np.repeat(np.arange(d.shape[0]), pieces)
    first = np.cumsum(pieces) - pieces
    k = np.arange(idx.size) - np.repeat(first, pieces)           # piece number within its descriptor
    off = k * max_bytes
    out = np.empty((idx.size, 3), dtype=np.int64)
    out[:, 0] = d[idx, 0] + off
    out[:, 1] = d[idx, 1] + off
    out[:, 2] = np.minimum(max_bytes, n[idx] - off)
    return out


def chunk_plan(desc: np.ndarray, chunk_bytes: int, first_chunk_bytes: int) -> list[tuple[int, int, int]]:
    """Cut ``desc`` (no descriptor longer than ``chunk_bytes``) into chunks at descriptor boundaries.

    Chunk sizes ramp up from ``first_chunk_bytes``, doubling, to ``chunk_bytes``, and
    ramp down again at the end (each at most half of what is left, never below
    ``first_chunk_bytes``): the first pack and the last unpack -- the pipeline's
    fill and drain, which nothing overlaps -- stay small. Returns ``(start, stop,
    nbytes)`` descriptor ranges.
    """
    n = desc[:, 2]
    cum = np.concatenate([[0], np.cumsum(n, dtype=np.int64)])
    total = int(cum[-1])
    out = []
    start, head = 0, int(first_chunk_bytes)
    nd = desc.shape[0]
    while start < nd:
        left = total - int(cum[start])
        target = min(head, chunk_bytes, max(int(first_chunk_bytes), left // 2))
        limit = int(cum[start]) + target
        stop = int(np.searchsorted(cum, limit, side="right")) - 1
        stop = min(max(stop, start + 1), nd)
        out.append((start, stop, int(cum[stop] - cum[start])))
        start = stop
        head = min(head * 2, chunk_bytes)
    assert sum(c[2] for c in out) == total
    return out


# control words of the pack engine (8 bytes each, in a small buffer on each side)
_GO = 0            # on the source: burst number the destination asked for (pull)
_AVAIL = 8         # on the destination: per lane, chunks available (push: landed; pull: packed)
_FREE = 24         # on the source: per lane, chunks released (push: unpacked; pull: copied out)
_SCRATCH = 40      # on either side: the value a flag copy sends: lanes 0..7, kernel stream 8, GO 9
_PROBE = 56        # on either side: the peer's set-up remote write lands here
_CTRL_WORDS = 64
_PROBE_VALUE = 0x5EED_F1A6
_PROBE_TIMEOUT_S = 10.0
ENV_KV_FLAG_PATH = "GPUXFER_KV_FLAG_PATH"
_MAX_LANES = 8


class _FlagLink:
    """A few 64-bit flags in each process's memory, written by the peer; every wait is on local memory.

    A signal reaches the peer's flag by a remote stream write where a set-up
    probe saw one arrive (no copy engine: the signal cannot queue behind
    another stream's chunk copy), else by ``write_flag`` on a local scratch word
    followed, on the same stream, by an 8-byte copy-engine copy of it (CUDA
    13.1+ refuses remote stream writes). ``GPUXFER_KV_FLAG_PATH=remote|copy``
    forces one path; ``path`` says which one this side uses.
    """

    def __init__(self, side: Side):
        want = flag_path_from_env(None, ENV_KV_FLAG_PATH)      # bad input fails here, on both sides alike
        self.side = side
        plat = side.platform
        self.local = plat.alloc(_CTRL_WORDS * 8, side.device)
        self.peer = None
        self.remote = False
        try:
            s = side.stream("setup")
            plat.memset_async(s, self.local.ptr, 0, _CTRL_WORDS * 8)
            if not plat.synchronize(s, side.timeout_s):
                raise TransferTimeout(rank=side.rank, step=0, flag="pack control words (memset)", expected=1,
                                      seen=0, timeout_s=side.timeout_s)
            handles = side.exchange(self.local.export())
            self.peer = plat.open_handle(handles[side.peer_rank], side.device)
            self.remote = self._probe_remote(want)
        except BaseException:
            self.close()
            raise
        side._releasers.append(self.release_waits)     # a failing side releases our waits too

    @property
    def path(self) -> str:
        return "remote stream writes" if self.remote else "8-byte copies"

    def _probe_remote(self, want: str) -> bool:
        """Whether this side's remote stream writes reach the peer: each side writes ``_PROBE_VALUE`` into
        the peer's probe word and reports it sent; each polls its own word and reports it seen."""
        side, plat = self.side, self.side.platform
        sent, why = False, f"{ENV_KV_FLAG_PATH}=copy"
        if want != "copy":
            try:
                s = side.stream("setup")
                plat.write_flag(s, self.peer.ptr + 8 * _PROBE, _PROBE_VALUE)
                if not plat.synchronize(s, _PROBE_TIMEOUT_S):
                    raise TransferTimeout(rank=side.rank, step=0, flag="pack flag probe (remote write)",
                                          expected=_PROBE_VALUE, seen=None, timeout_s=_PROBE_TIMEOUT_S)
                sent = True
            except Exception as exc:  # noqa: BLE001 - the remote path is optional: the probe says so
                why = f"{type(exc).__name__}: {exc}"
                side._streams.pop("setup", None)    # a failed stream op may leave the stream unusable
        seen = False
        if side.exchange(sent)[side.peer_rank]:
            try:    # a write the sender saw complete lands in microseconds
                seen = wait_flag_or_raise(plat, self.word(_PROBE), _PROBE_VALUE, 2.0, rank=side.rank, step=0,
                                          flag="pack flag probe", device=side.device) == _PROBE_VALUE
            except TransferTimeout:
                pass
        reports = side.exchange((seen, None if sent else why))    # rank r: (saw its peer's write, why not sent)
        remote = reports[side.peer_rank][0]
        if want == "remote" and not all(saw for saw, _ in reports):    # every side raises, with every reason
            raise BackendUnavailable("pack", {
                1 - r: f"{ENV_KV_FLAG_PATH}=remote, but its remote stream write did not reach rank {r}"
                       + (f" ({reports[1 - r][1]})" if reports[1 - r][1] else "")
                for r, (saw, _) in enumerate(reports) if not saw})
        if not remote:
            log.info("pack engine, rank %d: flags go to rank %d by 8-byte copies (%s)", side.rank,
                     side.peer_rank, why if not sent else "the peer did not see the remote write")
        return remote

    def word(self, index: int) -> int:
        return self.local.ptr + 8 * index

    def signal(self, stream: Stream, scratch: int, peer_index: int, value: int) -> None:
        """Make the peer's word ``peer_index`` hold ``value`` once earlier work on ``stream`` is done
        (``scratch``: this stream's own staging word on the copy path)."""
        plat = self.side.platform
        if self.remote:
            plat.write_flag(stream, self.peer.ptr + 8 * peer_index, value)
        else:
            plat.write_flag(stream, self.word(_SCRATCH + scratch), value)
            plat.copy_async(stream, self.peer.ptr + 8 * peer_index, self.word(_SCRATCH + scratch), 8)

    def wait(self, stream: Stream, index: int, value: int) -> None:
        if value > 0:
            self.side.platform.wait_flag(stream, self.word(index), value)

    def read(self, index: int) -> int:
        return self.side.platform.read_flag(self.word(index), self.side.device)

    def release_waits(self) -> None:
        """Abort: satisfy every local wait, so no stream of ours stays blocked."""
        for i in range(_SCRATCH):
            try:
                self.side.platform.host_write_flag(self.word(i), RELEASE_VALUE, self.side.device)
            except Exception:  # noqa: BLE001 - best effort on the abort path
                pass

    def close(self) -> None:
        if self.release_waits in self.side._releasers:
            self.side._releasers.remove(self.release_waits)
        for m in (getattr(self, "peer", None), self.local):
            if m is not None:
                m.close()


class _Chunk(NamedTuple):
    k: int                              # chunk number over the engine's life
    slot: int                           # staging slot
    lane: int                           # copy lane
    seq: int                            # its number on that lane (1, 2, ...): the value its flags carry
    before: tuple[int, int] | None      # (lane, seq) of the slot's previous chunk in this burst, if any


class _ChunkSchedule:
    """Which staging slot and copy lane each chunk of the pack engine uses.

    Chunks are counted over the engine's life; both sides build the same schedule
    from the same plans. Chunk ``k`` uses slot ``k % S`` and lane ``k % L``, except a
    burst's last chunk, which takes the lane of the chunk before it: on two lanes, a
    command queued after a chunk copy on one lane (the event that releases its unpack,
    its flag) completes only after the other lane's next copy (measured on 2x H200),
    so a burst ending on alternating lanes drains in two unpacks; with the other lane
    idle at the end, in one. On a lane, flags count that lane's chunks, so a flag only ever
    grows even when lanes finish out of order.
    """

    def __init__(self, nslots: int, nlanes: int):
        self.nslots, self.nlanes = nslots, nlanes
        self.k = 0                          # chunks scheduled so far
        self.burst_first = 0                # the first chunk of the burst being scheduled
        self._lane_seq = [0] * nlanes       # chunks scheduled per lane
        self._lane = 0                      # the lane of the last chunk
        self._slot_user: list[_Chunk | None] = [None] * nslots

    def start_burst(self) -> None:
        self.burst_first = self.k

    def next(self, last: bool) -> _Chunk:
        """The next chunk (``last``: the burst's last). ``before`` is None where the slot is fresh in
        this burst: every earlier burst has completed on both sides before this one is armed."""
        k, slot = self.k, self.k % self.nslots
        self.k += 1
        lane = self._lane if last and k > self.burst_first else k % self.nlanes
        self._lane = lane
        self._lane_seq[lane] += 1
        prev = self._slot_user[slot]
        before = (prev.lane, prev.seq) if prev is not None and prev.k >= self.burst_first else None
        c = self._slot_user[slot] = _Chunk(k, slot, lane, self._lane_seq[lane], before)
        return c


@dataclass
class _PackPlan:
    chunks: list[tuple[int, int, int]]      # (start, stop, nbytes) rows of the (split) descriptor table
    table: Any                              # the table on this side's device
    offsets: Any                            # its pack offsets (exclusive cumsum of sizes)
    configs: dict[int, tuple[Any, int, int]]   # chunk start -> (kernel tiling, programs, programs of a pack
                                               # after the burst's first), from the chunk's sizes


class PackEngine(Engine):
    name = "pack"
    needs_peer_mapping = True
    launches_kernels = True
    armable = True
    description = ("pack on the source, one copy-engine copy per chunk into the destination's staging, unpack "
                   "on the destination; chunked and pipelined, SMs only on local memory")
    uses_sms = "both GPUs, local HBM only"

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        return _kernel_reason(platform)

    def __init__(self, side: Side):
        super().__init__(side)
        o = self.options
        if o.pack_lanes > _MAX_LANES:
            raise BadInput(f"pack_lanes must be <= {_MAX_LANES}, got {o.pack_lanes}")
        plat = self.platform
        self.slot_bytes = o.pack_chunk_bytes
        self.nslots, self.nlanes = o.pack_slots, o.pack_lanes
        self._owned: list[Any] = []
        try:
            self.flags = _FlagLink(side)
            self._owned.append(self.flags)
            self.stage = plat.alloc(self.slot_bytes * self.nslots, side.device)
            self._owned.append(self.stage)
            handles = side.exchange(self.stage.export())
            self.peer_stage = plat.open_handle(handles[side.peer_rank], side.device)
            self._owned.append(self.peer_stage)
        except BaseException:
            self._release()
            raise
        self.kernel_stream = side.stream("pack-kernel")               # pack (source) or unpack (destination)
        self.copy_streams = [side.stream(f"pack-lane{i}") for i in range(self.nlanes)]
        self._stage_t = None
        self._pool_t = None
        self._chunks = _ChunkSchedule(self.nslots, self.nlanes)
        self._bursts = 0            # pull bursts posted so far (the GO flag)
        self._slot_event: list[Event | None] = [None] * self.nslots

    def row_extra(self) -> dict:
        return {"flag_path": self.flags.path}

    def _views(self):
        if self._stage_t is None:
            self._stage_t = self.platform.as_tensor(self.stage)
            self._pool_t = self.platform.as_tensor(self.side.pool)
        return self._stage_t, self._pool_t

    def prepare(self, burst: Burst, direction: str) -> Prepared:
        p = self._new_prepared(burst, direction, active=True)     # both sides work
        d = split_large(burst.concatenated(), self.slot_bytes)
        # Largest descriptors first, each size class together, so that each chunk's kernels get a
        # tiling for its own sizes: tiled for the burst's largest, the 528 B indexer pages at the
        # end of a page-16 burst unpack at 0.36 TB/s, after the last copy (measured on 2x H200).
        d = d[np.argsort(-d[:, 2], kind="stable")]
        chunks = chunk_plan(d, self.slot_bytes, self.options.pack_first_chunk_bytes)
        _, pool_t = self._views()
        configs = {a: self._geometry(pool_t.device, b - a, int(d[a:b, 2].max())) for a, b, _ in chunks}
        table = _device_table(self.side, pool_t, d)
        offsets = _kernels().pack_offsets(table)
        _sync_uploads(self.side)
        p.state = _PackPlan(chunks, table, offsets, configs)
        return p

    @staticmethod
    def _geometry(device, rows: int, largest: int) -> tuple[Any, int, int]:
        """The tiling for a chunk's largest descriptor; at most one program per group of rows: a
        chunk with fewer row groups than the default grid would split its descriptors' columns across
        programs (``slices`` > 1), and that path gives wrong bytes in pack/unpack on H200 (36 KiB
        pages); whole groups per program stay exact. The tiling is passed to the launcher, so
        the groups counted here are the ones it runs.

        And the grid of a pack after a burst's first: one program per two SMs. Those packs run beside
        earlier chunks' copies, off the critical path, and on every SM they take HBM from the copies
        (2xH200, ``gpuxfer bench kv``: 0.4-1.4 points of the ceiling at batches 1-64; the contention
        itself: scripts/ce_overlap_probe.py)."""
        k = _kernels()
        cfg = k.choose_config(largest, local=True)
        full, groups = k.default_programs(device, cfg), -(-rows // cfg.rows)
        return cfg, max(1, min(full, groups)), max(1, min(full // cfg.programs_per_sm // 2, groups))

    def _pack(self, stream: Stream, plan: _PackPlan, a: int, b: int, slot: int) -> None:
        stage_t, pool_t = self._views()
        cfg, programs, later = plan.configs[a]
        if a != plan.chunks[0][0]:
            programs = later
        self.platform.launch(stream, _bind(_kernels().pack, pool_t, stage_t, plan.table, plan.offsets, start=a,
                                           end=b, staging_offset=slot * self.slot_bytes, validate=False,
                                           config=cfg, num_programs=programs))

    def _unpack(self, stream: Stream, plan: _PackPlan, a: int, b: int, slot: int) -> None:
        stage_t, pool_t = self._views()
        cfg, programs, _ = plan.configs[a]
        self.platform.launch(stream, _bind(_kernels().unpack, stage_t, pool_t, plan.table, plan.offsets, start=a,
                                           end=b, staging_offset=slot * self.slot_bytes, validate=False,
                                           config=cfg, num_programs=programs))

    def _entry_streams(self, p: Prepared) -> list[Stream]:
        # push: the source's pack stream; pull: the destination's lane 0 (it sends GO to the source)
        return [self.kernel_stream if p.direction == "push" else self.copy_streams[0]]

    def _enqueue(self, p: Prepared) -> None:
        plan: _PackPlan = p.state
        source = self.side.role is Role.SOURCE
        self._chunks.start_burst()
        if p.direction == "push":
            (self._post_push_source if source else self._post_push_destination)(plan, p)
        else:
            self._bursts += 1
            (self._post_pull_source if source else self._post_pull_destination)(plan, p)

    def _burst_chunks(self, plan: _PackPlan):
        """``(chunk, a, b, nbytes)`` for each chunk of the burst being enqueued (rows ``a:b`` of the table)."""
        n = len(plan.chunks)
        return [(self._chunks.next(i == n - 1), a, b, nbytes) for i, (a, b, nbytes) in enumerate(plan.chunks)]

    def _wait_slot_free(self, stream: Stream, c: _Chunk) -> None:
        """``stream`` waits until the peer released the slot's previous chunk in this burst, if any."""
        if c.before is not None:
            self.flags.wait(stream, _FREE + c.before[0], c.before[1])

    def _slot_busy(self, c: _Chunk) -> Event | None:
        """The local event after which this side may reuse ``c``'s slot (None: fresh in this burst)."""
        return self._slot_event[c.slot] if c.before is not None else None

    def _copy_chunk(self, stream: Stream, slot: int, nbytes: int, *, pull: bool) -> None:
        off = slot * self.slot_bytes
        if pull:   # destination reads the source's slot into its own
            self.platform.copy_async(stream, self.stage.ptr + off, self.peer_stage.ptr + off, nbytes)
        else:      # source writes its slot into the destination's
            self.platform.copy_async(stream, self.peer_stage.ptr + off, self.stage.ptr + off, nbytes)

    def _post_push_source(self, plan: _PackPlan, p: Prepared) -> None:
        plat, fl = self.platform, self.flags
        last = None
        for c, a, b, nbytes in self._burst_chunks(plan):
            busy = self._slot_busy(c)
            if busy is not None:                         # our copy of the slot's previous chunk is done
                plat.stream_wait_event(self.kernel_stream, busy)
            self._pack(self.kernel_stream, plan, a, b, c.slot)
            packed = plat.record_event(self.kernel_stream)
            cs = self.copy_streams[c.lane]
            plat.stream_wait_event(cs, packed)
            self._wait_slot_free(cs, c)                  # the destination unpacked the slot's previous chunk
            self._copy_chunk(cs, c.slot, nbytes, pull=False)
            fl.signal(cs, c.lane, _AVAIL + c.lane, c.seq)
            self._slot_event[c.slot] = plat.record_event(cs)
            last = (cs, c)
        if last is None:
            p.done = plat.record_event(self.kernel_stream)
            return
        cs, c = last                                     # the last chunk is unpacked: all are
        fl.wait(cs, _FREE + c.lane, c.seq)
        p.done = plat.record_event(cs)

    def _post_push_destination(self, plan: _PackPlan, p: Prepared) -> None:
        plat, fl = self.platform, self.flags
        ks = self.kernel_stream
        for c, a, b, nbytes in self._burst_chunks(plan):
            fl.wait(ks, _AVAIL + c.lane, c.seq)
            self._unpack(ks, plan, a, b, c.slot)
            fl.signal(ks, _MAX_LANES, _FREE + c.lane, c.seq)
        p.done = plat.record_event(ks)

    def _post_pull_source(self, plan: _PackPlan, p: Prepared) -> None:
        plat, fl = self.platform, self.flags
        ks = self.kernel_stream
        fl.wait(ks, _GO, self._bursts)                    # nothing runs before the destination starts its timer
        for c, a, b, nbytes in self._burst_chunks(plan):
            self._wait_slot_free(ks, c)                   # the destination copied the slot's previous chunk out
            self._pack(ks, plan, a, b, c.slot)
            fl.signal(ks, _MAX_LANES, _AVAIL + c.lane, c.seq)
        p.done = plat.record_event(ks)

    def _post_pull_destination(self, plan: _PackPlan, p: Prepared) -> None:
        plat, fl = self.platform, self.flags
        ks = self.kernel_stream
        fl.signal(self.copy_streams[0], _MAX_LANES + 1, _GO, self._bursts)
        for c, a, b, nbytes in self._burst_chunks(plan):
            cs = self.copy_streams[c.lane]
            fl.wait(cs, _AVAIL + c.lane, c.seq)           # packed on the source
            busy = self._slot_busy(c)
            if busy is not None:                          # our unpack of the slot's previous chunk is done
                plat.stream_wait_event(cs, busy)
            self._copy_chunk(cs, c.slot, nbytes, pull=True)
            fl.signal(cs, c.lane, _FREE + c.lane, c.seq)
            landed = plat.record_event(cs)
            plat.stream_wait_event(ks, landed)
            self._unpack(ks, plan, a, b, c.slot)
            self._slot_event[c.slot] = plat.record_event(ks)
        p.done = plat.record_event(ks)

    def _release(self) -> None:
        self._stage_t = self._pool_t = None
        for r in reversed(getattr(self, "_owned", [])):
            try:
                r.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing
                log.warning("pack engine: closing %r failed: %s", r, exc)
        self._owned = []


# ----------------------------------------------------------------------------- the registry

#: name -> "module:Class"; built-ins first, in the order rows are measured (bulk first: the ceiling)
ENGINES: dict[str, str | type] = {
    "bulk": "gpuxfer.kv.engines:BulkEngine",
    "triton": "gpuxfer.kv.agent_engine:AgentTritonEngine",
    "pack-api": "gpuxfer.kv.agent_engine:AgentPackEngine",
    "pack": "gpuxfer.kv.engines:PackEngine",
    "copy_engine": "gpuxfer.kv.engines:CopyEngineEngine",
    # optional libraries (imported only when the engine is built; engine_report says why one cannot run)
    "nixl": "gpuxfer.kv.nixl_engine:NixlEngine",
    "nixl-bulk": "gpuxfer.kv.nixl_engine:NixlBulkEngine",
    "nixl-oneshot": "gpuxfer.kv.nixl_engine:NixlOneshotEngine",
    "nixl+pack": "gpuxfer.kv.nixl_engine:NixlPackEngine",
    "mooncake": "gpuxfer.kv.mooncake_engine:MooncakeEngine",
    "mooncake-rdma": "gpuxfer.kv.mooncake_engine:MooncakeRdmaEngine",
    "amd-mori": "gpuxfer.kv.mori_engine:MoriEngine",
}
#: the engines a default sweep measures
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


__all__ = ["DIRECTIONS", "DEFAULT_ENGINES", "ENGINES", "Burst", "BurstShape", "BulkEngine", "CopyEngineEngine", "Engine",
           "CROSS_HOST_PEER_MAPPING",
           "EngineOptions", "PackEngine", "Prepared", "Role", "Side", "TritonEngine", "as_descriptors",
           "check_direction", "chunk_plan", "contiguous_descriptors", "engine_class", "engine_report",
           "engine_unavailable_reason", "initiator_of", "measurement_order", "parse_engines", "register_engine",
           "split_large", "wait_event", "Gate", "FailsOnTimeout", "EXIT_CODE", "ENV_KV_ON_TIMEOUT", "on_timeout_from_env"]
