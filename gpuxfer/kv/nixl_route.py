"""The NIXL route of :class:`~gpuxfer.kv.agent.KVAgent`: peers whose memory cannot be mapped over IPC (another
host, or asked for with ``add_peer(..., route="nixl")``) are reached through NIXL (UCX), behind the same API.

An agent made with ``remote="nixl"`` (or ``GPUXFER_KV_REMOTE=nixl``) owns one NIXL agent (:class:`NixlSide`):
its allocations are registered with it (``VRAM`` on GPUs, ``DRAM`` on the host emulation) before its metadata
is taken, and the metadata bytes carry NIXL's agent metadata, the NIXL agent's name and the allocations' base
addresses (:func:`decode_nixl_meta` bounds and checks them). A peer on the route
(:class:`~gpuxfer.kv.nixl_peer.NixlPeer`) is built at ``add_peer``: both sides' descriptor lists are prepped once
(``prep_xfer_dlist``), one descriptor per block segment per layer piece over every shared group (the local list
over this agent's memory, the remote one over the peer's). Each list holds at most
:data:`~gpuxfer.kv.nixl_peer.PEER_SCALE` times as many descriptors as this agent's own blocks x pieces of those
groups, or ``GPUXFER_KV_NIXL_MAX_DESCRIPTORS`` if more: the peer's metadata sizes the remote list (its block
counts) and the local one (its block size), so a peer needing more is refused before any is built. A request's
block IDs are checked as on the IPC route (:class:`~gpuxfer.kv.ids._RouteIds`) and turned into two int32 index
arrays with NumPy (``NixlPeer.prepare``), and a post is one ``make_prepped_xfer`` + ``transfer`` (``READ`` pulls,
``WRITE`` pushes).

NIXL's progress thread is off by default (on two cores it cost more than it gave): a poller thread of the side
drains NIXL's notifications (which also progresses UCX for a passive peer), backing off while idle. A request's
notification rides on its transfer (``notify_slot``): the receiving side's poller writes its notification word,
advancing it only over values that all arrived (the n-th notification to a slot means the first n landed), so
:meth:`~gpuxfer.kv.agent.KVAgent.wait_notification` and ``stream_wait_notification`` work unchanged. A value
arrived ahead of one before it is held if at most :data:`NOTIFY_WINDOW` past the word, else refused and counted
(:attr:`NixlSide.refused`): a slot holds that many values at most, whatever a peer sends. Only this agent's peers
on the route send notifications that count: NIXL names each message's sender (the NIXL agent name it was made
with), and one from any other agent -- one that loaded this agent's metadata without being added as a peer, or a
peer removed since -- is refused and counted (:attr:`NixlSide.refused_senders`); the message itself carries no
name.

Every NIXL call goes through the side's lock (NIXL's agent is made without its own synchronisation). Every
wait is bounded: a transfer NIXL reports failed (a dead peer) raises :class:`~gpuxfer.kv.nixl_ffi.NixlError`,
one that does not complete in time raises :class:`~gpuxfer.errors.TransferTimeout` naming the request; neither
fails the agent (no stream waits on the peer). Importing this module never imports NIXL.
"""
from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Mapping

from .. import config
from ..errors import BackendUnavailable, BadMetadata
from .control import NOTIFY, NOTIFY_SLOTS

log = logging.getLogger("gpuxfer.kv.agent")

#: what an agent asked to reach other hosts installs
NIXL_EXTRA = "pip install 'gpuxfer[nixl]' (the nixl wheel; on a CPU-only machine: nixl==1.5.1 nixl-cu12==1.5.1 --no-deps)"
#: the largest NIXL agent metadata accepted from a peer
MAX_NIXL_MD_BYTES = 4 << 20
#: a notification riding on a transfer: this prefix, then ``<slot>:<value>``
NOTIF_PREFIX = b"gxkv:"
#: how far past a slot's word a notification may be and still be held until the values before it arrive: one
#: further ahead is refused (counted in :attr:`NixlSide.refused`), so a slot holds at most this many values
#: (one bit each) whatever a peer sends
NOTIFY_WINDOW = 1 << 16
#: the poller's interval: this right after a notification, doubling while idle up to POLL_MAX_S
POLL_MIN_S, POLL_MAX_S = 50e-6, 1e-3


