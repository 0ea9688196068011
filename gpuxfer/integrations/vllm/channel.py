"""The side channel between a prefill instance's worker and the decode instances that read from it:
one TCP connection per (decode worker, prefill engine), frames of a 4-byte big-endian length and a
body. No vLLM import.

* decode -> prefill ``{"op": "hello"}``; the prefill answers with three frames: its engine description
  (JSON), its agent's metadata bytes and its lease clock when it answered (an 8-byte big-endian double:
  :mod:`.lease` reads the prefill's deadlines with it). Once per remote engine; the decode side caches the
  result.
* decode -> prefill ``{"op": "done", "reqs": [id, ...]}``: the decode instance has read these requests'
  blocks (one message for a step's reads); ``{"op": "release", "reqs": [id, ...]}``: it will not read
  them (aborted, or computed locally). ``"keys": [key, ...]``: each request's hold key, from its
  ``kv_transfer_params`` (a message without the hold's key does not count). With ``"of": k`` (k > 1), the
  sender is one of k decode ranks that each read a share of this prefill rank's heads: the prefill frees the
  blocks at its next step once k such messages came (:class:`~.holds.PrefillHolds`). No answer.

Both ends are non-blocking sockets that the engine's own thread advances once a step
(:meth:`SideChannelServer.pump`, :meth:`SideChannelClient.pump`): a background Python thread gets the
GIL only when the engine thread lets go of it, and an engine thread that keeps releasing and
retaking it (a loop of short system calls) starves such a thread for hundreds of milliseconds. The
server's own thread pumps too, so an idle prefill instance still answers. A thread of the client
encodes and sends the done and release messages, which nobody waits for (a late one holds the
prefill's blocks a little longer), and watches the connection: the engine thread only queues them and
does not pay the loopback ``send``, which costs tens of microseconds inside an engine process. A frame longer than
its part of the protocol can be (``MAX_MESSAGE`` for what a decode sends; in a handshake answer ``MAX_INFO``, the
most an agent's metadata holds, 8 bytes), a message the protocol does not allow, an answer not drained within the
timeout, a connection that sent no hello or left a message half sent for longer than the timeout close that
connection only; past ``MAX_CONNECTIONS`` open, or ``MAX_CONNECTIONS_PER_HOST`` from one
address, a new one is closed at once (a host opening many cannot lock the others' decode workers out).
"""
from __future__ import annotations

import collections
import errno
import json
import logging
import queue
import select
import selectors
import socket
import struct
import math
import threading
import time

from ...kv.metadata import MAX_METADATA_BYTES, MAX_METADATA_LAYERS
from . import lease

log = logging.getLogger("gpuxfer.vllm")

MAX_FRAME = 64 << 20
MAX_INFO = MAX_METADATA_LAYERS * 1024      # a handshake's engine description (1 KiB a layer, as agent metadata)
#: the longest message a decode sends (a step's done list goes in messages of at most ``MAX_IDS_PER_MESSAGE``
#: requests), and the most connections a prefill worker keeps open: what hostile peers can make it buffer
MAX_MESSAGE = 1 << 20
MAX_IDS_PER_MESSAGE = 1024
MAX_CONNECTIONS = 1024
#: the most of them from one address (a decode worker keeps one per prefill engine: a host runs a few dozen)
MAX_CONNECTIONS_PER_HOST = 256
MAX_REQUEST_ID = 512
MAX_READERS = 256                   # decode ranks sharing one prefill rank's heads (a message's "of")
MAX_KEY = 64                        # characters of a hold's key
#: done and release events queued for the worker at most (an idle engine takes none); a connection queuing more closes
MAX_EVENTS = 1 << 18
#: the most host names the clients of a process resolve at once (each on a thread of its own, which a lookup that
#: hangs keeps for the resolver's timeout); a client past them fails its handshake
MAX_RESOLVING = 64
_resolving = [0]
_resolving_lock = threading.Lock()
#: how often an idle sender thread looks whether the prefill end closed (:attr:`SideChannelClient.alive` says it)
WATCH_S = 0.05
_LEN = struct.Struct(">I")
_CLOCK = struct.Struct(">d")
_ANSWER = (MAX_INFO, MAX_METADATA_BYTES + 64, _CLOCK.size)      # (metadata: its header and body)
_BY_US = "closed by this instance"
_ENCODER = json.JSONEncoder(separators=(",", ":"))     # made once: json.dumps with separators makes one a call


class ChannelClosed(ConnectionError):
    """The other end closed the connection or sent something the protocol does not allow."""


