"""The stage hand-off interface every backend implements.

A :class:`Transport` connects ONE sending rank to ONE receiving rank (pairs, not
a chain): rank ``i`` of stage ``s`` hands its outputs to rank ``i`` of stage
``s + 1``, and a middle stage holds two transports (receive from the previous
stage, send to the next). Transports are made collectively by
:func:`gpuxfer.pp.selection.connect`; this module holds what every backend
shares, with what it builds on (:mod:`~gpuxfer.pp.spec`, :mod:`~gpuxfer.pp.channel`,
:mod:`~gpuxfer.pp.watchdog`):

* :class:`~gpuxfer.pp.spec.SpecTable` -- the tensors to expect (name -> largest shape, dtype),
  validation of what the caller passes (before any GPU work and before metadata
  goes out), the packed layout of one step (offsets aligned to 256 bytes, cached
  per shape tuple) and the per-step metadata message (shapes only: keys and
  dtypes are fixed by the spec).
* :class:`Received` -- a deferred receive: ``recv()`` returns at once (after the
  metadata, if metadata travels); the first access to ``.tensors`` queues the
  GPU-side wait and the copy-out on the caller's current stream. Nothing waits
  before that, so the receiver's input preparation overlaps the transfer.
* :class:`~gpuxfer.pp.channel.CpuChannel` -- tagged point-to-point metadata messages over the CPU
  (gloo) group, unless the pair shares a host, where a shared-memory
  :class:`~gpuxfer.pp.mailbox.Mailbox` carries them (``Transport.meta``).
* :class:`~gpuxfer.pp.channel.PairSignals` -- keys in the process group's store (never a gloo
  collective: a timed gloo wait closes the pair for good, and the caller's group
  with it): the bounded pair barriers of teardown, and a "gone" note each end
  leaves when it fails, aborts or closes, which the peer's watchdog reads.
* the watchdog (:data:`~gpuxfer.pp.watchdog.WATCHDOG`) -- one daemon thread per process, off the transfer path, that
  polls what each transport's streams wait on (flag words, NCCL work objects)
  and turns a wait older than ``timeout_s`` (or a wait on a peer that left a
  "gone" note) into :class:`TransferTimeout` / :class:`PeerLost`.
* failure (:meth:`Transport._fail`) -- the first error that breaks a
  transport (a timeout, a lost peer, a stream error, bad peer metadata) is
  stored and raised by every later call; the GPU-side waits the transport
  queued (on its own streams and on the caller's) are released at once, so no
  host call in the process blocks behind them (the data they guard is then
  garbage: steps that did not complete are never handed out); the peer is told
  through the store. ``on_timeout="exit"`` (or ``GPUXFER_PP_ON_TIMEOUT=exit``)
  instead logs every transport's rank, step and pending flag and ends the
  process with :data:`~gpuxfer.errors.EXIT_CODE`, like torch's NCCL async error handling.
* :func:`~gpuxfer.pp.watchdog.close_all` -- teardown in a safe order for any set of transports,
  bounded by ``timeout_s`` + a few seconds whatever the peers do: release the
  waits of failed ends, drain own streams, pair barrier, close peer mappings,
  pair barrier, free buffers.

Failure, timeline (a receiver killed at step 50, inline steps, R = 2)::

    sender main thread            sender current stream      watchdog thread
    ------------------            ---------------------      ---------------
    send(52): queue wait
      empty[1] >= 50  ------->    waits (never written)
    host work: .item() ...        (blocked)                  t = timeout_s: wait too old
      (blocked behind the                                    -> _fail: error stored,
       stream)                                                  empty[*] := RELEASE,
                                  wait passes, copies run       note "gone" in the store
      returns                     (data: garbage)
    send(53) -> raises TransferTimeout
    close(): drain, barrier (peer gone: bounded), free what no peer maps

How a sender's bad input stays consistent with its receiver: the sender
validates first; if the input is refused and metadata travels, the sender sends
a *refusal* message for that step instead of shapes, and both sides raise
:class:`BadInput` without advancing their step counters (both can carry on).
Without metadata (``metadata=False``: the receiver passes ``recv(shapes=...)``)
nothing reaches the receiver; its wait for that step then ends in
:class:`TransferTimeout` unless the sender retries with valid input.
"""
from __future__ import annotations

import abc
import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence

from ..errors import BadInput, GpuxferError, PeerLost, ProtocolError, TransferTimeout
from .mailbox import MailboxTimeout
from .channel import CpuChannel, PairSignals
from .spec import Layout, Refusal, SpecTable
from .timeouts import ENV_ON_TIMEOUT, ENV_TIMEOUT, resolve_on_timeout, resolve_timeout  # noqa: F401 - re-exported
from .watchdog import close_all, exit_process

log = logging.getLogger("gpuxfer.pp")


def torch_is_stream_ordered(platform) -> bool:
    """Whether torch work on this platform's tensors is ordered on its streams.

    True on GPUs. On the host emulation torch runs on the calling thread, so the
    transport waits (bounded) for its own stream work before handing tensors to
    the caller -- the emulation's stand-in for stream order.
    """
    return not platform.host_memory


def _read_once(tensors: Mapping) -> dict:
    """A mapping's items in a dict of their own, or the :class:`Refusal` of a mapping that cannot be read."""
    try:
        return dict(tensors)
    except Exception as exc:  # noqa: BLE001 - the caller's mapping: any error is its refusal
        raise Refusal(1, -1, f"send() could not read the mapping it was given: {type(exc).__name__}: {exc}") from None


# --------------------------------------------------------------------------- received


class Received:
    """One step's tensors, received lazily.

    The first access to :attr:`tensors` queues the GPU-side wait and the copy-out
    on the caller's current stream (and returns without waiting on a GPU; on the
    host emulation it waits, bounded, since torch runs on the calling thread).
    Receives are materialized in step order: touching step k queues every
    earlier step not touched yet.
    """

    __slots__ = ("_transport", "step", "layout", "out", "_tensors", "_state", "__weakref__")

    def __init__(self, transport: "Transport", step: int, layout: Layout, out):
        self._transport, self.step, self.layout, self.out = transport, step, layout, out
        self._tensors: dict | None = None
        self._state = None     # backend-specific (NCCL work and buffer)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(zip(self._transport.specs.names, self.layout.shapes))

    @property
    def nbytes(self) -> int:
        return self.layout.total

    @property
    def tensors(self) -> dict:
        if self._tensors is None:
            self._transport._materialize(self)
        return self._tensors

    def wait(self) -> dict:
        """Same as :attr:`tensors`."""
        return self.tensors

    @property
    def queued(self) -> bool:
        """Whether the wait and copy-out have been queued."""
        return self._tensors is not None

    def __repr__(self) -> str:
        return (f"Received(step {self.step} from rank {self._transport.peer}, {self.layout.total} B, "
                f"{'queued' if self.queued else 'deferred'})")


# --------------------------------------------------------------------------- transport


