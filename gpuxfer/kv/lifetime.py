"""What :class:`~gpuxfer.kv.agent.KVAgent`'s memory lives through: posts, ``remove_peer`` and ``close`` from any
threads, and other agents of this process using it.

**Who owns what.** An agent owns its flag words and its staging (:class:`_Shared`), its streams, and its peers;
a peer (:class:`~gpuxfer.kv.peers.KVPeer`) owns its mappings of the other agent's memory and its flag link's
stage words. A peer that is another agent *of this process* maps nothing: it uses that agent's flag words and
staging as they are, so its link holds them (:meth:`_Shared.acquire`) until the peer is closed, and they are
freed by whichever lets go last: the owner's ``close`` or the last such peer. A peer in another process is
reached through mappings of the survivor's own, which stay mapped until the survivor's ``remove_peer`` or
``close`` (on the host emulation the pages live while any process maps them; on CUDA the exporting process must
not free what an importer still maps: each side removes the other before closing, as the agent's docs say).

**Posts against removal.** Everything that queues work touching a peer's or the agent's memory -- a post, a
``pack`` prepare's shape, ``stream_wait_notification``, :meth:`KVPeer.notify
<gpuxfer.kv.peers.KVPeer.notify>` -- holds the agent's post lock and checks, under it, that
the agent is open and the peer still its own (:meth:`Poster.check_usable
<gpuxfer.kv.posting.Poster.check_usable>`). ``remove_peer`` takes the peer out under the same lock and ``close``
passes through it after marking the agent closed, so a post either was queued (and is waited for before anything
is freed) or raises a typed error having queued nothing. Host reads of the flag words (notifications, the
release on failure) hold them like a peer does (:class:`Lifetime` does all of this for the agent).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from ..errors import BadInput, GpuxferError, NotRegistered, TransferTimeout
from ..platforms.base import Event, Stream
from .control import NOTIFY, PACK_WORDS, STATUS
from .peers import _LEAKED, KVPeer
from .posting import _ended

log = logging.getLogger("gpuxfer.kv.agent")


class _Shared:
    """An agent's flag words and staging, used by the agent and by whatever holds them (peer links of other
    agents of this process, host reads): freed once the owner retired them and no holder is left."""

    def __init__(self, flags: Any, staging: Any):
        self.items = (flags, staging)
        self._lock = threading.Lock()
        self._holders = 0
        self._retired = False
        self._free = False

    def acquire(self) -> tuple | None:
        """``(flags, staging)``, held until :meth:`release`; None once the owner retired them."""
        with self._lock:
            if self._retired:
                return None
            self._holders += 1
            return self.items

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._retired and self._free and self._holders == 0
        if last:
            self._close()

    def retire(self, free: bool) -> None:
        """The owner is done with them: free them now or when the last holder lets go (``free``), or never
        (queued work may still touch them: kept for the life of the process). Idempotent."""
        with self._lock:
            if self._retired:
                return
            self._retired, self._free = True, free
            now = free and self._holders == 0
        if now:
            self._close()

    def _close(self) -> None:
        for item in self.items:
            if item is not None:
                item.close()


class Lifetime:
    """What :class:`~gpuxfer.kv.agent.KVAgent`'s memory lives through, given its parts: ``remove_peer``, the
    streams made to wait on a notification slot, the release of waits on failure, host accesses to its flag
    words, and the drain and release of ``close``. ``agent``: its name, rank, platform, timeout, stream and flag
    words and staging are read from it, and it is failed (``fail``) where queued work does not complete;
    ``registry``, ``routes``, ``poster``, ``pack``: its :class:`~gpuxfer.kv.peers.Registry`,
    :class:`~gpuxfer.kv.routes.RouteCache`, :class:`~gpuxfer.kv.posting.Poster` and
    :class:`~gpuxfer.kv.pack_transfer.PackState`."""

    def __init__(self, agent, registry, routes, poster, pack):
        self.agent, self.registry, self.routes, self.poster, self.pack = agent, registry, routes, poster, pack
        self.waited_slots: set[int] = set()             # notification slots a stream was made to wait on
        self.stream_waits: dict[Stream, Event] = {}     # per stream made to wait on a slot: an event after its wait

    def hold(self) -> tuple:
        """The agent's ``(flags, staging)``, held for a host access (:meth:`_Shared.release` after it);
        :class:`BadInput` once closed."""
        shared = self.registry.shared
        held = shared.acquire() if shared is not None else None
        if held is None:
            raise BadInput(f"agent {self.agent.name!r} is closed")
        return held

    def stream_wait(self, stream: Stream, slot: int, index: int, value: int) -> None:
        """Queue on ``stream`` a wait for flag word ``index`` (notification slot ``slot``) to hold ``value``, and
        keep an event after it until it passed (close drains past it)."""
        agent, poster = self.agent, self.poster
        with poster.lock:                   # close passes through it: the wait is then in its books
            poster.check_open()
            waits = self.stream_waits
            for st in [st for st, e in waits.items() if _ended(agent.platform, e)]:
                del waits[st]
            self.waited_slots.add(slot)
            agent.flags.wait(stream, index, value)
            waits[stream] = agent.platform.record_event(stream)

    # ------------------------------------------------------------------ peers

    def remove_peer(self, peer: "KVPeer | str") -> None:
        """:meth:`KVAgent.remove_peer <gpuxfer.kv.agent.KVAgent.remove_peer>`."""
        agent, registry = self.agent, self.registry
        name = peer.name if isinstance(peer, KVPeer) else peer
        with self.poster.lock:              # no post with the peer is half queued, none comes after
            with registry.lock:
                p = registry.peers.get(name) if isinstance(name, str) else None
                if isinstance(peer, KVPeer) and p is not peer:
                    p = None            # a peer removed before, or another agent's: not the one of that name here
                if p is not None:
                    del registry.peers[name]
                    self.routes.forget(p)
            if p is None:
                raise NotRegistered(f"agent {agent.name!r} has no peer {name!r}" if not isinstance(peer, KVPeer) else
                                    f"{peer!r} is not a peer of agent {agent.name!r} (removed before, or another "
                                    "agent's)")
            self.pack.forget(p)
            posts = [(e, b) for e, b, _ in self.poster.inflight if _names_peer(b, p)]
            events = [e for e, _ in posts] + [n[1] for n in p._notified if n is not None]
        if not self.completed(events):
            log.warning("agent %s: transfers with peer %s did not complete within %g s of remove_peer; the agent "
                        "fails and releases its waits", agent.name, name, agent.timeout_s)
            agent.fail(TransferTimeout(rank=agent.rank, step=0, flag=f"transfers with peer {name!r}", expected=1,
                                       seen=0, timeout_s=agent.timeout_s, what="removing the peer"))
            if not self.completed(events):
                keep = p._keep()
                log.error("agent %s: transfers with peer %s still run after the waits were released; keeping %d "
                          "buffers and mappings they may touch for the life of the process", agent.name, name,
                          len(keep))
                _LEAKED.extend(keep)
                _LEAKED.append(posts)
        p.close()

    # ------------------------------------------------------------------ failure

    def release_waits(self) -> None:
        """:meth:`KVAgent.release_waits <gpuxfer.kv.agent.KVAgent.release_waits>`."""
        shared = self.registry.shared
        held = shared.acquire() if shared is not None else None
        if held is None:
            return
        try:
            # STATUS first: a pack transfer's check before its last signal reads it after any wait this passes
            held[0].release((STATUS, *PACK_WORDS, *(NOTIFY + k for k in sorted(self.waited_slots))))
        finally:
            shared.release()

    # ------------------------------------------------------------------ close

    def drained(self) -> bool:
        """Wait (:meth:`completed`) for every posted transfer (the caller's streams included), every stream
        made to wait on a notification and the agent's own streams; whether all completed."""
        agent = self.agent
        plat = agent.platform
        events = [e for e, *_ in self.poster.inflight] + list(self.stream_waits.values())
        for st in (agent.stream, self.pack.lane):
            if st is not None:
                try:
                    events.append(plat.record_event(st))
                except Exception as exc:  # noqa: BLE001 - a stream an error stopped runs nothing more
                    log.warning("agent %s: %r ended in an error: %s", agent.name, st, exc)
        return self.completed(events)

    def completed(self, events: list) -> bool:
        """Wait, at most the agent's timeout in all, for ``events``; whether all completed. Work that ended in
        an error of its stream is done (logged); a wait that itself fails is not."""
        agent = self.agent
        plat = agent.platform
        deadline = time.monotonic() + agent.timeout_s
        done = True
        for e in events:
            try:
                done = plat.event_wait(e, max(0.0, deadline - time.monotonic())) and done
            except GpuxferError as exc:     # the stream's own error: its work stopped, nothing more runs
                log.warning("agent %s: queued work ended in an error: %s", agent.name, exc)
            except Exception as exc:  # noqa: BLE001 - the wait itself failed: the work may still run
                log.warning("agent %s: waiting for queued work failed (%s: %s)", agent.name, type(exc).__name__,
                            exc)
                done = False
        return done

    def release(self) -> bool:
        """Close's part but the agent's own streams, NIXL side, flag words and staging: pass through the post lock
        (a post holding it is then tracked; later ones see the agent closed), drain (every queued wait bounded:
        the agent's timeout; released once), then close the peers, forget the parts' contents and close their
        streams. What a GPU wait that did not pass may still read or write -- the flag words, the staging, the
        peers' mappings and flag links, the posted transfers' buffers -- is kept for the life of the process
        instead (logged). Returns whether everything drained."""
        agent, registry, poster, pack = self.agent, self.registry, self.poster, self.pack
        registry.closed = True
        with poster.lock:
            pass
        drained = self.drained()
        if not drained:
            log.warning("agent %s: queued work did not complete within %g s of close; releasing its waits",
                        agent.name, agent.timeout_s)
            self.release_waits()
            drained = self.drained()
        with registry.lock:             # an add_peer registers under it only while the agent is open
            peers = list(registry.peers.values())
            registry.clear()
        if not drained:
            keep = [b for b in (agent.flags, agent.staging, pack.status_mirror) if b is not None]
            for p in peers:
                keep += p._keep()
            log.error("agent %s: queued work still runs after its waits were released; keeping %d buffers and "
                      "mappings it may touch for the life of the process", agent.name, len(keep))
            _LEAKED.extend(keep)
            _LEAKED.append(poster.inflight)
        for p in peers:
            p.close()
        with registry.lock:             # (device_bytes reads the dropped routes under it)
            self.routes.drop_all()
            self.routes.bounds = {}
        poster.inflight = collections.deque()       # a new one: one kept above stays as it is
        self.stream_waits = {}
        pack.shapes, pack.tail = collections.OrderedDict(), None
        for st in (poster.capture, pack.lane):
            if st is not None:
                st.close()
        poster.capture = pack.lane = None
        return drained


def _names_peer(buffers: tuple, peer) -> bool:
    """Whether a posted transfer's kept ``buffers`` hold a transfer with ``peer`` (a batch's transfers are a tuple
    of their own: :mod:`~gpuxfer.kv.batch`, :func:`~gpuxfer.kv.device_ids.post_together`)."""
    for x in buffers:
        if any(getattr(y, "peer", None) is peer for y in (x if type(x) is tuple else (x,))):
            return True
    return False
