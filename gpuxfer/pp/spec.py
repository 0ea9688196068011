"""What a stage hand-off moves: the tensor spec of a pair, the packed layout of one step and its metadata message.

:class:`SpecTable` holds the tensors to expect (name -> largest shape, dtype),
checks what the caller passes (before any GPU work and before metadata goes out),
lays out one step in a slot (offsets aligned to :data:`ALIGN` bytes, cached per
shape tuple, :class:`Layout`) and encodes / decodes the per-step metadata message
(shapes only: keys and dtypes are fixed by the spec). A sender's refused step
travels as a refusal message (:class:`Refusal`). :func:`as_bytes`,
:func:`byte_shape` and :func:`copy_bytes` move tensors as bytes, bit-exact.
"""
from __future__ import annotations

import math
import operator
import struct
from dataclasses import dataclass
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import BadInput, ProtocolError

ALIGN = 256                 # byte alignment of each tensor in a packed slot
MAX_NDIM = 8                # most dimensions a tensor may have
MAX_SLOT_BYTES = 1 << 48    # most bytes one step's largest shapes may need (past any device's memory)
META_MAGIC = 0x67787070     # "gxpp"
_NO_DIMS = (0,) * MAX_NDIM
_MAX_DIM = (1 << 63) - 1    # a dimension travels as an int64 word
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
    9: "a tensor is not a dense (strided) tensor",
    10: "a tensor's memory does not hold its bytes (a resized storage, or a tensor without data)",
}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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


class Refusal(BadInput):
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


