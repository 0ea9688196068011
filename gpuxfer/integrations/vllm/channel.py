"""The side channel between a prefill instance's worker and the decode instances that read from it:
one TCP connection per (decode worker, prefill rank), frames of a 4-byte big-endian length and a JSON body
(:mod:`.frames`); :class:`SideChannelServer` is the prefill's end, :class:`~.client.SideChannelClient` the
decode's. No vLLM import.

* decode -> prefill ``{"op": "hello"}``; the prefill answers with three frames: its engine description
  (JSON), its agent's metadata bytes and its lease clock when it answered (an 8-byte big-endian double:
  :mod:`.lease` reads the prefill's deadlines with it). Once per remote engine; the decode side caches the
  result.
* decode -> prefill ``{"op": "claim", "id": n, "reqs": [id, ...], "keys": [key, ...], "tokens": [token, ...]}``:
  this decode instance reads these requests (sent when their reads are posted). A token is random, made by the
  decode instance's scheduler side for one request and handed to each of its ranks, so the ranks of one instance
  claim alike. The prefill answers each claim message with ``{"op": "claimed", "id": n, "granted": "101"}``, a
  character a request: ``1`` where the request had no claim yet or this token's, ``0`` where another token
  claimed it, or its hold ended (read, released, or its lease ran out), or the key is not the hold's. A claim
  with a key is answered once the engine's secret is known (the key is a MAC under it: :func:`.holds.authentic`);
  the decision is one lock's (:class:`.holds.ClaimBook`), whichever thread pumps the server.
* decode -> prefill ``{"op": "done", "reqs": [id, ...]}``: the decode instance has read these requests'
  blocks (one message for a step's reads); ``{"op": "release", "reqs": [id, ...]}``: it will not read
  them (aborted, or computed locally). ``"keys": [key, ...]``: each request's hold key, from its
  ``kv_transfer_params`` (a message without the hold's key does not count); ``"tokens"``: each request's claim
  token (a done counts only with the granted claim's token; a release with it, or where no claim came, which
  then refuses later claims). With ``"of": k`` (k > 1), the sender is one of k decode ranks that each read a
  share of this prefill rank's heads: the prefill frees the blocks at its next step once k such messages came
  (:class:`~.holds.PrefillHolds`). No answer.

A load, as the threads see it (E: an engine thread, S: a sender or server thread, either ``|`` end may be
the other thread of its process)::

    decode worker                                    prefill worker
    E start_load_kv: post the read; queue claim
    E get_finished (same step; or S first):
       ---- claim(id, req, key, token) ------------>  E get_finished pump (or S, engine idle): grant or refuse
                                                      under the claim book's lock
    E get_finished: read answers  <--- claimed ----  (same pump)
    E read complete + granted: report loaded;
      queue done(req, key, token)
    S  ---- done ---------------------------------->  E get_finished: the token is the grant's: free the blocks

The read runs while the claim travels, and the answer goes out at the prefill's next pump: its engine thread's
next step, or the server's thread once the engine thread has not pumped for ``IDLE_S`` (2 ms: a prefill step
computing a long prompt does not hold the answer back). A load's finish waits for the grant only where that comes
later than the read completes. A refused claim fails the load (vLLM recomputes
it); no grant within the load's timeout, or a closed connection, fails it too.

Both ends are non-blocking sockets that the engine's own thread advances once a step
(:meth:`SideChannelServer.pump`, :meth:`~.client.SideChannelClient.pump`): a background Python thread gets the
GIL only when the engine thread lets go of it, and an engine thread that keeps releasing and
retaking it (a loop of short system calls) starves such a thread for hundreds of milliseconds. The
server's own thread pumps too, where the engine thread has not for ``IDLE_S``, so a prefill instance idle or
inside a long step still answers. A thread of the client
encodes and sends the done and release messages, which nobody waits on to be sent (a late one holds the
prefill's blocks a little longer), and watches the connection: the engine thread only queues them and
does not pay the loopback ``send``, which costs tens of microseconds inside an engine process. A claim, whose
answer a load's finish waits for, the engine thread sends itself at its next poll (``get_finished``, the end of the
step that posted the read) unless that thread sent it first. Both ends set ``TCP_NODELAY``: a claim sent while a
done is unacknowledged (a done gets no answer) would otherwise wait for the prefill's delayed ACK (~20-40 ms). A
frame longer than
its part of the protocol can be (``MAX_MESSAGE`` for what a decode sends; in a handshake answer ``MAX_INFO``, the
most an agent's metadata holds, 8 bytes; ``MAX_ANSWER`` for a claim's answer), a message the protocol does not
allow (a field past its bound: ``MAX_REQUEST_ID``, ``MAX_KEY``, ``MAX_TOKEN``, ``MAX_READERS``), an answer not
drained within the timeout, answers to claims left unread past ``MAX_UNSENT`` bytes, a claim message past ``MAX_DEFERRED`` of the server's waiting for the secret (a
decode worker's come only once the secret is known: its handshake carries the seal key made from it), a connection that
sent no hello or left a message half sent for longer than the timeout close that connection only; past
``MAX_CONNECTIONS`` open, or ``MAX_CONNECTIONS_PER_HOST`` from one address, a new one is closed at once (a host
opening many cannot lock the others' decode workers out).
"""
from __future__ import annotations

