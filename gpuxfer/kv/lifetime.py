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
``pack`` prepare's shape, ``stream_wait_notification`` -- holds the agent's post lock and checks, under it, that
the agent is open and the peer still its own (:meth:`_Lifetime._check_usable`). ``remove_peer`` takes the peer
out under the same lock and ``close`` passes through it after marking the agent closed, so a post either was
queued (and is waited for before anything is freed) or raises a typed error having queued nothing. Host reads
of the flag words (notifications, the release on failure) hold them like a peer does.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from ..errors import BadInput, GpuxferError, NotRegistered, PeerLost, TransferTimeout
from .control import NOTIFY, PACK_WORDS
from .peers import _LEAKED, _LOCAL_AGENTS, KVPeer

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


class _Lifetime:
    """:class:`~gpuxfer.kv.agent.KVAgent`'s lifetime: the checks a post makes, ``remove_peer``, the drain and
    the release of ``close``."""

    # ------------------------------------------------------------------ checks

    def _check_open(self) -> None:
        if self._closed:
            raise BadInput(f"agent {self.name!r} is closed")
        self.check()

    def _check_usable(self, peer: KVPeer) -> None:
        """The agent is open and usable and ``peer`` is still its own (and, in this process, open): else a typed
        error. Queuing work on the peer's memory calls it under the post lock."""
        if (type(peer) is KVPeer and peer.agent is self and not peer._closed and not self._closed
                and self.failed is None and self._peers.get(peer.name) is peer
                and (peer._local is None or not peer._local._closed)):
            return          # the per-post case
        self._check_open()
        if not isinstance(peer, KVPeer) or peer.agent is not self:
            raise NotRegistered(f"{peer!r} is not a peer of agent {self.name!r}")
        if peer.closed or self._peers.get(peer.name) is not peer:
            raise NotRegistered(f"peer {peer.name!r} was removed from agent {self.name!r}")
        if peer._local is None or not peer._local._closed:
            return          # usable: a peer of another kind (NIXL's) or of another process
        raise PeerLost(rank=self.rank, peer=peer._local.rank, step=0, flag=f"peer {peer.name!r}", after_s=0.0,
                       why=f"agent {peer.name!r} of this process was closed (remove_peer it)")

    def _hold(self) -> tuple:
        """This agent's ``(flags, staging)``, held for a host access (:meth:`_Shared.release` after it);
        :class:`BadInput` once closed."""
        held = self._shared.acquire() if getattr(self, "_shared", None) is not None else None
        if held is None:
            raise BadInput(f"agent {self.name!r} is closed")
        return held

    # ------------------------------------------------------------------ peers

    def remove_peer(self, peer: "KVPeer | str") -> None:
        """Forget a peer, then close its mappings and its flag link once every transfer posted with it
        completed (waiting at most the agent's timeout). Posts to it from then on raise
        :class:`~gpuxfer.errors.NotRegistered` having queued nothing.

        Past the timeout the agent fails (:meth:`fail`: its waits are released, its error is raised from
        every later call) and waits once more; what still runs then may touch the peer's mappings and
        flag link's words, so those are kept for the life of the process (logged) instead of freed under it."""
        name = peer.name if isinstance(peer, KVPeer) else peer
        with self._post_lock:               # no post with the peer is half queued, none comes after
            with self._lock:
                p = self._peers.pop(name, None) if isinstance(name, str) else None
                for k in [k for k in self._routes if k[0] is p]:
                    del self._routes[k]
            if p is None:
                raise NotRegistered(f"agent {self.name!r} has no peer {name!r}")
            for key in [k for k, v in self._pack_shapes.items() if v.peer is p]:
                del self._pack_shapes[key]
            posts = [(e, b) for e, b in self._inflight if any(getattr(x, "peer", None) is p for x in b)]
            events = [e for e, _ in posts] + [n[1] for n in p._notified if n is not None]
        if not self._completed(events):
            log.warning("agent %s: transfers with peer %s did not complete within %g s of remove_peer; the agent "
                        "fails and releases its waits", self.name, name, self.timeout_s)
            self.fail(TransferTimeout(rank=self.rank, step=0, flag=f"transfers with peer {name!r}", expected=1,
                                      seen=0, timeout_s=self.timeout_s, what="removing the peer"))
            if not self._completed(events):
                keep = p._keep()
                log.error("agent %s: transfers with peer %s still run after the waits were released; keeping %d "
                          "buffers and mappings they may touch for the life of the process", self.name, name,
                          len(keep))
                _LEAKED.extend(keep)
                _LEAKED.append(posts)
        p.close()

    # ------------------------------------------------------------------ failure

    def release_waits(self) -> None:
        """Write the release value into this agent's words its streams (or the caller's) may wait on: the
        pack flags and the notification slots waited on from a stream. Best effort: the abort path."""
        shared = getattr(self, "_shared", None)
        held = shared.acquire() if shared is not None else None
        if held is None:
            return
        try:
            held[0].release((*PACK_WORDS, *(NOTIFY + k for k in sorted(self._waited_slots))))
        finally:
            shared.release()

    # ------------------------------------------------------------------ close

    def _drained(self) -> bool:
        """Wait (:meth:`_completed`) for every posted transfer (the caller's streams included), every stream
        made to wait on a notification and the agent's own streams; whether all completed."""
        plat = self.platform
        events = [e for e, _ in getattr(self, "_inflight", ())] + list(getattr(self, "_stream_waits", {}).values())
        for st in (getattr(self, "stream", None), getattr(self, "_lane", None)):
            if st is not None:
                try:
                    events.append(plat.record_event(st))
                except Exception as exc:  # noqa: BLE001 - a stream an error stopped runs nothing more
                    log.warning("agent %s: %r ended in an error: %s", self.name, st, exc)
        return self._completed(events)

    def _completed(self, events: list) -> bool:
        """Wait, at most the agent's timeout in all, for ``events``; whether all completed. Work that ended in
        an error of its stream is done (logged); a wait that itself fails is not."""
        plat = self.platform
        deadline = time.monotonic() + self.timeout_s
        done = True
        for e in events:
            try:
                done = plat.event_wait(e, max(0.0, deadline - time.monotonic())) and done
            except GpuxferError as exc:     # the stream's own error: its work stopped, nothing more runs
                log.warning("agent %s: queued work ended in an error: %s", self.name, exc)
            except Exception as exc:  # noqa: BLE001 - the wait itself failed: the work may still run
                log.warning("agent %s: waiting for queued work failed (%s: %s)", self.name, type(exc).__name__, exc)
                done = False
        return done

    def _release(self) -> None:
        """Pass through the post lock (a post holding it is then tracked; later ones see the agent closed),
        drain (every queued wait bounded: the agent's timeout; released once), then close the peers'
        mappings, the streams, and retire the flag words and the staging (:class:`_Shared`: freed once no peer
        link of this process holds them). What a GPU wait that did not pass may still read or write -- the
        flag words, the staging, the peers' mappings and flag links, the posted transfers' buffers -- is kept
        for the life of the process instead (logged)."""
        _LOCAL_AGENTS.pop(getattr(self, "uid", ""), None)
        lock = getattr(self, "_post_lock", None)
        if lock is not None:
            with lock:
                pass
        drained = self._drained()
        if not drained:
            log.warning("agent %s: queued work did not complete within %g s of close; releasing its waits",
                        self.name, self.timeout_s)
            self.release_waits()
            drained = self._drained()
        peers = list(getattr(self, "_peers", {}).values())
        shared = getattr(self, "_shared", None)
        if not drained:
            keep = [getattr(self, k, None) for k in ("flags", "staging", "_status_mirror")]
            keep = [b for b in keep if b is not None]
            for p in peers:
                keep += p._keep()
            log.error("agent %s: queued work still runs after its waits were released; keeping %d buffers and "
                      "mappings it may touch for the life of the process", self.name, len(keep))
            _LEAKED.extend(keep)
            _LEAKED.append(getattr(self, "_inflight", None))
        for p in peers:
            p.close()
        if getattr(self, "nixl", None) is not None:
            self.nixl.close()
            self.nixl = None
        self._pack_shapes = collections.OrderedDict()
        self._pack_tail = None
        self._peers = {}
        self._routes = {}
        self._inflight = collections.deque()
        self._stream_waits = {}
        self._groups, self._flats = {}, {}
        for attr in ("stream", "_capture_stream", "_lane"):
            st = getattr(self, attr, None)
            if st is not None:
                st.close()
                setattr(self, attr, None)
        if shared is not None:
            shared.retire(free=drained)
        elif drained:           # a construction that failed before its words were shared
            for b in (getattr(self, "flags", None), getattr(self, "staging", None)):
                if b is not None:
                    b.close()
        self.flags = self.staging = None
