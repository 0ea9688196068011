"""Hostile call orders and inputs on the stage hand-off, on the host emulation: each is refused with a typed
error, or handled, before any byte is read or written past a buffer or reported as a step it is not.

* a tensor whose storage was shrunk or freed after it was made (``untyped_storage().resize_``): its shape and
  strides still pass every check, so its ``data_ptr()`` leads past its memory (or to none); ``send()`` refuses
  it (nothing sent, the receiver told) and so does ``recv(out=...)``; so is a tensor with no data at all (a
  wrapper subclass or a fake tensor: shape, dtype, device and storage size right, ``data_ptr()`` null).
* a sender whose wait for a free receive slot timed out (its receiver alive, only late): its failure releases
  the wait, and the released step's copies land in a slot whose earlier step the receiver has not taken yet.
  The receiver must not hand that earlier step out (it did: step 3's bytes as step 1, reported good); the
  released sender marks the receiver's slot words first, and the receiver checks its slot word once its
  copy is done.
* ``close()`` of an end whose streams still hold queued work after its waits were released (work of the
  caller's queued before the steps, another transport's wait on the same stream): the work may still copy
  into the peer's slots or out of the end's buffers, so nothing is unmapped or freed (left to process exit,
  as ``abort()`` does) and no teardown barrier is posted, so the peer frees only what no peer maps.
* ``close_all`` of a list naming one end twice (``conn.transports + [snd]``): the end is torn down once (it
  was failed as "closed by another thread", its waits released, and left without teardown: the second
  entry waited for the call lock the first had taken).
"""
from __future__ import annotations

import os

import pytest
import torch

from gpuxfer.errors import BadInput
from gpuxfer.pp.spec import Refusal, SpecTable
from test_pp_chain import check_equal, specs, step_tensors

CPU = torch.device("cpu")


