"""Claims on the side channel, reviewed (no vLLM): what a prefill that leaves claims unanswered, or a peer that sends
claims and never reads the answers, can make the other end keep."""
from __future__ import annotations

import socket
import time

from gpuxfer.integrations.vllm import channel, client
from gpuxfer.integrations.vllm.channel import SideChannelClient, SideChannelServer, message
from gpuxfer.integrations.vllm.holds import ClaimBook, make_key

SECRET = b"s" * 16


def _until(cond, wait_s: float = 10.0) -> bool:
    end = time.monotonic() + wait_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_claims_a_prefill_leaves_unanswered_are_bounded(monkeypatch):
    """A prefill end that takes claim messages and answers none (hung, or hostile): the decode worker keeps each
    message's requests until its answer, so past MAX_ASKED unanswered the connection ends (its loads fail) rather
    than keep them without bound."""
    monkeypatch.setattr(client, "MAX_ASKED", 4)
    lst = socket.create_server(("127.0.0.1", 0))
    c = SideChannelClient("127.0.0.1", lst.getsockname()[1], 5.0)
    conn, _ = lst.accept()
    try:
        conn.sendall(channel.frame(b"{}") + channel.frame(b"m") + channel.frame(b"\0" * 8))
        c.handshake()
        for i in range(4):
            assert c.claim([f"r{i}"], ["k"], ["t"])
        assert _until(lambda: len(c._asked) == 4 and not c._pending)
        assert c.alive
        c.claim(["r4"], ["k"], ["t"])
        assert _until(lambda: not c.alive)
        assert len(c._asked) <= 4 and "unanswered" in c.closed_reason
    finally:
        c.close()
        conn.close()
        lst.close()
