"""ROCm streams, events, copies and flags: torch's streams (or dedicated ones with their own hardware
queue) wrapped as :class:`RocmStream`, torch events, ``hipMemcpyAsync`` (SDMA, no CU, where a peer's memory
is touched), ``hipStreamWriteValue64`` / ``hipStreamWaitValue64``, and host flag access through a pinned
word on a private stream: :class:`RocmStreams`, a component of :class:`~gpuxfer.platforms.rocm.RocmPlatform`.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Callable

from ..errors import BadInput, DriverError
from .base import Event, Platform, Stream, check_flag_ptr
from .rocm_hip import (HIP_ERROR_NOT_READY, HIP_MEMCPY_DEFAULT, HIP_MEMCPY_DEVICE_TO_DEVICE_NOCU,
                       HIP_MEMCPY_DEVICE_TO_HOST, HIP_MEMCPY_HOST_TO_DEVICE, HIP_STREAM_WAIT_VALUE_GTE, MASK64,
                       HipApi, HipDevices, hip_first)

log = logging.getLogger("gpuxfer.platforms.rocm")


class RocmStream(Stream):
    """A torch stream (``torch_stream``) and its native handle; ``hip_stream`` when gpuxfer created it.

    Streams from :meth:`RocmPlatform.create_stream` are owned (``platform`` set): ``close()`` destroys the
    HIP stream of a dedicated one and makes either kind refused from then on; the platform's ``close()``
    destroys those still open.
    """

    def __init__(self, device: int, torch_stream, hip_stream=None, dedicated: bool = False,
                 platform: "Platform | None" = None):
        self.device = device
        self.torch_stream = torch_stream
        self.handle = int(torch_stream.cuda_stream)
        self.hip_stream = hip_stream
        self.dedicated = dedicated
        self._platform = platform      # set only for owned streams
        self._closed = False

    def __repr__(self) -> str:
        return (f"RocmStream(device {self.device}, 0x{self.handle:x}"
                f"{', own hardware queue' if self.dedicated else ''})")


class RocmEvent(Event):
    def __init__(self, torch_event):
        self.torch_event = torch_event


def as_stream(stream) -> RocmStream:
    """``stream`` if it is an open :class:`RocmStream`, else :class:`~gpuxfer.errors.BadInput`."""
    if not isinstance(stream, RocmStream):
        raise BadInput(f"not a ROCm stream: {stream!r}")
    if stream._closed:
        raise BadInput(f"{stream!r} is closed")
    return stream


class RocmStreams:
    """The streams, events, copies and flags of a :class:`~gpuxfer.platforms.rocm.RocmPlatform`: the dedicated
    streams it created (``owner`` is their platform: ``stream.close()`` comes back through it), copies that
    take SDMA where ``is_peer_address`` says a peer's memory is touched, and host flag access through a
    pinned word on a private stream per device, given up after ``host_flag_timeout_s``."""

    def __init__(self, devices: HipDevices, api: HipApi, owner: Platform, is_peer_address: Callable[..., bool],
                 dedicated_queues: bool, host_flag_timeout_s: float):
        self._devices = devices
        self._api = api
        self._owner = owner
        self._is_peer_address = is_peer_address
        self.dedicated_queues = dedicated_queues
        self.host_flag_timeout_s = host_flag_timeout_s
        self._lock = threading.RLock()
        self._owned: list[RocmStream] = []              # dedicated streams still open
        self._host_io: dict[int, tuple] = {}            # device -> (pinned ptr, RocmStream, lock)

    def create(self, device: int, dedicated: bool | None = None) -> RocmStream:
        """A new stream; with ``dedicated`` (the default, ``GPUXFER_ROCM_DEDICATED_QUEUES=0`` turns it
        off) it has its own hardware queue, so a flag wait on it blocks nothing else."""
        import torch
        self._devices.check_open()
        device = self._devices.check(device)
        dedicated = self.dedicated_queues if dedicated is None else dedicated
        tdev = torch.device("cuda", device)
        if not dedicated:
            return RocmStream(device, torch.cuda.Stream(device=tdev), platform=self._owner)
        cus = max(1, self._devices.attribute("MultiprocessorCount", device))
        words = (cus + 31) // 32
        with self._devices.on(device):
            hs = hip_first(self._api("hipExtStreamCreateWithCUMask", words, [0xFFFFFFFF] * words,
                                     doing=f"creating a stream with its own hardware queue on device {device}"))
        s = RocmStream(device, torch.cuda.ExternalStream(int(hs), device=tdev), hip_stream=hs, dedicated=True,
                       platform=self._owner)
        with self._lock:
            self._owned.append(s)
        return s

    def destroy(self, stream: RocmStream) -> None:
        if stream.hip_stream is None:
            return
        with self._lock:
            if stream in self._owned:
                self._owned.remove(stream)
        hs, stream.hip_stream = stream.hip_stream, None
        self._api("hipStreamDestroy", hs, doing=f"destroying {stream!r}")

    def current(self, device: int) -> RocmStream:
        import torch
        device = self._devices.check(device)
        return RocmStream(device, torch.cuda.current_stream(torch.device("cuda", device)))

    def record_event(self, stream: Stream, event: Event | None = None) -> RocmEvent:
        import torch
        s = as_stream(stream)
        if type(event) is RocmEvent:
            event.torch_event.record(s.torch_stream)
            return event
        ev = torch.cuda.Event()
        ev.record(s.torch_stream)
        return RocmEvent(ev)

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        if not isinstance(event, RocmEvent):
            raise BadInput(f"not a ROCm event: {event!r}")
        as_stream(stream).torch_stream.wait_event(event.torch_event)

    def event_query(self, event: Event) -> bool:
        if not isinstance(event, RocmEvent):
            raise BadInput(f"not a ROCm event: {event!r}")
        return bool(event.torch_event.query())

    def launch(self, stream: Stream, fn: Callable[[], object]) -> None:
        import torch
        if not callable(fn):
            raise BadInput(f"launch needs a callable, got {fn!r}")
        with torch.cuda.stream(as_stream(stream).torch_stream):
            fn()

    # ---- copies ----
    def copy_kind(self, dst: int, src: int, device: int, force_nocu: bool = False) -> int:
        if force_nocu or self._is_peer_address(dst, device) or self._is_peer_address(src, device):
            return HIP_MEMCPY_DEVICE_TO_DEVICE_NOCU
        return HIP_MEMCPY_DEFAULT

    def copy_async(self, stream: Stream, dst: int, src: int, nbytes: int, *, force_nocu: bool = False) -> None:
        s = as_stream(stream)
        if nbytes < 0:
            raise BadInput(f"cannot copy {nbytes} bytes")
        if not nbytes:
            return
        kind = self.copy_kind(int(dst), int(src), s.device, force_nocu)
        self._api("hipMemcpyAsync", int(dst), int(src), int(nbytes), self._api.enum("hipMemcpyKind", kind), s.handle,
                  doing=f"queueing a copy of {nbytes} B 0x{int(src):x} -> 0x{int(dst):x} "
                        f"({'SDMA, no CU' if kind == HIP_MEMCPY_DEVICE_TO_DEVICE_NOCU else 'default'}) on {s!r}")

    def memset_async(self, stream: Stream, ptr: int, value: int, nbytes: int) -> None:
        s = as_stream(stream)
        if nbytes < 0 or not 0 <= int(value) <= 255:
            raise BadInput(f"memset of {nbytes} bytes to {value!r}: need nbytes >= 0 and a byte value")
        if nbytes:
            self._api("hipMemsetAsync", int(ptr), int(value), int(nbytes), s.handle,
                      doing=f"queueing a memset of {nbytes} B at 0x{int(ptr):x} on {s!r}")

    # ---- flags ----
    def write_flag(self, stream: Stream, ptr: int, value: int) -> None:
        s = as_stream(stream)
        check_flag_ptr(int(ptr))
        self._api("hipStreamWriteValue64", s.handle, int(ptr), int(value) & MASK64, 0,
                  doing=f"queueing a flag write of {value} to 0x{int(ptr):x} on {s!r}")

    def wait_flag(self, stream: Stream, ptr: int, value: int) -> None:
        s = as_stream(stream)
        check_flag_ptr(int(ptr))
        self._api("hipStreamWaitValue64", s.handle, int(ptr), int(value) & MASK64, HIP_STREAM_WAIT_VALUE_GTE, MASK64,
                  doing=f"queueing a flag wait 0x{int(ptr):x} >= {value} on {s!r}")

    def _host_io_for(self, device: int):
        with self._lock:
            io = self._host_io.get(device)
            if io is None:
                with self._devices.on(device):
                    pinned = int(hip_first(self._api("hipHostMalloc", 16, 0,
                                                     doing="allocating a pinned word for host flag access")))
                io = (pinned, self.create(device, dedicated=True), threading.Lock())
                self._host_io[device] = io
            return io

    def _host_copy(self, device: int, dst: int, src: int, kind: int, doing: str) -> None:
        _, s, _ = self._host_io_for(device)
        self._api("hipMemcpyAsync", dst, src, 8, self._api.enum("hipMemcpyKind", kind), s.handle, doing=doing)
        deadline = time.monotonic() + self.host_flag_timeout_s
        delay = 1e-5
        while True:
            try:
                self._api("hipStreamQuery", s.handle, doing=doing)
                return
            except DriverError as exc:
                if exc.status != HIP_ERROR_NOT_READY:
                    raise
                if time.monotonic() > deadline:
                    raise DriverError("hipStreamQuery", exc.status_name, exc.status, doing,
                                      f"the 8-byte copy did not finish in {self.host_flag_timeout_s:g} s") from None
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def read_flag(self, ptr: int, device: int) -> int:
        check_flag_ptr(int(ptr))
        pinned, _, lock = self._host_io_for(self._devices.check(device))
        with lock:
            self._host_copy(device, pinned, int(ptr), HIP_MEMCPY_DEVICE_TO_HOST,
                            f"reading the flag at 0x{int(ptr):x} from the host")
            return ctypes.c_int64.from_address(pinned).value

    def host_write_flag(self, ptr: int, value: int, device: int) -> None:
        check_flag_ptr(int(ptr))
        pinned, _, lock = self._host_io_for(self._devices.check(device))
        with lock:
            ctypes.c_uint64.from_address(pinned + 8).value = int(value) & MASK64
            self._host_copy(device, int(ptr), pinned + 8, HIP_MEMCPY_HOST_TO_DEVICE,
                            f"writing {value} to the flag at 0x{int(ptr):x} from the host")

    def close(self) -> None:
        """Destroy the dedicated streams still open (the host-access ones included) and free the pinned words;
        a failure is logged, and the rest released."""
        with self._lock:
            owned, self._owned = list(self._owned), []
            host_io, self._host_io = dict(self._host_io), {}
        for s in owned:
            s._closed = True
            try:
                self.destroy(s)
            except DriverError as exc:
                log.warning("%s", exc)
        for pinned, _, _ in host_io.values():
            try:
                self._api("hipHostFree", pinned, doing="freeing the pinned flag word")
            except DriverError as exc:
                log.warning("%s", exc)
