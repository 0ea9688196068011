"""The vLLM connector's worker side under hostile orders of calls and peers, without vLLM: a handshake whose loads
timed out before it did, shutdown while the engine thread steps, loads after shutdown."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np

from gpuxfer.integrations.vllm.lease import now
from gpuxfer.integrations.vllm.loads import Load, _Remote
from gpuxfer.integrations.vllm.params import RemotePrefill
from test_vllm_worker_polls import _Client, _worker


def _load(req: str, port: int, engine: str = "p") -> Load:
    rp = RemotePrefill(engine, "127.0.0.1", port, f"{engine}-{req}", (np.arange(1, 3),), (16,), now() + 60)
    return Load(req, rp, (np.arange(5, 7),), 0, 31)


def test_a_handshake_its_loads_gave_up_on_first_is_closed():
    """A prefill that accepts the connection and says nothing: the load fails at its handshake timeout, read from
    the step's clock, which a handshake begun later in the step (behind other loads of the step) has not reached
    yet. That handshake must end with its last load, not stay pending with its socket open for good (a poll
    advances handshakes only while loads wait)."""
    w = _worker()
    silent = socket.create_server(("127.0.0.1", 0))     # listens; never accepts, never answers
    try:
        w.decode.start([_load("a", silent.getsockname()[1])])
        (r,) = w.decode.remotes.values()
        got = w.decode.finished(time.monotonic() + w.settings.handshake_timeout_s + 1)
        assert got == ({"a"}, {"a"})
        assert not w.decode.pending
        assert not w.decode.remotes and not r.client.alive
    finally:
        w.close()
        silent.close()


def test_shutdown_while_the_engine_thread_names_a_new_prefill():
    """vLLM's shutdown comes from another thread than the engine's steps: a client's close waits for its sender
    thread (up to seconds), and a step naming a new prefill engine meanwhile must neither break the shutdown
    (a dict changing under its iteration) nor open a connection once the shutdown began."""
    w = _worker()
    r = _Remote(("127.0.0.1", 1, "p"), state="ready", client=_Client())
    w.decode.remotes[r.key] = r
    closing, named = threading.Event(), threading.Event()

    def close():
        closing.set()
        assert named.wait(10)
        r.client.alive = False
    r.client.close = close
    silent = socket.create_server(("127.0.0.1", 0))
    errors = []

    def engine():
        try:
            assert closing.wait(10)
            w.start_loads([_load("b", silent.getsockname()[1], engine="q")])
        except BaseException as exc:        # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            named.set()
    t = threading.Thread(target=engine)
    t.start()
    try:
        w.close()
        t.join(10)
        assert not t.is_alive() and not errors
        q = w.decode.remotes[("127.0.0.1", silent.getsockname()[1], "q")]
        assert q.state == "failed" and q.client is None        # no connection made past the shutdown
        assert w.poll() == (set(), {"b"}, {"b"})
    finally:
        silent.close()