def nixl_reason(platform) -> str | None:
    """Why the NIXL route cannot run on ``platform`` here (None: it can). Never raises."""
    from .nixl_ffi import nixl_platform_reason, nixl_unavailable_reason
    why = nixl_platform_reason(platform)
    if why is not None:
        return why
    why = nixl_unavailable_reason()
    return None if why is None else f"{why.split(':', 1)[0]}: {NIXL_EXTRA}"


def route_report(platform) -> dict[str, str | None]:
    """``{route: why not, or None}`` for ``gpuxfer doctor``: ``ipc`` (peers on this host, their memory mapped)
    and ``nixl`` (peers on other hosts, or asked for)."""
    return {"ipc": None, "nixl": nixl_reason(platform)}


# ----------------------------------------------------------------------------- metadata


def decode_nixl_meta(raw: Any, allocations: tuple) -> dict | None:
    """The ``nixl`` section of a peer's metadata, checked: ``{"agent", "md" (bytes), "mem", "device",
    "bases"}`` (one base address per allocation, each allocation inside the address space), or None."""
    if raw is None:
        return None
    where = "metadata nixl"
    if not isinstance(raw, dict):
        raise BadMetadata(f"{where}: must be an object")
    agent = raw.get("agent")
    if not isinstance(agent, str) or not 0 < len(agent) <= 256:
        raise BadMetadata(f"{where}: 'agent' must be a string of 1..256 characters")
    md = raw.get("md")
    if not isinstance(md, str) or not 0 < len(md) <= 2 * MAX_NIXL_MD_BYTES:
        raise BadMetadata(f"{where}: 'md' must be hex of 1..{MAX_NIXL_MD_BYTES} bytes")
    try:
        md_bytes = bytes.fromhex(md)
    except ValueError:
        raise BadMetadata(f"{where}: 'md' is not hex") from None
    mem = raw.get("mem")
    if mem not in ("DRAM", "VRAM"):
        raise BadMetadata(f"{where}: 'mem' must be 'DRAM' or 'VRAM', got {mem!r:.40}")
    device = raw.get("device")
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < 1 << 16:
        raise BadMetadata(f"{where}: 'device' must be an integer in [0, 65536)")
    bases = raw.get("bases")
    if not isinstance(bases, list) or len(bases) != len(allocations):
        raise BadMetadata(f"{where}: 'bases' must list one address per allocation ({len(allocations)})")
    for i, (b, h) in enumerate(zip(bases, allocations)):
        if isinstance(b, bool) or not isinstance(b, int) or not 0 < b or b + h.nbytes > 1 << 64:
            raise BadMetadata(f"{where}: base {i} must be an address with its {h.nbytes} bytes below 2**64")
    return {"agent": agent, "md": md_bytes, "mem": mem, "device": device, "bases": list(bases)}


# ----------------------------------------------------------------------------- the agent's NIXL side