def shrunk(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``t`` with its storage resized to ``nbytes`` (its shape unchanged: torch allows it)."""
    t.untyped_storage().resize_(nbytes)
    return t


def test_a_tensor_whose_storage_was_shrunk_is_refused_by_send_and_recv_out():
    t = SpecTable(specs())
    good = step_tensors(3, 0, 1, CPU)
    good = {**good, "hidden": torch.zeros(48, 40, dtype=torch.bfloat16)}
    assert t.check_tensors(good, CPU)
    for nbytes in (0, 8, 48 * 40 * 2 - 1):
        bad = {**good, "hidden": shrunk(torch.zeros(48, 40, dtype=torch.bfloat16), nbytes)}
        with pytest.raises(Refusal, match="'hidden'.*(which holds|no data)") as ei:
            t.check_tensors(bad, CPU)
        assert ei.value.code == 10
    # a view at an offset: the bytes it needs end past the storage's end
    base = torch.zeros(100, dtype=torch.int64)
    view = base[52:]
    shrunk(base, 60 * 8)
    with pytest.raises(Refusal, match="'pos'"):
        t.check_tensors({**good, "pos": view}, CPU)
    out = {name: torch.zeros(shape, dtype=dt) for name, (shape, dt) in specs().items()}
    assert t.check_out(out, CPU)
    out["residual"] = shrunk(out["residual"], 16)
    with pytest.raises(BadInput, match=r"out\['residual'\].*which holds 16 B"):
        t.check_out(out, CPU)


class _NoData(torch.Tensor):
    """A wrapper subclass: shape, dtype, device and a storage of the right size, but no memory (a null
    ``data_ptr()``), as a tensor parallel or fake-tensor wrapper may be."""

    @staticmethod
    def __new__(cls, shape, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on a tensor without data")


def test_a_tensor_without_data_is_refused_by_send_and_recv_out():
    """Before: it passed every check, and its null data_ptr() reached the copies after the metadata went out
    (the host emulation refused the copy and broke the transport; a GPU copies from address 0)."""
    t = SpecTable(specs())
    good = step_tensors(3, 0, 1, CPU)
    nodata = _NoData(tuple(good["residual"].shape), torch.float32)
    assert nodata.numel() and nodata.data_ptr() == 0
    with pytest.raises(Refusal, match="'residual'.*no data") as ei:
        t.check_tensors({**good, "residual": nodata}, CPU)
    assert ei.value.code == 10
    out = {name: torch.zeros(shape, dtype=dt) for name, (shape, dt) in specs().items()}
    with pytest.raises(BadInput, match=r"out\['pos'\].*no data"):
        t.check_out({**out, "pos": _NoData((48,), torch.int64)}, CPU)


def storage_session(rank: int, world: int, init_method: str, platform_name: str) -> dict:
    os.environ["GPUXFER_PLATFORM"] = platform_name
    import torch.distributed as dist

    from gpuxfer.platforms import get_platform
    from gpuxfer.pp import connect
    from gpuxfer.pp.launch import init_cpu_group
    init_cpu_group(rank, world, init_method)
    plat = get_platform(platform_name)
    out = {}
    try:
        for backend in ("copy_engine", "nccl"):
            conn = connect(send_to=1 if rank == 0 else None, recv_from=0 if rank else None, specs=specs(),
                           backend=backend, platform=plat, device=0, timeout_s=30)
            with conn:
                if rank == 0:
                    s = conn.sender()
                    for nbytes in (0, 64):
                        bad = {**step_tensors(4, 0, 1, CPU),
                               "residual": shrunk(torch.ones(48, 40, dtype=torch.float32), nbytes)}
                        with pytest.raises(BadInput, match="nothing sent"):
                            s.send(bad)
                        assert s.step == 0 and s.error is None
                    s.send(step_tensors(4, 0, 1, CPU))
                else:
                    r = conn.receiver()
                    for _ in range(2):
                        with pytest.raises(BadInput, match="refused its input for step 1.*memory does not hold"):
                            r.recv()
                    o = {name: torch.zeros(shape, dtype=dt) for name, (shape, dt) in specs().items()}
                    o["hidden"] = shrunk(o["hidden"], 8)
                    with pytest.raises(BadInput, match=r"out\['hidden'\]"):
                        r.recv(out=o)
                    assert r.step == 0 and r.error is None
                    check_equal(r.recv().tensors, step_tensors(4, 0, 1, CPU), f"{backend} step 1")
                    out[backend] = True
                conn.synchronize(30)
    finally:
        dist.destroy_process_group()
        plat.close()
    return out


def test_shrunk_storages_are_refused_between_two_ranks(spawner):
    _, receiver = spawner.run_ranks(storage_session, 2, "host", timeout=180)
    assert receiver == {"copy_engine": True, "nccl": True}


def _undrainable_sender(drains: bool = False):
    """A send end over no peer whose streams never drain (or always do); it records the teardown steps that
    ran."""
    from gpuxfer.platforms import get_platform
    from gpuxfer.pp.transport import Transport

    class Stuck(Transport):
        name = "stuck"
        ran: list

        def _send_impl(self, step, tensors, layout): ...
        def _recv_impl(self, rcv): ...
        def _materialize_impl(self, rcv): ...
        def _watch(self, now, force=False): return None
        def _drain(self, timeout_s):
            self.ran.append("drain")
            return drains
        def _release_waits(self): self.ran.append("release")
        def _close_mappings(self): self.ran.append("close_mappings")
        def _free(self): self.ran.append("free")
        def _free_local(self): self.ran.append("free_local")
        def _allocated(self): return 0

    plat = get_platform("host")
    t = Stuck(platform=plat, role="send", rank=0, peer=1, device=0, specs=SpecTable(specs()), timeout_s=0.2,
              metadata=False, group=None, tag_base=0, torch_device=CPU)
    t.ran = []
    t._state = "open"
    return t, plat


def test_close_of_an_end_that_never_drains_unmaps_and_frees_nothing():
    t, plat = _undrainable_sender()
    try:
        t.close()
        assert t.closed
        assert "release" in t.ran and t.ran.count("drain") >= 2, t.ran
        assert not {"close_mappings", "free", "free_local"} & set(t.ran), t.ran
        t.close()           # idempotent
        t.abort()
        assert not {"close_mappings", "free", "free_local"} & set(t.ran), t.ran
    finally:
        plat.close()


def _fixed(step: int) -> dict:
    """A step of the spec's largest shapes whose bytes tell the step apart."""
    return {name: torch.full(shape, float(step)).to(dt) for name, (shape, dt) in specs().items()}


def _pair_session(rank: int, world: int, init_method: str):
    """In a spawned rank: the host platform, the CPU group's store, and a function connecting the copy_engine pair
    (rank 0 sends to rank 1, two receive slots) with a timeout."""
    os.environ["GPUXFER_PLATFORM"] = "host"
    from torch.distributed.distributed_c10d import _get_default_store

    from gpuxfer.platforms import get_platform
    from gpuxfer.pp import connect
    from gpuxfer.pp.launch import init_cpu_group
    init_cpu_group(rank, world, init_method)
    plat = get_platform("host")

    def pair(timeout_s: float):
        return connect(send_to=1 if rank == 0 else None, recv_from=0 if rank else None, specs=specs(),
                       backend="copy_engine", platform=plat, device=0, timeout_s=timeout_s, recv_slots=2)
    return plat, _get_default_store(), pair


def _released_sender(conn, plat, store) -> str:
    """Rank 0 of a late receiver's pair: steps 1 and 2 sent, then step 3, whose slot still holds step 1 (its wait
    times out and is released, its copies land in the slot); the receiver told, its end awaited. Returns what the
    third send did."""
    from gpuxfer.errors import TransferTimeout
    s = conn.sender()
    s.send(_fixed(1))
    s.send(_fixed(2))
    try:
        s.send(_fixed(3))
        third = "sent"
    except TransferTimeout:
        third = "TransferTimeout"
    assert plat.synchronize(plat.current_stream(0), 30)      # the released step's copies landed
    store.set("sender-failed", b"1")
    store.wait(["receiver-done"])
    conn.abort()
    return third


def late_receiver_session(rank: int, world: int, init_method: str, how: str) -> dict:
    import torch.distributed as dist

    from gpuxfer.errors import GpuxferError
    plat, store, pair = _pair_session(rank, world, init_method)
    out = {}
    try:
        conn = pair(1.0)
        if rank == 0:
            out["send3"] = _released_sender(conn, plat, store)
        else:
            r = conn.receiver()
            store.wait(["sender-failed"])       # the receiver, late: it takes step 1 only now
            for k in (1, 2):
                try:
                    rcv = r.recv(out=_fixed(0)) if how == "out" else r.recv()
                    got = rcv.tensors
                    same = all(torch.equal(got[n], v) for n, v in _fixed(k).items())
                    out[k] = "whole" if same else "other bytes"
                except GpuxferError as exc:
                    out[k] = type(exc).__name__
                    break
            store.set("receiver-done", b"1")
            conn.abort()
    finally:
        dist.destroy_process_group()
        plat.close()
    return out


@pytest.mark.parametrize("how", ["copy_out", "out"])
def test_a_released_sender_never_hands_the_late_receiver_other_bytes(spawner, how):
    sender, receiver = spawner.run_ranks(late_receiver_session, 2, how, timeout=120)
    assert sender == {"send3": "TransferTimeout"}
    assert "other bytes" not in receiver.values(), receiver
    assert receiver[1] == "PeerLost", receiver


def marked_slot_session(rank: int, world: int, init_method: str) -> dict:
    """As :func:`late_receiver_session`, the receiver taking steps as on a GPU (its wait queued, the step handed out
    without a host check of the slot): the released sender's mark on the slot fails the receiver once the watchdog
    reads it, so its next call raises instead of handing out more steps."""
    import time as _time

    import torch.distributed as dist

    plat, store, pair = _pair_session(rank, world, init_method)
    out = {}
    try:
        conn = pair(1.0)
        if rank == 0:
            _released_sender(conn, plat, store)
        else:
            r = conn.receiver()
            r._host_sync = False                # the GPU's way: no host check before a step is handed out
            store.wait(["sender-failed"])
            # step 1, on the slot the sender marked; its tensors are kept until the stream's copy into them ran
            # (the emulation's stream writes them after .tensors returned, as a GPU's would)
            got = r.recv().tensors
            deadline = _time.monotonic() + 30
            while r.error is None and _time.monotonic() < deadline:
                _time.sleep(0.01)
            out["error"] = type(r.error).__name__ if r.error is not None else None
            assert plat.synchronize(plat.current_stream(0), 30)
            store.set("receiver-done", b"1")
            conn.abort()
            del got
    finally:
        dist.destroy_process_group()
        plat.close()
    return out


def test_a_receiver_whose_slot_a_released_sender_marked_fails_without_a_host_check(spawner):
    _, receiver = spawner.run_ranks(marked_slot_session, 2, timeout=120)
    assert receiver == {"error": "PeerLost"}, receiver


def aborted_sender_session(rank: int, world: int, init_method: str) -> dict:
    """The sender aborts with no step waiting for a slot: the steps it sent stay whole for the receiver."""
    import torch.distributed as dist
    plat, store, pair = _pair_session(rank, world, init_method)
    out = {}
    try:
        conn = pair(30)
        if rank == 0:
            s = conn.sender()
            s.send(_fixed(1))
            s.send(_fixed(2))
            conn.abort()
            store.set("sender-aborted", b"1")
        else:
            r = conn.receiver()
            store.wait(["sender-aborted"])
            for k in (1, 2):
                got = r.recv().tensors
                out[k] = all(torch.equal(got[n], v) for n, v in _fixed(k).items())
            conn.abort()
    finally:
        dist.destroy_process_group()
        plat.close()
    return out


def test_a_sender_aborted_with_no_step_waiting_leaves_its_steps_whole(spawner):
    _, receiver = spawner.run_ranks(aborted_sender_session, 2, timeout=120)
    assert receiver == {1: True, 2: True}


def test_close_all_of_a_list_naming_an_end_twice_tears_it_down_once():
    from gpuxfer.pp import close_all
    t, plat = _undrainable_sender(drains=True)
    try:
        close_all([t, t])
        assert t.closed and t.error is None, t.error
        assert t.ran == ["drain", "close_mappings", "free_local"], t.ran     # (no store: no barrier met)
        assert t._call_lock.acquire(False)      # teardown gave the call lock back
        t._call_lock.release()
    finally:
        plat.close()