import collections
import logging
import queue
import selectors
import socket
import threading
import time

from . import lease
from .client import SideChannelClient
from .frames import (_CLOCK, MAX_CLAIM_ID, MAX_FRAME, MAX_IDS_PER_MESSAGE, MAX_INFO, MAX_KEY, MAX_MESSAGE,
                     MAX_READERS, MAX_REQUEST_ID, MAX_TOKEN, ChannelClosed, frame, keys_ok, message, parse_message,
                     no_delay, readers_ok, recv_some, request_ids_ok, send_some, take_frames, tokens_ok)

__all__ = ["MAX_CONNECTIONS", "MAX_CONNECTIONS_PER_HOST", "MAX_DEFERRED", "MAX_EVENTS", "MAX_FRAME", "MAX_UNSENT",
           "MAX_IDS_PER_MESSAGE", "MAX_INFO", "MAX_KEY", "MAX_MESSAGE", "MAX_READERS", "MAX_REQUEST_ID", "MAX_TOKEN",
           "ChannelClosed", "SideChannelClient", "SideChannelServer", "frame", "message", "parse_message",
           "take_frames"]

log = logging.getLogger("gpuxfer.vllm")

#: the most connections a prefill worker keeps open, and of them from one address (a decode worker keeps one per
#: prefill engine: a host runs a few dozen)
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_HOST = 256
#: done and release events queued for the worker at most (an idle engine takes none); a connection queuing more closes
MAX_EVENTS = 1 << 18
#: claim messages of all connections waiting for the engine's secret (answered in order once it is known)
MAX_DEFERRED = 64
#: bytes of answers to claims a connection leaves unread past what its socket takes (a decode worker reads them as
#: they come: a few dozen bytes a claim message); a connection leaving more closes
MAX_UNSENT = 1 << 20
_CLAIM_KEYS = frozenset(("op", "id", "reqs", "keys", "tokens"))


class _Conn:
    __slots__ = ("sock", "addr", "inbuf", "outbuf", "since", "greeted", "opened", "partial", "deferred")

    def __init__(self, sock: socket.socket, addr, now: float):
        self.sock, self.addr = sock, addr
        self.inbuf, self.outbuf = bytearray(), bytearray()
        self.since = 0.0                    # when the unsent answer was queued
        self.greeted = False                # its hello was answered (a connection gets one answer)
        self.opened = now                   # accepted (a peer that says no hello within the timeout goes)
        self.partial = 0.0                  # since when ``inbuf`` holds part of a message
        self.deferred: list[dict] = []      # claim messages waiting for the engine's secret, in order


