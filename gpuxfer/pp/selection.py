"""Choosing and setting up a stage hand-off backend, collectively, so every rank makes the same choice.

``GPUXFER_PP_TRANSPORT`` (or ``connect(backend=...)``) is ``auto`` (default),
``nccl`` or ``copy_engine`` (or any backend in :data:`~gpuxfer.pp.backends.BACKENDS`).

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

A zero-SM backend's class provides ``platform_reason(platform)`` (what the
platform's capabilities lack for it, or None), ``unavailable_reason(platform,
device)`` and the ``setup_*`` phases of ``CopyEngineTransport``; ``auto`` takes
the first registered zero-SM backend whose ``platform_reason`` is None on the
lowest rank (every rank then tries that one).

Test hook: ``GPUXFER_PP_INJECT_FAILURE=RANK:PHASE[,RANK:PHASE...]`` (or
``inject_failure=``) makes that rank's zero-SM setup fail in PHASE (``check``,
``alloc``, ``open``, ``probe``).
"""
from __future__ import annotations

import itertools
import logging
import operator
import os
import secrets
import socket
from typing import Iterable, Mapping

from .. import config
from ..errors import BackendUnavailable, BadInput, SetupFailed
from . import backends
from .backends import (BACKENDS, ENV_TRANSPORT, GRAPH_BACKEND, ZERO_SM,  # noqa: F401 - re-exported
                       backend_class, register_backend, requested_backend)
from .options import (ENV_INJECT, ENV_META, INJECT_PHASES, MAX_RECV_SLOTS,  # noqa: F401 - re-exported
                      ConnectOptions, injected, meta_channel_from_env)
from .setup import discard, reason, setup_mailboxes, setup_nccl, setup_pair_groups, setup_peer_memory
from .channel import PairSignals
from .spec import SpecTable
from .timeouts import resolve_on_timeout, resolve_timeout
from .transport import Transport
from .watchdog import WATCHDOG, close_all

log = logging.getLogger("gpuxfer.pp")

FALLBACK = "nccl"
TAG_BASE = 1 << 20
_TAGS_PER_CONNECTION = 1024
_CONN_IDS = itertools.count()

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
    for name in backends.BACKENDS:
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
        try:
            found = d.get(_rank(peer))
        except TypeError:
            raise BadInput(f"a peer is a rank (an integer), got {peer!r}") from None
        if found is None:
            raise BadInput(f"rank {self.rank} {what} {sorted(d)}, not rank {peer}")
        return found

    def synchronize(self, timeout_s: float | None = None) -> None:
        for t in self.transports:
            t.synchronize(timeout_s)

    def close(self) -> None:
        """Tear every transport down together (safe order, see :func:`close_all`). Idempotent. Graphs that
        captured ``copy_engine_graph`` steps must not be replayed afterwards (:mod:`gpuxfer.pp.graph`)."""
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


def _rank(r) -> int:
    if isinstance(r, bool):
        raise TypeError
    return operator.index(r)


def _ranks(x) -> tuple[int, ...]:
    if x is None:
        return ()
    try:
        out = (_rank(x),) if not isinstance(x, Iterable) else tuple(_rank(r) for r in x)
    except TypeError:
        raise BadInput(f"peer ranks must be integers (one, or an iterable of them), got {x!r}") from None
    if len(set(out)) != len(out):
        raise BadInput(f"duplicate peer ranks in {out}")
    return out


def _torch_device(platform, device: int):
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


_KINDS = {"rank": int, "err": (str, type(None)), "host": str, "pid": int, "counter": int, "nonce": int,
          "obj": dict, "made": dict, "opened": dict}     # what each key of an exchanged object holds


def _malformed(o, keys) -> str | None:
    """Why an exchanged object ``o`` is not a dict holding ``keys`` (and "rank") of their kinds, or None."""
    if type(o) is not dict:
        return f"a {type(o).__name__}, not a dict"
    for key in ("rank", *keys):
        if key not in o or not isinstance(o[key], _KINDS[key]) or isinstance(o[key], bool):
            return f"{key!r} is {o.get(key, 'missing')!r:.60}"
    return None


def _info_problem(i: dict) -> str | None:
    """What is wrong with a rank's setup facts (it passed its own checks: another version of gpuxfer, or a
    forged object), or None."""
    def ints(v) -> bool:
        return type(v) is tuple and all(type(r) is int for r in v)
    try:
        resolve_timeout(i["timeout"])
        resolve_on_timeout(i["on_timeout"])
        ok = (type(i["platform"]) is str and type(i["device"]) is int and type(i["backend"]) is str
              and ints(i["sends"]) and ints(i["recvs"]) and type(i["metadata"]) is bool
              and type(i["slots"]) is int and 2 <= i["slots"] <= MAX_RECV_SLOTS
              and all(d is None or type(d) is tuple for d in (i["sdig"], i["rdig"]))
              and (i["zero_sm"] is None or type(i["zero_sm"]) is str))
    except (KeyError, TypeError, BadInput) as exc:
        return f"malformed setup facts ({type(exc).__name__}: {exc})"
    return None if ok else "malformed setup facts"


