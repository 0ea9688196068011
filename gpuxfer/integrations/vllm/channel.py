"""The side channel between a prefill instance's worker and the decode instances that read from it:
one TCP connection per (decode worker, prefill engine), frames of a 4-byte big-endian length and a
body. No vLLM import.

* decode -> prefill ``{"op": "hello"}``; the prefill answers with two frames: its engine description
  (JSON) and its agent's metadata bytes. Once per remote engine; the decode side caches the result.
* decode -> prefill ``{"op": "done", "req": id}``: the decode instance has read the request's blocks;
  ``{"op": "release", "req": id}``: it will not read them (its request was aborted or computed
  locally). The prefill frees the blocks at its next step. No answer.

A frame longer than ``MAX_FRAME`` or a message that is not what the protocol says closes that
connection only; every socket operation has a timeout.
"""
from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import threading
from typing import Callable

log = logging.getLogger("gpuxfer.vllm")

MAX_FRAME = 64 << 20
_LEN = struct.Struct(">I")


class ChannelClosed(ConnectionError):
    """The other end closed the connection or sent something the protocol does not allow."""


def send_frame(sock: socket.socket, body: bytes) -> None:
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ChannelClosed("the connection closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ChannelClosed(f"a frame of {n} bytes (more than {MAX_FRAME})")
    return _recv_exact(sock, n)


def send_msg(sock: socket.socket, msg: dict) -> None:
    send_frame(sock, json.dumps(msg, separators=(",", ":")).encode())


def recv_msg(sock: socket.socket) -> dict:
    try:
        msg = json.loads(recv_frame(sock).decode())
    except (UnicodeDecodeError, ValueError):
        raise ChannelClosed("a message that is not JSON") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ChannelClosed("a message without an op")
    return msg


class SideChannelServer:
    """The prefill worker's listener: answers hellos with ``hello()`` (two frames) and queues
    ``(op, request id)`` of done and release messages on :attr:`events` for the worker to drain."""

    def __init__(self, host: str, port: int, hello: Callable[[], tuple[bytes, bytes]], timeout_s: float):
        self._hello = hello
        self.timeout_s = timeout_s
        self.events: "queue.SimpleQueue[tuple[str, str]]" = queue.SimpleQueue()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.2)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="gpuxfer-vllm-side-channel", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                if self._stop.is_set():
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, addr), name="gpuxfer-vllm-peer", daemon=True).start()

    def _serve(self, conn: socket.socket, addr) -> None:
        conn.settimeout(None)           # a decode instance may stay quiet for long; closing ends the read
        try:
            while not self._stop.is_set():
                msg = recv_msg(conn)
                op = msg["op"]
                if op == "hello":
                    info, meta = self._hello()
                    conn.settimeout(self.timeout_s)
                    send_frame(conn, info)
                    send_frame(conn, meta)
                    conn.settimeout(None)
                elif op in ("done", "release") and isinstance(msg.get("req"), str) and len(msg["req"]) <= 512:
                    self.events.put((op, msg["req"]))
                else:
                    raise ChannelClosed(f"an unknown message {str(msg)[:80]!r}")
        except (ChannelClosed, OSError) as exc:
            if not self._stop.is_set():
                log.debug("side channel: connection from %s ended: %s", addr, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self._thread.join(timeout=2.0)


class SideChannelClient:
    """The decode worker's connection to one prefill engine: :meth:`handshake` (blocking, bounded),
    then fire-and-forget :meth:`notify`; :attr:`alive` turns False when the prefill end closes."""

    def __init__(self, host: str, port: int, timeout_s: float):
        self.timeout_s = timeout_s
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._lock = threading.Lock()
        self.alive = True
        self.closed_reason: str | None = None

    def handshake(self) -> tuple[bytes, bytes]:
        send_msg(self._sock, {"op": "hello"})
        info = recv_frame(self._sock)
        meta = recv_frame(self._sock)
        self._sock.settimeout(None)
        threading.Thread(target=self._watch, name="gpuxfer-vllm-peer-watch", daemon=True).start()
        return info, meta

    def _watch(self) -> None:
        """The prefill end sends nothing after the handshake: a read that returns means it closed (or died)."""
        try:
            data = self._sock.recv(1)
            reason = "the prefill instance closed the side channel" if not data else "unexpected bytes"
        except OSError as exc:
            reason = f"the side channel failed: {exc}"
        self.closed_reason = reason
        self.alive = False

    def notify(self, op: str, request_id: str) -> bool:
        """Send a done or release message; False (and the connection marked dead) when it cannot."""
        if not self.alive:
            return False
        try:
            with self._lock:
                self._sock.settimeout(self.timeout_s)
                send_msg(self._sock, {"op": op, "req": request_id})
        except OSError as exc:
            self.alive = False
            self.closed_reason = f"sending {op} failed: {exc}"
            return False
        return True

    def close(self) -> None:
        self.alive = False
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
