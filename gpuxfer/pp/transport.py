"""The stage hand-off interface every backend implements.

A :class:`Transport` connects ONE sending rank to ONE receiving rank (pairs, not
a chain): rank ``i`` of stage ``s`` hands its outputs to rank ``i`` of stage
``s + 1``, and a middle stage holds two transports (receive from the previous
stage, send to the next). Transports are made collectively by
:func:`gpuxfer.pp.selection.connect`; this module holds what every backend
shares:

* :class:`SpecTable` -- the tensors to expect (name -> largest shape, dtype),
  validation of what the caller passes (before any GPU work and before metadata
  goes out), the packed layout of one step (offsets aligned to 256 bytes, cached
  per shape tuple) and the per-step metadata message (shapes only: keys and
  dtypes are fixed by the spec).
* :class:`Received` -- a deferred receive: ``recv()`` returns at once (after the
  metadata, if metadata travels); the first access to ``.tensors`` queues the
  GPU-side wait and the copy-out on the caller's current stream. Nothing waits
  before that, so the receiver's input preparation overlaps the transfer.
* :class:`CpuChannel` -- tagged point-to-point metadata messages over the CPU
  (gloo) group, unless the pair shares a host, where a shared-memory
  :class:`~gpuxfer.pp.mailbox.Mailbox` carries them (``Transport.meta``).
* :class:`PairSignals` -- keys in the process group's store (never a gloo
  collective: a timed gloo wait closes the pair for good, and the caller's group
  with it): the bounded pair barriers of teardown, and a "gone" note each end
  leaves when it fails, aborts or closes, which the peer's watchdog reads.
* the watchdog -- one daemon thread per process, off the transfer path, that
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
  process with :data:`EXIT_CODE`, like torch's NCCL async error handling.
* :func:`close_all` -- teardown in a safe order for any set of transports,
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
import atexit
import math
import collections
import logging
import os
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from collections.abc import Mapping, Sequence

import numpy as np

from .. import config
from ..errors import BadInput, GpuxferError, PeerLost, ProtocolError, TransferTimeout

log = logging.getLogger("gpuxfer.pp")

ALIGN = 256                 # byte alignment of each tensor in a packed slot
MAX_NDIM = 8                # most dimensions a tensor may have
ENV_TIMEOUT = "GPUXFER_PP_TIMEOUT_S"
ENV_ON_TIMEOUT = "GPUXFER_PP_ON_TIMEOUT"
EXIT_CODE = 70              # the process exit code of on_timeout="exit" (EX_SOFTWARE)
FAILED_TEARDOWN_S = 1.0     # drain / barrier limit of a failed transport at teardown (its peer is likely gone)
GONE_POLL_S = 0.25          # how often the watchdog reads a waiting transport's peer "gone" note
META_MAGIC = 0x67787070     # "gxpp"
_NO_DIMS = (0,) * MAX_NDIM
_HEADER = struct.Struct("=4q")   # a metadata message's first words: magic, step, refusal code, refused key

# why a sender refused a step (travels in the refusal message)
_REFUSALS = {
    1: "the tensors are not a dict of torch tensors",
    2: "its keys differ from the setup spec",
    3: "a dtype differs from the setup spec",
    4: "a tensor is on the wrong device",
    5: "a tensor is not contiguous",
    6: "a tensor is larger than its slot (the setup spec's largest shape)",
    7: "a tensor has too many dimensions",
    8: "a tensor is a lazily conjugated or negated view",
}


def resolve_timeout(timeout_s: float | None) -> float:
    """``timeout_s``, else ``$GPUXFER_PP_TIMEOUT_S``, else 300 s."""
    if timeout_s is None:
        return config.get(ENV_TIMEOUT)
    try:
        timeout_s = float(timeout_s)
    except (TypeError, ValueError):
        raise BadInput(f"the transfer timeout must be a number of seconds, got {timeout_s!r}") from None
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise BadInput(f"the transfer timeout must be a finite number of seconds > 0, got {timeout_s} "
                       f"(every wait is bounded: pick the longest a step may take)")
    return timeout_s


def resolve_on_timeout(value: str | None) -> str:
    """``value``, else ``$GPUXFER_PP_ON_TIMEOUT``, else ``raise``: what a failed transport does
    (``raise``: store the error, release its GPU waits, raise on every later call; ``exit``: also
    log every transport's state and end the process with :data:`EXIT_CODE`)."""
    return config.resolve(ENV_ON_TIMEOUT, value, option="on_timeout")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def torch_is_stream_ordered(platform) -> bool:
    """Whether torch work on this platform's tensors is ordered on its streams.

    True on GPUs. On the host emulation torch runs on the calling thread, so the
    transport waits (bounded) for its own stream work before handing tensors to
    the caller -- the emulation's stand-in for stream order.
    """
    return not platform.host_memory


# --------------------------------------------------------------------------- byte copies


def as_bytes(t):
    """A contiguous tensor's bytes as a uint8 view (no copy) of shape :func:`byte_shape` ``(t.shape)``."""
    import torch
    return (t if t.dim() else t.view(1)).view(torch.uint8)


def byte_shape(shape: tuple, itemsize: int) -> tuple:
    """The shape of :func:`as_bytes` of a tensor of ``shape``: the last dimension counts bytes."""
    return (itemsize,) if not shape else tuple(shape[:-1]) + (shape[-1] * itemsize,)


def copy_bytes(dsts: list, srcs: list) -> None:
    """Bit-exact copies between uint8 views, in one multi-tensor launch where torch can.

    Always bytes: ``torch._foreach_copy_`` on same-dtype float lists runs through
    float arithmetic, which rewrites bf16 / fp16 NaN payloads (seen on H200).
    """
    import torch
    if len(dsts) == 1:
        dsts[0].copy_(srcs[0])
    else:
        torch._foreach_copy_(dsts, srcs)


# --------------------------------------------------------------------------- specs and layout


class _Refusal(BadInput):
    def __init__(self, code: int, key: int, message: str):
        super().__init__(message)
        self.code, self.key = code, key


@dataclass(frozen=True)
class Layout:
    """Where each tensor of one step lies in a packed slot (byte offsets)."""

    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    total: int          # bytes that travel: end of the last tensor
    bshapes: tuple[tuple[int, ...], ...] = ()   # shapes of the tensors' uint8 views (as_bytes)
    strides: tuple[tuple[int, ...], ...] = ()   # contiguous strides of ``shapes`` (elements)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of a buffer :meth:`SpecTable.views` can view this step in (whole ALIGN units, >= 1 unit)."""
        return _align(max(self.total, 1))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(out))