class _Exchange:
    """all_gather_object over the CPU group, indexed by global rank; a rank that died or left mid-way
    (gloo's RuntimeError) becomes :class:`SetupFailed`, and so does an object of a rank that is not what
    every rank sends in that round (another version of gpuxfer, or a forged one): the same verdict on every
    rank, since every rank reads the same objects."""

    def __init__(self, group):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank()
        self.ranks = set(dist.get_process_group_ranks(group)) if group is not dist.group.WORLD else \
            set(range(self.size))
        self.round = 0

    def __call__(self, obj, keys: tuple = ()) -> dict[int, dict]:
        """Every rank's ``obj`` by rank; each must hold ``keys`` (the same on every rank) of their kinds."""
        out = [None] * self.size
        self.round += 1
        try:
            self.dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            raise SetupFailed(f"rank {self.rank}: pp connect: exchange {self.round} over the CPU group failed: "
                              f"a rank of the group died or left connect() ({exc})") from exc
        for i, o in enumerate(out):
            why = _malformed(o, keys)
            if why is not None:
                raise SetupFailed(f"rank {self.rank}: pp connect: exchange {self.round}: the object of the "
                                  f"group's rank {i} is malformed: {why}")
        got = {o["rank"]: o for o in out}
        if got.keys() != self.ranks:
            raise SetupFailed(f"rank {self.rank}: pp connect: exchange {self.round}: the objects name ranks "
                              f"{sorted(got)}, the group holds {sorted(self.ranks)}")
        return got


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
    ``metadata=False``: shapes do not travel; receivers pass ``recv(shapes=...)``, which must be the
    shapes the sender sent in that step: nothing checks that they are (the receiver reads the slot by
    its own layout).
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
    plat = opts = inject = None
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
            tr = config.torchrun()
            device = (rank if tr is None else tr[2]) % plat.device_count()
        plat.set_device(device)
        dinfo = plat.device_info(device)
        sends, recvs = _ranks(send_to), _ranks(recv_from)
        if rank in sends or rank in recvs:
            raise BadInput(f"rank {rank} cannot send to or receive from itself")
        sspec = SpecTable(send_specs or specs) if sends else None
        rspec = SpecTable(recv_specs or specs) if recvs else None
        meta_mode = meta_channel_from_env(opts.meta_channel)
        inject = injected(opts.inject_failure, rank)
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
                    metadata=opts.metadata, slots=opts.recv_slots,
                    zero_sm=next((b for b in backends.ZERO_SM if backend_class(b).platform_reason(plat) is None), None))
    except Exception as exc:  # noqa: BLE001 - exchanged, raised on every rank
        info["err"] = reason(exc)
    infos = exchange(info, ("err", "host", "pid", "counter", "nonce"))

    # ---- the same verdict everywhere ----
    problems: dict[int, str] = {r: i["err"] for r, i in infos.items() if i["err"]}
    problems.update({r: why for r, i in infos.items() if not i["err"] and (why := _info_problem(i))})
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

    chosen, ends, fallback = None, [], {}
    if wanted != FALLBACK:
        cand = wanted
        if wanted == "auto":
            cand = infos[min(infos)]["zero_sm"]
        if cand is None:
            fallback = {r: f"no zero-SM backend for platform {infos[r]['platform']!r}" for r in infos}
        else:
            ok, reasons, ends = setup_peer_memory(cand, backend_class(cand), exchange, infos, my_pairs, common,
                                                  tag_of, nonce, recv_slots=me["slots"], flag_path=opts.flag_path,
                                                  inline_bytes=opts.inline_bytes, recv_views=opts.recv_views,
                                                  inject=inject)
            if ok:
                chosen = cand
            elif wanted == "auto":
                fallback = reasons
            else:
                raise BackendUnavailable(cand, reasons)
    if chosen is None:
        ends = setup_nccl(exchange, infos, my_pairs, common, tag_of, plat, group, opts.device_group,
                          _nccl_reason(plat))
        chosen = FALLBACK

    for t in ends:
        t.signals = PairSignals.default(f"gpuxfer-pp/{nonce:x}/{tag_of[(t.rank, t.peer) if t.role == 'send' else (t.peer, t.rank)]:x}",
                                        rank, t.peer)
    try:
        setup_mailboxes(exchange, infos, ends, tag_of, nonce, rank, meta_mode)
        setup_pair_groups(ends, tag_of, nonce, rank)
    except SetupFailed:
        discard(ends)
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
