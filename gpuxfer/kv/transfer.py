"""A prepared request (:class:`KVTransfer`, the base every engine's transfer extends) and the handle
of a posted one (:class:`KVTransferHandle`)."""
from __future__ import annotations

import time
from itertools import repeat

import numpy as np

from ..errors import BadInput, PeerLost, TransferTimeout
from ..platforms.base import Event, Stream


class KVTransferHandle:
    """A posted transfer: ``done()``, ``wait(timeout_s)``, ``event`` (make another stream wait on it).

    ``notify_value`` is what the peer's notification word holds once it landed (None: no notification).
    A request whose block IDs were checked on the device carries its post's status word: a completed one that
    failed the check raises :class:`~gpuxfer.errors.BlockIdError` from ``done()`` and ``wait()``.
    """

    __slots__ = ("transfer", "event", "name", "notify_value", "_stream", "_status", "_landed")

    def __init__(self, transfer: KVTransfer, event: Event, stream: Stream, notify_value: int | None,
                 status=None, landed=None):
        # the transfer keeps its buffers; the agent keeps the transfer until the event completed
        self.transfer, self.event, self._stream, self.notify_value = transfer, event, stream, notify_value
        self.name = transfer.name
        self._status = status
        self._landed = landed       # a folded post's host word (:class:`~gpuxfer.kv.triton_transfer._Landed`)

    @classmethod
    def _together(cls, transfers, event: Event, stream: Stream, values=None, status=None,
                  landed=None) -> list[KVTransferHandle]:
        """The handles of ``transfers`` posted together (one event; ``values``: their notified values, default
        None), each as :meth:`__init__` makes it, without a call per handle (:mod:`gpuxfer.kv.batch`)."""
        # (the handles made in one call, each filled by one statement per attribute: no call and no tuple packed
        # and unpacked per handle)
        out = list(map(cls.__new__, repeat(cls, len(transfers))))
        for h, x, v in zip(out, transfers, repeat(None) if values is None else values):
            h.transfer = x
            h.event = event
            h._stream = stream
            h.notify_value = v
            h.name = x.name
            h._status = status
            h._landed = landed
        return out

    def done(self) -> bool:
        """Whether the transfer completed; a completed two-sided one raises instead where its agent failed
        (:class:`~gpuxfer.errors.TransferMismatch` where the sides did not pair up, the error of a release),
        as :meth:`wait` does. A post whose completion lands in a host word (a folded post) reads it first, no
        driver call; while it has not landed, the answer is "not yet" for the first
        :data:`~gpuxfer.kv.triton_transfer.LANDED_ONLY_S` after the post, then the event's (a failed stream
        raises from there)."""
        agent = self.transfer.agent
        landed = self._landed
        if landed is None:
            done = agent.platform.event_query(self.event)
        elif landed.landed():
            done = True
        elif time.monotonic() < landed.until:
            return False
        else:
            done = agent.platform.event_query(self.event)
        if done:
            if self.transfer.waits_on_peer:
                agent.check()
            if self._status is not None:
                self._status.raise_if_bad(self.name)
        return done

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the transfer has completed; :class:`TransferTimeout` naming the request past ``timeout_s``
        (default: the agent's; a finite number of seconds > 0, at most :data:`~gpuxfer.sync.MAX_TIMEOUT_S`,
        else :class:`~gpuxfer.errors.BadInput`: :meth:`done` asks without waiting);
        :class:`~gpuxfer.errors.TransferMismatch` where a two-sided transfer's sides posted different requests."""
        from ..sync import SPIN_S, check_timeout, wait_event_or_raise
        agent = self.transfer.agent
        agent.check()
        t = agent.timeout_s if timeout_s is None else check_timeout(timeout_s, f"KV transfer {self.name!r}: timeout_s")
        try:
            wait_event_or_raise(agent.platform, self.event, t, rank=agent.rank, what=f"KV transfer {self.name!r}",
                                spin_s=SPIN_S)
        except PeerLost:
            raise               # the transfer's own error (its peer exited), not a timeout of this wait
        except TransferTimeout as exc:
            err = TransferTimeout(rank=agent.rank, step=0, flag=f"request {self.name!r}", expected=1, seen=0,
                                  timeout_s=t, what=f"{self.transfer.describe()} did not complete")
            if self.transfer.waits_on_peer:
                agent.fail(err)
            raise err from exc
        if self.transfer.waits_on_peer:     # the two sides' verdict (pack): a mismatch fails the agent
            agent.check()
        if self._status is not None:
            self._status.raise_if_bad(self.name)

    def stream_wait(self, stream: Stream) -> None:
        """Make ``stream``'s later work wait for this transfer."""
        self.transfer.agent.platform.stream_wait_event(stream, self.event)

    def __repr__(self) -> str:
        return f"KVTransferHandle({self.name!r})"


