"""Choosing and setting up a stage hand-off backend, collectively, so every rank makes the same choice.

``GPUXFER_PP_TRANSPORT`` (or ``connect(backend=...)``) is ``auto`` (default),
``nccl`` or ``copy_engine`` (or any backend in :data:`BACKENDS`).

:func:`connect` is called by EVERY rank of the CPU group (ranks holding no
transport too). Each rank runs every check that can differ between ranks --
the platform, 64-bit stream memory operations, the link between the two
stages' devices (``platform.link``), the same node (host names), allocation,
opening the peer's handles, the remote-write probe -- inside ``try``, and the
errors are exchanged with ``all_gather_object`` after each phase (every rank
calls every exchange; there are no early returns). Then:

* no rank failed: the zero-SM backend is used everywhere;
* ``auto`` and some rank failed: every rank closes its peer mappings, meets the
  others at a barrier, frees its buffers, falls back to NCCL, and logs why
  (each failing rank's reason);
* a zero-SM backend forced and some rank failed: every rank frees the same way
  and raises :class:`BackendUnavailable` carrying each failing rank's reason.

The choice is logged once per rank. :func:`backend_report` gives each
backend's local verdict for ``gpuxfer doctor``.

Adding a backend (e.g. ``sdma`` for ROCm, subclassing
:class:`~gpuxfer.pp.copy_engine.CopyEngineTransport`)::

    register_backend("sdma", "gpuxfer.pp.sdma", "SdmaTransport", zero_sm=True)

A zero-SM backend's class provides ``platforms``, ``unavailable_reason(platform,
device)`` and the ``setup_*`` phases of ``CopyEngineTransport``; ``auto`` tries
the registered zero-SM backends in order and takes the first whose
``platforms`` include the platform in use.

Test hook: ``GPUXFER_PP_INJECT_FAILURE=RANK:PHASE[,RANK:PHASE...]`` (or
``inject_failure=``) makes that rank's zero-SM setup fail in PHASE (``check``,
``alloc``, ``open``, ``probe``).
"""
from __future__ import annotations

import importlib
import itertools
import logging
import os
import secrets
import socket
from typing import Iterable, Mapping

from .. import config
from ..errors import BackendUnavailable, BadInput, GpuxferError, SetupFailed
from .options import ConnectOptions
from .transport import (PairSignals, SpecTable, Transport, close_all, resolve_on_timeout, resolve_timeout,
                        WATCHDOG)

log = logging.getLogger("gpuxfer.pp")

ENV_TRANSPORT = "GPUXFER_PP_TRANSPORT"
ENV_INJECT = "GPUXFER_PP_INJECT_FAILURE"
ENV_META = "GPUXFER_PP_META_CHANNEL"
FALLBACK = "nccl"
TAG_BASE = 1 << 20
_TAGS_PER_CONNECTION = 1024
_CONN_IDS = itertools.count()

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


def _nccl_reason(platform) -> str | None:
    try:
        import torch.distributed as dist
    except Exception as exc:  # noqa: BLE001
        return f"torch.distributed cannot be imported: {exc}"
    if not dist.is_available():
        return "torch was built without torch.distributed"
    if platform.collective_backend == "gloo":
        return None if dist.is_gloo_available() else "gloo is not available in this torch build"
    return None if dist.is_nccl_available() else "NCCL is not available in this torch build"


def backend_report(platform) -> dict[str, str | None]:
    """Each backend: None if usable on this node as far as local checks tell, else the reason."""
    report: dict[str, str | None] = {}
    for name in BACKENDS:
        try:
            cls = backend_class(name)
            if name == FALLBACK:
                report[name] = _nccl_reason(platform)
                continue
            why = cls.unavailable_reason(platform, None)
            if why is None and platform.device_count() >= 2:
                link = platform.link(0, 1)
                if not link.is_fast:
                    why = (f"devices 0 and 1 are linked by {link.kind}{' (' + link.detail + ')' if link.detail else ''}"
                           f", not NVLink-class: stages on different devices would fall back to nccl "
                           f"(same-device pairs still work)")
            report[name] = why
        except Exception as exc:  # noqa: BLE001 - a report, not a crash
            report[name] = f"{type(exc).__name__}: {exc}"
    return report