class NixlSide:
    """A KV agent's NIXL agent: registrations, the lock every NIXL call takes, the notification poller.
    ``agent``: the :class:`~gpuxfer.kv.agent.KVAgent` (its name, uid, rank, platform, device and flag words);
    ``registry``: its :class:`~gpuxfer.kv.peers.Registry` (the allocations to register)."""

    def __init__(self, agent, registry):
        from .nixl_ffi import NixlAgent, find_nixl
        self.agent, self.registry = agent, registry
        why = nixl_reason(agent.platform)
        if why is not None:
            raise BackendUnavailable("nixl", {agent.name: why})
        mod, _ = find_nixl()
        self.lock = threading.Lock()
        self.mem_type = "DRAM" if agent.platform.host_memory else "VRAM"
        self.device = 0 if agent.platform.host_memory else agent.device
        self.name = f"gxkv-{agent.name}-{agent.uid}"
        self._registered = 0                  # agent allocations registered so far (in order)
        self._word: list[int] = [0] * NOTIFY_SLOTS
        self._ahead: list[int] = [0] * NOTIFY_SLOTS    # per slot: bit i set when value word + 1 + i arrived
        self.refused = 0                    # notifications refused: further than NOTIFY_WINDOW past their word
        self.refused_senders = 0            # notifications refused: their sender is no peer of this side
        # NIXL agent names of the agent's peers on the route (NixlPeer adds and drops its own, under the lock): the
        # senders whose notifications count
        self.senders: set[str] = set()
        self.nixl = NixlAgent(mod, self.name, mem_type=self.mem_type, rank=agent.rank, telemetry=False,
                              progress_thread=config.get("GPUXFER_NIXL_PROGRESS_THREAD"))
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name=f"gpuxfer-nixl-{agent.name}", daemon=True)
        self._poller.start()

    def register(self) -> None:
        """Register the agent's allocations NIXL does not hold yet (before metadata and descriptor lists)."""
        reg = self.registry
        with self.lock:
            while self._registered < len(reg.allocs):
                i = self._registered
                self.nixl.register(reg.alloc_bases[i], reg.allocs[i].nbytes, self.device, f"allocation {i}")
                self._registered += 1

    def metadata(self, allocations: int) -> dict:
        """The metadata's ``nixl`` section: one base address per allocation of the ``allocations`` it lists (an
        allocation listed since, by a register_group of another thread, is in the next metadata)."""
        self.register()
        with self.lock:
            md = self.nixl.metadata()
        return {"agent": self.name, "md": bytes(md).hex(), "mem": self.mem_type, "device": self.device,
                "bases": [int(b) for b in self.registry.alloc_bases[:allocations]]}

    def check_peer(self, meta) -> None:
        """Whether the agent of ``meta`` (:class:`~gpuxfer.kv.metadata.PeerMetadata`) is one this side reaches (a
        typed error if not), with the allocations registered since made known to NIXL."""
        nx = meta.nixl
        if nx is None:
            raise BackendUnavailable("nixl", {meta.agent: "the peer's metadata carries no NIXL agent: create it "
                                                         "with KVAgent(..., remote='nixl')"})
        if nx["mem"] != self.mem_type:
            raise BadMetadata(f"peer {meta.agent!r} registered {nx['mem']} memory with NIXL, this agent "
                              f"{self.mem_type}")
        self.register()

    # -- notifications

    def _poll(self) -> None:
        """Drain NIXL's notifications (progressing UCX for a passive side) until closed, backing off while idle."""
        delay = POLL_MIN_S
        while not self._stop.wait(delay):
            try:
                with self.lock:     # delivered under it too: close, taking it, never frees words being written
                    if self.nixl.closed:
                        return
                    notifs = self.nixl.agent.get_new_notifs()
                    if notifs:
                        self._deliver(notifs)
            except Exception as exc:  # noqa: BLE001 - a poller never dies of one failed call
                log.warning("agent %s: polling NIXL notifications failed: %s", self.agent.name, exc)
                notifs = None
                delay = POLL_MAX_S
            delay = POLL_MIN_S if notifs else min(2 * delay, POLL_MAX_S)

    def _deliver(self, notifs: Mapping) -> None:
        """Write each slot's word up to the longest run of values that all arrived; a value further than
        :data:`NOTIFY_WINDOW` past its slot's word is refused (counted, the first one logged), and so is every
        message of a sender (NIXL's name for it) that is not one of :attr:`senders`. Called under the lock."""
        moved = set()
        for sender, msgs in notifs.items():
            if sender not in self.senders:
                self._refuse_sender(sender, len(msgs))
                continue
            for msg in msgs:
                slot_value = _parse_notif(msg)
                if slot_value is None:
                    log.debug("agent %s: ignored a NIXL notification from %s: %r", self.agent.name, sender,
                              bytes(msg)[:64])
                    continue
                slot, value = slot_value
                ahead = value - self._word[slot] - 1
                if ahead < 0:                       # a repeat
                    continue
                if ahead >= NOTIFY_WINDOW:
                    self._refuse(sender, slot, value)
                elif ahead:                         # held until the values before it arrive
                    self._ahead[slot] |= 1 << ahead
                else:                               # the next value: the word moves over it and the run held after
                    bits = self._ahead[slot] | 1
                    run = (~bits & (bits + 1)).bit_length() - 1
                    self._ahead[slot] = bits >> run
                    self._word[slot] += run
                    moved.add(slot)
        flags = self.agent.flags
        for slot in moved:
            w = self._word[slot]
            if flags is not None and not flags.closed and flags.read(NOTIFY + slot) < w:
                self.agent.platform.host_write_flag(flags.word(NOTIFY + slot), w, self.agent.device)
                words = self.agent.host_words       # then the word's host copy (gpuxfer.kv.host_notify)
                if words is not None:
                    words.store(slot, w)

    def _refuse(self, sender, slot: int, value: int) -> None:
        self.refused += 1
        if self.refused == 1:
            log.warning("agent %s: refused NIXL notification %d to slot %d from %s: more than %d past the slot's "
                        "value %d (a broken or forged sender); later ones are counted in its NIXL side's refused, "
                        "not logged", self.agent.name, value, slot, sender, NOTIFY_WINDOW, self._word[slot])

    def _refuse_sender(self, sender, count: int) -> None:
        if not self.refused_senders:
            log.warning("agent %s: refused %d NIXL notification(s) from agent %r: not a peer of this agent on the "
                        "NIXL route (never added, or removed); later ones are counted in its NIXL side's "
                        "refused_senders, not logged", self.agent.name, count, str(sender)[:256])
        self.refused_senders += count

    def close(self) -> None:
        """Stop the poller (bounded) and close the NIXL agent: its transfers, lists, peers and registrations
        released, or kept where a transfer never completed (:class:`~gpuxfer.kv.nixl_ffi.NixlAgent`)."""
        self._stop.set()
        if self._poller.is_alive() and self._poller is not threading.current_thread():
            self._poller.join(timeout=max(1.0, self.agent.timeout_s))
        with self.lock:
            self.nixl.close()


