"""The SGLang backend's control sockets hold each frame of a message to ``GPUXFER_SGLANG_MAX_FRAME_MB``: a live
prefill and decode rank (tests/integrations/sglang_instance.py, SGLang's own classes and bootstrap server, the
limit set to 1 MiB) each have a KV manager socket whose ``MAXMSGSIZE`` is the limit, on the port the rank
published (the prefill's in SGLang's bootstrap server, the decode's in its registration message); a message
with a frame past the limit sent to that port never reaches the manager's control thread (its connection
dropped), a message after it on a new connection is handled, and requests then land byte for byte between the
two ranks (each reaching the other at the port it published).
"""
from __future__ import annotations

import random
import time

import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

import zmq  # noqa: E402
from sglang.srt.disaggregation.common.conn import ABORT_ACK_TAG, ABORT_TAG  # noqa: E402
from test_sglang_backend import ENV, _close, _land_through_queue, _Pages, _ready_pair  # noqa: E402

LIMIT_MB = 1
LIMIT = LIMIT_MB << 20


@pytest.fixture(scope="module")
def pair():
    """A prefill and a decode rank with 16-token pages whose control sockets take frames of 1 MiB at most."""
    p, d = _ready_pair(16, {**ENV, "GPUXFER_SGLANG_MAX_FRAME_MB": str(LIMIT_MB)})
    try:
        yield p, d
    finally:
        codes = _close(p, d)
        assert codes == [0, 0], codes


def _until(what, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _send(port: int, parts: list) -> tuple:
    """``(socket, monitor)``: a new PUSH connection to ``127.0.0.1:port`` that sent ``parts``, and the monitor
    of its disconnects."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart(parts)
    return sock, monitor


def _dropped(sender: tuple) -> bool:
    """Whether the receiver dropped the sender's connection (a disconnect seen by its monitor)."""
    return sender[1].poll(0) != 0


def _close_sender(sender: tuple) -> None:
    sock, monitor = sender
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_control_socket_takes_frames_up_to_the_limit_on_the_port_it_published(pair, role):
    rank = pair[0] if role == "prefill" else pair[1]
    got = rank.call("control")
    assert got["max_msg_size"] == LIMIT, got
    assert got["published"] == got["port"], got


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_frame_over_the_limit_never_reaches_the_manager_and_a_message_after_it_does(pair, role):
    """One message of an ABORT (prefill) or ABORT_ACK (decode) of a room no request holds, its last frame one
    byte past the limit: its connection dropped, the control thread never received it; the same message of
    small frames on a new connection is received and handled (nothing logged as failed)."""
    rank = pair[0] if role == "prefill" else pair[1]
    port = rank.call("control")["port"]
    tag = ABORT_TAG if role == "prefill" else ABORT_ACK_TAG
    big = _send(port, [tag, b"987654", b"0", b"\0" * (LIMIT + 1)])
    try:
        # dropped there, or (what the test exists to catch) received whole: one of the two comes
        assert _until(lambda: _dropped(big) or rank.call("control_seen")), "the large message was neither " \
                                                                           "dropped nor received"
        assert rank.call("control_seen") == [], "the control thread received the frame past the limit"
    finally:
        _close_sender(big)
    small = _send(port, [tag, b"987655", b"0"])
    try:
        assert _until(lambda: rank.call("control_seen")), "a message after the large one was never received"
        assert rank.call("control_seen") == [(tag, [len(tag), 6, 1])]
    finally:
        _close_sender(small)
    assert rank.call("routes")["errors"] == []


def test_requests_land_between_ranks_whose_control_sockets_are_bounded(pair):
    """Requests land byte for byte through both sides' queues after the tests above: each rank reaches the
    other at the port it published (the decode's registration and pages to the prefill's, the prefill's rows
    and statuses to the decode's)."""
    p, d = pair
    rng = random.Random(3)
    pages = _Pages(3)
    _land_through_queue(p, d, [pages.take(room, rng.randint(1, 9)) for room in range(2000, 2016)], 16, rng)


def test_a_bounded_socket_made_with_sglangs_peer_allow_list(monkeypatch):
    """SGLang's socket maker with its peer allow list on (``restrict_peers``, ``SGLANG_ZMQ_ALLOWED_PEERS``), given
    the bounded context, makes the socket (SGLang's authenticator makes its own sockets through the context, with
    pyzmq's ``socket_class``), the limit set and the allow list's domain on it."""
    from sglang.srt.utils import network

    from gpuxfer.integrations.sglang.control import _Bounded
    monkeypatch.setenv("SGLANG_ZMQ_ALLOWED_PEERS", "127.0.0.1")
    ctx = zmq.Context()
    try:
        port, sock = network.get_zmq_socket_on_host(_Bounded(ctx, LIMIT), zmq.PULL, host="127.0.0.1",
                                                    restrict_peers=True)
        try:
            assert sock.getsockopt(zmq.MAXMSGSIZE) == LIMIT and sock.zap_domain == b"sglang" and port > 0
        finally:
            sock.close(linger=0)
    finally:
        with network._zmq_authenticators_lock:
            auth = network._zmq_authenticators.pop(ctx.underlying, None)
        if auth is not None:
            auth.stop()
        ctx.destroy(linger=0)    # (closes a socket the maker left open where it raised)
