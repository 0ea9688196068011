"""The KV manager's control socket (SGLang's ZMQ PULL socket, ``server_socket`` on ``rank_port``) with a bound on
the size of each frame of a message it takes. SGLang's ``CommonKVManager`` binds it with no bound, so any peer
that reaches the port could send one frame of gigabytes, allocated whole before the thread that receives it
sees it. ZMQ's ``MAXMSGSIZE`` holds a connection to the bound (a frame over it drops the connection, nothing of
its message is delivered) only where it is set before the bind (a listener copies the options when it binds),
so the socket is made again, with it, before its port is published (:func:`bound_control_socket`). ZMQ bounds
each frame (its "message part"), not their number: a message of many frames is not held to it. A decode's page
list past the limit is not sent (:func:`within_frame`). No SGLang import: the manager hands in SGLang's own socket
maker.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Tuple

from ... import config
from ...errors import BadInput

if TYPE_CHECKING:
    import zmq

log = logging.getLogger("gpuxfer.sglang")

_MIB = 1 << 20


def _zmq():
    """pyzmq, imported where a socket is made (SGLang's dependency: importing this module needs neither)."""
    import zmq
    return zmq


class _Bounded:
    """A ZMQ context whose sockets take no frame over ``max_bytes`` (the option set before any bind); anything
    else is the context's."""

    def __init__(self, context: zmq.Context, max_bytes: int):
        self._context, self._max_bytes = context, max_bytes

    def socket(self, socket_type: int, *args: Any, **kwargs: Any) -> zmq.Socket:
        sock = self._context.socket(socket_type, *args, **kwargs)
        try:
            sock.setsockopt(_zmq().MAXMSGSIZE, self._max_bytes)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def max_frame_bytes() -> int:
    """The largest frame of a control message a KV manager takes (``GPUXFER_SGLANG_MAX_FRAME_MB``)."""
    return config.get("GPUXFER_SGLANG_MAX_FRAME_MB") * _MIB


def within_frame(frame: bytes, what: str) -> bytes:
    """``frame``, a frame of a message this rank sends a peer's control socket, where it is within
    :func:`max_frame_bytes` (the peer's limit where both run the same setting); ``BadInput`` naming ``what``
    otherwise: a peer's socket would drop the connection, and with it every message queued on it."""
    if len(frame) > max_frame_bytes():
        raise BadInput(f"{what} take {len(frame)} bytes, past the {max_frame_bytes() // _MIB} MiB of a control "
                       "message frame (GPUXFER_SGLANG_MAX_FRAME_MB)")
    return frame


def bound_control_socket(mgr: Any, make_socket: Callable[..., Tuple[int, zmq.Socket]]) -> None:
    """Replace ``mgr``'s control socket by one made as SGLang makes it (``make_socket``: its
    ``get_zmq_socket_on_host``: a PULL socket of the manager's context, SGLang's buffer settings, bound to a random
    port of ``mgr.local_ip``, IPv6 where that is an IPv6 address) that takes no frame over
    :func:`max_frame_bytes`; the old socket is closed (nothing sent to it is waited for: its port was published
    nowhere) and ``mgr.rank_port`` names the new one's port. Done once: called again it changes nothing."""
    if getattr(mgr, "_control_bounded", False):
        return
    limit = max_frame_bytes()
    port, sock = make_socket(_Bounded(mgr._zmq_ctx, limit), _zmq().PULL, host=mgr.local_ip)
    old, mgr.rank_port, mgr.server_socket = mgr.server_socket, port, sock
    mgr._control_bounded = True
    old.close(linger=0)
    log.info("gpuxfer: SGLang control socket %s:%s takes message frames of at most %d MiB "
             "(GPUXFER_SGLANG_MAX_FRAME_MB)", mgr.local_ip, port, limit // _MIB)