class SpecTable:
    """The tensors a transport expects: name -> (largest shape, dtype), in sorted name order."""

    def __init__(self, specs: Mapping[str, tuple[Sequence[int], object]]):
        import torch
        if not isinstance(specs, Mapping) or not specs:
            raise BadInput("specs must be a non-empty dict: name -> (largest shape, dtype)")
        names, shapes, dtypes = [], [], []
        for name in sorted(specs):
            if not isinstance(name, str) or not name:
                raise BadInput(f"tensor names must be non-empty strings, got {name!r}")
            entry = specs[name]
            if isinstance(entry, torch.Tensor):
                entry = (tuple(entry.shape), entry.dtype)
            try:
                shape, dtype = entry
            except (TypeError, ValueError):
                raise BadInput(f"spec of {name!r} must be (shape, dtype), got {entry!r}") from None
            if not isinstance(dtype, torch.dtype):
                raise BadInput(f"spec of {name!r}: {dtype!r} is not a torch dtype")
            try:
                shape = tuple(int(s) for s in shape)
            except (TypeError, ValueError):
                raise BadInput(f"spec of {name!r}: shape {shape!r} is not a sequence of integers") from None
            if len(shape) > MAX_NDIM or any(s < 0 for s in shape):
                raise BadInput(f"spec of {name!r}: shape {shape} needs <= {MAX_NDIM} non-negative dims")
            names.append(name)
            shapes.append(shape)
            dtypes.append(dtype)
        self.names: tuple[str, ...] = tuple(names)
        self.nameset = frozenset(names)
        self.max_shapes: tuple[tuple[int, ...], ...] = tuple(shapes)
        self.dtypes = tuple(dtypes)
        self.itemsizes = tuple(torch.empty((), dtype=d).element_size() for d in dtypes)
        self.max_nbytes = tuple(int(np.prod(s, dtype=np.int64)) * i for s, i in zip(shapes, self.itemsizes))
        self.max_numel = tuple(int(np.prod(s, dtype=np.int64)) for s in shapes)
        self.slot_bytes = max(ALIGN, sum(_align(n) for n in self.max_nbytes))
        self.meta_len = 4 + len(names) * (1 + MAX_NDIM)
        self._tensor = torch.Tensor
        self._fast = tuple(zip(names, dtypes, self.max_numel, (d.is_complex for d in dtypes)))
        self._layouts: dict[tuple, Layout] = {}
        self._decoded: dict[bytes, tuple] = {}     # metadata body (bytes) -> checked shapes
        self._rows: dict[tuple, np.ndarray] = {}   # shapes -> metadata row (the step word left 0)

    def digest(self) -> tuple:
        """What both ends of a pair must agree on (compared at setup)."""
        return (self.names, tuple(str(d) for d in self.dtypes), self.max_shapes)

    def describe(self) -> str:
        return ", ".join(f"{n}: {tuple(s)} {str(d).replace('torch.', '')}"
                         for n, s, d in zip(self.names, self.max_shapes, self.dtypes))

    def layout(self, shapes: tuple[tuple[int, ...], ...]) -> Layout:
        lay = self._layouts.get(shapes)
        if lay is None:
            shapes = tuple(tuple(s) for s in shapes)    # plain tuples (a tensor's shape is a torch.Size)
            offsets, nbytes, off, end = [], [], 0, 0
            for shape, item in zip(shapes, self.itemsizes):
                n = int(np.prod(shape, dtype=np.int64)) * item
                offsets.append(off)
                nbytes.append(n)
                end = off + n
                off = _align(end)
            lay = Layout(shapes, tuple(offsets), tuple(nbytes), end,
                         tuple(byte_shape(sh, it) for sh, it in zip(shapes, self.itemsizes)),
                         tuple(_contiguous_strides(sh) for sh in shapes))
            if len(self._layouts) > 4096:   # shapes vary per step (token counts): keep the cache bounded
                self._layouts.clear()
            self._layouts[shapes] = lay
        return lay

    def views(self, buf, layout: Layout, at: int = 0) -> dict:
        """The step's tensors as views of ``buf`` (uint8, storage offset 0, packed as ``layout`` says from
        byte ``at`` on, a multiple of ALIGN): one ``as_strided`` per tensor."""
        typed, out = {}, {}
        for name, dtype, item, shape, strides, off in zip(self.names, self.dtypes, self.itemsizes, layout.shapes,
                                                         layout.strides, layout.offsets):
            base = typed.get(dtype)
            if base is None:
                base = typed[dtype] = buf.view(dtype)
            out[name] = base.as_strided(shape, strides, (at + off) // item)
        return out

    # ---- validation (before any GPU work and before metadata goes out) ----
    def check_tensors(self, tensors, device) -> tuple[tuple[int, ...], ...]:
        """The shapes of ``tensors`` (spec order), or the first :class:`_Refusal` that applies."""
        if type(tensors) is dict and device.type != "cpu":
            shapes = self._fast_shapes(tensors, device.index or 0)
            if shapes is not None:
                return shapes
        return self._checked_shapes(tensors, device)

    def _fast_shapes(self, tensors: dict, index: int) -> tuple[tuple[int, ...], ...] | None:
        """The per-step path on a GPU: every check of :meth:`_checked_shapes` in one expression per
        tensor; None sends any doubt there (which says what is wrong). A dict of as many entries as the
        spec that holds every name has the spec's keys."""
        if len(tensors) != len(self._fast):
            return None
        Tensor, shapes = self._tensor, []
        for name, dtype, max_numel, cplx in self._fast:
            t = tensors.get(name)
            if (not isinstance(t, Tensor) or t.dtype is not dtype or t.get_device() != index
                    or not t.is_contiguous() or t.is_neg() or (cplx and t.is_conj()) or t.numel() > max_numel):
                return None      # (only complex tensors carry a lazy conjugation)
            shape = t.shape      # a torch.Size: equal to (and hashed as) the tuple of its dimensions
            if len(shape) > MAX_NDIM:
                return None
            shapes.append(shape)
        return tuple(shapes)

    def _checked_shapes(self, tensors, device) -> tuple[tuple[int, ...], ...]:
        import torch
        if not isinstance(tensors, Mapping):
            raise _Refusal(1, -1, f"send() takes a dict of tensors, got {type(tensors).__name__}")
        if tensors.keys() != self.nameset:
            extra = sorted(set(tensors) - self.nameset)
            missing = sorted(self.nameset - set(tensors))
            raise _Refusal(2, -1, f"the tensors' keys differ from the setup spec: unexpected {extra}, "
                                  f"missing {missing} (spec: {self.describe()})")
        shapes = []
        for i, name in enumerate(self.names):
            t = tensors[name]
            if not isinstance(t, torch.Tensor):
                raise _Refusal(1, i, f"{name!r} is a {type(t).__name__}, not a torch tensor")
            if t.dtype != self.dtypes[i]:
                raise _Refusal(3, i, f"{name!r} has dtype {t.dtype}, the setup spec says {self.dtypes[i]}")
            if t.device != device:
                raise _Refusal(4, i, f"{name!r} is on {t.device}, the transport's device is {device}")
            if not t.is_contiguous():
                raise _Refusal(5, i, f"{name!r} is not contiguous (strides {t.stride()}); pass .contiguous()")
            if t.is_conj() or t.is_neg():    # its bytes are not its values: copies move bytes
                raise _Refusal(8, i, f"{name!r} is a lazily conjugated or negated view; pass .resolve_conj() / "
                                     f".resolve_neg()")
            if t.dim() > MAX_NDIM:
                raise _Refusal(7, i, f"{name!r} has {t.dim()} dimensions, at most {MAX_NDIM} are supported")
            if t.numel() > self.max_numel[i]:
                raise _Refusal(6, i, f"{name!r} of shape {tuple(t.shape)} ({t.numel() * self.itemsizes[i]} B) "
                                     f"is larger than its slot: the setup spec's largest shape is "
                                     f"{self.max_shapes[i]} ({self.max_nbytes[i]} B)")
            shapes.append(tuple(t.shape))
        return tuple(shapes)

    def check_shapes(self, shapes) -> tuple[tuple[int, ...], ...]:
        return self.layout_of(shapes).shapes

    def layout_of(self, shapes) -> Layout:
        """The layout of ``recv(shapes=...)``'s shapes, checked: a dict of shapes seen before is one lookup
        (a key equal to a cached one has the same, checked, integer shapes)."""
        if type(shapes) is dict and len(shapes) == len(self.names):
            try:
                lay = self._layouts.get(tuple([shapes[n] for n in self.names]))
            except (KeyError, TypeError):
                lay = None
            if lay is not None:
                return lay
        return self.layout(self._checked_shape_tuple(shapes))

    def _checked_shape_tuple(self, shapes) -> tuple[tuple[int, ...], ...]:
        if not isinstance(shapes, Mapping) or shapes.keys() != self.nameset:
            got = sorted(shapes) if isinstance(shapes, Mapping) else type(shapes).__name__
            raise BadInput(f"recv(shapes=...) needs a dict with exactly the keys {sorted(self.nameset)}, got {got}")
        out = []
        for i, name in enumerate(self.names):
            try:
                shape = tuple(int(s) for s in shapes[name])
            except (TypeError, ValueError):
                raise BadInput(f"shape of {name!r} must be a sequence of integers, got {shapes[name]!r}") from None
            if len(shape) > MAX_NDIM or any(s < 0 for s in shape):
                raise BadInput(f"shape of {name!r} {shape} needs <= {MAX_NDIM} non-negative dims")
            if math.prod(shape) > self.max_numel[i]:
                raise BadInput(f"expected shape {shape} of {name!r} is larger than its slot "
                               f"(the setup spec's largest shape is {self.max_shapes[i]})")
            out.append(shape)
        return tuple(out)

    def check_out(self, out, device) -> None:
        """``recv(out=...)``: persistent tensors the data is copied into (a prefix of each, by numel)."""
        import torch
        if not isinstance(out, Mapping) or out.keys() != self.nameset:
            raise BadInput(f"recv(out=...) needs a dict with exactly the keys {sorted(self.nameset)}")
        for i, name in enumerate(self.names):
            t = out[name]
            if not isinstance(t, torch.Tensor) or t.dtype != self.dtypes[i] or t.device != device:
                raise BadInput(f"out[{name!r}] must be a {self.dtypes[i]} tensor on {device}")
            if not t.is_contiguous() or t.numel() < self.max_numel[i] or t.is_conj() or t.is_neg():
                raise BadInput(f"out[{name!r}] must be contiguous (not a conjugated or negated view) with >= "
                               f"{self.max_numel[i]} elements (the setup spec's largest shape {self.max_shapes[i]})")

    # ---- metadata ----
    def encode(self, buf: np.ndarray, step: int, shapes) -> None:
        """Fill ``buf`` with the message of ``step``: the row of these shapes (built once per shape tuple),
        then the step."""
        row = self._rows.get(shapes)
        if row is None:
            vals = [META_MAGIC, 0, 0, 0]
            for shape in shapes:
                vals.append(len(shape))
                vals += shape
                vals += _NO_DIMS[len(shape):]
            if len(self._rows) > 4096:      # shapes vary per step (token counts): keep the cache bounded
                self._rows.clear()
            row = self._rows[shapes] = np.array(vals, dtype=np.int64)
        buf[:] = row
        buf[1] = step

    def encode_refusal(self, buf: np.ndarray, step: int, refusal: _Refusal) -> None:
        buf[:] = 0
        buf[0], buf[1], buf[2], buf[3] = META_MAGIC, step, refusal.code, refusal.key

    def decode(self, buf: np.ndarray, *, step: int, peer: int, rank: int):
        """Shapes for ``step``, or raise the sender's refusal as :class:`BadInput`.

        Nothing in the message is trusted: every shape is checked against the spec (dimensions,
        element count) and the step against the slot, in Python integers (no overflow), before
        anything is viewed or copied; a violation is :class:`ProtocolError`.
        """
        if len(buf) != self.meta_len:
            raise ProtocolError(f"rank {rank}: metadata from rank {peer} holds {len(buf)} words, expected "
                                f"{self.meta_len}")
        raw = buf.tobytes()
        known = self._decoded.get(raw[32:])                 # shapes seen (and checked) before: per step
        if known is not None and raw[:32] == _HEADER.pack(META_MAGIC, step, 0, 0):
            return known
        vals = buf.tolist()       # one conversion, then plain ints
        if vals[0] != META_MAGIC or vals[1] != step:
            raise ProtocolError(f"rank {rank}: metadata from rank {peer} is out of order: expected step {step}, "
                                f"got magic 0x{vals[0]:x} step {vals[1]}")
        if vals[2]:
            key = vals[3]
            which = f" ({self.names[key]!r})" if 0 <= key < len(self.names) else ""
            raise BadInput(f"rank {rank}: rank {peer} refused its input for step {step}{which}: "
                           f"{_REFUSALS.get(vals[2], 'unknown reason')}; nothing was sent and the step "
                           f"was not consumed on either side")
        shapes, pos, total = [], 4, 0
        for i, name in enumerate(self.names):
            nd = vals[pos]
            dims = vals[pos + 1:pos + 1 + MAX_NDIM]
            if not 0 <= nd <= MAX_NDIM or any(d < 0 for d in dims) or any(dims[nd:]):
                raise ProtocolError(f"rank {rank}: metadata from rank {peer} for step {step} is malformed: "
                                    f"{name!r} has {nd} dimensions {tuple(dims)}")
            shape = tuple(dims[:nd])
            numel = math.prod(shape)
            if numel > self.max_numel[i]:
                raise ProtocolError(f"rank {rank}: rank {peer} claims shape {shape} for {name!r} at step {step}: "
                                    f"{numel} elements, larger than its slot (the setup spec's largest shape "
                                    f"is {self.max_shapes[i]}, {self.max_numel[i]} elements); nothing was read")
            total = _align(total) + numel * self.itemsizes[i]
            shapes.append(shape)
            pos += 1 + MAX_NDIM
        if total > self.slot_bytes:       # implied by the per-tensor checks; kept as the last line of defence
            raise ProtocolError(f"rank {rank}: rank {peer}'s step {step} needs {total} B, its slot holds "
                                f"{self.slot_bytes} B")
        if len(self._decoded) > 4096:      # shapes vary per step (token counts): keep the cache bounded
            self._decoded.clear()
        shapes = self._decoded[np.asarray(vals[4:], dtype=np.int64).tobytes()] = tuple(shapes)
        return shapes


# --------------------------------------------------------------------------- CPU channel


class CpuChannel:
    """Tagged metadata messages to one peer over a CPU (gloo) group.

    gloo's timed ``wait`` closes the pair on timeout, so a timed-out channel is
    dead; the transport is then broken anyway (TransferTimeout is final). To keep
    the caller's group out of that, :func:`~gpuxfer.pp.selection.connect` gives
    each pair whose metadata travels this way a two-rank gloo group of its own
    (:meth:`use_pair_group`); without one (a transport made by hand) messages go
    over ``group`` with global ranks.
    """

    RING = 4
    what = "the CPU group"

    def __init__(self, group, peer: int, tag_base: int, meta_len: int):
        import torch
        self.group, self.peer, self.tag_meta, self.tag_barrier = group, peer, tag_base, tag_base + 1
        self._pair: tuple | None = None      # (a two-rank gloo ProcessGroup, the peer's rank in it)
        self._ring = [torch.zeros(meta_len, dtype=torch.int64) for _ in range(self.RING)]
        self.send_buffers = [t.numpy() for t in self._ring]
        self._works: list = [None] * self.RING
        self._i = 0
        self._recv_buf = torch.zeros(meta_len, dtype=torch.int64)
        self.recv_np = self._recv_buf.numpy()

    def next_send_buffer(self, timeout_s: float, cancelled=None) -> int:
        i = self._i % self.RING
        w = self._works[i]
        if w is not None:
            w.wait(timeout=timedelta(seconds=timeout_s))
            self._works[i] = None
        return i

    def use_pair_group(self, pg, peer_rank: int) -> None:
        """Send and receive over ``pg`` (two ranks; the peer is ``peer_rank`` in it) from now on."""
        self._pair = (pg, peer_rank)

    def send(self, i: int) -> None:
        if self._pair is not None:
            pg, dst = self._pair
            self._works[i] = pg.send([self._ring[i]], dst, self.tag_meta)
        else:
            import torch.distributed as dist
            self._works[i] = dist.isend(self._ring[i], dst=self.peer, group=self.group, tag=self.tag_meta)
        self._i += 1

    def recv(self, timeout_s: float, cancelled=None) -> np.ndarray:
        if self._pair is not None:
            pg, src = self._pair
            w = pg.recv([self._recv_buf], src, self.tag_meta)
        else:
            import torch.distributed as dist
            w = dist.irecv(self._recv_buf, src=self.peer, group=self.group, tag=self.tag_meta)
        w.wait(timeout=timedelta(seconds=timeout_s))
        return self.recv_np

    def close(self) -> None:
        """Drop the pair group (its gloo threads end with it). Idempotent."""
        self._works = [None] * self.RING
        self._pair = None

    def drain(self, timeout_s: float) -> None:
        for i, w in enumerate(self._works):
            if w is not None:
                try:
                    w.wait(timeout=timedelta(seconds=timeout_s))
                except RuntimeError:
                    pass
                self._works[i] = None


class PairSignals:
    """What the two ends of a pair tell each other outside the transfer: keys in the store of the
    default process group (``prefix`` is unique to the pair and the connection).

    * ``barrier(label)``: :meth:`post` sets ``prefix/label/rank``; :meth:`finish` waits (bounded)
      for the peer's key. A store wait that times out breaks nothing, unlike a gloo one.
    * ``gone``: :meth:`leave` sets ``prefix/gone/rank`` (why: failed, aborted, closed);
      :meth:`peer_gone` reads the peer's, without waiting.

    A store that fails (its server died with rank 0) makes barriers fail and ``peer_gone`` say
    nothing: the waits' own timeouts still bound everything.
    """

    def __init__(self, store, prefix: str, rank: int, peer: int):
        self.store, self.prefix, self.rank, self.peer = store, prefix, rank, peer

    @classmethod
    def default(cls, prefix: str, rank: int, peer: int) -> "PairSignals | None":
        try:
            from torch.distributed.distributed_c10d import _get_default_store
            return cls(_get_default_store(), prefix, rank, peer)
        except Exception as exc:  # noqa: BLE001 - teardown then relies on timeouts alone
            log.warning("rank %d: no process-group store for the pair with rank %d (%s): teardown barriers "
                        "and peer-gone notes are off", rank, peer, exc)
            return None

    def _key(self, label: str, rank: int) -> str:
        return f"{self.prefix}/{label}/{rank}"

    def post(self, label: str) -> bool:
        try:
            self.store.set(self._key(label, self.rank), b"1")
            return True
        except Exception as exc:  # noqa: BLE001
            log.warning("rank %d: %s barrier with rank %d not posted: %s", self.rank, label, self.peer, exc)
            return False

    def finish(self, label: str, deadline: float) -> bool:
        """Poll for the peer's key until ``deadline`` (polls, not ``store.wait``: a client's blocking wait
        holds its connection, and the watchdog reads "gone" notes through the same store)."""
        key = self._key(label, self.peer)
        nap = 1e-3
        try:
            while not self.store.check([key]):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(nap)
                nap = min(2 * nap, 0.02)
        except Exception:  # noqa: BLE001 - a dead store: the caller logs and carries on
            return False
        try:
            self.store.delete_key(key)     # seen: the peer posted it, nobody reads it again
        except Exception:  # noqa: BLE001 - a store without delete keeps a few bytes
            pass
        return True

    def leave(self, why: str) -> None:
        try:
            self.store.set(self._key("gone", self.rank), why.encode()[:512])
        except Exception as exc:  # noqa: BLE001
            log.debug("rank %d: gone note for rank %d not set: %s", self.rank, self.peer, exc)

    def peer_gone(self) -> str | None:
        key = self._key("gone", self.peer)
        try:
            if not self.store.check([key]):
                return None
            return self.store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001
            return None


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
    """

    name = "abstract"
    watch_after_error = False    # whether the watchdog keeps calling _watch once the transport is broken
    max_pending: int | None = None     # most receives left deferred at once (None: no limit)
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
        if self._error is not None or self._state != "open" or self.role != "send":
            self._check_usable("send")
        specs = self.specs
        shapes = None
        if type(tensors) is dict and self._gpu_index is not None:     # the per-step case: checked in one pass
            shapes = specs._fast_shapes(tensors, self._gpu_index)
        if shapes is None:
            try:
                shapes = specs.check_tensors(tensors, self.torch_device)
            except _Refusal as refusal:
                if self.metadata:
                    self._send_meta(lambda buf: specs.encode_refusal(buf, self.step + 1, refusal))
                raise BadInput(f"rank {self.rank}: step {self.step + 1} to rank {self.peer} refused, nothing "
                               f"sent: {refusal}") from None
        k = self.step + 1
        layout = specs._layouts.get(shapes) or specs.layout(shapes)
        if self.metadata:
            self._send_meta(lambda buf: specs.encode(buf, k, layout.shapes))
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
        if self._error is not None or self._state != "open" or self.role != "recv":
            self._check_usable("recv")
        k = self.step + 1
        if out is not None:
            self.specs.check_out(out, self.torch_device)
        most = self.max_pending
        if most is not None and len(self._pending) >= most:
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
        self._check_usable("synchronize")
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
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
        if self._state in ("closed", "aborted"):
            return
        self._state = "aborted"
        if self._error is None:
            self._error = GpuxferError(f"rank {self.rank}: the {self.name} transport with rank {self.peer} "
                                       f"was aborted")
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

    def _send_meta(self, fill) -> None:
        t0 = self._waiting_since = time.monotonic()
        try:
            i = self.meta.next_send_buffer(self.timeout_s, self._failed)
            fill(self.meta.send_buffers[i])
            self.meta.send(i)
        except Exception as exc:  # noqa: BLE001 - a mailbox timeout, or gloo's error (closed or timed out)
            raise self._fail(self._meta_error(exc, self.step + 1, t0, "metadata send stuck")) from None
        finally:
            self._waiting_since = None

    def _wait_label(self, entry) -> str:
        """What a watchdog entry waits for, in words (logs)."""
        return "a pending wait"

    def _failed(self) -> bool:
        return self._error is not None

    def _meta_error(self, exc: BaseException, step: int, t0: float, what: str) -> BaseException:
        """The typed error of a failed metadata wait: the peer's connection closed (gloo says so before the
        timeout), the peer left a "gone" note, or a timeout."""
        if isinstance(exc, GpuxferError):
            return exc
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
            _exit_process(self, err)
        return self._error

    def _close_meta(self) -> None:
        if self.meta is not self.channel:
            self.meta.close()
        self.channel.close()

    def _materialize(self, rcv: Received) -> None:
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

    def _free_local(self) -> None:
        """Free what no peer has mapped (abort); default: everything (nothing is exported)."""
        self._free()

    @abc.abstractmethod
    def _allocated(self) -> int: ...


# --------------------------------------------------------------------------- watchdog


class _Watchdog:
    """One daemon thread per process polling every open transport's pending waits (off the transfer path)."""

    BUSY_S = 0.02
    IDLE_S = 0.2

    def __init__(self):
        self._transports: "weakref.WeakSet[Transport]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._at_exit = False

    def register(self, t: Transport) -> None:
        with self._lock:
            self._transports.add(t)
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="gpuxfer-pp-watchdog", daemon=True)
                self._thread.start()
                if not self._at_exit:
                    self._at_exit = True
                    atexit.register(self.stop)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (at interpreter exit). A daemon thread still inside a C++ call (a store read,
        a driver query) when the interpreter finalizes is unwound by ``pthread_exit`` through C++ frames,
        and the process aborts ("terminate called without an active exception")."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def open_transports(self) -> list:
        with self._lock:
            return [t for t in self._transports if t._state in ("open", "closing")]

    def _run(self) -> None:
        released = 0.0
        while not self._stop.is_set():
            with self._lock:
                live = [t for t in self._transports
                        if t._state == "open" and (t._error is None or t.watch_after_error)]
                failed = [t for t in self._transports if t._state == "open" and t._error is not None
                          and t.release_again and not t.watch_after_error]
            busy = False
            now = time.monotonic()
            if failed and now - released > 2 * GONE_POLL_S:
                released = now
                for t in failed:
                    try:
                        t._release_waits()
                    except Exception as exc:  # noqa: BLE001
                        log.debug("re-release of a failed %s transport: %s", t.name, exc)
            for t in live:
                waiting = t._waiting_since
                if not t._wd and waiting is None:
                    continue
                busy = True
                err = None
                if t._wd:
                    try:
                        with t._wd_lock:
                            if t._state != "open":
                                continue
                            err = t._watch(now)
                    except Exception as exc:  # noqa: BLE001 - a stream error found while polling
                        err = exc
                try:
                    since = waiting if waiting is not None else t._wd[0][2]
                except (IndexError, TypeError):   # popped meanwhile, or an entry without a start time
                    since = now
                if (err is None and t._error is None and t.signals is not None and now - since > GONE_POLL_S
                        and now - t._gone_checked > GONE_POLL_S):   # a wait that lasts: is the peer gone?
                    t._gone_checked = now
                    gone = t.signals.peer_gone()
                    if gone is not None:
                        err = PeerLost(rank=t.rank, peer=t.peer, step=t.step + 1,
                                       flag="metadata" if waiting is not None else "peer", after_s=now - since,
                                       why=f"rank {t.peer} {gone}", detail=f"{t.name} {t.role}")
                if err is not None:
                    try:
                        t._fail(err)
                    except Exception as exc:  # noqa: BLE001 - the watchdog must outlive any one transport
                        log.error("rank %d: failing the %s transport: %s", t.rank, t.name, exc)
            self._stop.wait(self.BUSY_S if busy else self.IDLE_S)


