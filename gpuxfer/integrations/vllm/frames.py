"""The side channel's wire format (:mod:`.channel` describes the protocol): frames of a 4-byte big-endian length and
a body, JSON messages, the bounds on every field a peer sends, and the non-blocking socket calls both ends make. No
vLLM import."""
from __future__ import annotations

import json
import socket
import struct

from ...kv.metadata import MAX_METADATA_BYTES, MAX_METADATA_LAYERS

MAX_FRAME = 64 << 20
MAX_INFO = MAX_METADATA_LAYERS * 1024      # a handshake's engine description (1 KiB a layer, as agent metadata)
#: the longest message a decode sends (a step's done list goes in messages of at most ``MAX_IDS_PER_MESSAGE``
#: requests): what hostile peers can make a prefill worker buffer
MAX_MESSAGE = 1 << 20
MAX_IDS_PER_MESSAGE = 1024
MAX_REQUEST_ID = 512
MAX_READERS = 256                   # decode ranks sharing one prefill rank's heads (a message's "of")
MAX_KEY = 64                        # characters of a hold's key
MAX_TOKEN = 32                      # characters of a claim's token (a decode instance's, per request: 16 hex digits)
#: the longest answer to a claim message (its id and one character a request)
MAX_ANSWER = 2 * MAX_IDS_PER_MESSAGE + 64
MAX_CLAIM_ID = 1 << 53              # a claim message's id: a JSON integer below it
_LEN = struct.Struct(">I")
_CLOCK = struct.Struct(">d")
_ANSWER = (MAX_INFO, MAX_METADATA_BYTES + 64, _CLOCK.size)      # (metadata: its header and body)
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


def readers_ok(msg: dict) -> bool:
    """Whether a done or release message's ``of`` (absent: 1) is a count of readers this end takes."""
    of = msg.get("of", 1)
    return type(of) is int and 1 <= of <= MAX_READERS


def keys_ok(msg: dict, n: int) -> bool:
    """Whether a done or release message's ``keys`` (absent: none) are ``n`` strings a hold's key could be."""
    keys = msg.get("keys")
    return keys is None or (type(keys) is list and len(keys) == n and all(
        type(k) is str and len(k) <= MAX_KEY for k in keys))




def tokens_ok(msg: dict, n: int, required: bool) -> bool:
    """Whether a message's ``tokens`` (absent: none, unless ``required``) are ``n`` claim tokens: non-empty ASCII
    strings of at most ``MAX_TOKEN`` characters."""
    tokens = msg.get("tokens")
    if tokens is None:
        return not required
    return type(tokens) is list and len(tokens) == n and all(
        type(t) is str and 0 < len(t) <= MAX_TOKEN and t.isascii() for t in tokens)


def request_ids_ok(reqs) -> bool:
    """Whether a message's ``reqs`` are request IDs this end takes."""
    return isinstance(reqs, list) and all(isinstance(r, str) and len(r) <= MAX_REQUEST_ID for r in reqs)


def recv_some(sock: socket.socket) -> bytes | None:
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


def send_some(sock: socket.socket, out: bytearray) -> None:
    try:
        n = sock.send(out)
    except (BlockingIOError, InterruptedError):
        return
    except OSError as exc:
        raise ChannelClosed(f"the connection failed: {exc}") from None
    del out[:n]


def no_delay(sock: socket.socket) -> None:
    """Each frame leaves at once (``TCP_NODELAY``): with Nagle's algorithm a claim sent while an earlier message (a
    done, which gets no answer) is unacknowledged waits for the peer's delayed ACK, up to ~40 ms on Linux. Not a
    TCP socket (a test's socket pair): nothing to set."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
