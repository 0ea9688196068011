"""The decode worker's end of the side channel (:mod:`.channel` describes the protocol): :class:`SideChannelClient`,
one connection to one prefill rank, its handshake advanced by the engine thread, its claim, done and release
messages sent by a thread of its own, the prefill's answers to its claims read by either. No vLLM import."""
from __future__ import annotations

import collections
import errno
import itertools
import logging
import math
import queue
import select
import socket
import threading
import time

from . import lease
from .frames import (_ANSWER, _CLOCK, _LEN, MAX_ANSWER, MAX_IDS_PER_MESSAGE, MAX_MESSAGE, ChannelClosed, message,
                     no_delay, parse_message, recv_some, send_some, take_frames)

log = logging.getLogger("gpuxfer.vllm")

#: the most host names the clients of a process resolve at once (each on a thread of its own, which a lookup that
#: hangs keeps for the resolver's timeout); a client past them fails its handshake
MAX_RESOLVING = 64
_resolving = [0]
_resolving_lock = threading.Lock()
#: how often an idle sender thread looks whether the prefill end closed (:attr:`SideChannelClient.alive` says it)
WATCH_S = 0.05
_BY_US = "closed by this instance"
#: answers to claims kept for loads that did not take them (a load that failed before its answer came)
MAX_ANSWERS = 1 << 16
#: claim messages sent and not answered at most (a prefill answers each at its next pump): past them the connection
#: ends, so a prefill end that takes claims and answers none cannot have their requests kept without bound
MAX_ASKED = 1 << 12