WATCHDOG = _Watchdog()


def _exit_process(failed: "Transport", err: BaseException) -> None:
    """``on_timeout="exit"``: log the error and every transport of this process, then end it."""
    try:
        log.critical("rank %d: the %s transport with rank %d failed and on_timeout='exit': ending the process "
                     "with code %d: %s", failed.rank, failed.name, failed.peer, EXIT_CODE, err)
        for t in WATCHDOG.open_transports():
            waits = ", ".join(f"step {w[0]} ({t._wait_label(w)}) for {time.monotonic() - w[2]:.1f} s"
                              for w in list(t._wd)[:4]) or "none"
            log.critical("rank %d: %s %s with rank %d: step %d, %s, pending waits: %s", t.rank, t.name, t.role,
                         t.peer, t.step, f"failed: {t._error}" if t._error is not None else "healthy", waits)
        for h in logging.getLogger().handlers + log.handlers:
            h.flush()
    finally:
        os._exit(EXIT_CODE)


# --------------------------------------------------------------------------- teardown


def close_all(transports: Sequence[Transport], timeout_s: float | None = None) -> None:
    """Tear transports down together in a safe order (idempotent), in at most the largest
    ``timeout_s`` + a few seconds whatever the peers do; the caller's process group is never used.

    1. release the GPU waits of every failed end first (a healthy end's drain may sit on the
       same stream behind them);
    2. drain each end's own streams (one deadline for all; a failed end gets
       :data:`FAILED_TEARDOWN_S`; an end that does not drain is released and drained briefly),
       then leave the peer a "closed" note (its waits for steps never sent fail at once);
    3. pair barrier with each peer in the store (all posted before any is waited, so a middle
       stage closing both of its transports cannot deadlock);
    4. close peer mappings;  5. pair barrier again;  6. free buffers.
    A barrier that times out (a peer gone or late) is logged; that end then frees only what no
    peer maps (as :meth:`Transport.abort`), and the rest goes at process exit.
    """
    todo = [t for t in transports if t._state == "open"]
    if not todo:
        return
    limit = max(t.timeout_s if timeout_s is None else float(timeout_s) for t in todo)
    deadline = time.monotonic() + limit
    for t in todo:
        t._state = "closing"
        if t._error is not None:
            try:
                t._release_waits()
            except Exception as exc:  # noqa: BLE001
                log.debug("release of a failed end: %s", exc)
    for t in todo:
        budget = deadline - time.monotonic()
        if t._error is not None:
            budget = min(budget, FAILED_TEARDOWN_S)
        drained = False
        try:
            drained = t._drain(max(0.05, budget))
        except Exception as exc:  # noqa: BLE001 - a failed stream: release and carry on
            log.warning("rank %d: %s transport with rank %d: drain failed: %s", t.rank, t.name, t.peer, exc)
        if not drained:
            log.warning("rank %d: %s transport with rank %d did not drain in %.3g s; releasing its GPU waits",
                        t.rank, t.name, t.peer, max(0.05, budget))
            try:
                t._release_waits()
                t._drain(FAILED_TEARDOWN_S)
            except Exception as exc:  # noqa: BLE001
                log.debug("release after a failed drain: %s", exc)
        try:
            t.meta.drain(min(FAILED_TEARDOWN_S, max(0.05, deadline - time.monotonic())))
            t.channel.drain(min(FAILED_TEARDOWN_S, max(0.05, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001
            pass
        with t._wd_lock:
            t._wd.clear()
        if t.signals is not None:    # after the drain: everything this end published has landed
            t.signals.leave("closed its end" if t._error is None else
                            f"closed its end after {type(t._error).__name__}: {t._error}")

    met = {id(t): True for t in todo}

    def barrier(label: str) -> None:
        posted = [t for t in todo if t.signals is not None and t.signals.post(label)]   # posted even where
        for t in todo:                                  # an earlier barrier failed: a late peer is not held up
            if t not in posted:
                met[id(t)] = False
        for t in posted:
            if not met[id(t)]:
                continue
            end = deadline if t._error is None else time.monotonic() + FAILED_TEARDOWN_S
            end = max(end, time.monotonic() + 1.0)      # a peer a moment behind still meets us
            if not t.signals.finish(label, end):
                met[id(t)] = False
                log.warning("rank %d: %s barrier with rank %d not met in time (the peer is gone or late); "
                            "tearing down without it", t.rank, label, t.peer)

    barrier("teardown-unmap")
    for t in todo:
        try:
            t._close_mappings()
        except Exception as exc:  # noqa: BLE001
            log.warning("rank %d: closing %s mappings: %s", t.rank, t.name, exc)
    barrier("teardown-free")
    for t in todo:
        with t._wd_lock:
            try:
                if met[id(t)]:
                    t._free()
                else:   # the peer may still map (and write) this end's buffers: free only what is ours alone
                    t._free_local()
            except Exception as exc:  # noqa: BLE001
                log.warning("rank %d: freeing %s buffers: %s", t.rank, t.name, exc)
            t._close_meta()
            t._state = "closed"