# --------------------------------------------------------------------------- the connection


class Connection:
    """What :func:`connect` returns: this rank's transports, by peer, and the backend chosen.

    ``senders[peer]`` sends to ``peer``; ``receivers[peer]`` receives from it.
    ``backend`` is the backend in use; ``fallback_reasons`` (rank -> reason)
    says why ``auto`` fell back to NCCL (empty otherwise).
    """

    def __init__(self, backend: str, senders: dict[int, Transport], receivers: dict[int, Transport],
                 fallback_reasons: dict[int, str], rank: int):
        self.backend, self.senders, self.receivers = backend, senders, receivers
        self.fallback_reasons, self.rank = fallback_reasons, rank

    @property
    def transports(self) -> list[Transport]:
        return list(self.receivers.values()) + list(self.senders.values())

    @property
    def allocated_bytes(self) -> int:
        return sum(t.allocated_bytes for t in self.transports)

    def sender(self, peer: int | None = None) -> Transport:
        return self._one(self.senders, peer, "sends to")

    def receiver(self, peer: int | None = None) -> Transport:
        return self._one(self.receivers, peer, "receives from")

    def _one(self, d: dict, peer, what: str) -> Transport:
        if not d:
            side, other = ("send", "receives from") if what == "sends to" else ("receive", "sends to")
            others = sorted(self.receivers if side == "send" else self.senders)
            raise BadInput(f"rank {self.rank} has no {side} side in this connection"
                           + (f" (it only {other} {others})" if others else " (it holds no transport)"))
        if peer is None:
            if len(d) != 1:
                raise BadInput(f"rank {self.rank} {what} {sorted(d)}: name the peer")
            return next(iter(d.values()))
        if peer not in d:
            raise BadInput(f"rank {self.rank} {what} {sorted(d)}, not rank {peer}")
        return d[peer]

    def synchronize(self, timeout_s: float | None = None) -> None:
        for t in self.transports:
            t.synchronize(timeout_s)

    def close(self) -> None:
        """Tear every transport down together (safe order, see :func:`close_all`). Idempotent."""
        close_all(self.transports)

    def abort(self) -> None:
        for t in self.transports:
            t.abort()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Connection(rank {self.rank}, {self.backend}, sends to {sorted(self.senders)}, "
                f"receives from {sorted(self.receivers)})")


# --------------------------------------------------------------------------- helpers


def _ranks(x) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, int):
        return (x,)
    out = tuple(int(r) for r in x)
    if len(set(out)) != len(out):
        raise BadInput(f"duplicate peer ranks in {out}")
    return out


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _injected(spec: str | None, rank: int) -> set[str]:
    spec = spec if spec is not None else config.get(ENV_INJECT)
    phases = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        r, _, phase = item.partition(":")
        try:
            if int(r) == rank:
                phases.add(phase or "check")
        except ValueError:
            raise BadInput(f"{ENV_INJECT} entries are RANK:PHASE, got {item!r}") from None
    return phases


def _inject(phases: set[str], phase: str) -> None:
    if phase in phases:
        raise GpuxferError(f"injected setup failure in phase {phase!r} ({ENV_INJECT})")


def _torch_device(platform, device: int):
    import torch
    return platform.torch_device(device)


def _cpu_group(group):
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise BadInput("connect() needs torch.distributed initialised (a gloo CPU group for metadata)")
    if group is None:
        group = dist.group.WORLD
    if "gloo" not in str(dist.get_backend(group)).lower():
        raise BadInput(f"connect() needs a CPU (gloo) process group, got backend {dist.get_backend(group)!r}: "
                       f"pass group=dist.new_group(backend='gloo')")
    return group