class KVTransfer:
    """A prepared request: block IDs checked and staged; :meth:`post` may be called again and again.

    ``poster``: its agent's :class:`~gpuxfer.kv.posting.Poster`, what its posts run on; :attr:`agent` is that
    agent; ``peer``: a :class:`~gpuxfer.kv.peers.KVPeer`; ``route``: a :class:`~gpuxfer.kv.routes._Route`."""

    waits_on_peer = False           # whether its streams wait on flags the peer writes (a timeout fails the agent)
    _pooled = None                  # the host array's pool token (:class:`_RequestPool`), if it came from the pool

    def __init__(self, poster, peer, route, op: str, name: str, n_seg, host_req, notify_slot: int | None,
                 descriptors: int, nbytes: int):
        self.poster, self.agent = poster, poster.agent
        self.peer, self.route, self.op, self.name = peer, route, op, name
        self.n_seg = n_seg              # segments per group of the route
        self.descriptors, self.nbytes = descriptors, nbytes
        self.notify_slot = notify_slot
        self._host_req = host_req       # the request array's host memory (a tensor)

    def describe(self) -> str:
        return (f"{self.op} of request {self.name!r} with peer {self.peer.name!r} ({self.descriptors:,} "
                f"descriptors, {self.nbytes:,} bytes)")

    def post(self, stream: Stream | None = None) -> KVTransferHandle:
        """Enqueue the transfer on ``stream`` (default: the agent's own) and return its handle; host work that
        does not depend on the number of descriptors (each engine's transfer says what it is)."""
        raise NotImplementedError

    def _finish(self, s: Stream) -> tuple[int | None, Event]:
        """The end of a post on ``s`` (the caller holds the agent's post lock): the notification, if the request
        has one (:meth:`KVPeer._notify <gpuxfer.kv.peers.KVPeer._notify>`), and the post's event: ``(notified value
        or None, event)``."""
        if self.notify_slot is None:
            return None, self.agent.platform.record_event(s)
        return self.peer._notify(s, self.notify_slot)

    def expanded_descriptors(self) -> np.ndarray:
        """The ``(N, 3)`` descriptors of this request (offsets from the source and destination anchors), as the
        engine expands them -- for checking the expansion; not a transfer path."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"KVTransfer({self.describe()})"

    def __reduce_ex__(self, protocol):
        """Refused (:class:`BadInput`): a copy would share the pooled host array, and each would give it back to the
        pool when collected -- two later requests staged into one array, one posting the other's IDs. The same for
        ``copy.copy``, ``copy.deepcopy`` and pickling, which all come here."""
        raise BadInput(f"{self!r} cannot be copied or pickled (its request array is the agent's): prepare the "
                       "request again")

    def __del__(self):
        """The host array goes back to the agent's pool: the agent keeps a posted transfer until its last post
        completed, so nothing reads the array any more."""
        poster = getattr(self, "poster", None)
        if poster is not None and self._pooled is not None:
            poster.requests.give(self._pooled)
