"""A request's metadata rows through the agent (:class:`AuxRows`): each SGLang rank registers, beside its KV pool,
a buffer of its own on the agent's device (group ``aux``: one block per metadata row, a 64-byte stamp followed by
the rows of every aux buffer of SGLang's, back to back), so the prefill's last push of a request carries its rows
with its KV, before the notification word it bumps. No SGLang here.

SGLang's own aux buffers are host memory of each process (a peer's agent cannot reach them), so the rows pass
through these buffers: the prefill copies its request's rows into its buffer's row with the stamp
(:meth:`AuxRows.stage`) before it posts that push (``local_blocks={"kv": pages, "aux": [its row]}``,
``remote_blocks={"kv": ..., "aux": [the decode's row]}``); the decode zeroes the stamp of the row a request
names before it names it to the prefill (:meth:`AuxRows.clear`), reads the stamp while the request waits
(:meth:`AuxRows.stamp`) and, once the stamp is its request's and the word says the push that wrote it landed,
copies the rows into SGLang's aux buffers (:meth:`AuxRows.take`).

The stamp names the request (the decode's token), the notification slot and the value the push writes there,
each beside its complement: a row zeroed before it was named reads as no stamp, and a stamp read while a push
writes it (bytes of it still zero) fails the complement check, so only a whole stamp is taken.
"""
from __future__ import annotations

import ctypes
import logging
import numbers
import struct
import threading
import time
from typing import Any, List, Optional, Tuple

import numpy as np

from ...errors import BadInput, DriverError, GpuxferError, TransferTimeout
from .layout import _ints, read_aux_rows, write_aux_rows

AUX_GROUP = "aux"
STAMP_BYTES = 64
_MAGIC = 0x31574F5258475F  # b"_GXROW1" little-endian
_MASK = (1 << 64) - 1
_FMT = "<8Q"

log = logging.getLogger("gpuxfer.sglang")


#: queries of a copy's event before the wait sleeps between them: a row's copy takes tens of microseconds, and a
#: sleep of any length costs the thread ~60 us or more (the kernel's timer slack)
SPINS = 200


def wait_until(query, timeout_s: float, doing: str) -> None:
    """Poll ``query()`` (a device event's) until it is true, at most ``timeout_s``: ``TransferTimeout`` naming
    ``doing`` past it (a hung device never holds an SGLang thread for good). ``SPINS`` queries back to back
    first, then sleeps doubling from 2 us to 1 ms between them."""
    if query():
        return
    deadline = time.monotonic() + timeout_s
    spins, delay = 0, 2e-6
    while not query():
        if time.monotonic() > deadline:
            raise TransferTimeout(rank=0, step=0, flag=doing, expected=1, seen=None, timeout_s=timeout_s,
                                  what=f"{doing}: the device's copy did not complete")
        spins += 1
        if spins > SPINS:
            time.sleep(delay)
            delay = min(1e-3, 2 * delay)


def token_number(token: Optional[bytes]) -> Optional[int]:
    """The decode's request token as the stamp carries it (an int of at most 18 digits); None for anything else
    (that request's rows go on the control socket)."""
    if not token or len(token) > 18 or not token.isdigit() or int(token) == 0:
        return None
    return int(token)


def encode_stamp(token: int, slot: int, value: int) -> bytes:
    words = [_MAGIC, token, slot, value]
    return struct.pack(_FMT, *[w for v in words for w in (v & _MASK, ~v & _MASK)])


def decode_stamp(raw: bytes) -> Optional[Tuple[int, int, int]]:
    """``(token, slot, value)`` of a whole stamp; None for a zeroed, torn or foreign one."""
    w = struct.unpack(_FMT, raw[:STAMP_BYTES])
    if any(w[i] != (~w[i + 1] & _MASK) for i in range(0, 8, 2)) or w[0] != _MAGIC:
        return None
    return w[2], w[4], w[6]