class _Exchange:
    """all_gather_object over the CPU group, indexed by global rank; a rank that died or left mid-way
    (gloo's RuntimeError) becomes :class:`SetupFailed`."""

    def __init__(self, group):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank()
        self.round = 0

    def __call__(self, obj) -> dict[int, dict]:
        out = [None] * self.size
        self.round += 1
        try:
            self.dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            raise SetupFailed(f"rank {self.rank}: pp connect: exchange {self.round} over the CPU group failed: "
                              f"a rank of the group died or left connect() ({exc})") from exc
        return {o["rank"]: o for o in out}


# --------------------------------------------------------------------------- connect


def connect(group=None, *, send_to: int | Iterable[int] | None = None, recv_from: int | Iterable[int] | None = None,
            specs: Mapping | None = None, send_specs: Mapping | None = None, recv_specs: Mapping | None = None,
            options: ConnectOptions | None = None, **settings) -> Connection:
    """Set up this rank's stage hand-off transports; collective over ``group`` (every rank calls it).

    Who talks to whom and what travels are the arguments below; every other setting is a field of
    ``options`` (a :class:`~gpuxfer.pp.ConnectOptions`, checked when built), or the same name passed as a
    keyword (``connect(..., recv_slots=4)``: it takes the place of that field of ``options``).

    ``send_to`` / ``recv_from``: global rank(s) this rank sends to / receives
    from (each pair is one transport; both ends must name each other).
    ``specs`` (or ``send_specs`` / ``recv_specs``): name -> (largest shape,
    dtype); both ends of a pair must agree. ``group``: a gloo group (default:
    the world group, which must then be gloo-capable). The settings -- ``device``: this rank's
    device (default ``$LOCAL_RANK`` or the rank, modulo the device count).
    ``metadata=False``: shapes do not travel; receivers pass ``recv(shapes=...)``.
    ``device_group``: the NCCL group for the nccl backend (default: ``group``
    on the host emulation or if it is NCCL-capable, else a new NCCL group over
    ``group``'s ranks -- which needs every process of the default group to call
    ``connect``). ``recv_slots`` (>= 2), ``flag_path`` (auto|remote|copy,
    default ``$GPUXFER_FLAG_PATH``) and ``inline_bytes`` (the largest step sent
    without staging, default ``$GPUXFER_PP_INLINE_BYTES`` or 1 MiB; a sender's own
    choice) tune the copy-engine backend. ``meta_channel``
    (auto|group, default ``$GPUXFER_PP_META_CHANNEL``): a pair on one host passes its
    per-step metadata through a shared-memory mailbox (``auto``) or the CPU group.
    ``recv_views=True`` (copy-engine receivers): ``.tensors`` are views of the
    receive slot itself -- no allocation, no copy-out -- valid until the next
    ``.tensors`` access on that transport, whose wait hands the slot back to the
    sender in stream order (after the work queued on the views by then);
    ``recv(out=...)`` still copies.
    ``graph=True``: steps are captured in CUDA graphs and moved by replays (the
    ``copy_engine_graph`` backend, :mod:`gpuxfer.pp.graph`); there is no fallback,
    since NCCL's steps cannot be replayed this way: a rank that cannot set it up
    makes every rank raise :class:`BackendUnavailable`.
    ``timeout_s`` (default ``$GPUXFER_PP_TIMEOUT_S`` or 300; finite, > 0) bounds every
    wait; ``on_timeout`` (``raise`` | ``exit``, default ``$GPUXFER_PP_ON_TIMEOUT`` or
    ``raise``) is what a failed transport does (see :mod:`gpuxfer.pp.transport`).
    A rank that dies during setup makes the others raise :class:`SetupFailed`. Pairs
    whose metadata travels over the CPU group get a two-rank gloo group of their own
    (a timed-out gloo wait closes the pair it waited on); teardown barriers are keys in
    the store: the caller's group carries only the setup exchanges.
    """
    unknown = sorted(set(settings) - set(ConnectOptions.fields()))
    if unknown:      # a misspelt keyword fails here, before any collective, like any unexpected keyword argument
        raise TypeError(f"connect() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    import torch.distributed as dist

    group = _cpu_group(group)
    rank = dist.get_rank()
    exchange = _Exchange(group)
    plat = opts = None
    info = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "counter": next(_CONN_IDS),
            "nonce": secrets.randbits(40) << 8, "err": None}
    try:
        if options is not None and not isinstance(options, ConnectOptions):
            raise BadInput(f"options must be a gpuxfer.pp.ConnectOptions, got {type(options).__name__}")
        opts = (options or ConnectOptions()).with_settings(settings)
        if opts.platform is None or isinstance(opts.platform, str):
            from ..platforms import current
            plat = current(opts.platform)            # the process's: closed at exit, never here
        else:
            plat = opts.platform
        device = opts.device
        if device is None:
            device = int(os.environ.get("LOCAL_RANK", rank)) % plat.device_count()
        plat.set_device(device)
        dinfo = plat.device_info(device)
        sends, recvs = _ranks(send_to), _ranks(recv_from)
        if rank in sends or rank in recvs:
            raise BadInput(f"rank {rank} cannot send to or receive from itself")
        sspec = SpecTable(send_specs or specs) if sends else None
        rspec = SpecTable(recv_specs or specs) if recvs else None
        meta_mode = meta_channel_from_env(opts.meta_channel)
        wanted = requested_backend(opts.backend)
        if opts.graph:
            if wanted not in ("auto", "copy_engine", GRAPH_BACKEND):
                raise BadInput(f"graph=True captures steps in CUDA graphs, which only the {GRAPH_BACKEND} backend "
                               f"does; backend {wanted!r} cannot be captured")
            wanted = GRAPH_BACKEND
        info.update(platform=plat.name, device=device, pci=dinfo.pci_bus_id, backend=wanted,
                    timeout=resolve_timeout(opts.timeout_s), on_timeout=resolve_on_timeout(opts.on_timeout),
                    sends=sends, recvs=recvs,
                    sdig=sspec.digest() if sspec else None, rdig=rspec.digest() if rspec else None,
                    metadata=opts.metadata, slots=opts.recv_slots)
    except Exception as exc:  # noqa: BLE001 - exchanged, raised on every rank
        info["err"] = _reason(exc)
    infos = exchange(info)

    # ---- the same verdict everywhere ----
    problems: dict[int, str] = {r: i["err"] for r, i in infos.items() if i["err"]}
    if not problems:
        wanted = {i["backend"] for i in infos.values()}
        if len(wanted) > 1:
            problems.update({r: f"asks for backend {i['backend']!r}" for r, i in infos.items()})
        for r, i in infos.items():
            for d in i["sends"]:
                peer = infos.get(d)
                if peer is None:
                    problems[r] = f"sends to rank {d}, which is not in the group"
                elif r not in peer["recvs"]:
                    problems[r] = f"sends to rank {d}, which does not receive from it"
                elif i["sdig"] != peer["rdig"]:
                    problems[r] = f"send specs {i['sdig']} differ from rank {d}'s receive specs {peer['rdig']}"
                elif (i["metadata"], i["slots"]) != (peer["metadata"], peer["slots"]):
                    problems[r] = f"metadata/recv_slots differ from rank {d}'s"
            for s in i["recvs"]:
                peer = infos.get(s)
                if peer is None or r not in peer["sends"]:
                    problems[r] = f"receives from rank {s}, which does not send to it"
    if problems:
        raise BadInput("pp connect: inconsistent setup: " +
                       "; ".join(f"rank {r}: {why}" for r, why in sorted(problems.items())))

    conn_id = infos[min(infos)]["counter"]
    nonce = infos[min(infos)]["nonce"]
    pairs = sorted({(r, d) for r, i in infos.items() for d in i["sends"]})
    if len(pairs) * 4 > _TAGS_PER_CONNECTION:
        raise BadInput(f"too many pairs in one connect: {len(pairs)}")
    tag_of = {pair: TAG_BASE + (conn_id % 1000) * _TAGS_PER_CONNECTION + 4 * n for n, pair in enumerate(pairs)}
    me = infos[rank]
    common = dict(platform=plat, rank=rank, device=device, timeout_s=me["timeout"], metadata=me["metadata"],
                  group=group, torch_device=_torch_device(plat, device), on_timeout=me["on_timeout"])
    my_pairs = [("send", d, (rank, d), sspec) for d in me["sends"]] + \
               [("recv", s, (s, rank), rspec) for s in me["recvs"]]
    wanted = me["backend"]
    inject = _injected(opts.inject_failure, rank)

    chosen, ends, fallback = None, [], {}
    if wanted != FALLBACK:
        cand = wanted
        if wanted == "auto":
            lead = infos[min(infos)]["platform"]
            cand = next((b for b in ZERO_SM if lead in getattr(backend_class(b), "platforms", ())), None)
        if cand is None:
            fallback = {r: f"no zero-SM backend for platform {infos[r]['platform']!r}" for r in infos}
        else:
            ok, reasons, ends = _setup_peer_memory(cand, exchange, infos, my_pairs, common, tag_of, nonce,
                                                   recv_slots=me["slots"], flag_path=opts.flag_path,
                                                   inline_bytes=opts.inline_bytes, recv_views=opts.recv_views,
                                                   inject=inject)
            if ok:
                chosen = cand
            elif wanted == "auto":
                fallback = reasons
            else:
                raise BackendUnavailable(cand, reasons)
    if chosen is None:
        ends = _setup_nccl(exchange, infos, my_pairs, common, tag_of, plat, group, opts.device_group)
        chosen = FALLBACK

    for t in ends:
        t.signals = PairSignals.default(f"gpuxfer-pp/{nonce:x}/{tag_of[(t.rank, t.peer) if t.role == 'send' else (t.peer, t.rank)]:x}",
                                        rank, t.peer)
    try:
        _setup_mailboxes(exchange, infos, ends, tag_of, nonce, rank, meta_mode)
        _setup_pair_groups(ends, tag_of, nonce, rank)
    except SetupFailed:
        _discard(ends)
        raise
    senders = {t.peer: t for t in ends if t.role == "send"}
    receivers = {t.peer: t for t in ends if t.role == "recv"}
    for t in ends:
        WATCHDOG.register(t)
    notes = []
    paths = sorted({t.flags_via for t in ends if getattr(t, "flags_via", None)})
    if chosen != FALLBACK and paths:
        notes.append(f"flags: {', '.join(paths)}")
    if any(t.metadata for t in ends):
        notes.append("metadata over " + ", ".join(sorted({t.meta.what for t in ends if t.metadata})))
    detail = f" ({'; '.join(notes)})" if notes else ""
    if fallback:
        log.warning("rank %d: PP transport: nccl (auto fell back from the zero-SM backend: %s)", rank,
                    "; ".join(f"rank {r}: {why}" for r, why in sorted(fallback.items())))
    else:
        log.info("rank %d: PP transport: %s%s%s", rank, chosen, detail,
                 "" if wanted == chosen else f" (requested {wanted})")
    return Connection(chosen, senders, receivers, fallback, rank)