def _dims(shape, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, or :class:`BadInput` naming ``what`` where it is not a sequence of at
    most :data:`MAX_NDIM` non-negative integers."""
    try:
        if isinstance(shape, (str, bytes)):
            raise TypeError
        dims = tuple(_dim(s) for s in shape)
    except (TypeError, ValueError):
        raise BadInput(f"{what}: shape {shape!r} is not a sequence of integers") from None
    if len(dims) > MAX_NDIM or any(not 0 <= s <= _MAX_DIM for s in dims):
        raise BadInput(f"{what}: shape {dims} needs <= {MAX_NDIM} dims, each in [0, 2**63 - 1]")
    return dims


def _dim(s) -> int:
    """One dimension as an int: any integer type (numpy's, a 0-d integer tensor), never a bool or a float."""
    if isinstance(s, bool):
        raise TypeError
    return operator.index(s)


def _bytes_viewable(dtype) -> bool:
    """Whether a step's tensors of ``dtype`` can be made and viewed as a receiver does (:meth:`SpecTable.fresh`,
    :meth:`SpecTable.views`) and as bytes (quantized dtypes cannot)."""
    import torch
    try:
        buf = torch.empty(8, dtype=dtype)
        buf.as_strided((1,), (1,), 0)
        buf.view(torch.uint8)
        return True
    except Exception:  # noqa: BLE001 - torch says no in several ways
        return False


def _unbacked(t, nbytes: int) -> str | None:
    """Why contiguous ``t``'s ``nbytes`` bytes are not memory a copy may read or write from ``data_ptr()`` on,
    or None: its storage was resized (freed, shrunk) after the tensor was made, which torch allows, or it has
    no data at all (a wrapper subclass, a fake tensor: a null ``data_ptr()``)."""
    if not nbytes:
        return None
    try:
        ptr, have, offset = t.data_ptr(), t.untyped_storage().nbytes(), t.storage_offset() * t.element_size()
    except Exception as exc:  # noqa: BLE001 - torch refuses in several ways
        return f"its memory cannot be reached ({type(exc).__name__}: {exc})"
    if not ptr:
        return "it has no data (a null data_ptr(): a tensor subclass or a fake tensor without memory)"
    if offset + nbytes > have:
        return (f"it needs {nbytes} B from byte {offset} of its storage, which holds {have} B (resized after "
                f"the tensor was made)")
    return None


def _span(shape: tuple[int, ...], itemsize: int) -> int:
    """The bytes a contiguous tensor of ``shape`` would span with each empty dimension counted as 1: what its
    strides and its byte view's last dimension reach, which must fit an int64 (torch's) even where it holds no
    element."""
    return math.prod(max(d, 1) for d in shape) * itemsize


def _strides_fit(shape: tuple[int, ...], itemsize: int) -> bool:
    return _span(shape, itemsize) <= _MAX_DIM


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
        for name in specs:
            if not isinstance(name, str) or not name:
                raise BadInput(f"tensor names must be non-empty strings, got {name!r}")
        for name in sorted(specs):
            entry = specs[name]
            if isinstance(entry, torch.Tensor):
                entry = (tuple(entry.shape), entry.dtype)
            try:
                shape, dtype = entry
            except (TypeError, ValueError):
                raise BadInput(f"spec of {name!r} must be (shape, dtype), got {entry!r}") from None
            if not isinstance(dtype, torch.dtype):
                raise BadInput(f"spec of {name!r}: {dtype!r} is not a torch dtype")
            if not _bytes_viewable(dtype):
                raise BadInput(f"spec of {name!r}: {dtype} tensors cannot be made and viewed as bytes (a quantized "
                               f"dtype?), which is how a step moves them")
            shape = _dims(shape, f"spec of {name!r}")
            if not math.prod(shape) and not _strides_fit(shape, torch.empty((), dtype=dtype).element_size()):
                raise BadInput(f"spec of {name!r}: shape {shape} has strides past 2**63 bytes (each empty "
                               f"dimension counted as 1)")     # (a shape with elements: its step's bytes, below)
            names.append(name)
            shapes.append(shape)
            dtypes.append(dtype)
        self.names: tuple[str, ...] = tuple(names)
        self.nameset = frozenset(names)
        self.max_shapes: tuple[tuple[int, ...], ...] = tuple(shapes)
        self.dtypes = tuple(dtypes)
        self.itemsizes = tuple(torch.empty((), dtype=d).element_size() for d in dtypes)
        self.max_numel = tuple(math.prod(s) for s in shapes)       # Python ints: no overflow
        self.max_nbytes = tuple(n * i for n, i in zip(self.max_numel, self.itemsizes))
        self.slot_bytes = max(ALIGN, sum(_align(n) for n in self.max_nbytes))
        if self.slot_bytes > MAX_SLOT_BYTES:
            raise BadInput(f"specs need {self.slot_bytes} B per step ({self.describe()}), more than the "
                           f"{MAX_SLOT_BYTES} B a step may hold")
        self.meta_len = 4 + len(names) * (1 + MAX_NDIM)
        self._tensor = torch.Tensor
        self._fast = tuple(zip(names, dtypes, (d.is_complex for d in dtypes)))
        # recv(shapes=...)'s shapes in spec order, one C call (a 1-tuple for one name)
        self._pick = operator.itemgetter(*names) if len(names) > 1 else lambda d, n=names[0]: (d[n],)
        self._layouts: dict[tuple, Layout] = {}
        self._decoded: dict[bytes, tuple] = {}     # metadata body (bytes) -> checked shapes
        self._rows: dict[tuple, np.ndarray] = {}   # shapes -> metadata row (the step word left 0)
        self._fresh: dict[tuple, tuple] = {}      # shapes -> how fresh() makes a step's tensors

    def digest(self) -> tuple:
        """What both ends of a pair must agree on (compared at setup)."""
        return (self.names, tuple(str(d) for d in self.dtypes), self.max_shapes)

    def describe(self) -> str:
        return ", ".join(f"{n}: {tuple(s)} {str(d).replace('torch.', '')}"
                         for n, s, d in zip(self.names, self.max_shapes, self.dtypes))

    def layout(self, shapes) -> Layout:
        """The packed layout of one step of ``shapes`` (spec order), cached per shape tuple. Shapes outside
        the spec (a dimension that is not a non-negative integer, more than :data:`MAX_NDIM` dimensions,
        more elements than the largest shape) are :class:`BadInput`: every cached layout fits its slot, so
        the per-step paths that find their shapes in the cache need no size check."""
        try:
            lay = self._layouts.get(shapes)
        except TypeError:                   # unhashable (lists): checked below
            lay = None
        if lay is None:
            if not isinstance(shapes, Sequence) or len(shapes) != len(self.names):
                raise BadInput(f"a step's layout needs {len(self.names)} shapes (spec order {self.names}), "
                               f"got {shapes!r}")
            shapes = tuple(self._checked_shape(i, s) for i, s in enumerate(shapes))
            offsets, nbytes, off, end = [], [], 0, 0
            for shape, item in zip(shapes, self.itemsizes):
                n = math.prod(shape) * item
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

    def fresh(self, layout: Layout, device) -> tuple[dict, object]:
        """New tensors for one step of ``layout`` on ``device``, the caller's own: views of one new buffer
        (one allocation, packed as ``layout`` says, its bytes from offset 0 on) and that buffer. The recipe
        is kept per layout: tensors of one dtype whose shapes differ only in their first dimension, packed
        without gaps (hidden states and residual), are one split of the buffer along it; other tensors of
        one dtype one ``as_strided`` each; mixed dtypes :meth:`views` of a uint8 buffer."""
        make = self._fresh.get(layout.shapes)
        if make is None:
            if len(self._fresh) > 4096:     # shapes vary per step (token counts): keep the cache bounded
                self._fresh.clear()
            make = self._fresh[layout.shapes] = self._fresh_recipe(layout)
        dtype, shape, split, parts = make
        import torch
        buf = torch.empty(shape, dtype=dtype, device=device)
        if split is not None:
            return dict(zip(self.names, buf.split_with_sizes(split))), buf
        if parts is not None:
            return {name: buf.as_strided(sh, strides, off) for name, sh, strides, off in parts}, buf
        return self.views(buf, layout), buf

    def _fresh_recipe(self, layout: Layout) -> tuple:
        """How :meth:`fresh` makes a step of ``layout``: (buffer dtype, buffer shape, first dimensions to split
        it into or None, per tensor (name, shape, strides, element offset) or None)."""
        import torch
        if len(set(self.dtypes)) > 1:
            return torch.uint8, (layout.buffer_bytes,), None, None
        item, shapes = self.itemsizes[0], layout.shapes
        packed = all(off == sum(layout.nbytes[:i]) for i, off in enumerate(layout.offsets))
        if packed and all(sh and sh[1:] == shapes[0][1:] for sh in shapes):
            return self.dtypes[0], (sum(sh[0] for sh in shapes), *shapes[0][1:]), tuple(sh[0] for sh in shapes), None
        return self.dtypes[0], (layout.buffer_bytes // item,), None, tuple(
            (name, sh, strides, off // item)
            for name, sh, strides, off in zip(self.names, shapes, layout.strides, layout.offsets))

    # ---- validation (before any GPU work and before metadata goes out) ----
    def fast_layout(self, tensors: dict, index: int) -> Layout | None:
        """The per-step path on a GPU: the layout of ``tensors`` where each of the spec's names holds a
        contiguous tensor of its dtype on device ``index`` (not a lazily negated or conjugated view) and
        their shapes have a cached layout (which :meth:`layout` holds only for shapes within the spec: the
        size checks of :meth:`check_tensors` hold); None sends any doubt to :meth:`check_tensors` (which
        says what is wrong). A dict of as many entries as the spec that holds every name has its keys."""
        if len(tensors) != len(self._fast):
            return None
        Tensor, shapes = self._tensor, []
        try:
            for name, dtype, cplx in self._fast:
                t = tensors.get(name)
                if (not isinstance(t, Tensor) or t.dtype is not dtype or t.get_device() != index
                        or not t.is_contiguous() or t.is_neg() or (cplx and t.is_conj())):
                    return None      # (only complex tensors carry a lazy conjugation)
                if _unbacked(t, t.nbytes) is not None:
                    return None
                shapes.append(t.shape)   # a torch.Size: equal to (and hashed as) the tuple of its dimensions
        except RuntimeError:         # a tensor without strides (sparse CSR, nested): check_tensors refuses it
            return None
        return self._layouts.get(tuple(shapes))

    def check_tensors(self, tensors, device) -> tuple[tuple[int, ...], ...]:
        """The shapes of ``tensors`` (spec order), or the first :class:`Refusal` that applies."""
        import torch
        if not isinstance(tensors, Mapping):
            raise Refusal(1, -1, f"send() takes a dict of tensors, got {type(tensors).__name__}")
        if tensors.keys() != self.nameset:
            extra = sorted(set(tensors) - self.nameset)
            missing = sorted(self.nameset - set(tensors))
            raise Refusal(2, -1, f"the tensors' keys differ from the setup spec: unexpected {extra}, "
                                  f"missing {missing} (spec: {self.describe()})")
        shapes = []
        for i, name in enumerate(self.names):
            t = tensors[name]
            if not isinstance(t, torch.Tensor):
                raise Refusal(1, i, f"{name!r} is a {type(t).__name__}, not a torch tensor")
            if t.layout is not torch.strided or t.is_nested:     # sparse, mkldnn, nested: no plain bytes
                raise Refusal(9, i, f"{name!r} is a {'nested' if t.is_nested else t.layout} tensor; pass a "
                                     f"dense (strided) one")
            if t.dtype != self.dtypes[i]:
                raise Refusal(3, i, f"{name!r} has dtype {t.dtype}, the setup spec says {self.dtypes[i]}")
            if t.device != device:
                raise Refusal(4, i, f"{name!r} is on {t.device}, the transport's device is {device}")
            if not t.is_contiguous():
                raise Refusal(5, i, f"{name!r} is not contiguous (strides {t.stride()}); pass .contiguous()")
            if t.is_conj() or t.is_neg():    # its bytes are not its values: copies move bytes
                raise Refusal(8, i, f"{name!r} is a lazily conjugated or negated view; pass .resolve_conj() / "
                                     f".resolve_neg()")
            if t.dim() > MAX_NDIM:
                raise Refusal(7, i, f"{name!r} has {t.dim()} dimensions, at most {MAX_NDIM} are supported")
            if t.numel() > self.max_numel[i]:
                raise Refusal(6, i, f"{name!r} of shape {tuple(t.shape)} ({t.numel() * self.itemsizes[i]} B) "
                                     f"is larger than its slot: the setup spec's largest shape is "
                                     f"{self.max_shapes[i]} ({self.max_nbytes[i]} B)")
            why = _unbacked(t, t.numel() * self.itemsizes[i])
            if why is not None:
                raise Refusal(10, i, f"{name!r} of shape {tuple(t.shape)} cannot be read: {why}")
            shapes.append(tuple(t.shape))
        return tuple(shapes)

    def check_shapes(self, shapes) -> tuple[tuple[int, ...], ...]:
        return self.layout_of(shapes).shapes

    def layout_of(self, shapes) -> Layout:
        """The layout of ``recv(shapes=...)``'s shapes, checked: a dict of shapes seen before is one lookup
        (a key equal to a cached one has the same, checked, integer shapes)."""
        if type(shapes) is dict and len(shapes) == len(self.names):
            try:
                lay = self._layouts.get(self._pick(shapes))
            except (KeyError, TypeError):
                lay = None
            if lay is not None:
                return lay
        if not isinstance(shapes, Mapping) or shapes.keys() != self.nameset:
            got = sorted(shapes) if isinstance(shapes, Mapping) else type(shapes).__name__
            raise BadInput(f"recv(shapes=...) needs a dict with exactly the keys {sorted(self.nameset)}, got {got}")
        return self.layout(tuple(shapes[name] for name in self.names))

    def _checked_shape(self, i: int, shape) -> tuple[int, ...]:
        """Shape ``shape`` of the spec's tensor ``i`` as a tuple of ints, or :class:`BadInput` where it is
        not one within the spec."""
        name = self.names[i]
        shape = _dims(shape, f"tensor {name!r}")
        if math.prod(shape) > self.max_numel[i]:
            raise BadInput(f"expected shape {shape} of {name!r} is larger than its slot "
                           f"(the setup spec's largest shape is {self.max_shapes[i]})")
        if not _strides_fit(shape, self.itemsizes[i]):
            raise BadInput(f"tensor {name!r}: shape {shape} has strides past 2**63 bytes (each empty dimension "
                           f"counted as 1)")
        return shape

    def check_out(self, out, device) -> dict:
        """``recv(out=...)``: persistent tensors the data is copied into (a prefix of each, by numel). Returns
        the tensors it checked, in a dict of its own: what the step writes (``out`` itself may change before
        ``.tensors``)."""
        import torch
        if not isinstance(out, Mapping) or out.keys() != self.nameset:
            raise BadInput(f"recv(out=...) needs a dict with exactly the keys {sorted(self.nameset)}")
        out = {name: out[name] for name in self.names}
        for i, name in enumerate(self.names):
            t = out[name]
            if not isinstance(t, torch.Tensor) or t.dtype != self.dtypes[i] or t.device != device:
                raise BadInput(f"out[{name!r}] must be a {self.dtypes[i]} tensor on {device}")
            if not t.is_contiguous() or t.numel() < self.max_numel[i] or t.is_conj() or t.is_neg():
                raise BadInput(f"out[{name!r}] must be contiguous (not a conjugated or negated view) with >= "
                               f"{self.max_numel[i]} elements (the setup spec's largest shape {self.max_shapes[i]})")
            why = _unbacked(t, self.max_nbytes[i])
            if why is not None:
                raise BadInput(f"out[{name!r}] cannot take the {self.max_nbytes[i]} B a step may write: {why}")
        # each tensor's bytes a step may fill: tensors sharing any would hand out another tensor's bytes
        spans = sorted((out[name].data_ptr(), out[name].data_ptr() + n, name)
                       for name, n in zip(self.names, self.max_nbytes) if n)
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise BadInput(f"recv(out=...): out[{a!r}] and out[{b!r}] share memory (the first "
                               f"{self.max_nbytes[self.names.index(a)]} B of each receive a step); pass tensors "
                               f"that do not overlap")
        return out

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

    def encode_refusal(self, buf: np.ndarray, step: int, refusal: Refusal) -> None:
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
            if not _strides_fit(shape, self.itemsizes[i]):
                raise ProtocolError(f"rank {rank}: rank {peer} claims shape {shape} for {name!r} at step {step}: "
                                    f"its strides pass 2**63 bytes; nothing was read")
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
