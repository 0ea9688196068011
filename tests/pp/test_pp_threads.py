"""Public calls of one transport from several threads: calls go one at a time (every step whole), and a close
or abort from another thread ends a call that waits with a typed error, frees nothing under it, and returns.

Two ranks on the host emulation (and, marked ``gpu``, on CUDA), one connection per scenario:

* two threads send on one sender: every step arrives whole and numbered once (before, both could send the
  same step into the same slot: the receiver took a mix of the two as step 1, then a protocol error);
* a receiver's ``recv()`` waits for metadata that never comes; another thread closes: the wait ends in
  "closed by another thread" (before, the mailbox was unmapped under it: a ``TypeError`` reported as the
  peer lost);
* a sender blocked by back-pressure (its receiver takes nothing); another thread closes, or aborts: the call
  ends in "closed by another thread" or the abort's error, not a timeout of the healthy pair (before, the close
  freed nothing until the call's own timeout failed the transport);
* several threads close and abort one connection at once while calls run: nothing is torn down twice.
"""
from __future__ import annotations

import os
import threading
import time

from test_pp_chain import specs

TIMEOUT = 20.0
JOIN_S = 60.0


def _start_thread(fn, box: list) -> threading.Thread:
    def body():
        try:
            box.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box.append((type(exc).__name__, str(exc)))
    th = threading.Thread(target=body, daemon=True)
    th.start()
    return th


def threads_session(rank: int, world: int, init_method: str, platform_name: str) -> dict:
    os.environ["GPUXFER_PLATFORM"] = platform_name
    import torch
    import torch.distributed as dist

    from gpuxfer.platforms import get_platform
    from gpuxfer.pp import connect
    from gpuxfer.pp.launch import init_cpu_group
    init_cpu_group(rank, world, init_method)
    plat = get_platform(platform_name)
    device = rank % plat.device_count()
    dev = torch.device("cpu") if plat.is_emulation else torch.device("cuda", device)
    if not plat.is_emulation:
        torch.cuda.set_device(device)
    out = {}

    def conn(**kw):
        return connect(send_to=1 if rank == 0 else None, recv_from=0 if rank else None, specs=specs(),
                       backend="copy_engine", platform=plat, device=device, timeout_s=TIMEOUT, **kw)

    def step(value: float) -> dict:
        return {"hidden": torch.full((5, 40), value, dtype=torch.bfloat16, device=dev),
                "pos": torch.full((5,), int(value), dtype=torch.int64, device=dev),
                "residual": torch.full((5, 40), value, dtype=torch.float32, device=dev)}

    try:
        # A. two threads send on one sender: 2 x N steps, each whole
        n = 40          # values t * 100 + i: exact in bfloat16
        for inline in (1 << 20, 0):
            c = conn(recv_slots=3, inline_bytes=inline)
            if rank == 0:
                boxes = [[], []]
                ths = [_start_thread(lambda t=t: [c.sender().send(step(t * 100 + i)) for i in range(n)], boxes[t])
                       for t in (0, 1)]
                for th in ths:
                    th.join(JOIN_S)
                    assert not th.is_alive(), "a sending thread did not finish"
                out[f"A:{inline}:send"] = [b[0][0] for b in boxes]
            else:
                seen = []
                for _ in range(2 * n):
                    got = c.receiver().recv().tensors
                    v = got["residual"].flatten()[0].item()
                    whole = all(bool((t == t.flatten()[0]).all()) for t in got.values()) and \
                        got["pos"][0].item() == int(v) and got["hidden"][0, 0].item() == v
                    seen.append((v, whole))
                c.synchronize(TIMEOUT)
                out[f"A:{inline}:recv"] = seen
            c.close()

        # B. recv() waits for metadata that never comes; another thread closes the receiver
        c = conn()
        if rank == 1:
            box = []
            th = _start_thread(lambda: c.receiver().recv().tensors, box)
            time.sleep(0.5)
            c.close()
            th.join(JOIN_S)
            assert not th.is_alive(), "recv() still waits after close()"
            out["B"] = box[0]
        dist.barrier()
        c.close()

        # C. a sender blocked by back-pressure; another thread closes (C) or aborts (C2) it
        for how in ("close", "abort"):
            c = conn(recv_slots=2)
            if rank == 0:
                box = []
                th = _start_thread(lambda: [c.sender().send(step(i)) for i in range(50)], box)
                time.sleep(1.0)
                getattr(c, how)()
                th.join(JOIN_S)
                assert not th.is_alive(), f"send() still waits after {how}()"
                out[f"C:{how}"] = box[0]
            dist.barrier()
            c.close()

        # D. several threads close and abort one connection while calls run on it
        c = conn(recv_slots=2)
        box = []
        if rank == 0:
            work = _start_thread(lambda: [c.sender().send(step(i)) for i in range(10 ** 6)], box)
        else:
            work = _start_thread(lambda: [c.receiver().recv().tensors for _ in range(10 ** 6)], box)
        time.sleep(0.5)
        enders = [_start_thread(getattr(c, how), []) for how in ("close", "abort", "close", "abort")]
        for th in enders + [work]:
            th.join(JOIN_S)
            assert not th.is_alive(), "a call or a teardown did not return"
        out["D"] = box[0][0]
        assert all(t.closed for t in c.transports)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        plat.close()
    return out