def meta_channel_from_env(value: str | None = None) -> str:
    """``auto`` (a shared-memory mailbox for a pair on one host, else the CPU group) or ``group``."""
    return config.resolve(ENV_META, value, option="meta_channel")


def _setup_mailboxes(exchange, infos, ends, tag_of, nonce: int, rank: int, mode: str) -> None:
    """Give each same-host pair with metadata a shared-memory mailbox (:mod:`gpuxfer.pp.mailbox`).

    Every rank runs both exchanges. Phase 1: each receiver creates its pair's mailbox;
    phase 2: the sender opens it where it was made. Both ends switch to it only if the
    sender opened it; the receiver unlinks the segment either way, so none outlives setup.
    A pair that cannot (another host, ``GPUXFER_PP_META_CHANNEL=group``, an error) keeps
    the CPU group; an error is logged.
    """
    from ..common import unlink_shm
    from .mailbox import Mailbox

    def name(pair) -> str:
        return f"/gpuxfer-pp-{nonce:x}-{tag_of[pair]:x}"

    def eligible(t) -> bool:
        return t.metadata and mode == "auto" and infos[t.peer]["host"] == infos[rank]["host"]

    created, made, boxes, opened = {}, {}, {}, {}
    try:
        for t in ends:
            if t.role == "recv" and eligible(t):
                pair = (t.peer, rank)
                try:
                    created[pair] = Mailbox.create(name(pair), t.specs.meta_len, nonce)
                    made[pair] = None
                except Exception as exc:  # noqa: BLE001 - the pair keeps the CPU group
                    made[pair] = _reason(exc)
        seen = exchange({"rank": rank, "made": made})
        for t in ends:
            pair = (rank, t.peer)
            if t.role == "send" and eligible(t) and pair in seen[t.peer]["made"]:
                try:
                    if seen[t.peer]["made"][pair] is not None:
                        raise GpuxferError(f"rank {t.peer} could not create it: {seen[t.peer]['made'][pair]}")
                    boxes[pair] = Mailbox.open(name(pair), t.specs.meta_len, nonce)
                    opened[pair] = None
                except Exception as exc:  # noqa: BLE001
                    opened[pair] = _reason(exc)
        got = exchange({"rank": rank, "opened": opened})
    except SetupFailed:
        for t in ends:    # a receiver that died after creating its box left it: the surviving sender unlinks
            if t.role == "send" and eligible(t):
                unlink_shm(name((rank, t.peer)))
        for box in list(created.values()) + list(boxes.values()):
            box.close()
        raise
    finally:
        for box in created.values():
            box.unlink()
    for t in ends:
        if t.role == "send":
            pair = (rank, t.peer)
            if pair in boxes:
                t.meta = boxes[pair]
            elif opened.get(pair) is not None:
                log.warning("rank %d: metadata to rank %d over the CPU group: mailbox: %s", rank, t.peer,
                            opened[pair])
            continue
        pair = (t.peer, rank)
        if made.get(pair) is not None:
            log.warning("rank %d: metadata from rank %d over the CPU group: mailbox: %s", rank, t.peer, made[pair])
        box = created.get(pair)
        if box is not None and got[t.peer]["opened"].get(pair, "not opened") is None:
            t.meta = box
        elif box is not None:
            box.close()


