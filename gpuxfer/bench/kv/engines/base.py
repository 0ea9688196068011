"""The KV engine interface: the two sides, a burst of descriptors, the transfer record, the gate, waits.

An *engine* moves a *burst* (:class:`DescriptorBurst`: the requests of one batch; each
request an int64 ``(N, 3)`` table of ``(src_offset, dst_offset, nbytes)`` into the
source and destination pools) from the prefill side's pool to the decode side's pool.
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
    fail: gate, GO/AVAIL/FREE :=        lane 0: released, drains
      RELEASE_VALUE
    raise TransferTimeout               (no stream of the side waits any more)
    prepare/arm/post/wait: raise it
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import numpy as np

from ....errors import EXIT_CODE, BackendUnavailable, BadInput, TransferTimeout
from ....flaglink import FIRST_WORD, FlagWords
from ....platforms.base import Closable, DeviceBuffer, Event, Memory, PeerMapping, Platform, Stream
from ....sync import SPIN_S, wait_event_or_raise
from ....kv.descriptors import DIRECTIONS, as_descriptors, check_bounds
from ....kv.failure import ENV_KV_ON_TIMEOUT, FailsOnTimeout, on_timeout_from_env

#: why an engine with ``needs_peer_mapping`` cannot run when the ranks are on different hosts
CROSS_HOST_PEER_MAPPING = "needs the peer pool mapped over IPC; the ranks are on different hosts"


class Role(str, enum.Enum):
    """Which pool a process holds."""

    SOURCE = "source"             # the prefill side
    DESTINATION = "destination"   # the decode side

    @property
    def serving_name(self) -> str:
        return "prefill" if self is Role.SOURCE else "decode"


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
    _releasers: list = field(default_factory=list, repr=False)       # the engines' releases of their flag words

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
        for name in ("engine", "gate-trigger", "pack-kernel",
                     *(f"pack-lane{i}" for i in range(self.options.pack_lanes))):
            self.stream(name)
        _ = self.gate

    @property
    def gate(self) -> "Gate":
        if self._gate is None:
            self._gate = Gate(self)
        return self._gate

    def on_release(self, release: Callable[[], None]) -> None:
        """Have :meth:`release_waits` (the failure path) call ``release`` too: an engine's own flag words."""
        self._releasers.append(release)

    def forget_release(self, release: Callable[[], None]) -> None:
        if release in self._releasers:
            self._releasers.remove(release)

    def release_waits(self) -> None:
        """Abort path: satisfy the gate and every engine's flag words, so no stream of ours stays blocked."""
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


class BurstShape(NamedTuple):
    """What a cap needs to know about a burst, without materialising it."""

    batch: int
    descriptors: int
    nbytes: int


class DescriptorBurst:
    """The descriptors of one batch's requests, posted together and awaited together.

    ``requests[r]`` is request r's ``(N_r, 3)`` table; ``plan`` (optional) is their
    concatenation when the caller already has it (e.g. :class:`gpuxfer.bench.kv.model.plan.Burst`'s
    ``plan``, whose ``requests`` are views into it).

    The burst holds its own read-only copy of the descriptors (``requests`` are views
    into it): what :meth:`check_bounds` checked is what every engine moves, whatever the
    caller does to its arrays afterwards.
    """

    def __init__(self, requests: Sequence[np.ndarray], plan: np.ndarray | None = None, source=None):
        #: the :class:`~gpuxfer.bench.kv.model.plan.Burst` (layouts, seeded block tables) these descriptors come
        #: from, if any: engines that move blocks by ID (``triton``, through the KV API) need it
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
    def from_plan(cls, plan_burst) -> "DescriptorBurst":
        """From a :class:`gpuxfer.bench.kv.model.plan.Burst`."""
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
        :func:`gpuxfer.kv.descriptors.check_bounds` (overflow-safe). Checked once per pair of sizes (the
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
    burst: DescriptorBurst
    active: bool                 # this side posts work for this burst
    initiator: bool              # this side times the burst
    state: Any = None
    done: Event | None = None
    gate: int | None = None      # the gate value this burst's armed work waits for (None: not armed)
    released: bool = False


# ----------------------------------------------------------------------------- waiting


class Gate:
    """A 64-bit flag in this process's device memory (a :class:`~gpuxfer.flaglink.FlagWords` of one word) that
    armed work waits on; posting writes it.

    Values only grow (one per armed burst of the process). The trigger is a stream
    write on a stream that never waits for anything, so it cannot be held up.
    """

    def __init__(self, side: "Side"):
        self.side = side
        self.words = FlagWords(side.platform, side.device, 1, rank=side.rank, name="gate", timeout_s=side.timeout_s)
        self.value = 0

    def next(self) -> int:
        self.value += 1
        return self.value

    def wait(self, stream: Stream, value: int) -> None:
        self.words.wait(stream, FIRST_WORD, value)

    def trigger(self, value: int) -> None:
        self.words.write(self.side.stream("gate-trigger"), FIRST_WORD, value)

    def release_waits(self) -> None:
        self.words.release([FIRST_WORD])

    def close(self) -> None:
        self.words.close()



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

    def verify_descriptors(self, burst: DescriptorBurst) -> np.ndarray:
        """The descriptors whose destination bytes the verifier checks after this engine's transfer."""
        return burst.concatenated()

    # -- the burst protocol
    @abc.abstractmethod
    def prepare(self, burst: DescriptorBurst, direction: str) -> Prepared:
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
                wait_event_or_raise(self.platform, p.done, self.side.timeout_s, rank=self.side.rank, spin_s=SPIN_S,
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

    def _new_prepared(self, burst: DescriptorBurst, direction: str, *, active: bool | None = None) -> Prepared:
        """The start of every :meth:`prepare`: checks the direction and every descriptor's bounds
        (on both sides, active or not), so no engine moves a byte of a hostile burst."""
        check_direction(direction)
        if self._closed:
            raise BadInput(f"engine {self.name} is closed")
        self.side.check()
        if not isinstance(burst, DescriptorBurst):
            raise BadInput(f"{self.name}: prepare takes a gpuxfer.bench.kv.engines.DescriptorBurst, "
                           f"got {type(burst).__name__}")
        burst.check_bounds(*self._pool_limits())
        ini = self.is_initiator(direction)
        return Prepared(self.name, direction, burst, active=ini if active is None else active, initiator=ini)
