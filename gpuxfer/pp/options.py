"""How :func:`~gpuxfer.pp.connect` sets up a rank's transports: one frozen, checked options object.

``connect(group, send_to=..., recv_from=..., specs=..., options=ConnectOptions(...))`` keeps who talks to
whom and what travels in ``connect``'s own arguments; everything else is here. The settings may also be
passed to ``connect`` as keywords (``connect(..., recv_slots=4)``): :meth:`ConnectOptions.with_settings`
maps them onto the options object, the one place that does.

Values left ``None`` take their ``GPUXFER_*`` variable (:mod:`gpuxfer.config`) when ``connect`` runs;
values given are checked when the object is built (a bad one raises :class:`~gpuxfer.errors.BadInput`
naming it). :func:`meta_channel_from_env` and :func:`injected` resolve two of them; the backend registry
(:mod:`~gpuxfer.pp.backends`) and the timeouts (:mod:`~gpuxfer.pp.timeouts`) lie below this module.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Mapping

from .. import config
from ..errors import BadInput
from .backends import GRAPH_BACKEND, requested_backend
from .timeouts import resolve_on_timeout, resolve_timeout

MAX_RECV_SLOTS = 1024       # most receive slots a pair may have
ENV_INJECT = "GPUXFER_PP_INJECT_FAILURE"
ENV_META = "GPUXFER_PP_META_CHANNEL"


def _index(name: str, value, least: int) -> int:
    """``value`` as an int >= ``least`` (any integer type; a bool or anything else is refused)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise BadInput(f"{name} must be an integer >= {least}, got {value!r}") from None
    if n < least:
        raise BadInput(f"{name} must be >= {least}, got {n}")
    return n


def meta_channel_from_env(value: str | None = None) -> str:
    """``auto`` (a shared-memory mailbox for a pair on one host, else the CPU group) or ``group``."""
    return config.resolve(ENV_META, value, option="meta_channel")


INJECT_PHASES = ("check", "alloc", "open", "probe")


def injected(spec: str | None, rank: int) -> set[str]:
    """The setup phases ``spec`` (``RANK:PHASE[,RANK:PHASE...]``, else ``$GPUXFER_PP_INJECT_FAILURE``) fails on
    ``rank``; a malformed entry or an unknown phase is :class:`BadInput` whatever the rank."""
    spec = spec if spec is not None else config.get(ENV_INJECT)
    if not isinstance(spec, str):
        raise BadInput(f"inject_failure must be a string RANK:PHASE[,RANK:PHASE...], got {spec!r}")
    phases = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        r, _, phase = item.partition(":")
        phase = phase.strip() or "check"
        try:
            r = int(r)
        except ValueError:
            r = None
        if r is None or phase not in INJECT_PHASES:
            raise BadInput(f"{ENV_INJECT} / inject_failure entries are RANK:PHASE with PHASE one of "
                           f"{', '.join(INJECT_PHASES)}, got {item!r}")
        if r == rank:
            phases.add(phase)
    return phases


@dataclass(frozen=True)
class ConnectOptions:
    """The settings of :func:`~gpuxfer.pp.connect` (see its docstring for each one's effect).

    ``backend``: ``auto`` or a registered backend (default ``$GPUXFER_PP_TRANSPORT``). ``platform``: a
    platform object or name (default: the process's, :func:`gpuxfer.platforms.current`). ``device``:
    this rank's device (default ``$LOCAL_RANK`` or the rank, modulo the device count). ``timeout_s``
    (finite, > 0) and ``on_timeout`` (``raise`` | ``exit``): every wait's bound and what a failed
    transport does. ``metadata``: shapes travel with each step. ``recv_slots`` (2 to
    :data:`MAX_RECV_SLOTS`), ``flag_path``
    (``auto`` | ``remote`` | ``copy``), ``inline_bytes`` and ``recv_views`` tune the copy-engine backend;
    ``graph``: steps captured in CUDA graphs (the ``copy_engine_graph`` backend). ``meta_channel``
    (``auto`` | ``group``): where per-step metadata travels. ``device_group``: the NCCL group of the
    nccl backend. ``inject_failure``: a test hook, ``"RANK:PHASE[,RANK:PHASE...]"`` (phases
    ``check``, ``alloc``, ``open``, ``probe``).
    """

    backend: str | None = None
    platform: Any = None
    device: int | None = None
    timeout_s: float | None = None
    on_timeout: str | None = None
    metadata: bool = True
    recv_slots: int = 2
    flag_path: str | None = None
    inline_bytes: int | str | None = None
    recv_views: bool = False
    graph: bool = False
    meta_channel: str | None = None
    device_group: Any = None
    inject_failure: str | None = None

    def __post_init__(self) -> None:
        for name in ("metadata", "recv_views", "graph"):        # None and 0/1 read as False/True
            value = getattr(self, name)
            if value is not None and not isinstance(value, int):
                raise BadInput(f"{name} must be True or False, got {value!r}")
            object.__setattr__(self, name, bool(value))
        object.__setattr__(self, "recv_slots", _index("recv_slots", self.recv_slots, 2))
        if self.recv_slots > MAX_RECV_SLOTS:
            raise BadInput(f"recv_slots must be <= {MAX_RECV_SLOTS}, got {self.recv_slots} (each slot holds a "
                           f"whole step of the largest shapes)")
        if self.device is not None:
            object.__setattr__(self, "device", _index("device", self.device, 0))
        from ..flaglink import flag_path_from_env
        from .copy_engine import inline_bytes_from_env
        if self.timeout_s is not None:
            resolve_timeout(self.timeout_s)
        if self.on_timeout is not None:
            resolve_on_timeout(self.on_timeout)
        if self.flag_path is not None:
            flag_path_from_env(self.flag_path)
        if self.inline_bytes is not None:
            inline_bytes_from_env(self.inline_bytes)
        if self.meta_channel is not None:
            meta_channel_from_env(self.meta_channel)
        if self.backend is not None:
            wanted = requested_backend(self.backend)
            if self.graph and wanted not in ("auto", "copy_engine", GRAPH_BACKEND):
                raise BadInput(f"graph=True captures steps in CUDA graphs, which only the {GRAPH_BACKEND} backend "
                               f"does; backend {wanted!r} cannot be captured")
        if self.inject_failure is not None:
            injected(self.inject_failure, -1)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def with_settings(self, settings: Mapping[str, Any]) -> "ConnectOptions":
        """These options with ``settings`` (``connect``'s keywords) in place of their fields, checked again.

        A name that is no setting raises ``TypeError``, as an unknown keyword argument does."""
        unknown = sorted(set(settings) - set(self.fields()))
        if unknown:
            raise TypeError(f"connect() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                            f"its settings are {', '.join(self.fields())}")
        return dataclasses.replace(self, **settings) if settings else self