class AuxRows:
    """This rank's buffer of metadata rows on its agent's device, registered as group ``aux`` of ``agent``.
    :meth:`create` returns None where ``kv_args`` has no aux buffers."""

    def __init__(self, agent: Any, kv_args: Any, index: int):
        import torch
        self.kv_args = kv_args
        self.items = _ints(kv_args, "aux_item_lens")
        lens = _ints(kv_args, "aux_data_lens")
        self.rows = min(n // i for n, i in zip(lens, self.items))
        self.row_bytes = STAMP_BYTES + sum(self.items)
        self.device = agent.platform.torch_device(agent.device)
        self._platform = agent.platform
        self._staged = None             # the prefill's rows as staged for their pushes (host memory, pinned on a GPU)
        self._staging_at = 0            # ... its address
        self.tensor = torch.zeros((self.rows, self.row_bytes), dtype=torch.uint8, device=self.device)
        self._tensor_at = self.tensor.data_ptr()
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self.timeout_s = float(agent.timeout_s)
        self._stuck: list = []          # host buffers of copies that timed out (the device may still reach them)
        # one device copy at a time through a pinned buffer of a row, kept (a copy that timed out leaves it to the
        # device: :meth:`_finish` keeps it for good and the next copy pins another), and one event
        self._lock = threading.Lock()
        self._host = self._event = None
        if self._stream is not None:
            self._host = torch.empty(self.row_bytes, dtype=torch.uint8, pin_memory=True)
            self._event = torch.cuda.Event()
        agent.register_group(AUX_GROUP, 1, {"aux.0": agent.layer_at(self.tensor.data_ptr(), self.tensor.numel(),
                                                                     self.row_bytes, index=index)})

    @classmethod
    def create(cls, agent: Any, kv_args: Any) -> Optional["AuxRows"]:
        """The rows of ``kv_args``' aux buffers registered with ``agent``; None where it has none, or where the
        agent cannot register them (memory it cannot export, logged): its requests' rows go in messages."""
        items, lens = _ints(kv_args, "aux_item_lens"), _ints(kv_args, "aux_data_lens")
        if (not items or not len(items) == len(lens) == len(_ints(kv_args, "aux_data_ptrs")) or min(items) <= 0
                or min(n // i for n, i in zip(lens, items)) < 1):
            return None     # (lists of different lengths: a row staged from some buffers would not fill its block)
        try:
            return cls(agent, kv_args, len(_ints(kv_args, "kv_data_ptrs")))
        except Exception as exc:        # noqa: BLE001 - any failure here only sends the rows in messages
            log.warning("gpuxfer: the metadata rows are not registered with the agent (%s: %s); they go on the "
                        "control socket", type(exc).__name__, exc)
            return None

    def _check(self, index: int) -> int:
        """``index`` as an int of the rows registered: ``BadInput`` for anything else (a bool, a float, which
        truncated would name another row, an int outside them)."""
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= int(index) < self.rows:
            raise BadInput(f"metadata row {index!r:.40} is no int of the {self.rows} rows registered")
        return int(index)

    def _device(self, doing: str, op, *args):
        """``op(*args)``, a failure of the device's copy (a torch error) raised as ``DriverError`` naming
        ``doing``: the SGLang threads calling here get gpuxfer's errors alone."""
        try:
            return op(*args)
        except GpuxferError:
            raise
        except Exception as exc:        # noqa: BLE001 - whatever the device raised, typed
            raise DriverError("torch", type(exc).__name__, 0, doing, str(exc)[:200]) from exc

    def _write(self, index: int, offset: int, data: bytes) -> None:
        if self._stream is None:        # host memory: written here and now
            ctypes.memmove(self.tensor.data_ptr() + index * self.row_bytes + offset, data, len(data))
            return
        import torch
        with self._lock:
            src = self._pinned()[:len(data)]
            src.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
            with torch.cuda.stream(self._stream):
                self.tensor[index, offset:offset + len(data)].copy_(src, non_blocking=True)
            self._finish(f"writing metadata row {index}")   # in device memory before anything posted or sent after

    def _read(self, index: int, start: int, stop: int) -> bytes:
        if self._stream is None:
            return ctypes.string_at(self.tensor.data_ptr() + index * self.row_bytes + start, stop - start)
        import torch
        with self._lock:
            out = self._pinned()[:stop - start]
            with torch.cuda.stream(self._stream):
                out.copy_(self.tensor[index, start:stop], non_blocking=True)
            self._finish(f"reading metadata row {index}")
            return out.numpy().tobytes()

    def _pinned(self):
        """The pinned buffer of this buffer's copies (under ``_lock``): a new one where a copy that timed out kept
        the last."""
        if self._host is None:
            import torch
            self._host = torch.empty(self.row_bytes, dtype=torch.uint8, pin_memory=True)
        return self._host

    def _finish(self, doing: str) -> None:
        """Wait (at most the agent's ``timeout_s``) for the copy just queued on this buffer's stream (under
        ``_lock``); where it timed out, its pinned buffer is kept for good (the device may still reach it)."""
        self._event.record(self._stream)
        try:
            wait_until(self._event.query, self.timeout_s, doing)
        except TransferTimeout:
            self._stuck.append(self._host)
            self._host = None
            raise

    # -- prefill

    def stage(self, index: int, token: int, slot: int, value: int, stream) -> None:
        """Row ``index`` of SGLang's aux buffers here, with the stamp of the decode's request ``token`` landing at
        ``value`` of notification ``slot``, into this buffer's row ``index`` (the push's source): written into the
        row's host staging, then copied to the device on ``stream`` (the agent's stream, where the push that carries
        it is posted next: stream order puts the copy first, and nothing on the host waits for it). The staging of
        a row is written again only for a later request of that row index, whose earlier push was waited for
        before SGLang could free the index."""
        index = self._check(index)
        data = encode_stamp(token, slot, value) + b"".join(read_aux_rows(self.kv_args, index))
        if len(data) != self.row_bytes:     # SGLang's aux lists changed since the rows were registered
            raise BadInput(f"metadata row {index}: {len(data) - STAMP_BYTES} bytes of rows read for a "
                           f"{self.row_bytes - STAMP_BYTES}-byte block")
        src = self.staging_row(index)
        ctypes.memmove(src, data, self.row_bytes)
        self._device(f"staging metadata row {index}", self._platform.copy_async, stream,
                     self._tensor_at + index * self.row_bytes, src, self.row_bytes)

    def staging(self):
        """The host staging of every row, pinned where the rows are on a GPU (an asynchronous copy from it): made
        at a prefill's startup (:mod:`.conn`), else at its first :meth:`stage`."""
        if self._staged is None:
            import torch
            staged = torch.zeros((self.rows, self.row_bytes), dtype=torch.uint8, pin_memory=self._stream is not None)
            self._staging_at, self._staged = staged.data_ptr(), staged
        return self._staged

    def staging_row(self, index: int) -> int:
        """The address of row ``index``'s host staging (:meth:`staging`)."""
        self.staging()
        return self._staging_at + index * self.row_bytes

    # -- decode

    def clear(self, index: int) -> None:
        """Zero row ``index``'s stamp (before a request names the row: what an earlier request left is no stamp)."""
        index = self._check(index)
        self._device(f"zeroing metadata row {index}'s stamp", self._write, index, 0, bytes(STAMP_BYTES))

    def stamp(self, index: int) -> Optional[Tuple[int, int, int]]:
        """Row ``index``'s stamp, ``(token, slot, value)``, or None (none whole)."""
        index = self._check(index)
        return decode_stamp(self._device(f"reading metadata row {index}'s stamp", self._read, index, 0, STAMP_BYTES))

    def row(self, index: int) -> bytes:
        """Row ``index`` as it is now, its stamp and rows (one device copy): :func:`decode_stamp` reads its
        stamp, :meth:`take` its rows."""
        index = self._check(index)
        return self._device(f"reading metadata row {index}", self._read, index, 0, self.row_bytes)

    def take(self, index: int, token: int, raw: Optional[bytes] = None) -> None:
        """Row ``index``'s rows into SGLang's aux buffers, where its stamp is request ``token``'s (read with the
        rows: ``raw``, the row as :meth:`row` read it once the push that wrote it landed, or read here);
        ``BadInput`` otherwise, nothing written."""
        index = self._check(index)
        if raw is None or len(raw) != self.row_bytes:
            raw = self.row(index)
        got = decode_stamp(raw)
        if got is None or got[0] != token:
            raise BadInput(f"metadata row {index} holds no row of this request (stamp {got!r})")
        rows: List[bytes] = []
        at = STAMP_BYTES
        for item in self.items:
            rows.append(raw[at:at + item])
            at += item
        write_aux_rows(self.kv_args, index, rows)