class Transport(abc.ABC):
    """One end of a pair: ``role`` is ``"send"`` (only :meth:`send`) or ``"recv"`` (only :meth:`recv`).

    Made by :func:`gpuxfer.pp.selection.connect`. Attributes: ``name`` (the
    backend), ``rank`` and ``peer`` (global ranks), ``device``, ``specs``,
    ``timeout_s``, ``metadata`` (whether shapes travel per step), ``step`` (steps
    done), :attr:`allocated_bytes` (device bytes this end owns), ``on_timeout``
    (``raise`` | ``exit``: what a failure does, see :meth:`_fail`).

    Any thread may call it: each public call holds the end's call lock, so calls go one at a time;
    :meth:`close` and :meth:`abort` from another thread end a waiting call with a typed error and
    free nothing under it (:func:`~gpuxfer.pp.watchdog.close_all`).
    """

    name = "abstract"
    watch_after_error = False    # whether the watchdog keeps calling _watch once the transport is broken
    max_pending: int | None = None     # most receives left deferred at once, >= 1 (None: no limit)
    release_again = False    # whether a failed end re-releases its waits while open (a live peer may
                             # still write smaller step numbers over the release value)

    def __init__(self, *, platform, role: str, rank: int, peer: int, device: int, specs: SpecTable,
                 timeout_s: float, metadata: bool, group, tag_base: int, torch_device, on_timeout: str = "raise",
                 signals: "PairSignals | None" = None):
        if role not in ("send", "recv"):
            raise BadInput(f"role must be 'send' or 'recv', got {role!r}")
        self.platform, self.role, self.rank, self.peer, self.device = platform, role, rank, peer, device
        self.specs, self.timeout_s, self.metadata = specs, timeout_s, metadata
        self.on_timeout = resolve_on_timeout(on_timeout)
        self.signals = signals               # set by connect: barriers and "gone" notes in the store
        self.group, self.tag_base, self.torch_device = group, tag_base, torch_device
        self._gpu_index = None if torch_device.type == "cpu" else (torch_device.index or 0)   # send()'s fast checks
        self.channel = CpuChannel(group, peer, tag_base, specs.meta_len)
        self.meta = self.channel             # per-step metadata: this channel, or a Mailbox (set by connect)
        self.step = 0
        self._error: BaseException | None = None
        self._state = "setup"            # setup -> open -> (closed | aborted)
        self._pending: collections.deque[Received] = collections.deque()
        self._host_sync = not torch_is_stream_ordered(platform)
        self._wd: collections.deque = collections.deque()    # watchdog entries, appended on the hot path
        self._wd_lock = threading.Lock()
        self._fail_lock = threading.Lock()
        self._call_lock = threading.Lock()    # held by each public call (send, recv, .tensors, synchronize)
                                              # and by teardown: calls from several threads go one at a time
        self._waiting_since: float | None = None   # a host wait (metadata) in progress: the watchdog reads
        self._gone_checked = 0.0                    # the peer's "gone" note meanwhile

    # ---- public ----
    @property
    def allocated_bytes(self) -> int:
        """Device bytes this end owns (send ring / staging, receive slots, flags); 0 once freed."""
        return self._allocated()

    @property
    def closed(self) -> bool:
        return self._state in ("closed", "aborted")

    @property
    def error(self) -> BaseException | None:
        """The error that broke this transport (a watchdog timeout...), if any."""
        return self._error

    def check(self) -> None:
        """Raise the error that broke this transport, if any.

        On a GPU, ``.tensors`` returns before its data lands; a failure found later
        releases the step's wait and leaves its data garbage. After a host sync with
        the stream (``.item()``, ``.cpu()``, ``synchronize()``), ``check()`` tells
        whether the steps consumed so far were whole.
        """
        if self._error is not None:
            raise self._error

    def send(self, tensors: Mapping[str, object]) -> None:
        """Hand ``tensors`` (the spec's keys, dtypes, shapes up to the largest) to the peer.

        Returns once the work is queued: the caller may overwrite its tensors at
        once (they are read by copies queued on the current stream -- into a send
        ring slot, or for a small ``copy_engine`` step straight into the peer's
        slot -- so later work on that stream comes after them).
        """
        lock = self._call_lock
        if not lock.acquire(False):
            self._acquire("send()")
        try:
            self._send(tensors)
        finally:
            lock.release()

    def _send(self, tensors) -> None:
        if self._error is not None or self._state != "open" or self.role != "send":
            self._check_usable("send")
        specs = self.specs
        layout = None
        if type(tensors) is dict and self._gpu_index is not None:     # the per-step case: checked in one pass
            layout = specs.fast_layout(tensors, self._gpu_index)
        if layout is None:
            try:
                if type(tensors) is not dict and isinstance(tensors, Mapping):
                    tensors = _read_once(tensors)   # each tensor read once: what is checked is what is sent
                layout = specs.layout(specs.check_tensors(tensors, self.torch_device))
            except Refusal as refusal:
                if self.metadata:
                    self._send_meta(self.step + 1, refusal=refusal)
                raise BadInput(f"rank {self.rank}: step {self.step + 1} to rank {self.peer} refused, nothing "
                               f"sent: {refusal}") from None
        k = self.step + 1
        if self.metadata:
            self._send_meta(k, layout.shapes)
        try:
            self._send_impl(k, tensors, layout)
        except Exception as exc:
            raise self._fail(exc) from (None if exc is self._error else exc)
        if self._error is not None:      # failed meanwhile (its waits were released): the step is lost
            raise self._error
        self.step = k

    def recv(self, shapes: Mapping[str, Sequence[int]] | None = None, out: Mapping[str, object] | None = None
             ) -> Received:
        """The next step's tensors, deferred (see :class:`Received`).

        With metadata (the default) shapes come from the sender and ``shapes``
        must be None; with ``metadata=False`` at setup, ``shapes`` is required
        and nothing travels. ``out``: persistent tensors to copy into (each with
        at least the spec's largest numel; ``.tensors`` returns views of them).
        """
        lock = self._call_lock
        if not lock.acquire(False):
            self._acquire("recv()")
        try:
            return self._recv(shapes, out)
        finally:
            lock.release()

    def _recv(self, shapes, out) -> Received:
        if self._error is not None or self._state != "open" or self.role != "recv":
            self._check_usable("recv")
        k = self.step + 1
        if out is not None:
            out = self.specs.check_out(out, self.torch_device)     # the tensors checked: what the step writes
        if self._pending:
            try:
                self._make_room(len(self._pending))
            except Exception as exc:
                raise self._fail(exc) from (None if exc is self._error else exc)
        if self._pending and (most := self.max_pending) is not None and len(self._pending) >= most:
            raise BadInput(f"rank {self.rank}: recv() of step {k} from rank {self.peer} with {len(self._pending)} "
                           f"earlier receives not yet accessed (steps {self._pending[0].step}..{self._pending[-1].step}"
                           f"): the sender cannot get further ahead of the receive slots given back, so this "
                           f"receive would wait for ever; access .tensors of step {self._pending[0].step} first "
                           f"(nothing was consumed)")
        if self.metadata:
            if shapes is not None:
                raise BadInput("recv(shapes=...) is for transports set up with metadata=False; here the "
                               "sender's shapes travel with each step")
            t0 = self._waiting_since = time.monotonic()
            try:
                buf = self.meta.recv(self.timeout_s, self._failed)
            except Exception as exc:  # noqa: BLE001 - a mailbox timeout, or gloo's error (closed or timed out)
                raise self._fail(self._meta_error(exc, k, t0, "no step metadata arrived")) from None
            finally:
                self._waiting_since = None
            try:
                got = self.specs.decode(buf, step=k, peer=self.peer, rank=self.rank)
            except ProtocolError as exc:
                raise self._fail(exc) from None
            layout = self.specs.layout(got)
        else:
            if shapes is None:
                raise BadInput("this transport was set up with metadata=False: recv() needs shapes=...")
            layout = self.specs.layout_of(shapes)
        rcv = Received(self, k, layout, out)
        try:
            self._recv_impl(rcv)
        except Exception as exc:
            raise self._fail(exc) from (None if exc is self._error else exc)
        self.step = k
        self._pending.append(rcv)
        return rcv

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Wait (bounded) for this end's queued work; raise the first error (TransferTimeout...)."""
        timeout_s = self.timeout_s if timeout_s is None else resolve_timeout(timeout_s)
        self._acquire("synchronize()")
        try:
            self._synchronize(timeout_s)
        finally:
            self._call_lock.release()

    def _synchronize(self, timeout_s: float) -> None:
        self._check_usable("synchronize")
        deadline = time.monotonic() + timeout_s
        while not self._drain(min(0.1, max(0.0, deadline - time.monotonic()))):
            if self._error is not None:          # the watchdog found the stuck flag meanwhile
                raise self._error
            if time.monotonic() >= deadline:
                with self._wd_lock:
                    err = self._watch(time.monotonic(), force=True)
                raise self._fail(err or TransferTimeout(
                    rank=self.rank, step=self.step, flag="stream", expected=self.step, seen=None,
                    timeout_s=timeout_s, what=f"{self.name} {self.role} with rank {self.peer}: own work did "
                                              f"not finish"))
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Drain, barrier with the peer, close mappings, barrier, free. Idempotent."""
        close_all([self])

    def abort(self) -> None:
        """Release every pending GPU-side wait so the process can exit, without talking to the peer. Idempotent.

        Own streams are released (local flags set to a huge step) and drained
        briefly; then peer mappings are closed (only if the drain finished: the
        released work writes into the peer) and local-only buffers freed.
        Buffers the peer has mapped stay allocated until the process exits (or
        :meth:`close`): a live peer may still write into them, and freeing them
        under it is undefined behaviour on a GPU. ``allocated_bytes`` keeps
        counting them.
        """
        from .watchdog import _TEARDOWN, quiesce
        with _TEARDOWN:
            state = self._state
            if state in ("open", "setup"):
                self._state = "aborted"
        if state not in ("open", "setup"):     # closed, aborted, or a close of another thread under way
            return
        with self._fail_lock:
            if self._error is None:
                self._error = GpuxferError(f"rank {self.rank}: the {self.name} transport with rank {self.peer} "
                                           f"was aborted")
        if not quiesce(self, time.monotonic() + min(self.timeout_s, 5.0)):
            log.warning("rank %d: abort of the %s transport with rank %d: a call of another thread did not "
                        "return; its mappings and buffers are left to process exit", self.rank, self.name,
                        self.peer)
            self._release_waits()
            return
        try:
            self._abort_held()
        finally:
            self._call_lock.release()

    def _abort_held(self) -> None:
        if self.signals is not None:
            self.signals.leave(f"aborted its end after {type(self._error).__name__}: {self._error}")
        drained = False
        try:
            self._release_waits()
            drained = self._drain(min(self.timeout_s, 5.0))
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.debug("abort: drain failed: %s", exc)
        with self._wd_lock:
            self._wd.clear()
        self._close_meta()
        if not drained:
            log.warning("rank %d: abort of the %s transport with rank %d: own streams did not drain; its "
                        "mappings and buffers are left to process exit", self.rank, self.name, self.peer)
            return
        try:
            self._close_mappings()
            self._free_local()
        except Exception as exc:  # noqa: BLE001
            log.warning("rank %d: abort of %s transport: %s", self.rank, self.name, exc)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        arrow = f"{self.rank} -> {self.peer}" if self.role == "send" else f"{self.peer} -> {self.rank}"
        return (f"{type(self).__name__}({arrow}, device {self.device}, step {self.step}, "
                f"{self.allocated_bytes} B, {self._state})")

    # ---- internals shared by the backends ----
    def _check_usable(self, what: str) -> None:
        if self._error is not None:
            raise self._error
        if self._state != "open":
            raise BadInput(f"rank {self.rank}: cannot {what}: the {self.name} transport with rank {self.peer} "
                           f"is {self._state}")
        if what == "send" and self.role != "send":
            raise BadInput(f"rank {self.rank} receives on this transport (from rank {self.peer}); it cannot send")
        if what == "recv" and self.role != "recv":
            raise BadInput(f"rank {self.rank} sends on this transport (to rank {self.peer}); it cannot receive")

    def _send_meta(self, step: int, shapes=None, refusal: Refusal | None = None) -> None:
        """Send step's metadata message: its shapes, or the sender's refusal."""
        t0 = self._waiting_since = time.monotonic()
        try:
            meta = self.meta
            i = meta.next_send_buffer(self.timeout_s, self._failed)
            if refusal is None:
                self.specs.encode(meta.send_buffers[i], step, shapes)
            else:
                self.specs.encode_refusal(meta.send_buffers[i], step, refusal)
            meta.send(i)
        except Exception as exc:  # noqa: BLE001 - a mailbox timeout, or gloo's error (closed or timed out)
            raise self._fail(self._meta_error(exc, self.step + 1, t0, "metadata send stuck")) from None
        finally:
            self._waiting_since = None

    def _wait_label(self, entry) -> str:
        """What a watchdog entry waits for, in words (logs)."""
        return "a pending wait"

    def _failed(self) -> bool:
        """Whether a host wait of a call should give up: the transport failed, or is being closed."""
        return self._error is not None or self._state != "open"

    def _acquire(self, what: str) -> None:
        """Take the call lock (a public call of another thread holds it), bounded by ``timeout_s``."""
        if not self._call_lock.acquire(timeout=self.timeout_s):
            raise TransferTimeout(rank=self.rank, step=self.step + 1, flag="call", expected=self.step + 1,
                                  seen=self.step, timeout_s=self.timeout_s,
                                  what=f"{self.name} {what} with rank {self.peer}: a call of another thread "
                                       f"on this transport held it")

    def _meta_error(self, exc: BaseException, step: int, t0: float, what: str) -> BaseException:
        """The typed error of a failed metadata wait: the peer's connection closed (gloo says so before the
        timeout), the peer left a "gone" note, or a timeout."""
        if isinstance(exc, GpuxferError) and not isinstance(exc, MailboxTimeout):
            return exc
        if self._error is None and self._state != "open":    # the wait gave up: another thread closes
            return GpuxferError(f"rank {self.rank}: the {self.name} transport with rank {self.peer} was closed "
                                f"by another thread while step {step} waited ({what})")
        elapsed = time.monotonic() - t0
        gone = self.signals.peer_gone() if self.signals is not None else None
        if gone is not None or (isinstance(exc, RuntimeError) and elapsed < 0.9 * self.timeout_s):
            return PeerLost(rank=self.rank, peer=self.peer, step=step, flag="metadata", after_s=elapsed,
                            why=f"rank {self.peer} {gone}" if gone else "",
                            detail=f"{self.name} {what} over {self.meta.what}: {exc}")
        return TransferTimeout(rank=self.rank, step=step, flag="metadata", expected=step, seen=self.step,
                               timeout_s=self.timeout_s,
                               what=f"{self.name} {'receive from' if self.role == 'recv' else 'send to'} rank "
                                    f"{self.peer}: {what} over {self.meta.what} ({exc})")

    def _fail(self, err: BaseException) -> BaseException:
        """Break the transport with ``err`` (the first error wins, and is returned).

        Releases every GPU-side wait this end queued (its own streams and the caller's), so no host
        call in the process can block behind them, and leaves a "gone" note for the peer. With
        ``on_timeout="exit"`` it then logs every transport's state and ends the process. Safe from
        any thread; idempotent.
        """
        if not isinstance(err, GpuxferError):      # a library's error: typed, the original its cause
            cause = err
            err = GpuxferError(f"rank {self.rank}: the {self.name} {self.role} end with rank {self.peer} broke: "
                               f"{type(cause).__name__}: {cause}")
            err.__cause__ = cause
        with self._fail_lock:
            first = self._error is None
            if first:
                self._error = err
        if not first:
            return self._error
        log.error("%s", err)
        try:
            self._release_waits()
        except Exception as exc:  # noqa: BLE001 - best effort: the error is what the caller needs
            log.warning("rank %d: releasing the %s transport's GPU waits failed: %s", self.rank, self.name, exc)
        if self.signals is not None:
            self.signals.leave(f"failed with {type(err).__name__}: {err}")
        if self.on_timeout == "exit":
            exit_process(self, err)
        return self._error

    def _close_meta(self) -> None:
        if self.meta is not self.channel:
            self.meta.close()
        self.channel.close()

    def _materialize(self, rcv: Received) -> None:
        lock = self._call_lock
        if not lock.acquire(False):
            self._acquire(f".tensors of step {rcv.step}")
        try:
            self._materialize_locked(rcv)
        finally:
            lock.release()

    def _materialize_locked(self, rcv: Received) -> None:
        if rcv._tensors is not None:
            return
        if self._error is not None or self._state != "open":
            self._check_usable("recv")
        while self._pending:
            r = self._pending.popleft()
            try:
                self._materialize_impl(r)
            except Exception as exc:
                raise self._fail(exc) from (None if exc is self._error else exc)
            if self._error is not None:    # failed meanwhile: its waits were released, the data is garbage
                r._tensors = None
                raise self._error
            if r is rcv:
                return

    def _timeout(self, *, step: int, flag: str, expected: int, seen, what: str) -> TransferTimeout:
        return TransferTimeout(rank=self.rank, step=step, flag=flag, expected=expected, seen=seen,
                               timeout_s=self.timeout_s, what=f"{self.name} {what}")

    # ---- backend hooks ----
    def _make_room(self, queued: int) -> None:
        """Called by ``recv()`` while ``queued`` receives are not yet accessed, before :attr:`max_pending` is
        checked: a backend gives back here what would otherwise count against the limit."""

    @abc.abstractmethod
    def _send_impl(self, step: int, tensors, layout: Layout) -> None: ...

    @abc.abstractmethod
    def _recv_impl(self, rcv: Received) -> None: ...

    @abc.abstractmethod
    def _materialize_impl(self, rcv: Received) -> None: ...

    @abc.abstractmethod
    def _watch(self, now: float, force: bool = False) -> BaseException | None:
        """Called by the watchdog thread (under ``_wd_lock``): a timeout error, or None."""

    @abc.abstractmethod
    def _drain(self, timeout_s: float) -> bool:
        """Wait for this end's own queued work; False on timeout. Raises stream errors."""

    def _release_waits(self) -> None:
        """Unblock GPU-side waits this end's streams may be stuck in (abort / close after a timeout)."""

    @abc.abstractmethod
    def _close_mappings(self) -> None: ...

    @abc.abstractmethod
    def _free(self) -> None: ...

    def _unpublish(self) -> None:
        """Drop the names of what this end exported, where exports are names (after a failed setup)."""

    def _free_local(self) -> None:
        """Free what no peer has mapped (abort); default: everything (nothing is exported)."""
        self._free()

    @abc.abstractmethod
    def _allocated(self) -> int: ...
