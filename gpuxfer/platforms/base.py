"""The platform-hook contract.

``pp/`` and ``kv/`` do everything device-specific through a :class:`Platform`:
raw exportable buffers, IPC handles, streams, events, copies, and 64-bit
flags written and waited *on streams*. Three implementations exist:

* ``cuda``  -- CuPy runtime (raw ``cudaMalloc``, IPC handles) + ``cuda.bindings``
  (``cuStreamWriteValue64`` / ``cuStreamWaitValue64``, ``cuMemcpyAsync``,
  ``cuMemcpyBatchAsync``) + NVML (NVLink per pair).
* ``rocm``  -- hip-python + HSA through ctypes.
* ``host``  -- an emulation on the CPU for CI: shared memory buffers, one FIFO
  worker thread per stream. It is a *test* platform and says so
  (``is_emulation``).

Rules every implementation keeps:

* Importing a platform module never touches a device. ``unavailable_reason()``
  returns a string (or ``None``) and never raises.
* Buffers come from the raw allocator (never a caching-allocator block), so an
  IPC handle names exactly the buffer.
* Stream semantics: work on one stream runs in order; a flag wait blocks later
  work *on that stream only*; other streams run on.
* Flags are 8-byte, 8-byte-aligned words holding monotonically increasing step
  numbers; waits are ``>=`` (GEQ).
* Every owned resource has an idempotent ``close()`` and is a context manager.
"""
from __future__ import annotations

import abc
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from .. import config
from ..errors import BadInput, NotExportable
from .values import DeviceInfo, ExportedRange, IpcHandle, LinkInfo     # noqa: F401 - part of the contract

FLAG_BYTES = 8
#: written into a local flag word from the host to release every stream wait on it (close, abort): larger than
#: any step number a wait awaits
RELEASE_VALUE = 1 << 62


class Closable:
    """Idempotent close + context manager + a warning when garbage-collected open."""

    _closed: bool = False
    _warn_leaks: bool = False

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj._warn_leaks = config.get("GPUXFER_WARN_LEAKS")     # read here: never during garbage collection
        return obj

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()

    @abc.abstractmethod
    def _release(self) -> None: ...

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover - GC timing
        if not self._closed and self._warn_leaks:
            try:
                warnings.warn(f"{type(self).__name__} garbage-collected without close()",
                              ResourceWarning, stacklevel=2)
            except Exception:
                pass


class Memory(Closable):
    """Device memory addressable from this process: ``ptr`` .. ``ptr + nbytes``.

    ``device`` is the local device that kernels touching this memory run on.
    """

    platform: "Platform"
    device: int
    ptr: int
    nbytes: int
    #: this process can dereference ``[ptr, ptr + nbytes)``: kernels, torch views (``as_tensor``) and copies
    #: reach it. False for the host emulation's mapping of another process's plain memory (cross-memory
    #: attach): ``ptr`` stands for that memory in this process's address space, but only ``copy_async`` /
    #: ``copy_batch_async`` reach it, and nothing may read or write it directly
    addressable: bool = True

    def check_range(self, offset: int, nbytes: int, what: str = "range") -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise BadInput(f"{what} [{offset}, {offset + nbytes}) lies outside "
                           f"{type(self).__name__} of {self.nbytes} bytes")


class DeviceBuffer(Memory):
    """A raw, exportable allocation owned by this process."""

    def __init__(self, platform: "Platform", device: int, ptr: int, nbytes: int, impl=None,
                 allocated_bytes: int | None = None):
        self.platform, self.device, self.ptr, self.nbytes, self.impl = platform, device, ptr, nbytes, impl
        #: device memory this buffer holds: ``nbytes`` or more, where the platform rounds sizes up
        self.allocated_bytes = nbytes if allocated_bytes is None else allocated_bytes

    def _release(self) -> None:
        self.platform._free(self)

    def export(self) -> IpcHandle:
        return self.platform.export_handle(self)

    def __repr__(self) -> str:
        return f"DeviceBuffer({self.platform.name}:{self.device}, {self.nbytes} B, ptr=0x{self.ptr:x})"