def _setup_peer_memory(name, exchange, infos, my_pairs, common, tag_of, nonce, *, recv_slots, flag_path,
                       inline_bytes, inject, recv_views=False):
    """The collective setup of a zero-SM backend; returns (ok, reasons by rank, ends)."""
    import torch.distributed as dist
    rank, plat, device = common["rank"], common["platform"], common["device"]
    cls = backend_class(name)
    ends: list = []
    failed: dict[int, str] = {}

    def step(fn, obj=None):
        nonlocal failed
        err = None
        if not failed:
            try:
                obj = fn()
            except Exception as exc:  # noqa: BLE001 - exchanged below
                err = _reason(exc)
        try:
            got = exchange({"rank": rank, "err": err, "obj": obj})
        except SetupFailed:
            _discard(ends)
            raise
        if not failed:
            failed = {r: g["err"] for r, g in got.items() if g["err"]}
        return got

    # 1. local checks, allocation, export
    def prepare():
        _inject(inject, "check")
        why = cls.unavailable_reason(plat, device)
        if why:
            raise GpuxferError(why)
        me = infos[rank]
        for role, peer, pair, spec in my_pairs:
            pi = infos[peer]
            if pi["host"] != me["host"]:
                raise GpuxferError(f"rank {peer} runs on host {pi['host']!r}, this rank on {me['host']!r}: "
                                   f"{name} needs both stages on one node")
            peer_dev = _local_index(plat, pi)
            link = plat.link(device, peer_dev)
            if not link.is_fast:
                raise GpuxferError(f"device {device} and rank {peer}'s device {peer_dev} are linked by {link.kind}"
                                   f"{' (' + link.detail + ')' if link.detail else ''}, not NVLink-class")
        _inject(inject, "alloc")
        payloads = {}
        for role, peer, pair, spec in my_pairs:
            t = cls(role=role, peer=peer, specs=spec, tag_base=tag_of[pair], recv_slots=recv_slots,
                    flag_path=flag_path, inline_bytes=inline_bytes, recv_views=recv_views, **common)
            ends.append(t)
            payloads[pair] = t.setup_prepare()
        return payloads

    got = step(prepare, {})

    def peer_obj(g, t):
        pair = (t.rank, t.peer) if t.role == "send" else (t.peer, t.rank)
        return g[t.peer]["obj"][pair]

    # 2. open the peers' handles
    def open_():
        _inject(inject, "open")
        for t in ends:
            t.setup_open(peer_obj(got, t))
        return {}

    step(open_, {})

    # 3. probe: write into the peers' probe words
    def probe_send():
        _inject(inject, "probe")
        return {((t.rank, t.peer) if t.role == "send" else (t.peer, t.rank)): t.setup_probe_send(nonce) for t in ends}

    sent = step(probe_send, {})

    # 4. probe: check what the peers wrote here
    def probe_check():
        return {((t.rank, t.peer) if t.role == "send" else (t.peer, t.rank)): t.setup_probe_check(peer_obj(sent, t))
                for t in ends}

    checked = step(probe_check, {})

    # 5. choose the flag paths (a forced path that does not work fails here)
    def finish():
        for t in ends:
            t.setup_finish(peer_obj(checked, t))
        return {}

    step(finish, {})

    if not failed:
        return True, {}, ends
    # every rank: close mappings, barrier, free
    for t in ends:
        try:
            t._release_waits()
            t._close_mappings()
        except Exception as exc:  # noqa: BLE001
            log.warning("rank %d: closing %s mappings after a failed setup: %s", rank, name, exc)
    try:
        dist.barrier(group=common["group"])
    except RuntimeError as exc:
        _discard(ends)
        raise SetupFailed(f"rank {rank}: pp connect: the barrier after a failed {name} setup failed: a rank "
                          f"died or left connect() ({exc})") from exc
    for t in ends:
        try:
            t._free()
        except Exception as exc:  # noqa: BLE001
            log.warning("rank %d: freeing %s buffers after a failed setup: %s", rank, name, exc)
        t._state = "closed"
    return False, failed, []