class SideChannelServer:
    """The prefill worker's listener: answers hellos with ``hello()`` (two frames), claims with ``claim(request,
    key, token)`` (True: granted, False: refused, None: not yet, asked again at later pumps; no ``claim``: every
    claim refused), and queues ``(op, request id, readers, key or None, token or None)`` of done and release
    messages on :attr:`events` for the worker to drain.
    :meth:`pump` serves whatever is ready without blocking; the worker calls it each step and the
    server's thread calls it while the engine is idle."""

    def __init__(self, host: str, port: int, hello, timeout_s: float, claim=None):
        self._hello, self._claim = hello, claim
        self.timeout_s = timeout_s
        self.events: "queue.SimpleQueue[tuple[str, str, int, str | None, str | None]]" = queue.SimpleQueue()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.setblocking(False)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._conns: dict[socket.socket, _Conn] = {}
        self._per_host: collections.Counter = collections.Counter()     # open connections by address
        self._lock = threading.Lock()           # one pump at a time
        self._deferred = 0                      # claim messages waiting for the secret, of all connections
        self._pumped = 0.0                      # when the engine thread last pumped
        self._swept = 0.0                       # when connections were last looked at for timeouts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuxfer-vllm-side-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """Serve while the engine thread does not: past ``IDLE_S`` without its :meth:`pump`, the engine idle or
        inside a step (a forward pass) longer than that. (A thread holding the lock while starved of the GIL
        keeps the engine thread's pump from serving: it gives up after a few milliseconds and serves next step.)"""
        while not self._stop.is_set():
            try:
                ready = self._sel.select(0.2)
            except (OSError, ValueError):      # closed under the select
                return
            busy_for = self.IDLE_S - (time.monotonic() - self._pumped)
            if busy_for > 0:
                # the engine thread serves while it steps: sleep until it would count as idle (a select
                # again now returns at once for what it left unread, and spinning on it takes the GIL)
                self._stop.wait(busy_for)
                continue
            due = self._conns and time.monotonic() - self._swept > self.SWEEP_S       # (timeouts looked at)
            if ready or due or any(c.outbuf or c.deferred for c in list(self._conns.values())):
                with self._lock:
                    if not self._stop.is_set():
                        self._pump_locked()

    #: how long after the engine thread's last pump the server's thread serves what is ready: short, so a claim
    #: waits for no prefill step; long enough that an engine stepping faster serves it itself
    IDLE_S = 0.002

    def pump(self) -> None:
        """Serve what is ready now (the engine thread, once a step)."""
        self._pumped = time.monotonic()
        if self._lock.acquire(timeout=0.005):   # the thread holds it only for a pump of its own
            try:
                if not self._stop.is_set():
                    self._pump_locked()
            finally:
                self._lock.release()

    def _pump_locked(self) -> None:
        for key, _ in self._sel.select(0):
            if key.fileobj is self._sock:
                self._accept()
            else:
                self._serve(self._conns[key.fileobj])
        now = time.monotonic()
        if now - self._swept > self.SWEEP_S:
            self._sweep(now)
        for c in [c for c in self._conns.values() if c.deferred]:
            self._answer(c)
        for c in [c for c in self._conns.values() if c.outbuf]:
            try:
                send_some(c.sock, c.outbuf)
                if c.outbuf and now - c.since > self.timeout_s:
                    raise ChannelClosed(f"the answer was not read within {self.timeout_s:g} s")
            except ChannelClosed as exc:
                self._drop(c, exc)
                continue
            self._sel.modify(c.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if c.outbuf else 0))

    SWEEP_S = 0.5

    def _sweep(self, now: float) -> None:
        """Close the connections that said no hello, or left a message half sent, for longer than the timeout."""
        self._swept = now
        limit = self.timeout_s
        for c in list(self._conns.values()):
            if not c.greeted and now - c.opened > limit:
                self._drop(c, f"no hello within {limit:g} s")
            elif c.inbuf and now - c.partial > limit:
                self._drop(c, f"a message left half sent for {limit:g} s")

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            host = addr[0] if isinstance(addr, tuple) else addr
            if len(self._conns) >= MAX_CONNECTIONS or self._per_host[host] >= MAX_CONNECTIONS_PER_HOST:
                log.warning("side channel: %d connections open, %d from %s; closing the new one", len(self._conns),
                            self._per_host[host], host)
                sock.close()
                continue
            no_delay(sock)
            sock.setblocking(False)
            log.debug("side channel: connection from %s", addr)
            self._conns[sock] = _Conn(sock, addr, time.monotonic())
            self._per_host[host] += 1
            self._sel.register(sock, selectors.EVENT_READ, None)

    def _serve(self, c: _Conn) -> None:
        try:
            data = recv_some(c.sock)
            if data is None:
                return
            fresh = not c.inbuf
            c.inbuf += data
            bodies = take_frames(c.inbuf, MAX_MESSAGE)
            if c.inbuf and (fresh or bodies):      # what is left began with this data
                c.partial = time.monotonic()
            for body in bodies:
                msg = parse_message(body)
                op, reqs = msg["op"], msg.get("reqs")
                if op == "hello":
                    if c.greeted:           # each answer is the agent's metadata: a peer asking again and again
                        raise ChannelClosed("a second hello")       # would have it buffered without bound
                    c.greeted = True
                    log.debug("side channel: hello from %s", c.addr)
                    info, meta = self._hello()
                    if not c.outbuf:
                        c.since = time.monotonic()
                    c.outbuf += frame(info) + frame(meta) + frame(_CLOCK.pack(lease.now()))
                elif op == "claim" and c.greeted and request_ids_ok(reqs) and msg.get("keys") is not None and \
                        keys_ok(msg, len(reqs)) and tokens_ok(msg, len(reqs), True) and \
                        type(msg.get("id")) is int and 0 <= msg["id"] < MAX_CLAIM_ID and msg.keys() <= _CLAIM_KEYS:
                    if len(reqs) > MAX_IDS_PER_MESSAGE:
                        raise ChannelClosed(f"a claim of {len(reqs)} requests (more than {MAX_IDS_PER_MESSAGE})")
                    if self._deferred >= MAX_DEFERRED:
                        raise ChannelClosed(f"more than {MAX_DEFERRED} claim messages waiting for the secret")
                    c.deferred.append(msg)
                    self._deferred += 1
                    self._answer(c)
                    if len(c.outbuf) > MAX_UNSENT:
                        send_some(c.sock, c.outbuf)
                        if len(c.outbuf) > MAX_UNSENT:
                            raise ChannelClosed(f"more than {MAX_UNSENT} bytes of answers to claims left unread")
                elif op in ("done", "release") and request_ids_ok(reqs) and readers_ok(msg) and \
                        keys_ok(msg, len(reqs)) and tokens_ok(msg, len(reqs), False):
                    if self.events.qsize() + len(reqs) > MAX_EVENTS:
                        raise ChannelClosed(f"more than {MAX_EVENTS} done and release events queued")
                    of = msg.get("of", 1)
                    tokens = msg.get("tokens") or [None] * len(reqs)
                    for req, key, token in zip(reqs, msg.get("keys") or [""] * len(reqs), tokens):
                        self.events.put((op, req, of, key or None, token))
                else:
                    raise ChannelClosed(f"an unknown message {str(msg)[:80]!r}")
        except ChannelClosed as exc:
            self._drop(c, exc)

    def _answer(self, c: _Conn) -> None:
        """Answer the connection's claim messages, oldest first, up to the first that cannot be decided yet (the
        engine's secret not known): each request granted or refused (``claim``), one answer a message."""
        while c.deferred:
            msg = c.deferred[0]
            got = []
            for req, key, token in zip(msg["reqs"], msg["keys"], msg["tokens"]):
                ok = self._claim(req, key, token) if self._claim is not None else False
                if ok is None:
                    if got:         # (undecided only before the secret: a message's requests are decided alike)
                        log.debug("side channel: a claim from %s decided in part", c.addr)
                    return
                got.append("1" if ok else "0")
            c.deferred.pop(0)
            self._deferred -= 1
            if not c.outbuf:
                c.since = time.monotonic()
            c.outbuf += message({"op": "claimed", "id": msg["id"], "granted": "".join(got)})

    def _drop(self, c: _Conn, why) -> None:
        if not self._stop.is_set():
            log.debug("side channel: connection from %s ended: %s", c.addr, why)
        if self._conns.pop(c.sock, None) is not None:
            self._deferred -= len(c.deferred)
            c.deferred.clear()
            host = c.addr[0] if isinstance(c.addr, tuple) else c.addr
            self._per_host[host] -= 1
            if not self._per_host[host]:
                del self._per_host[host]
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            for c in list(self._conns.values()):
                try:
                    c.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._drop(c, "closing")
            try:
                self._sel.unregister(self._sock)
            except (KeyError, ValueError):
                pass
            self._sock.close()
        self._thread.join(timeout=2.0)
        self._sel.close()

