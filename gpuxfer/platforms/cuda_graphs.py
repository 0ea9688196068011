"""CUDA graphs: stream capture of what a callable enqueues on an owned stream, instantiated as a
:class:`CudaGraph` and launched on any stream: :class:`CudaGraphs`, a component of
:class:`~gpuxfer.platforms.cuda.CudaPlatform`.
"""
from __future__ import annotations

import gc
import threading
import weakref
from typing import Callable

from ..errors import BadInput
from . import cuda_driver
from .base import Stream
from .cuda_driver import CudaContexts, _cu, _driver
from .cuda_entry import CUDA_SUCCESS
from .cuda_streams import as_stream


class CudaGraph:
    """An instantiated CUDA graph (``CUgraphExec``) and its graph; destroyed when collected (a launch still
    in flight finishes first: the driver frees it afterwards)."""

    def __init__(self, device: int, graph, exe):
        self.device = device
        self.exe = exe
        self.handle = int(exe)      # the CUgraphExec as an int (for entry points called through ctypes)
        weakref.finalize(self, _destroy_graph, exe, graph)

    def __repr__(self) -> str:
        return f"CudaGraph(cuda:{self.device}, 0x{int(self.exe):x})"


def _destroy_graph(exe, graph) -> None:
    try:
        cuda_driver._DRIVER.cuGraphExecDestroy(exe)
        cuda_driver._DRIVER.cuGraphDestroy(graph)
    except Exception:  # noqa: BLE001 - interpreter exit: the driver may be gone first
        pass


class _NoCollection:
    """``with _NO_COLLECTION:`` -- the garbage collector off inside, on every thread, until the last such block
    of any thread ends; then as it was before the first began."""

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._restore = False

    def __enter__(self):
        with self._lock:
            if self._depth == 0:
                self._restore = gc.isenabled()
                gc.disable()
            self._depth += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._restore:
                gc.enable()


_NO_COLLECTION = _NoCollection()


class CudaGraphs:
    """Graph capture and launch on the streams of a :class:`~gpuxfer.platforms.cuda.CudaPlatform` (no state of
    its own: a graph is freed when collected)."""

    def __init__(self, contexts: CudaContexts):
        self._ctx = contexts

    def is_capturing(self, stream: Stream) -> bool:
        """``cuStreamIsCapturing``: True while ``stream`` records a graph (an invalidated capture included)."""
        s = as_stream(stream)
        with self._ctx.on(s.device):
            status = _cu(_driver().cuStreamIsCapturing, s.handle, doing=lambda: f"asking whether {s!r} captures")
        return int(status) != 0      # CU_STREAM_CAPTURE_STATUS_NONE

    def capture(self, stream: Stream, record: Callable[[Stream], object]) -> CudaGraph:
        """Stream capture (thread-local mode) of what ``record(stream)`` enqueues, instantiated.

        The garbage collector is off while it lasts: a collection that an allocation inside ``record`` set off
        would run finalizers on this thread, and one driver call a capture forbids on its thread (a synchronise,
        a query) among them ends the capture invalidated."""
        s = as_stream(stream)
        if not s.owned:
            raise BadInput(f"capture_graph needs a stream of create_stream, got {s!r}")
        with _NO_COLLECTION:
            return self._capture(s, record)

    def _capture(self, s, record: Callable[[Stream], object]) -> CudaGraph:
        drv = _driver()
        with self._ctx.on(s.device):
            _cu(drv.cuStreamBeginCapture, s.handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                doing=lambda: f"starting a capture on {s!r}")
            try:
                record(s)
            except BaseException:
                res = drv.cuStreamEndCapture(s.handle)
                if int(res[0]) == CUDA_SUCCESS and len(res) > 1 and res[1] is not None:
                    drv.cuGraphDestroy(res[1])
                raise
            graph = _cu(drv.cuStreamEndCapture, s.handle, doing=lambda: f"ending the capture on {s!r}")
            try:
                exe = _cu(drv.cuGraphInstantiate, graph, 0, doing=lambda: f"instantiating a graph captured on {s!r}")
            except BaseException:
                drv.cuGraphDestroy(graph)
                raise
        return CudaGraph(s.device, graph, exe)

    def launch(self, stream: Stream, graph) -> None:
        s = as_stream(stream)
        if type(graph) is not CudaGraph:
            raise BadInput(f"not a CUDA graph: {graph!r}")
        self._ctx.stream_op(s, _driver().cuGraphLaunch, graph.exe, s.handle,
                            doing=lambda: f"launching {graph!r} on {s!r}")
