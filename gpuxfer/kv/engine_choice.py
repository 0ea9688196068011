"""Which KV engine to use by default between two devices, picked from the link between them.

Measured on H200 (``gpuxfer bench kv``): between two GPUs over NVLink the ``pack`` engine (gather on
the source GPU, one copy-engine transfer, scatter) is the fastest; on one GPU, where source and
destination pools share the device, ``pack`` moves every byte three times through the same HBM and
ran at 3-12% of the local copy rate while the one-kernel ``triton`` copy ran at 60-83%. Over PCIe
with peer access ``pack`` still wins: a few large copies instead of many small reads across the
bus. Without peer access no kernel can reach the other pool: ``copy_engine`` (the driver's copies).
On the host emulation the kernels run in Triton's interpreter: ``copy_engine`` (memcpy) is the
only one that moves a real request in reasonable time.

An engine the platform cannot run is passed over for the next candidate, with the reason kept: every
engine of the agent needs torch and the Triton kernels (:func:`kernel_reason`), whichever copies the bytes.
:func:`engine_report` says, for ``gpuxfer doctor``, whether each can run here.

Importing this module never imports torch or Triton.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple

__all__ = ["AGENT_ENGINES", "EngineChoice", "agent_engine_choice", "default_engine", "default_engine_choice",
           "engine_report",
           "engine_unavailable_reason", "kernel_reason", "peer_engine"]

#: the engines the agent runs
AGENT_ENGINES = ("triton", "pack", "copy_engine")


def kernel_reason(platform) -> str | None:
    """Why the Triton kernels cannot run here (None if they can). Never raises."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a reason, not a crash
        return f"triton is not importable: {type(exc).__name__}: {exc}"
    try:
        importlib.import_module("gpuxfer.kernels")
    except Exception as exc:  # noqa: BLE001
        return f"gpuxfer.kernels is not importable: {type(exc).__name__}: {exc}"
    return None


def engine_unavailable_reason(name: str, platform) -> str | None:
    """Why the agent's engine ``name`` cannot run on ``platform`` (None if it can). Never raises for an engine of
    :data:`AGENT_ENGINES`; :class:`~gpuxfer.errors.BadInput` for any other name."""
    if name not in AGENT_ENGINES:
        from ..errors import BadInput
        raise BadInput(f"unknown engine {name!r}; the agent runs {', '.join(AGENT_ENGINES)}")
    return kernel_reason(platform)      # the agent needs torch and the kernels, whatever its engine


def engine_report(platform) -> dict[str, str | None]:
    """For ``gpuxfer doctor``: every engine of the agent -> None (usable here) or why not."""
    return {name: engine_unavailable_reason(name, platform) for name in AGENT_ENGINES}


_EMULATION = "the host emulation: the kernels run in Triton's interpreter, memcpy does not"


class EngineChoice(NamedTuple):
    name: str
    reason: str


def _candidates(platform, src_dev: int, dst_dev: int) -> list[tuple[str, str]]:
    if platform.kernels_interpreted:
        return [("copy_engine", _EMULATION)]
    link = platform.link(src_dev, dst_dev)
    if src_dev == dst_dev or link.kind == "same-device":
        return [("triton", f"both pools on device {src_dev}: one kernel copies within its memory "
                           "(pack would move every byte three times through it)"),
                ("copy_engine", f"both pools on device {src_dev}")]
    if not link.peer_access:
        return [("copy_engine", f"devices {src_dev} and {dst_dev} have no peer access ({link.kind}): "
                                "no kernel can reach the other pool")]
    return [("pack", f"devices {src_dev} and {dst_dev} are linked by {link.kind}: pack on the source, "
                     "one copy-engine transfer, unpack"),
            ("triton", f"devices {src_dev} and {dst_dev} are linked by {link.kind}"),
            ("copy_engine", f"devices {src_dev} and {dst_dev} are linked by {link.kind}")]


def default_engine_choice(platform, src_dev: int, dst_dev: int) -> EngineChoice:
    """The engine to move KV blocks from ``src_dev`` to ``dst_dev`` by default, and why."""
    passed = []
    for name, why in _candidates(platform, int(src_dev), int(dst_dev)):
        not_here = engine_unavailable_reason(name, platform)
        if not_here is None:
            return EngineChoice(name, why + "".join(f"; {p}" for p in passed))
        passed.append(f"{name} cannot run here: {not_here}")
    return EngineChoice("copy_engine", "; ".join(passed))


def agent_engine_choice(platform) -> EngineChoice:
    """The engine of ``KVAgent(engine="auto")``: :func:`default_engine_choice`'s candidates an agent can take on
    its own. ``pack`` is left out, since both agents of a pair must run it (pass ``engine="pack"`` to both where
    :func:`default_engine` says it wins); a peer whose caches this process cannot address then gets
    ``copy_engine`` (:func:`peer_engine`)."""
    if platform.kernels_interpreted:
        return EngineChoice("copy_engine", _EMULATION)
    return EngineChoice("triton", "one kernel over the peer's blocks, posted by one side alone")


def default_engine(platform, src_dev: int, dst_dev: int) -> str:
    """The name of :func:`default_engine_choice`'s engine (e.g. ``"pack"`` between two NVLinked GPUs,
    ``"triton"`` on one GPU)."""
    return default_engine_choice(platform, src_dev, dst_dev).name


def peer_engine(engine: str, auto: bool, peer: str, addressable: bool) -> str:
    """The engine of a :class:`~gpuxfer.kv.agent.KVAgent`'s transfers with a peer: the agent's ``engine``, but,
    where this process cannot address the peer's caches (another process's plain memory the host emulation
    reaches by cross-memory-attach copies, :mod:`gpuxfer.platforms.host_cma`), ``copy_engine`` when the agent
    was built with ``engine="auto"`` (``auto``), and :class:`~gpuxfer.errors.BackendUnavailable` for
    ``triton``, whose kernel runs over the peer's caches (``pack`` touches only each side's own caches and the
    peer's shared-memory staging; ``copy_engine`` only copies)."""
    if addressable:
        return engine
    if auto:
        return "copy_engine"
    if engine == "triton":
        from ..errors import BackendUnavailable
        raise BackendUnavailable("triton", {peer: (
            "its caches are another process's memory this process cannot address (the host emulation reaches "
            "plain process memory by cross-memory-attach copies, never by a kernel): use engine='copy_engine' or "
            "'auto' (or register caches of Platform.alloc + as_tensor)")})
    return engine