class SideChannelClient:
    """The decode worker's connection to one prefill engine, advanced by the engine's thread:
    :meth:`pump` until it returns the handshake (bounded by ``timeout_s`` from the connect), then
    :meth:`claim` and :meth:`notify`; :attr:`answers` holds the prefill's answers to claims
    ((request, token) -> granted),
    :meth:`read_answers` takes those that arrived; :attr:`alive` is False once the prefill end closed;
    :attr:`peer_clock` (once the handshake is in) bounds the prefill's lease clock against this one."""

    def __init__(self, host: str, port: int, timeout_s: float):
        self.timeout_s = timeout_s
        self._where = f"{host}:{port}"
        self._sock: socket.socket | None = None
        self._resolved: list = []               # a host name's address (or the error), from its resolver thread
        try:
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        except socket.gaierror:                 # a name: resolved on a thread (a lookup may take seconds)
            with _resolving_lock:
                busy = _resolving[0] >= MAX_RESOLVING
                if not busy:
                    _resolving[0] += 1
            if busy:
                self._resolved.append(OSError(f"{MAX_RESOLVING} host names are being resolved already"))
            else:
                try:
                    threading.Thread(target=self._resolve, args=(host, port), name="gpuxfer-vllm-resolve",
                                     daemon=True).start()
                except BaseException:
                    with _resolving_lock:
                        _resolving[0] -= 1
                    raise
        else:
            self._connect(info[0])
        self._t0 = time.monotonic()
        self._sent = lease.now()                # before the hello leaves (the prefill reads its clock after)
        self.peer_clock: lease.PeerClock | None = None
        self._out = bytearray(message({"op": "hello"}))
        self._in = bytearray()
        self._got: list[bytes] = []
        self._closed = False
        #: False once the prefill end closed (after the handshake it sends only answers to claims: the sender thread
        #: reads them when idle, and finds a closed end so), sent what is not such an answer, a send failed or
        #: :meth:`close` was called (an attribute: the engine thread reads it in every load's step)
        self.alive = True
        self.closed_reason: str | None = None
        self.outbox: "collections.deque[tuple[float, str, list, list | None, list | None]]" = collections.deque()
        # (when queued, op, request ids, their hold keys, their claim tokens)
        # claim messages sent and not answered: id -> their (request, token) pairs
        self._asked: dict[int, list[tuple[str, str | None]]] = {}
        self._next_id = 0
        # the prefill's answers to claims not taken yet, by (request, token): an answer a load left (it failed before
        # the answer came) is never taken by a later load of the same request ID with its own token
        self.answers: dict[tuple[str, str | None], bool] = {}
        self._recv_lock = threading.Lock()          # one reader of answers at a time
        self._answer_in = bytearray()
        self._wake: "queue.SimpleQueue[bool]" = queue.SimpleQueue()    # True: a message; False: close
        self._send_lock = threading.Lock()      # one sender of whole messages at a time
        self._sender: threading.Thread | None = None
        self._stopping = False
        self._head: bytearray | None = None     # the oldest message's unsent rest (under the send lock)
        self._head_deadline = 0.0
        self._abandoned = False
        self.claimed = False                   # a claim was queued since the engine thread's last flush_late
        #: decode ranks that read shares of this prefill rank's heads (each done or release says so); set at
        #: the handshake, before any message
        self.readers = 1

    def _resolve(self, host: str, port: int) -> None:
        try:
            self._resolved.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0])
        except (OSError, UnicodeError) as exc:
            self._resolved.append(exc)
        finally:
            with _resolving_lock:
                _resolving[0] -= 1

    def _connect(self, info) -> None:
        family, kind, proto, _, addr = info
        sock = socket.socket(family, kind, proto)
        no_delay(sock)
        sock.setblocking(False)
        err = sock.connect_ex(addr)
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            sock.close()
            raise ChannelClosed(f"connecting to {self._where} failed: {err}")
        self._sock = sock

    def pump(self) -> tuple[bytes, bytes] | None:
        """Advance the handshake without blocking: ``(description, metadata)`` once both arrived, None
        before; :class:`ChannelClosed` when the prefill end failed it (or its host name did not resolve),
        :class:`TimeoutError` past ``timeout_s``."""
        if self.peer_clock is not None:
            return self._got[0], self._got[1]
        if self._closed:
            raise ChannelClosed(self.closed_reason or "closed")
        try:
            if self._sock is None:
                if not self._resolved:
                    if time.monotonic() - self._t0 > self.timeout_s:
                        self._fail(f"{self._where} not resolved within {self.timeout_s:g} s")
                        raise TimeoutError(self.closed_reason)
                    return None
                got = self._resolved[0]
                if isinstance(got, Exception):
                    raise ChannelClosed(f"resolving {self._where} failed: {got}")
                self._connect(got)
            if self._out:
                send_some(self._sock, self._out)
            data = recv_some(self._sock)
            if data is not None:
                self._in += data
                while len(self._got) < 3 and (got := take_frames(self._in, _ANSWER[len(self._got)], most=1)):
                    self._got += got            # (each frame held to what its part of the answer can be)
                if len(self._got) == 3 and self._in:
                    raise ChannelClosed("more than the three frames of a handshake")
                if len(self._got) == 3:
                    clock = self._got[2]
                    peer = _CLOCK.unpack(clock)[0] if len(clock) == _CLOCK.size else math.nan
                    if not math.isfinite(peer):
                        raise ChannelClosed("a handshake whose clock frame is not a finite double "
                                            f"({len(clock)} bytes)")
                    self.peer_clock = lease.PeerClock(sent=self._sent, peer=peer, same=False)
        except ChannelClosed as exc:
            self._fail(str(exc))
            raise
        if self.peer_clock is not None:
            log.debug("side channel: %d + %d bytes of handshake in %.3f s", len(self._got[0]), len(self._got[1]),
                      time.monotonic() - self._t0)
            self._start_sender()            # here, not in a request's step (a thread start costs ~0.1 ms)
            return self._got[0], self._got[1]
        if time.monotonic() - self._t0 > self.timeout_s:
            self._fail(f"no handshake within {self.timeout_s:g} s")
            raise TimeoutError(self.closed_reason)
        return None

    def handshake(self) -> tuple[bytes, bytes]:
        """:meth:`pump` until done (blocking; for tools and tests)."""
        while True:
            got = self.pump()
            if got is not None:
                return got
            time.sleep(0.001)

    def read_answers(self) -> None:
        """Take the prefill's answers to claims that arrived into :attr:`answers`, without blocking (the engine
        thread while its loads wait for them, and the sender thread when idle: whichever gets the lock); a closed
        connection, or bytes that are not an answer to a claim this end sent, end the connection."""
        if self._sock is None or self.peer_clock is None or self._closed:
            return
        if not self._recv_lock.acquire(blocking=False):
            return                          # the other thread is reading them
        try:
            try:
                data = self._sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            except (OSError, ValueError) as exc:
                self._fail(f"the side channel failed: {exc}")
                return
            if not data:
                self._fail("the prefill instance closed the side channel")
                return
            self._answer_in += data
            try:
                for body in take_frames(self._answer_in, MAX_ANSWER):
                    self._take_answer(parse_message(body))
            except ChannelClosed as exc:
                self._fail(f"the prefill sent what is not an answer to a claim: {exc}")
        finally:
            self._recv_lock.release()

    def _take_answer(self, msg: dict) -> None:
        reqs = self._asked.pop(msg.get("id"), None) if type(msg.get("id")) is int else None
        got = msg.get("granted")
        if msg["op"] != "claimed" or reqs is None or type(got) is not str or len(got) != len(reqs) or \
                got.strip("01"):
            raise ChannelClosed(f"{str(msg)[:80]!r}")
        answers = self.answers
        for claim, g in zip(reqs, got):
            answers[claim] = g == "1"
        if len(answers) > MAX_ANSWERS:      # answers no load took (its load failed first): the oldest go
            for claim in list(itertools.islice(answers, len(answers) - MAX_ANSWERS // 2)):
                answers.pop(claim, None)

    def claim(self, request_ids: list[str], keys: list[str | None], tokens: list[str]) -> bool:
        """Queue a claim on ``request_ids`` (their holds' keys and this instance's tokens): sent by the sender thread
        like :meth:`notify`'s messages, or by the engine thread's next :meth:`flush_late`, whichever comes first (a
        load's finish waits for the answer); the prefill's answers come into :attr:`answers`. False when the
        connection is dead already."""
        if len(request_ids) > MAX_IDS_PER_MESSAGE:
            if not self.notify("claim", request_ids, keys, tokens):
                return False
        elif self._closed:
            return False
        else:                                   # (one message: notify's own, without its loop)
            self.outbox.append((time.monotonic(), "claim", list(request_ids), None if keys is None else list(keys),
                                  None if tokens is None else list(tokens)))
            self._wake.put(True)
        self.claimed = True
        return True

    def notify(self, op: str, request_ids: list[str], keys: list[str | None] | None = None,
               tokens: list[str | None] | None = None) -> bool:
        """Queue a done or release message for ``request_ids`` (``keys``: their holds' keys, from their params;
        ``tokens``: their claims' tokens; none: one message naming none, which finds a dead connection): the
        client's sender thread (started at the handshake,
        so nothing interleaves with the hello) sends the messages in order, each within ``timeout_s`` or the
        connection is dead. False when it is dead already."""
        if self._closed:
            return False
        t, n = time.monotonic(), MAX_IDS_PER_MESSAGE
        if len(request_ids) <= n:               # (the usual: one message)
            self.outbox.append((t, op, list(request_ids), None if keys is None else list(keys),
                                  None if tokens is None else list(tokens)))
        else:
            for i in range(0, len(request_ids), n):
                self.outbox.append((t, op, list(request_ids[i:i + n]), None if keys is None else list(keys[i:i + n]),
                                      None if tokens is None else list(tokens[i:i + n])))
        self._wake.put(True)
        return True

    def flush_late(self, now: float) -> None:
        """Send, on the calling (engine) thread, the queued messages when one is a claim (a load's finish waits for
        its answer) or the oldest has waited ``LATE_S``: a sender thread waits for the GIL while the engine thread
        polls in a loop of short system calls, and holds them no longer than that."""
        pending = self.outbox
        claimed, self.claimed = self.claimed, False   # (a sender thread holding the lock sends all that is queued)
        if not pending:                         # nothing queued: the usual poll
            return
        try:
            oldest = pending[0][0]              # no lock: the sender thread may pop it meanwhile
        except IndexError:
            return
        if (claimed or now - oldest > self.LATE_S) and self._sender is not None and \
                self._send_lock.acquire(blocking=False):
            try:
                self._send_pending(block=False)     # what the socket takes now; the thread sends the rest
            finally:
                self._send_lock.release()

    LATE_S = 0.02

    def _start_sender(self) -> None:
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_queued, name="gpuxfer-vllm-notify", daemon=True)
            self._sender.start()

    def _send_pending(self, block: bool = True) -> None:
        """Each queued message whole, oldest first (the caller holds the send lock); a message not taken within
        ``timeout_s`` or a failed send ends the connection. A message partly sent stays in ``_head`` (never
        sent again from its start); ``block=False`` (the engine thread) returns when the socket is full."""
        pending = self.outbox
        try:
            while pending and not self._broken:
                if self._head is None:
                    t, op, reqs, keys, tokens = pending[0]
                    msg = {"op": op, "reqs": reqs}
                    if keys is not None and (any(keys) or op == "claim"):
                        msg["keys"] = [k or "" for k in keys]
                    if tokens is not None and all(tokens):
                        msg["tokens"] = tokens
                    if op == "claim":
                        msg["id"] = self._next_id
                    elif self.readers > 1:
                        msg["of"] = self.readers
                    head = message(msg)
                    if len(head) - _LEN.size > MAX_MESSAGE and len(reqs) > 1:
                        # IDs JSON writes as escapes (up to 12 bytes a character): halves until each fits the
                        # prefill's MAX_MESSAGE (one ID of MAX_REQUEST_ID characters always does)
                        h = len(reqs) // 2
                        pending[0] = (t, op, reqs[h:], None if keys is None else keys[h:],
                                      None if tokens is None else tokens[h:])
                        pending.appendleft((t, op, reqs[:h], None if keys is None else keys[:h],
                                            None if tokens is None else tokens[:h]))
                        continue
                    if op == "claim":       # (before it goes: the answer may come before this thread runs again)
                        if len(self._asked) >= MAX_ASKED:
                            raise ChannelClosed(f"{len(self._asked)} claim messages unanswered")
                        self._asked[self._next_id] = list(zip(reqs, tokens or [None] * len(reqs)))
                        self._next_id += 1
                    self._head = bytearray(head)
                    self._head_deadline = time.monotonic() + self.timeout_s
                out = self._head
                while out:
                    send_some(self._sock, out)
                    if not out:
                        break
                    left = self._head_deadline - time.monotonic()
                    if left <= 0 or self._stopping:
                        raise ChannelClosed(f"a message was not taken within {self.timeout_s:g} s")
                    if not block:
                        return
                    select.select([], [self._sock], [], min(left, 0.05))
                self._head = None
                pending.popleft()
        except (ChannelClosed, OSError, ValueError) as exc:
            self._abandoned = True              # a half-sent message: nothing may follow it on this socket
            self._fail(f"sending a message failed: {exc}")

    def _send_queued(self) -> None:
        """The sender thread (from the handshake on): the queued messages as they come; idle, it watches the
        connection every ``WATCH_S``. A dead connection or :meth:`close` ends it."""
        while True:
            try:
                more = self._wake.get(timeout=WATCH_S)
            except queue.Empty:
                more = not self._closed
                if more and self._head is None:     # else: send the rest flush_late left
                    self.read_answers()             # (and whether the prefill end closed)
                    continue
            with self._send_lock:
                self._send_pending()
            if not more or self._broken:
                return

    @property
    def _broken(self) -> bool:
        """Closed other than by :meth:`close` (which still sends what was queued before it)."""
        return self._abandoned or (self._closed and self.closed_reason != _BY_US)

    def _fail(self, reason: str) -> None:
        if not self._closed:
            self.closed_reason = reason         # before _closed: _broken reads both without a lock
            self._closed = True
            self.alive = False

    def close(self) -> None:
        """Send what :meth:`notify` queued (for at most a second), then close."""
        close_all([self])


def close_all(clients: list[SideChannelClient]) -> None:
    """Close ``clients`` together: each sends what :meth:`~SideChannelClient.notify` queued within one shared second
    (a second each, one after the other, would hold a shutdown for as many seconds as prefill ends stopped reading).
    Any other object with a ``close`` is closed on its own."""
    for c in [c for c in clients if not isinstance(c, SideChannelClient)]:
        c.close()
    clients = [c for c in clients if isinstance(c, SideChannelClient)]
    senders = [c._sender for c in clients if c._sender is not None]
    for c in clients:
        c._fail(_BY_US)
        if c._sender is not None:
            c._wake.put(False)
    _join(senders, 1.0)
    for c in clients:
        c._stopping = True
    _join(senders, 1.0)
    for c in clients:
        if c._sock is not None:                 # (None: closed while its host name was resolved)
            try:
                c._sock.shutdown(socket.SHUT_RDWR)      # a send still under way fails now
            except OSError:
                pass
    _join(senders, 0.2)
    for c in clients:
        if c._sock is not None:
            c._sock.close()


def _join(threads: list[threading.Thread], timeout_s: float) -> None:
    """Join ``threads`` within ``timeout_s`` in all."""
    end = time.monotonic() + timeout_s
    for t in threads:
        t.join(timeout=max(0.0, end - time.monotonic()))