def frame(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


def message(msg: dict) -> bytes:
    return frame(_ENCODER.encode(msg).encode())


def take_frames(buf: bytearray, limit: int = MAX_FRAME, most: int | None = None) -> list[bytes]:
    """Cut up to ``most`` complete frames off ``buf``; :class:`ChannelClosed` on a length past ``limit``."""
    out = []
    while len(buf) >= _LEN.size and (most is None or len(out) < most):
        (n,) = _LEN.unpack_from(buf)
        if n > limit:
            raise ChannelClosed(f"a frame of {n} bytes (more than {limit})")
        if len(buf) < _LEN.size + n:
            break
        out.append(bytes(buf[_LEN.size:_LEN.size + n]))
        del buf[:_LEN.size + n]
    return out


def parse_message(body: bytes) -> dict:
    try:
        msg = json.loads(body.decode())
    except (ValueError, RecursionError):        # (JSON nested past the parser's depth raises a RecursionError)
        raise ChannelClosed("a message that is not JSON") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ChannelClosed("a message without an op")
    return msg


def _readers(msg: dict) -> bool:
    """Whether a done or release message's ``of`` (absent: 1) is a count of readers this end takes."""
    of = msg.get("of", 1)
    return type(of) is int and 1 <= of <= MAX_READERS


def _keys(msg: dict, n: int) -> bool:
    """Whether a done or release message's ``keys`` (absent: none) are ``n`` strings a hold's key could be."""
    keys = msg.get("keys")
    return keys is None or (type(keys) is list and len(keys) == n and all(
        type(k) is str and len(k) <= MAX_KEY for k in keys))


def _recv_some(sock: socket.socket) -> bytes | None:
    """What the socket holds now (None: nothing yet); :class:`ChannelClosed` when the other end closed."""
    try:
        data = sock.recv(1 << 20)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as exc:
        raise ChannelClosed(f"the connection failed: {exc}") from None
    if not data:
        raise ChannelClosed("the connection closed")
    return data


def _send_some(sock: socket.socket, out: bytearray) -> None:
    try:
        n = sock.send(out)
    except (BlockingIOError, InterruptedError):
        return
    except OSError as exc:
        raise ChannelClosed(f"the connection failed: {exc}") from None
    del out[:n]


class _Conn:
    __slots__ = ("sock", "addr", "inbuf", "outbuf", "since", "greeted", "opened", "partial")

    def __init__(self, sock: socket.socket, addr, now: float):
        self.sock, self.addr = sock, addr
        self.inbuf, self.outbuf = bytearray(), bytearray()
        self.since = 0.0                    # when the unsent answer was queued
        self.greeted = False                # its hello was answered (a connection gets one answer)
        self.opened = now                   # accepted (a peer that says no hello within the timeout goes)
        self.partial = 0.0                  # since when ``inbuf`` holds part of a message


class SideChannelServer:
    """The prefill worker's listener: answers hellos with ``hello()`` (two frames) and queues
    ``(op, request id, readers, key or None)`` of done and release messages on :attr:`events` for the worker to
    drain.
    :meth:`pump` serves whatever is ready without blocking; the worker calls it each step and the
    server's thread calls it while the engine is idle."""

    def __init__(self, host: str, port: int, hello, timeout_s: float):
        self._hello = hello
        self.timeout_s = timeout_s
        self.events: "queue.SimpleQueue[tuple[str, str, int, str | None]]" = queue.SimpleQueue()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.setblocking(False)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._conns: dict[socket.socket, _Conn] = {}
        self._per_host: collections.Counter = collections.Counter()     # open connections by address
        self._lock = threading.Lock()           # one pump at a time
        self._pumped = 0.0                      # when the engine thread last pumped
        self._swept = 0.0                       # when connections were last looked at for timeouts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuxfer-vllm-side-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """Serve while the engine thread does not: past ``IDLE_S`` without its :meth:`pump`. (A thread
        holding the lock while starved of the GIL would keep the engine thread from serving.)"""
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
            if ready or due or any(c.outbuf for c in list(self._conns.values())):
                with self._lock:
                    if not self._stop.is_set():
                        self._pump_locked()

    IDLE_S = 0.1

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
        for c in [c for c in self._conns.values() if c.outbuf]:
            try:
                _send_some(c.sock, c.outbuf)
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
            sock.setblocking(False)
            log.debug("side channel: connection from %s", addr)
            self._conns[sock] = _Conn(sock, addr, time.monotonic())
            self._per_host[host] += 1
            self._sel.register(sock, selectors.EVENT_READ, None)

    def _serve(self, c: _Conn) -> None:
        try:
            data = _recv_some(c.sock)
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
                elif op in ("done", "release") and isinstance(reqs, list) and all(
                        isinstance(r, str) and len(r) <= MAX_REQUEST_ID for r in reqs) and _readers(msg) and \
                        _keys(msg, len(reqs)):
                    if self.events.qsize() + len(reqs) > MAX_EVENTS:
                        raise ChannelClosed(f"more than {MAX_EVENTS} done and release events queued")
                    of = msg.get("of", 1)
                    for req, key in zip(reqs, msg.get("keys") or [""] * len(reqs)):
                        self.events.put((op, req, of, key or None))
                else:
                    raise ChannelClosed(f"an unknown message {str(msg)[:80]!r}")
        except ChannelClosed as exc:
            self._drop(c, exc)

    def _drop(self, c: _Conn, why) -> None:
        if not self._stop.is_set():
            log.debug("side channel: connection from %s ended: %s", c.addr, why)
        if self._conns.pop(c.sock, None) is not None:
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


class SideChannelClient:
    """The decode worker's connection to one prefill engine, advanced by the engine's thread:
    :meth:`pump` until it returns the handshake (bounded by ``timeout_s`` from the connect), then
    :meth:`notify`; :attr:`alive` is False once the prefill end closed; :attr:`peer_clock` (once the handshake
    is in) bounds the prefill's lease clock against this one."""

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
        self.closed_reason: str | None = None
        self._pending: "collections.deque[tuple[float, str, list, list | None]]" = collections.deque()
        # (when queued, op, request ids, their hold keys)
        self._wake: "queue.SimpleQueue[bool]" = queue.SimpleQueue()    # True: a message; False: close
        self._send_lock = threading.Lock()      # one sender of whole messages at a time
        self._sender: threading.Thread | None = None
        self._stopping = False
        self._head: bytearray | None = None     # the oldest message's unsent rest (under the send lock)
        self._head_deadline = 0.0
        self._abandoned = False
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
                _send_some(self._sock, self._out)
            data = _recv_some(self._sock)
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

    @property
    def alive(self) -> bool:
        """False once the prefill end closed (it sends nothing after the handshake: the sender thread watches
        for it), a send failed or :meth:`close` was called."""
        return not self._closed

    def _watch(self) -> None:
        """The sender thread, idle: whether the prefill end closed the connection."""
        try:
            data = self._sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ValueError) as exc:
            self._fail(f"the side channel failed: {exc}")
            return
        self._fail("the prefill instance closed the side channel" if not data else "unexpected bytes")

    def notify(self, op: str, request_ids: list[str], keys: list[str | None] | None = None) -> bool:
        """Queue a done or release message for ``request_ids`` (``keys``: their holds' keys, from their params; none:
        one message naming none, which finds a dead connection): the client's sender thread (started at the handshake,
        so nothing interleaves with the hello) sends the messages in order, each within ``timeout_s`` or the
        connection is dead. False when it is dead already."""
        if not self.alive:
            return False
        t, n = time.monotonic(), MAX_IDS_PER_MESSAGE
        for i in range(0, max(len(request_ids), 1), n):
            self._pending.append((t, op, list(request_ids[i:i + n]), None if keys is None else list(keys[i:i + n])))
        self._wake.put(True)
        return True

    def flush_late(self, now: float) -> None:
        """Send, on the calling (engine) thread, the queued messages when the oldest has waited ``LATE_S``: a
        sender thread starved of the GIL by a busy engine thread holds them no longer than that."""
        pending = self._pending
        if not pending:                         # nothing queued: the usual poll
            return
        try:
            oldest = pending[0][0]              # no lock: the sender thread may pop it meanwhile
        except IndexError:
            return
        if now - oldest > self.LATE_S and self._sender is not None and self._send_lock.acquire(blocking=False):
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
        pending = self._pending
        try:
            while pending and not self._broken:
                if self._head is None:
                    t, op, reqs, keys = pending[0]
                    msg = {"op": op, "reqs": reqs}
                    if keys is not None and any(keys):
                        msg["keys"] = [k or "" for k in keys]
                    if self.readers > 1:
                        msg["of"] = self.readers
                    head = message(msg)
                    if len(head) - _LEN.size > MAX_MESSAGE and len(reqs) > 1:
                        # IDs JSON writes as escapes (up to 12 bytes a character): halves until each fits the
                        # prefill's MAX_MESSAGE (one ID of MAX_REQUEST_ID characters always does)
                        h = len(reqs) // 2
                        pending[0] = (t, op, reqs[h:], None if keys is None else keys[h:])
                        pending.appendleft((t, op, reqs[:h], None if keys is None else keys[:h]))
                        continue
                    self._head = bytearray(head)
                    self._head_deadline = time.monotonic() + self.timeout_s
                out = self._head
                while out:
                    _send_some(self._sock, out)
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
                    self._watch()
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

    def close(self) -> None:
        """Send what :meth:`notify` queued (for at most a second), then close."""
        self._fail(_BY_US)
        if self._sender is not None:
            self._wake.put(False)
            self._sender.join(timeout=1.0)
            self._stopping = True
            self._sender.join(timeout=1.0)
        if self._sock is None:                  # (closed while its host name was resolved)
            return
        try:
            self._sock.shutdown(socket.SHUT_RDWR)      # a send still under way fails now
        except OSError:
            pass
        if self._sender is not None:
            self._sender.join(timeout=0.2)
        self._sock.close()
