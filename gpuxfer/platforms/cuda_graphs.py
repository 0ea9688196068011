"""CUDA graphs: stream capture of what a callable enqueues on an owned stream, instantiated as a
:class:`CudaGraph` and launched on any stream. Mixed into :class:`~gpuxfer.platforms.cuda.CudaPlatform`.
"""
from __future__ import annotations

import weakref
from typing import Callable

from ..errors import BadInput
from . import cuda_driver
from .base import Stream
from .cuda_driver import _cu, _driver
from .cuda_entry import CUDA_SUCCESS


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


class _CudaGraphs:
    """The graph hooks of :class:`~gpuxfer.platforms.cuda.CudaPlatform` (``_stream``, ``_on``,
    ``_stream_op``)."""

    # ---- graph capture ----
    def is_capturing(self, stream: Stream) -> bool:
        """``cuStreamIsCapturing``: True while ``stream`` records a graph (an invalidated capture included)."""
        s = self._stream(stream)
        with self._on(s.device):
            status = _cu(_driver().cuStreamIsCapturing, s.handle, doing=lambda: f"asking whether {s!r} captures")
        return int(status) != 0      # CU_STREAM_CAPTURE_STATUS_NONE

    def capture_graph(self, stream: Stream, record: Callable[[Stream], object]) -> CudaGraph:
        """Stream capture (thread-local mode) of what ``record(stream)`` enqueues, instantiated."""
        s = self._stream(stream)
        if not s.owned:
            raise BadInput(f"capture_graph needs a stream of create_stream, got {s!r}")
        drv = _driver()
        with self._on(s.device):
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

    def launch_graph(self, stream: Stream, graph) -> None:
        s = self._stream(stream)
        if type(graph) is not CudaGraph:
            raise BadInput(f"not a CUDA graph: {graph!r}")
        self._stream_op(s, _driver().cuGraphLaunch, graph.exe, s.handle,
                        doing=lambda: f"launching {graph!r} on {s!r}")
