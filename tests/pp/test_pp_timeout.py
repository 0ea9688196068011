"""A stuck peer ends in TransferTimeout naming rank, step, flag and the value seen; abort/close let the
process exit."""
from __future__ import annotations

import os
import time

from test_pp_chain import specs, step_shapes, step_tensors

TIMEOUT = 1.5
SEED = 6     # every step of this seed carries data (a zero-byte NCCL step completes without its peer)


def timeout_session(rank: int, world: int, init_method: str, platform_name: str) -> dict:
    os.environ["GPUXFER_PLATFORM"] = platform_name
    import pytest
    import torch
    import torch.distributed as dist

    from gpuxfer.errors import GpuxferError, TransferTimeout
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

    def conn_for(backend, metadata, inline_bytes=None):
        # a group of its own: gloo closes a pair whose timed wait expires, and the test keeps the world group
        g = dist.new_group(backend="gloo")
        return connect(g, send_to=1 if rank == 0 else None, recv_from=0 if rank == 1 else None, specs=specs(),
                       backend=backend, platform=plat, device=device, timeout_s=TIMEOUT, metadata=metadata,
                       inline_bytes=inline_bytes)

    try:
        # A. the receiver waits for a step the sender never sends: its GPU-side wait times out
        for backend in ("copy_engine", "nccl"):
            conn = conn_for(backend, metadata=False)
            if rank == 0:
                conn.sender().send(step_tensors(SEED, 0, 1, dev))
                dist.barrier()                     # until the receiver has seen its timeout
                t0 = time.monotonic()
                conn.abort()
                out[f"A:{backend}:abort_s"] = time.monotonic() - t0
            else:
                r = conn.receiver()
                got = r.recv(shapes=step_shapes(SEED, 0, 1)).tensors
                assert got["pos"].shape == step_shapes(SEED, 0, 1)["pos"]
                rcv = r.recv(shapes=step_shapes(SEED, 0, 2))
                t0 = time.monotonic()
                with pytest.raises(TransferTimeout) as ei:
                    rcv.tensors          # the host emulation waits here (bounded) and raises
                    r.synchronize(TIMEOUT * 4)   # on a GPU the wait is on the stream: the watchdog reports it
                out[f"A:{backend}"] = (ei.value.rank, ei.value.step, ei.value.flag, ei.value.seen)
                assert time.monotonic() - t0 < TIMEOUT + 10
                with pytest.raises(TransferTimeout):   # the transport stays broken
                    r.recv(shapes=step_shapes(SEED, 0, 3))
                dist.barrier()
                t0 = time.monotonic()
                conn.close()                           # bounded: releases the GPU wait, barriers time out
                out[f"A:{backend}:close_s"] = time.monotonic() - t0

        # B. the receiver never consumes: the sender waits on `empty` -- on its side stream (staged steps,
        # inline_bytes=0) or on its current stream (small steps, the default) -- and the timeout names it
        for inline in (0, None):
            conn = conn_for("copy_engine", metadata=False, inline_bytes=inline)
            if rank == 0:
                s = conn.sender()
                # made first: a copy to the GPU queued behind a stuck current stream would block the host
                steps = {k: step_tensors(SEED, 0, k, dev) for k in range(1, 6)}
                s.send(steps[1])
                s.send(steps[2])
                with pytest.raises(TransferTimeout) as ei:
                    s.send(steps[3])                   # reuses slot 0: waits for empty[0] >= 1 (never written)
                    time.sleep(TIMEOUT + 1.0)          # the host emulation raised above; a GPU's watchdog
                    s.send(steps[4])                   # found the stuck wait meanwhile, and send() raises it
                out[f"B:{inline}"] = (ei.value.rank, ei.value.step, ei.value.flag, ei.value.expected, ei.value.seen)
                with pytest.raises(TransferTimeout):
                    s.synchronize()
                t0 = time.monotonic()
                conn.abort()                           # releases the stream's wait
                out[f"B:{inline}:abort_s"] = time.monotonic() - t0
                with pytest.raises(GpuxferError):
                    s.send(steps[5])
                dist.barrier()
            else:
                dist.barrier()
                conn.abort()

        # C. metadata never arrives (the sender never calls send)
        conn = conn_for("copy_engine", metadata=True)
        if rank == 1:
            with pytest.raises(TransferTimeout) as ei:
                conn.receiver().recv()
            out["C"] = (ei.value.rank, ei.value.step, ei.value.flag)
            out["C:via"] = "shared-memory mailbox" in str(ei.value)   # one host: the mailbox carries metadata
        dist.barrier()
        conn.abort()
    finally:
        dist.destroy_process_group()
        plat.close()
    return out


def test_stuck_peer_times_out(spawner, platform_name, nccl_pairs):
    sender, receiver = spawner.run_ranks(timeout_session, 2, platform_name, timeout=180)
    # A: rank 1, step 2, the flag of slot 1 (steps 1, 2 use slots 0, 1), nothing ever written there
    assert receiver["A:copy_engine"] == (1, 2, "full[1]", 0)
    assert receiver["A:nccl"][:3] == (1, 2, "nccl recv")
    for b in ("copy_engine", "nccl"):
        # bounded (hang guards, generous for loaded machines; not speed tests)
        assert receiver[f"A:{b}:close_s"] < 60
        assert sender[f"A:{b}:abort_s"] < 60
    # B: rank 0, step 3 waited for empty[0] >= 1 (step 1 consumed), the receiver never wrote it
    for inline in (0, None):
        assert sender[f"B:{inline}"] == (0, 3, "empty[0]", 1, 0)
        assert sender[f"B:{inline}:abort_s"] < 60
    assert receiver["C"] == (1, 1, "metadata") and receiver["C:via"]


def test_watchdog_reads_each_slot_flag_once_per_poll():
    """A poll settles hundreds of queued waits with one flag read per slot, and times out the first late one."""
    import collections
    import types

    from gpuxfer.errors import TransferTimeout
    from gpuxfer.pp.copy_engine import CopyEngineTransport
    reads = []

    def seen(j):
        reads.append(j)
        return 250          # both slots' flags have reached step 250

    stub = types.SimpleNamespace(role="send", timeout_s=10.0, rank=0, peer=1, name="copy_engine", _seen=seen,
                                 _wd=collections.deque((k, (k - 1) % 2, 0.0, k) for k in range(1, 301)))
    assert CopyEngineTransport._watch(stub, now=1.0) is None
    assert sorted(reads) == [0, 1] and stub._wd[0][0] == 251
    err = CopyEngineTransport._watch(stub, now=100.0)
    assert isinstance(err, TransferTimeout)
    assert (err.rank, err.step, err.flag, err.expected, err.seen) == (0, 251, "empty[0]", 251, 250)