def test_calls_from_several_threads(spawner, platform_name):
    sender, receiver = spawner.run_ranks(threads_session, 2, platform_name, timeout=300)
    for inline in (1 << 20, 0):
        assert sender[f"A:{inline}:send"] == ["ok", "ok"]
        seen = receiver[f"A:{inline}:recv"]
        assert all(whole for _v, whole in seen), [s for s in seen if not s[1]]
        assert sorted(v for v, _ in seen) == sorted(float(t * 100 + i) for t in (0, 1) for i in range(40))
    kind, msg = receiver["B"]
    assert kind == "GpuxferError" and "closed by another thread" in msg, receiver["B"]
    kind, msg = sender["C:close"]
    assert kind == "GpuxferError" and "closed by another thread" in msg, sender["C:close"]
    kind, msg = sender["C:abort"]
    assert kind == "GpuxferError" and "aborted" in msg, sender["C:abort"]
    assert sender["D"] in ("GpuxferError", "BadInput", "PeerLost", "TransferTimeout")
    assert receiver["D"] in ("GpuxferError", "BadInput", "PeerLost", "TransferTimeout")


# --------------------------------------------------------------------------- one process


def _lone_sender(fail_with=None):
    """A send end over no peer (metadata off): its step hook runs ``fail_with`` or does nothing."""
    import torch

    from gpuxfer.platforms import get_platform
    from gpuxfer.pp.spec import SpecTable
    from gpuxfer.pp.transport import Transport

    class Lone(Transport):
        name = "lone"

        def _send_impl(self, step, tensors, layout):
            if fail_with is not None:
                raise fail_with

        def _recv_impl(self, rcv): ...
        def _materialize_impl(self, rcv): ...
        def _watch(self, now, force=False): return None
        def _drain(self, timeout_s): return True
        def _close_mappings(self): ...
        def _free(self): ...
        def _allocated(self): return 0

    plat = get_platform("host")
    t = Lone(platform=plat, role="send", rank=0, peer=1, device=0, specs=SpecTable(specs()), timeout_s=5.0,
             metadata=False, group=None, tag_base=0, torch_device=torch.device("cpu"))
    t._state = "open"
    return t, plat


def test_a_library_error_that_breaks_a_transport_is_stored_typed():
    """An error of torch or a driver binding inside a step breaks the end with a GpuxferError (the original
    its cause), raised by that call and every later one (before: the RuntimeError itself, untyped)."""
    from gpuxfer.errors import GpuxferError
    from test_pp_badinput import good
    t, plat = _lone_sender(RuntimeError("the driver said no"))
    try:
        for _ in range(2):
            try:
                t.send(good())
            except GpuxferError as exc:
                assert "RuntimeError: the driver said no" in str(exc)
                assert isinstance(exc.__cause__, RuntimeError) or isinstance(t.error.__cause__, RuntimeError)
            else:
                raise AssertionError("send() did not raise")
        assert isinstance(t.error, GpuxferError) and t.step == 0
    finally:
        t.abort()
        plat.close()


def test_a_call_waiting_for_the_call_lock_is_bounded():
    """A call that cannot get the lock within timeout_s (another thread's call holds it) raises
    TransferTimeout and breaks nothing."""
    from gpuxfer.errors import TransferTimeout
    from test_pp_badinput import good
    t, plat = _lone_sender()
    t.timeout_s = 0.2
    try:
        assert t._call_lock.acquire()
        try:
            try:
                t.send(good())
            except TransferTimeout as exc:
                assert "another thread" in str(exc)
            else:
                raise AssertionError("send() did not wait for the lock")
        finally:
            t._call_lock.release()
        assert t.error is None
        t.send(good())
        assert t.step == 1
    finally:
        t.close()
        plat.close()


def test_a_transport_dropped_unclosed_is_still_watched():
    """A transport its caller dropped without close() still has its stuck waits failed and released at the
    timeout (on a GPU such a wait sits on the caller's stream, which nothing else would release); before, the
    watchdog forgot it when it was garbage-collected."""
    import gc
    import types

    from gpuxfer.pp.watchdog import WATCHDOG
    released = threading.Event()
    t, plat = _lone_sender()
    t.timeout_s = 0.2
    t._release_waits = released.set
    t._wd.append((1, 0, time.monotonic(), 1))       # a wait for a flag that never comes

    def watch(self, now, force=False):
        return RuntimeError("a stuck wait") if now - self._wd[0][2] > self.timeout_s else None
    t._watch = types.MethodType(watch, t)
    WATCHDOG.register(t)
    ident = id(t)
    del t
    gc.collect()
    try:
        assert released.wait(30), "the dropped transport's wait was never released"
    finally:
        for t in [t for t in WATCHDOG.open_transports() if id(t) == ident]:
            t.close()
        plat.close()


def test_close_all_of_what_is_not_transports_is_bad_input():
    """close_all() takes transports: None, one transport (not in a list), a connection, or a list holding
    something else is BadInput naming what it got, and closes nothing (no AttributeError / TypeError, no
    transport before the bad item closed)."""
    import pytest

    from gpuxfer.errors import BadInput
    from gpuxfer.pp import close_all
    from gpuxfer.pp.selection import Connection
    t, plat = _lone_sender()
    try:
        for bad in (None, t, Connection("lone", {1: t}, {}, {}, rank=0), [t, None], [t, 5], "ab", 7):
            with pytest.raises(BadInput, match="close_all"):
                close_all(bad)
            assert t._state == "open"
        close_all((x for x in [t]))
        assert t.closed
    finally:
        t.abort()
        plat.close()