def _setup_pair_groups(ends, tag_of, nonce: int, rank: int) -> None:
    """Give each pair whose metadata travels over the CPU group (and each ``nccl`` pair on the host
    emulation, whose data would) a two-rank gloo group of its own, so a wait that times out (gloo then
    closes the pair) never breaks the caller's group.

    Made through the default group's store, pair by pair in one global order (sorted by (sender,
    receiver)), so no two ranks wait on each other's later pair; the sender is rank 0 of its pair.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store
    from datetime import timedelta

    def pair_of(t):
        return (t.rank, t.peer) if t.role == "send" else (t.peer, t.rank)

    todo = sorted((t for t in ends if (t.metadata and t.meta is t.channel) or getattr(t, "wants_pair_group", False)),
                  key=pair_of)
    for t in todo:
        pair = pair_of(t)
        store = dist.PrefixStore(f"gpuxfer-pp/{nonce:x}/{tag_of[pair]:x}/group", _get_default_store())
        try:
            pg = dist.ProcessGroupGloo(store, 0 if t.role == "send" else 1, 2,
                                       timedelta(seconds=min(t.timeout_s, 120.0)))
        except RuntimeError as exc:
            raise SetupFailed(f"rank {rank}: pp connect: the metadata group of the pair {pair[0]} -> {pair[1]} "
                              f"could not be made: rank {t.peer} died or left connect() ({exc})") from exc
        peer_rank = 1 if t.role == "send" else 0
        t.channel.use_pair_group(pg, peer_rank)
        if getattr(t, "wants_pair_group", False):
            t.use_pair_group(pg, peer_rank)


def _discard(ends) -> None:
    """After a failed collective setup: release and free what no peer maps (as abort does)."""
    for t in ends:
        try:
            t._release_waits()
            t._close_mappings()
            t._free_local()
            t._close_meta()
        except Exception as exc:  # noqa: BLE001 - best effort, the setup error is what the caller needs
            log.warning("rank %d: cleaning up after a failed setup: %s", t.rank, exc)
        t._state = "closed"


def _local_index(plat, peer_info) -> int:
    """The peer's device as numbered in this process (PCI bus id where the platform knows it)."""
    pci = peer_info.get("pci")
    if pci is None:
        return int(peer_info["device"])
    for i in range(plat.device_count()):
        if plat.device_info(i).pci_bus_id == pci:
            return i
    raise GpuxferError(f"rank {peer_info['rank']}'s device (PCI {pci}) is not visible in this process "
                       f"(CUDA_VISIBLE_DEVICES?)")


