"""The default ``copy_engine`` receiver (no ``recv_views``): each step's tensors are the caller's own (a later
step never changes them), bit-exact, made with a fixed number of platform calls per step (the slot given
back with the next step's wait, one copy out), and a slot it still holds goes back before a receive that
the sender could only reach with it. Structural, not timed."""
from __future__ import annotations

import collections
import os

import pytest

from test_pp_step_calls import EMULATION_ONLY, QUEUED, _spy

TIMEOUT = 20.0
N = 96                  # elements of each tensor (float32, int64): one small inline step
WARM, COUNTED = 4, 10


def copy_out_session(rank: int, world: int, init_method: str, platform_name: str, batch: str) -> dict:
    os.environ["GPUXFER_PLATFORM"] = platform_name
    os.environ["GPUXFER_PP_FLAG_BATCH"] = batch
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
    counts = _spy(plat)
    specs = {"x": ((N,), torch.float32), "i": ((N,), torch.int64)}
    conn = connect(dist.new_group(backend="gloo"), send_to=1 if rank == 0 else None,
                   recv_from=0 if rank == 1 else None, specs=specs, backend="copy_engine", platform=plat,
                   device=device, timeout_s=TIMEOUT)
    steps, ahead = WARM + COUNTED, 3            # then recv_slots + 1 receives left unaccessed
    out: dict = {"emulation": plat.is_emulation}
    try:
        t = conn.transports[0]
        out["remote_flags"], out["slots"] = t.remote_flags, t.recv_slots
        if rank == 0:
            src = {"x": torch.zeros(N, dtype=torch.float32, device=dev),
                   "i": torch.zeros(N, dtype=torch.int64, device=dev)}
            for k in range(1, steps + ahead + 1):
                src["x"].copy_(torch.arange(N, dtype=torch.float32) + k)     # (stream-ordered after the
                src["i"].fill_(-k)                                           # copies that read it last)
                t.send(src)
            t.synchronize()
        else:
            kept = []
            for k in range(1, steps + 1):
                if k == WARM + 1:
                    counts.clear()
                kept.append(t.recv().tensors)
                if k == steps:
                    out["calls"] = dict(counts)
            pending = [t.recv() for _ in range(ahead)]          # the slot of step `steps` is still held
            kept += [r.tensors for r in pending]
            t.synchronize()
            assert plat.synchronize(plat.current_stream(device), 30.0)
            for k, got in enumerate(kept, 1):    # every step's bytes, read after all later steps landed
                assert torch.equal(got["x"].cpu(), torch.arange(N, dtype=torch.float32) + k), f"step {k}: x"
                assert bool((got["i"].cpu() == -k).all()), f"step {k}: i"
            out["buffers"] = len({g["x"].untyped_storage().data_ptr() for g in kept})
            out["steps"] = len(kept)
            out["in_slots"] = sum(g["x"].data_ptr() - p in range(t.specs.slot_bytes)
                                  for g in kept for p in t._slot_ptr)
        dist.barrier()
        conn.close()
    finally:
        conn.abort()
        dist.destroy_process_group()
        plat.close()
    return out


@pytest.mark.parametrize("batch", ["0", "1"], ids=["flag-calls", "flag-batch"])
def test_default_receiver_tensors_are_the_callers_and_a_step_is_few_calls(spawner, platform_name, batch):
    _, got = spawner.run_ranks(copy_out_session, 2, platform_name, batch, timeout=120)
    assert got["steps"] == WARM + COUNTED + 3
    assert got["buffers"] == got["steps"] and got["in_slots"] == 0, got   # a new buffer per step, no slot
    per_step = collections.Counter({k: v / COUNTED for k, v in got["calls"].items()})
    queued = sum(per_step[k] for k in QUEUED)
    batched = batch == "1" and got["remote_flags"]
    # give the last step's slot back and wait for this one (one flag_ops call where batched), one copy out
    want = (2 if batched else 3) + (0 if got["remote_flags"] else 1)      # (+1: a copy-path publish)
    assert queued == want, f"{queued} queued calls per step: {dict(per_step)}"
    assert per_step["flag_ops" if batched else "wait_flag"] == 1, dict(per_step)
    assert per_step["copy_async"] == (1 if got["remote_flags"] else 2), dict(per_step)
    others = {k: v for k, v in per_step.items() if k not in QUEUED and k != "current_stream"
              and not (got["emulation"] and k in EMULATION_ONLY)}
    assert not others, f"calls besides the step's own per step: {others}"
    assert per_step["current_stream"] <= 1, dict(per_step)


def swapped_out_session(rank: int, world: int, init_method: str, platform_name: str, backend: str) -> dict:
    """The receiver passes recv(out=out), then puts into ``out`` a tensor of another dtype with as many elements
    (a quarter of the bytes) before touching .tensors."""
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
    specs = {"x": ((N,), torch.float32), "i": ((N,), torch.int64)}
    sent = {"x": torch.arange(N, dtype=torch.float32, device=dev) + 0.5,
            "i": torch.arange(N, dtype=torch.int64, device=dev) * 3}
    res = {}
    with connect(send_to=1 if rank == 0 else None, recv_from=0 if rank == 1 else None, specs=specs,
                 backend=backend, platform=plat, device=device, timeout_s=TIMEOUT) as conn:
        if rank == 0:
            conn.sender().send(sent)
        else:
            out = {name: torch.zeros(N, dtype=dt, device=dev) for name, (_, dt) in specs.items()}
            mine = dict(out)
            r = conn.receiver().recv(out=out)
            guard = torch.full((4 * N + 64,), 0xAB, dtype=torch.uint8, device=dev)
            out["x"] = guard[:N]          # N uint8 elements: N bytes where the step brings 4 N
            got = r.tensors
            res["guard intact"] = bool((guard[N:] == 0xAB).all())
            res["into the checked tensors"] = all(got[n].data_ptr() == mine[n].data_ptr() for n in specs)
            res["bytes"] = all(torch.equal(got[n].cpu(), sent[n].cpu()) for n in specs)
        conn.synchronize()
    dist.destroy_process_group()
    plat.close()
    return res


@pytest.mark.parametrize("backend", ["copy_engine", "nccl"])
def test_recv_out_is_the_dict_checked_at_recv(spawner, platform_name, nccl_pairs, backend):
    """recv(out=...) copies into the tensors it checked: a tensor the caller puts into the dict afterwards is
    never written (the step's 4 N bytes copied into an N-byte uint8 tensor put there would write past its
    end)."""
    _, got = spawner.run_ranks(swapped_out_session, 2, platform_name, backend, timeout=120)
    assert got == {"guard intact": True, "into the checked tensors": True, "bytes": True}