class PeerMapping(Memory):
    """Another process's buffer opened here over IPC (closed, never freed, by us)."""

    def __init__(self, platform: "Platform", device: int, ptr: int, handle: IpcHandle, impl=None):
        self.platform, self.device, self.ptr, self.handle, self.impl = platform, device, ptr, handle, impl
        self.nbytes = handle.nbytes

    def _release(self) -> None:
        self.platform._close_mapping(self)

    def __repr__(self) -> str:
        return (f"PeerMapping({self.platform.name}:{self.device} <- device {self.handle.device} "
                f"of pid {self.handle.owner_pid}, {self.nbytes} B)")


class Stream:
    """An ordered queue of device work. ``handle`` is the native handle (an int) or None.

    A stream from :meth:`Platform.create_stream` is owned by its creator, who closes it; the
    platform refuses work on a closed stream (:class:`~gpuxfer.errors.BadInput`). A stream from
    :meth:`Platform.current_stream` is borrowed: its ``close()`` does nothing.
    """

    device: int
    handle: int | None
    _platform = None               # the creating platform, set only for owned streams (it has _destroy_stream)
    _closed = False

    def close(self) -> None:
        """Release a stream made by ``create_stream`` (queued work still completes).

        Idempotent; a no-op for borrowed streams (``current_stream``).
        """
        if self._platform is not None and not self._closed:
            self._closed = True
            self._platform._destroy_stream(self)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` released this stream (never for a borrowed one)."""
        return self._closed


class Event:
    """A marker recorded on a stream."""


class SdmaEngines(abc.ABC):
    """A platform's system DMA (SDMA) engines, as the ``sdma`` stage hand-off uses them: :attr:`Platform.sdma`.

    Two ways to drive them. *Stream-ordered* (``alloc_flags``, ``copy_async``): copies
    queued on a stream, the runtime choosing the engine. *Host-queued* (the rest):
    copies queued by the host on a chosen engine, ordered by the runtime's signals
    rather than by a stream; :meth:`runtime` is the object that queues them and owns
    the signals (ROCm: :class:`gpuxfer.platforms.hsa.Hsa` -- ``signal_create``,
    ``signal_store``, ``signal_load``, ``signal_wait_at_most``, ``signal_destroy``,
    ``copy_on_engine``). Engines are one-hot ids (engine ``n`` is ``1 << n``).
    """

    @abc.abstractmethod
    def unavailable_reason(self, device: int, host_queued: bool) -> str | None:
        """Why the engines of ``device`` cannot carry the hand-off (``host_queued``: driven from the host), or
        None. Never raises."""

    @abc.abstractmethod
    def alloc_flags(self, nbytes: int, device: int) -> DeviceBuffer:
        """Flag memory an engine's write is visible in to a stream wait without cache maintenance (exportable)."""

    @abc.abstractmethod
    def copy_async(self, stream: Stream, dst: int, src: int, nbytes: int) -> None:
        """A stream-ordered copy on an SDMA engine (never on compute units)."""

    @abc.abstractmethod
    def runtime(self):
        """The host-side runtime that queues copies on an engine and owns their signals (loaded on first use;
        raises :class:`~gpuxfer.errors.DriverError` where it cannot be loaded)."""

    @abc.abstractmethod
    def agent(self, device: int):
        """The runtime's agent of ``device`` (``.handle``: what copies name as source or destination)."""

    @abc.abstractmethod
    def owner_agent(self, ptr: int, what: str):
        """The GPU agent owning the memory at ``ptr`` (``what`` names it in the error when none does)."""

    @abc.abstractmethod
    def alloc_signal(self, device: int):
        """A signal a stream may write: a closable object with ``ptr`` (its value word, for :meth:`Platform.
        write_flag`) and ``signal`` (the runtime's handle, for copy dependencies). Its value starts at 1."""

    @abc.abstractmethod
    def plan_engines(self, src_agent, dst_agent, copies: int):
        """Which engines carry a pair's copies: an object with ``data`` (one-hot ids the data copies rotate
        over), ``local`` (the engine of a copy within the source device) and ``why``."""

    def pcie_atomics_64(self, device: int) -> bool | None:
        """Whether an engine's completion decrements a signal atomically (so copies may share one); None:
        unknown, treated as no."""
        return None


# --------------------------------------------------------------------------- contract


class Platform(abc.ABC):
    """The hook contract. Abstract hooks must be implemented; the rest have safe defaults.

    A platform object holds per-process state (opened libraries, probe results,
    helper streams): a process uses one, :func:`gpuxfer.platforms.current`, closed
    at exit (one from :func:`gpuxfer.platforms.detect` is the caller's to close).
    """

    name: str = "abstract"
    #: only for labelling outputs (:attr:`label`); code asks the capabilities below
    is_emulation: bool = False

    # ---- capabilities: what pp/ and kv/ ask instead of a platform's name ----
    #: buffers are host memory: torch tensors over them are CPU tensors, and torch runs work on them at once on
    #: the calling thread, outside the platform's streams (so nothing is stream-ordered with torch's work)
    host_memory: bool = False
    #: whose memory a buffer is, for third-party engines that register it: "cuda", "hip" or "host"
    memory_runtime: str = "host"
    #: the torch.distributed backend that moves this platform's tensors: "nccl" (NCCL or RCCL) or "gloo"
    collective_backend: str = "nccl"
    #: Triton kernels run in Triton's CPU interpreter (far slower than a memcpy: size work down)
    kernels_interpreted: bool = False
    #: :meth:`copy_async` into or out of a peer's mapping runs on a copy engine (no SM), in stream order with
    #: the stream's flag writes and waits: the ``copy_engine`` stage hand-off rests on it. False where such a
    #: copy may run as a kernel (ROCm's blits: its hand-off drives the SDMA engines, :attr:`sdma`)
    copy_engine_peer_copies: bool = False

    def torch_device(self, device: int):
        """The torch device of tensors over this platform's buffers on ``device``."""
        import torch
        return torch.device("cpu") if self.host_memory else torch.device("cuda", int(device))

    # ---- detection (class-level, side-effect free) ----
    @classmethod
    @abc.abstractmethod
    def unavailable_reason(cls) -> str | None:
        """Why this platform cannot run here, or None. Never raises, never creates a context."""

    @property
    def sdma(self) -> "SdmaEngines | None":
        """The platform's SDMA engines (ROCm), or None where it has none to offer (the default)."""
        return None

    @property
    def label(self) -> str:
        """How outputs name this platform (emulation says so)."""
        return f"{self.name} (EMULATION on the CPU: no GPU is used)" if self.is_emulation else self.name

    # ---- devices ----
    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def device_info(self, device: int) -> DeviceInfo: ...

    def link(self, src: int, dst: int) -> LinkInfo:
        """The link between two devices; the default knows nothing."""
        if src == dst:
            return LinkInfo(src, dst, "same-device", True)
        return LinkInfo(src, dst, "unknown", False, "this platform cannot tell")

    def set_device(self, device: int) -> None:
        """Make ``device`` current for this thread (driver calls use the current context)."""

    def versions(self) -> dict[str, str]:
        """Versions of the libraries this platform uses (for preambles and doctor)."""
        return {}

    @classmethod
    def load_runtime_library(cls, major: int) -> str | None:
        """Load major version ``major`` of this platform's runtime library into the process (``RTLD_GLOBAL``),
        for a third-party extension linked against that version; None once loaded, else why not. Never raises.
        Default: there is none."""
        return f"the {cls.name} platform has no runtime library to load"

    # ---- memory ----
    @abc.abstractmethod
    def alloc(self, nbytes: int, device: int) -> DeviceBuffer:
        """A raw exportable buffer of ``nbytes`` on ``device`` (contents undefined).

        A platform may allocate more (CUDA: whole 2 MiB pages from 2 MiB up); the
        buffer's ``allocated_bytes`` says how much."""

    @abc.abstractmethod
    def _free(self, buf: DeviceBuffer) -> None:
        """Free ``buf``; called once by ``buf.close()``."""

    @abc.abstractmethod
    def export_handle(self, buf: DeviceBuffer) -> IpcHandle: ...

    def export_range(self, ptr: int, nbytes: int, device: int, within: tuple[int, int] | None = None
                     ) -> ExportedRange:
        """Export memory this process holds by any means (e.g. a torch tensor from the caching
        allocator, carved from a larger allocation): the handle of the allocation holding
        ``[ptr, ptr + nbytes)`` on ``device`` and the range's offset in it. ``within``: ``(base, nbytes)``
        of memory the caller knows holds the range (a tensor's storage), for a platform that cannot find
        allocations itself (the host emulation's cma handles cover it); the others ignore it.

        Optional hook. Raises :class:`~gpuxfer.errors.NotExportable` (with the reason) for memory
        that cannot be exported; the default knows no allocation but those of :meth:`alloc`.
        """
        raise NotExportable(f"memory at 0x{int(ptr):x}", f"the {self.name} platform can only export "
                            "buffers it allocated (Platform.alloc)")

    def allocation_range(self, ptr: int, device: int) -> tuple[int, int] | None:
        """``(base, nbytes)`` of the allocation (or IPC mapping) holding ``ptr``, or None where the
        platform cannot tell (the default). Used to check a peer's claims about its memory."""
        return None

    @abc.abstractmethod
    def open_handle(self, handle: IpcHandle, device: int) -> PeerMapping:
        """Open another process's buffer; usable from kernels and copies on ``device``."""

    @abc.abstractmethod
    def _close_mapping(self, mapping: PeerMapping) -> None: ...

    def map_host_words(self, ptr: int, nbytes: int, device: int) -> int | None:
        """Make host memory ``[ptr, ptr + nbytes)`` (a page-aligned shared-memory mapping of this process)
        reachable by flag writes, flag waits and copies on ``device``'s streams, and return the address they
        use; None where this platform cannot (the default). Undone by :meth:`unmap_host_words`."""
        return None

    def unmap_host_words(self, ptr: int, device: int) -> None:
        """Undo :meth:`map_host_words` (after the streams that used the memory are drained)."""

    @abc.abstractmethod
    def as_tensor(self, mem: Memory, dtype=None, shape: Sequence[int] | None = None,
                  offset: int = 0):
        """A zero-copy torch tensor over ``mem[offset:]`` (uint8 by default; any dtype, bf16 included).

        The tensor lives on ``mem.device`` (a CPU tensor on the host emulation).
        It does not own the memory: keep ``mem`` open while it is used.
        """

    # ---- streams and events ----
    @abc.abstractmethod
    def create_stream(self, device: int) -> Stream: ...

    @abc.abstractmethod
    def current_stream(self, device: int) -> Stream:
        """The stream torch enqueues work on for ``device`` in this thread."""

    @abc.abstractmethod
    def record_event(self, stream: Stream, event: Event | None = None) -> Event:
        """Record an event on ``stream`` and return it.

        ``event``: an event this platform returned before that the caller no
        longer needs as it was; a platform may re-record it (CUDA does, saving an
        event's creation) and return it. Waits already enqueued on it keep their
        meaning. Use the returned event: a platform may return a new one.
        """

    @abc.abstractmethod
    def stream_wait_event(self, stream: Stream, event: Event) -> None: ...

    @abc.abstractmethod
    def event_query(self, event: Event) -> bool:
        """True once all work before the event has completed."""

    def event_wait(self, event: Event, timeout_s: float) -> bool:
        """Wait on the host for ``event``; False on timeout (never hangs)."""
        import time
        deadline = time.monotonic() + wait_seconds(timeout_s)
        delay = 1e-5
        while not self.event_query(event):
            if time.monotonic() > deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        return True

    def synchronize(self, stream: Stream, timeout_s: float = 60.0) -> bool:
        """Wait for all work on ``stream``; False on timeout."""
        return self.event_wait(self.record_event(stream), timeout_s)

    @abc.abstractmethod
    def launch(self, stream: Stream, fn: Callable[[], object]) -> None:
        """Run ``fn`` (which enqueues work through torch or Triton) in ``stream``'s order."""

    def native_stream(self, stream: Stream):
        """The driver's handle of ``stream`` for a kernel launcher that takes one (a launch straight on it,
        without :meth:`launch`'s context switches; the calling thread's current device must be the
        stream's, which such launchers check), or None: launch through :meth:`launch`. Default: None."""
        return None

    # ---- copies ----
    @abc.abstractmethod
    def copy_async(self, stream: Stream, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``src`` to ``dst`` (local or peer pointers) on ``stream``.

        On GPUs this is a copy-engine copy (no SM) for peer memory.
        """

    def copy_batch_async(self, stream: Stream, dsts: np.ndarray, srcs: np.ndarray,
                         sizes: np.ndarray) -> None:
        """Many independent copies on ``stream`` (no order among them).

        Default: one :meth:`copy_async` each. CUDA overrides it with ``cuMemcpyBatchAsync``.
        """
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            self.copy_async(stream, d, s, n)

    @abc.abstractmethod
    def memset_async(self, stream: Stream, ptr: int, value: int, nbytes: int) -> None: ...

    # ---- flags ----
    @abc.abstractmethod
    def write_flag(self, stream: Stream, ptr: int, value: int) -> None:
        """Write the 64-bit ``value`` to ``ptr`` once earlier work on ``stream`` is done (with a fence)."""

    @abc.abstractmethod
    def wait_flag(self, stream: Stream, ptr: int, value: int) -> None:
        """Block later work on ``stream`` until ``*(int64*)ptr >= value``. Does not block the host."""

    def flag_ops(self, stream: Stream, ops: np.ndarray) -> None:
        """Queue flag writes and waits on ``stream``, in row order, where a platform can as one call.

        ``ops`` is a :func:`flag_ops_array`: one row per operation, ``(FLAG_OP_WRITE | FLAG_OP_WAIT,
        address, value, 0, 0, 0)``; a write is :meth:`write_flag`, a wait :meth:`wait_flag`. Default: one
        of those calls per row."""
        for op, ptr, value in ops[:, :3].tolist():
            if op == FLAG_OP_WRITE:
                self.write_flag(stream, ptr, value)
            elif op == FLAG_OP_WAIT:
                self.wait_flag(stream, ptr, value)
            else:
                raise BadInput(f"flag operation {op} is neither a write ({FLAG_OP_WRITE}) nor a wait ({FLAG_OP_WAIT})")

    @abc.abstractmethod
    def read_flag(self, ptr: int, device: int) -> int:
        """Read a flag from the host, without waiting behind any stream."""

    @abc.abstractmethod
    def host_write_flag(self, ptr: int, value: int, device: int) -> None:
        """Write a flag from the host, without waiting behind any stream (used to release waits on abort)."""

    # ---- graph capture ----
    def capture_graph(self, stream: Stream, record: Callable[[Stream], object]):
        """A replayable graph of the work ``record(stream)`` enqueues on ``stream`` (an idle stream from
        :meth:`create_stream`, captured, not run), or None where this platform cannot capture (the caller
        then enqueues the work itself). Replay it with :meth:`launch_graph`; it is freed when collected."""
        return None

    def launch_graph(self, stream: Stream, graph) -> None:
        """Enqueue one replay of a graph from :meth:`capture_graph` on ``stream``."""
        raise BadInput(f"the {self.name} platform captures no graphs")

    def is_capturing(self, stream: Stream) -> bool:
        """Whether ``stream`` is capturing a graph (its work is recorded for replay, not run). Default: never."""
        return False

    # ---- a per-step path ----
    def stream_calls(self, stream: Stream) -> "StreamCalls":
        """:meth:`write_flag`, :meth:`wait_flag`, :meth:`launch_graph`, :meth:`flag_ops` and :meth:`copy_async`
        bound to ``stream``, for a path that queues a few calls per step on the same stream: same effects and errors
        as the methods (a platform may skip the per-call stream checks there). Default: the methods
        themselves."""
        return StreamCalls(stream, lambda ptr, value: self.write_flag(stream, ptr, value),
                           lambda ptr, value: self.wait_flag(stream, ptr, value),
                           lambda graph: self.launch_graph(stream, graph),
                           lambda ops: self.flag_ops(stream, ops),
                           lambda dst, src, nbytes: self.copy_async(stream, dst, src, nbytes))

    # ---- lifetime ----
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (a closed platform refuses new resources)."""
        return False

    def close(self) -> None:
        """Release per-process state (helper streams, library handles). Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StreamCalls:
    """What :meth:`Platform.stream_calls` returns: ``write_flag(ptr, value)``, ``wait_flag(ptr, value)``,
    ``launch_graph(graph)``, ``flag_ops(ops)`` and ``copy(dst, src, nbytes)`` queued on ``stream`` (without a
    ``flag_ops`` of its own: the rows one ``write_flag`` / ``wait_flag`` each, as :meth:`Platform.flag_ops`
    by default; ``copy`` may be None: the caller then uses the platform's ``copy_async``)."""

    __slots__ = ("stream", "write_flag", "wait_flag", "launch_graph", "flag_ops", "copy")

    def __init__(self, stream: Stream, write_flag: Callable[[int, int], None], wait_flag: Callable[[int, int], None],
                 launch_graph: Callable[[object], None], flag_ops: Callable[[np.ndarray], None] | None = None,
                 copy: Callable[[int, int, int], None] | None = None):
        self.stream, self.write_flag, self.wait_flag, self.launch_graph = stream, write_flag, wait_flag, launch_graph
        if flag_ops is None:
            def flag_ops(ops: np.ndarray) -> None:
                for op, ptr, value in ops[:, :3].tolist():
                    if op == FLAG_OP_WRITE:
                        write_flag(ptr, value)
                    elif op == FLAG_OP_WAIT:
                        wait_flag(ptr, value)
                    else:
                        raise BadInput(f"flag operation {op} is neither a write ({FLAG_OP_WRITE}) nor a wait "
                                       f"({FLAG_OP_WAIT})")
        self.flag_ops = flag_ops
        self.copy = copy


#: operations of a :meth:`Platform.flag_ops` row (CUDA's CU_STREAM_MEM_OP_WAIT_VALUE_64 / _WRITE_VALUE_64)
FLAG_OP_WAIT, FLAG_OP_WRITE = 4, 5
FLAG_OP_WORDS = 6       # a row: CUDA's CUstreamBatchMemOpParams (48 bytes) as uint64 words
FLAG_OP_ADDRESS, FLAG_OP_VALUE = 1, 2   # a row's address and value words (its first word: the operation)


def flag_ops_array(ops: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """Rows for :meth:`Platform.flag_ops` from ``(op, address, value)`` triples; callers change the address
    and value columns (:data:`FLAG_OP_ADDRESS`, :data:`FLAG_OP_VALUE`) in place between calls. The wait compares with >= (cyclic, as :meth:`wait_flag`)."""
    arr = np.zeros((len(ops), FLAG_OP_WORDS), dtype=np.uint64)
    for i, (op, ptr, value) in enumerate(ops):
        if op not in (FLAG_OP_WAIT, FLAG_OP_WRITE):
            raise BadInput(f"flag operation {op} is neither a write ({FLAG_OP_WRITE}) nor a wait ({FLAG_OP_WAIT})")
        ptr = check_flag_ptr(ptr)
        arr[i, 0], arr[i, FLAG_OP_ADDRESS], arr[i, FLAG_OP_VALUE] = op, ptr, int(value) & ((1 << 64) - 1)
    return arr


def check_flag_ptr(ptr: int) -> int:
    """A flag's address as an int: an integer (not a bool or a float), non-null, inside 64 bits, 8-byte
    aligned; else :class:`BadInput`."""
    if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)):
        raise BadInput(f"a flag address must be an integer, got {ptr!r}")
    ptr = int(ptr)
    if not 0 < ptr < 1 << 64:
        raise BadInput(f"flag address {ptr:#x} is not an address (null, negative or past 64 bits)")
    if ptr % FLAG_BYTES:
        raise BadInput(f"flag address 0x{ptr:x} is not {FLAG_BYTES}-byte aligned")
    return ptr


def wait_seconds(timeout_s) -> float:
    """A host wait's bound in seconds (below 0: do not wait); :class:`BadInput` where it is not a finite number
    of at most :data:`~gpuxfer.config.MAX_SECONDS`, since no host wait may go unbounded."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float, np.integer, np.floating)) \
            or not math.isfinite(timeout_s) or timeout_s > config.MAX_SECONDS:
        raise BadInput(f"a wait's timeout must be a finite number of seconds (at most {config.MAX_SECONDS:g}: "
                       f"longer overflows the clocks a wait goes through), got {timeout_s!r}")
    return max(0.0, float(timeout_s))


def as_int64_array(values: Iterable[int] | np.ndarray, name: str) -> np.ndarray:
    try:
        raw = np.asarray(values)
        if raw.size and (raw.dtype.kind not in "iu" or (raw.dtype.kind == "u" and int(raw.max()) >= 1 << 63)):
            raise TypeError(f"{raw.dtype} values{' past 2**63' if raw.dtype.kind == 'u' else ''}")
        arr = np.ascontiguousarray(raw, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadInput(f"{name} must hold 64-bit integers: {exc}") from None
    if arr.ndim != 1:
        raise BadInput(f"{name} must be one-dimensional, got shape {arr.shape}")
    return arr


@dataclass
class Detection:
    """The result of :func:`gpuxfer.platforms.detect`."""

    platform: Platform
    skipped: dict[str, str] = field(default_factory=dict)   # platform name -> why it was skipped
