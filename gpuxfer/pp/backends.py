"""The registry of stage hand-off backends: name -> (module, class), imported when first used.

``auto`` takes the first of :data:`ZERO_SM` (the peer-memory backends, in order of preference) that the
platform supports, else ``nccl`` (see :mod:`gpuxfer.pp.selection`). Adding a backend::

    register_backend("sdma", "gpuxfer.pp.sdma", "SdmaTransport", zero_sm=True)

Below :mod:`~gpuxfer.pp.options` and :mod:`~gpuxfer.pp.selection`, which both read it; code that reads the
registry at call time reads it through this module (``backends.BACKENDS``), which is where a test patches it.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .. import config
from ..errors import BadInput

if TYPE_CHECKING:
    from .transport import Transport

ENV_TRANSPORT = "GPUXFER_PP_TRANSPORT"

# name -> (module, class); zero-SM (peer-memory) backends in auto's order of preference
BACKENDS: dict[str, tuple[str, str]] = {
    "nccl": ("gpuxfer.pp.nccl", "NcclTransport"),
    "copy_engine": ("gpuxfer.pp.copy_engine", "CopyEngineTransport"),
    # ROCm; forced only (GPUXFER_PP_TRANSPORT=sdma) until it has run on hardware: see gpuxfer/pp/sdma.py
    "sdma": ("gpuxfer.pp.sdma", "SdmaTransport"),
    # steps captured in CUDA graphs (connect(graph=True)); never chosen by auto: see gpuxfer/pp/graph.py
    "copy_engine_graph": ("gpuxfer.pp.graph", "GraphTransport"),
}
GRAPH_BACKEND = "copy_engine_graph"
ZERO_SM: list[str] = ["copy_engine"]


def register_backend(name: str, module: str, cls: str, *, zero_sm: bool = True) -> None:
    """Add a backend (``zero_sm``: a peer-memory backend with CopyEngineTransport's setup phases)."""
    BACKENDS[name] = (module, cls)
    if zero_sm and name not in ZERO_SM:
        ZERO_SM.append(name)


def backend_class(name: str) -> type[Transport]:
    if name not in BACKENDS:
        raise BadInput(f"unknown PP transport {name!r}; known: auto, {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def requested_backend(backend: str | None = None) -> str:
    """``backend``, else ``$GPUXFER_PP_TRANSPORT``, else ``auto`` (validated)."""
    name = str(backend or config.get(ENV_TRANSPORT)).strip().lower()
    if name != "auto" and name not in BACKENDS:
        raise BadInput(f"{ENV_TRANSPORT}={name!r} is not a PP transport; choose auto, {', '.join(BACKENDS)}")
    return name