def _nccl_same_device(infos, my_pairs, not_nccl: bool) -> str | None:
    """Why NCCL cannot join this rank's pairs: two ranks on one device, which NCCL refuses at its first
    operation ("Duplicate GPU detected"); None if every pair spans two devices (or gloo moves the tensors)."""
    if not_nccl:
        return None
    for _role, _peer, (a, b), _spec in my_pairs:
        ia, ib = infos[a], infos[b]
        if ia["host"] != ib["host"]:
            continue
        if (ia["pci"] == ib["pci"]) if ia["pci"] is not None else (ia["device"] == ib["device"]):
            where = f"device {ia['device']}" + (f" (PCI {ia['pci']})" if ia["pci"] else "")
            return (f"ranks {a} and {b} share {where}: NCCL refuses two ranks on one device; "
                    "use copy_engine for a same-device pair")
    return None


def _setup_nccl(exchange, infos, my_pairs, common, tag_of, plat, group, device_group):
    import torch.distributed as dist
    from .nccl import NcclTransport
    rank = common["rank"]
    why = _nccl_reason(plat) or _nccl_same_device(infos, my_pairs, plat.collective_backend != "nccl")
    got = exchange({"rank": rank, "err": why})
    failed = {r: g["err"] for r, g in got.items() if g["err"]}
    if failed:
        raise BackendUnavailable(FALLBACK, failed)
    if device_group is None:
        if plat.collective_backend != "nccl" or "nccl" in str(dist.get_backend(group)).lower():
            device_group = group
        else:   # collective over the default group: every process calls connect
            device_group = dist.new_group(ranks=sorted(infos), backend="nccl")
    ends, err = [], None
    try:
        for role, peer, pair, spec in my_pairs:
            ends.append(NcclTransport(role=role, peer=peer, specs=spec, tag_base=tag_of[pair],
                                      device_group=device_group, data_tag=tag_of[pair] + 2, **common))
    except Exception as exc:  # noqa: BLE001
        err = _reason(exc)
    try:
        got = exchange({"rank": rank, "err": err})
    except SetupFailed:
        _discard(ends)
        raise
    failed = {r: g["err"] for r, g in got.items() if g["err"]}
    if failed:
        for t in ends:
            t._free()
            t._state = "closed"
        raise BackendUnavailable(FALLBACK, failed)
    return ends