def _parse_notif(msg) -> tuple[int, int] | None:
    try:
        raw = bytes(msg)
        if not raw.startswith(NOTIF_PREFIX) or len(raw) > 64:
            return None
        slot, value = (int(x) for x in raw[len(NOTIF_PREFIX):].decode("ascii").split(":"))
    except (ValueError, TypeError, UnicodeDecodeError):
        return None
    if 0 <= slot < NOTIFY_SLOTS and 0 < value < 1 << 62:
        return slot, value
    return None


# ----------------------------------------------------------------------------- the agent's hooks


def side_for(agent, registry, remote: str | None) -> NixlSide | None:
    """The agent's NIXL side when ``remote`` (``GPUXFER_KV_REMOTE`` when not given) is ``"nixl"``, else None."""
    if config.resolve("GPUXFER_KV_REMOTE", remote, option="remote") != "nixl":
        return None
    return NixlSide(agent, registry)


def choose_route(agent, meta, route: str | None) -> str:
    """The route ``add_peer`` takes to ``meta``'s agent: ``"ipc"`` (same host) or ``"nixl"`` (another host, or
    asked; ``route`` None: ``GPUXFER_KV_ROUTE``); a typed error naming what is missing when the route cannot be
    taken."""
    route = config.resolve("GPUXFER_KV_ROUTE", route, option="route")
    here = socket.gethostname() or "unknown"
    if route == "auto":
        route = "ipc" if meta.host == here else "nixl"
    if route == "ipc":
        if meta.host != here:
            raise BackendUnavailable(agent.engine, {meta.agent: f"the peer is on host {meta.host!r}; the "
                                                                f"{agent.engine} engine maps its memory over IPC "
                                                                "(route='nixl' reaches other hosts)"})
        return route
    if agent.nixl is None:
        raise BackendUnavailable("nixl", {meta.agent: f"the peer is on host {meta.host!r}, this agent on {here!r}"
                                          if meta.host != here else "route='nixl' was asked"}
                                 | {agent.name: "this agent has no NIXL agent: create it with "
                                                "KVAgent(..., remote='nixl') (or GPUXFER_KV_REMOTE=nixl)"})
    return route
