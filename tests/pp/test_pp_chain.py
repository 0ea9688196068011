"""Stage hand-off chains: 2 and 4 stages, varying sizes, random lags in every stage, every byte checked.

Each stage receives from the previous stage (checking every byte against what
that stage sent, regenerated from the seed), then sends its own step data to the
next. Runs on the host emulation in CI (gloo groups, spawned processes) and, marked
``gpu``, on CUDA with four stages on two GPUs (two processes per GPU).
"""
from __future__ import annotations

import math
import os
import random
import time


SPECS_SHAPES = {"hidden": ((48, 40), "bfloat16"), "pos": ((48,), "int64"), "residual": ((48, 40), "float32")}
# copy_engine steps go inline (on the caller's stream) up to inline_bytes, staged above: the default
# (1 MiB) sends every step of these specs inline, 0 stages every step, and MIXED (a step is 0-11,904 B)
# sends some of each kind in one chain
MIXED = 4096


def specs():
    import torch
    return {k: (shape, getattr(torch, dt)) for k, (shape, dt) in SPECS_SHAPES.items()}


def step_shapes(seed: int, sender: int, step: int) -> dict:
    rng = random.Random(seed * 1_000_003 + sender * 7919 + step)
    n = rng.choice([0, 1, 2, 7, 31, 48, rng.randint(0, 48)])
    w = rng.choice([40, 40, rng.randint(1, 40)])
    return {"hidden": (n, w), "pos": (n,), "residual": (n, w)}


def step_bytes(seed: int, sender: int, step: int) -> int:
    sizes = {"bfloat16": 2, "int64": 8, "float32": 4}
    return sum(math.prod(shape) * sizes[SPECS_SHAPES[name][1]]
               for name, shape in step_shapes(seed, sender, step).items())


def mixes_paths(seed: int, world: int, steps: int) -> bool:
    """Whether every sender of the chain sends steps on both sides of MIXED."""
    return all(min(got) <= MIXED < max(got)
               for got in ([step_bytes(seed, r, k) for k in range(1, steps + 1)] for r in range(world - 1)))


def step_tensors(seed: int, sender: int, step: int, device) -> dict:
    """Random bytes (every bit pattern, NaNs included) of the step's shapes and dtypes."""
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + sender * 7919 + step)
    out = {}
    for name, shape in step_shapes(seed, sender, step).items():
        dt = getattr(torch, SPECS_SHAPES[name][1])
        item = torch.empty((), dtype=dt).element_size()
        n = 1
        for s in shape:
            n *= s
        raw = torch.randint(0, 256, (n * item,), dtype=torch.uint8, generator=g)
        out[name] = raw.view(dt).view(shape).to(device)
    return out


def check_equal(got: dict, want: dict, what: str) -> None:
    import torch
    assert got.keys() == want.keys(), what
    for k in want:
        g, w = got[k], want[k]
        assert tuple(g.shape) == tuple(w.shape) and g.dtype == w.dtype, f"{what} {k}: {g.shape} {g.dtype}"
        gb, wb = g.detach().cpu().contiguous().view(torch.uint8), w.detach().cpu().contiguous().view(torch.uint8)
        wrong = int((gb != wb).sum())
        assert wrong == 0, f"{what} {k}: {wrong} wrong bytes of {wb.numel()}"


def _lag(rng: random.Random, lag_ms: float) -> None:
    if lag_ms <= 0:
        return
    r = rng.random()
    if r < 0.6:
        time.sleep(rng.random() * lag_ms / 1e3)
    elif r < 0.65:
        time.sleep(5 * lag_ms / 1e3)     # a stage falling well behind: exercises back-pressure


def run_chain(conn, rank: int, world: int, *, seed: int, steps: int, lag_ms: float, metadata: bool, use_out: bool,
              device, torch_device, views: bool = False) -> int:
    """One chain of ``steps`` steps over ``conn``; returns the bytes received and checked."""
    import torch
    rng = random.Random(seed + 17 * rank)
    checked = 0
    out = None
    if use_out and rank > 0:
        out = {k: torch.full((s[0] * (s[1] if len(s) > 1 else 1),), 0, dtype=getattr(torch, dt), device=torch_device)
               for k, (s, dt) in SPECS_SHAPES.items()}
    pending = []
    for k in range(1, steps + 1):
        if rank > 0:
            _lag(rng, lag_ms)
            rcv = conn.receiver().recv(**({} if metadata else {"shapes": step_shapes(seed, rank - 1, k)}),
                                       **({"out": out} if out is not None else {}))
            _lag(rng, lag_ms)                      # "input preparation" overlapping the transfer
            got = rcv.tensors
            want = step_tensors(seed, rank - 1, k, "cpu")
            if out is not None or views:           # views of persistent tensors or of the slot: check before reuse
                check_equal(got, want, f"rank {rank} step {k}")
            else:
                pending.append((k, got, want))
            checked += rcv.nbytes
        if rank < world - 1:
            _lag(rng, lag_ms)
            conn.sender().send(step_tensors(seed, rank, k, torch_device))
        if len(pending) > 4 or k == steps:
            for kk, got, want in pending:
                check_equal(got, want, f"rank {rank} step {kk}")
            pending.clear()
    conn.synchronize(60)
    return checked


def chain_session(rank: int, world: int, init_method: str, platform_name: str, scenarios: list, seed: int) -> list:
    os.environ["GPUXFER_PLATFORM"] = platform_name
    import torch

    from gpuxfer.platforms import get_platform
    from gpuxfer.pp import connect
    from gpuxfer.pp.launch import init_cpu_group
    init_cpu_group(rank, world, init_method)
    plat = get_platform(platform_name)
    results = []
    try:
        for sc in scenarios:
            # "mod": rank r on device r % n (chain pairs cross devices); "div": ranks 2i, 2i+1 share a device
            # (same-device pairs: copy engines over IPC within one GPU)
            n = plat.device_count()
            device = (rank // 2 if sc.get("devices") == "div" else rank) % n
            torch_device = torch.device("cpu") if plat.is_emulation else torch.device("cuda", device)
            if not plat.is_emulation:
                torch.cuda.set_device(device)
            conn = connect(send_to=rank + 1 if rank < world - 1 else None, recv_from=rank - 1 if rank else None,
                           specs=specs(), backend=sc["backend"], platform=plat, device=device, timeout_s=60,
                           metadata=sc.get("metadata", True), recv_slots=sc.get("recv_slots", 2),
                           flag_path=sc.get("flag_path"), meta_channel=sc.get("meta_channel"),
                           inline_bytes=sc.get("inline_bytes"), recv_views=sc.get("views", False))
            with conn:
                assert conn.backend == sc["backend"], (conn.backend, conn.fallback_reasons)
                allocated = conn.allocated_bytes
                checked = run_chain(conn, rank, world, seed=seed, steps=sc["steps"], lag_ms=sc.get("lag_ms", 2.0),
                                    metadata=sc.get("metadata", True), use_out=sc.get("out", False),
                                    device=device, torch_device=torch_device, views=sc.get("views", False))
                flags = sorted({getattr(t, "remote_flags", None) for t in conn.transports}, key=str)
                meta = sorted({t.meta.what for t in conn.transports if t.metadata})
            assert conn.allocated_bytes == 0
            results.append({"backend": conn.backend, "checked": checked, "allocated": allocated, "remote": flags,
                            "meta": meta})
    finally:
        import torch.distributed as dist
        dist.destroy_process_group()
        plat.close()
    return results


def run_session(spawner, world: int, platform_name: str, scenarios: list, seed: int, timeout: float = 150):
    return spawner.run_ranks(chain_session, world, platform_name, scenarios, seed, timeout=timeout)


def test_four_stage_chain(spawner, platform_name, nccl_pairs):
    gpu = platform_name != "host"
    scenarios = [
        {"backend": "copy_engine", "steps": 300 if gpu else 30, "lag_ms": 1.0 if gpu else 2.0,
         "inline_bytes": MIXED},
        {"backend": "copy_engine", "steps": 150 if gpu else 24, "flag_path": "copy", "metadata": False,
         "recv_slots": 3, "devices": "div", "inline_bytes": 0},
        {"backend": "nccl", "steps": 150 if gpu else 24, "meta_channel": "group"},
    ]
    assert mixes_paths(11, 4, scenarios[0]["steps"])
    results = run_session(spawner, 4, platform_name, scenarios, seed=11, timeout=300 if gpu else 150)
    for rank, res in enumerate(results):
        for sc, r in zip(scenarios, res):
            assert r["backend"] == sc["backend"]
            if rank > 0:
                assert r["checked"] > 0
        assert res[0]["allocated"] > 0
    # the forced 8-byte-copy flag path was used
    assert all(res[1]["remote"] == [False] for res in results)
    # metadata: a shared-memory mailbox between processes of one host, the CPU group when asked for
    assert all(res[0]["meta"] == ["the shared-memory mailbox"] for res in results)
    assert all(res[1]["meta"] == [] and res[2]["meta"] == ["the CPU group"] for res in results)


def test_two_stage_chain(spawner, platform_name, nccl_pairs):
    gpu = platform_name != "host"
    scenarios = [
        {"backend": "copy_engine", "steps": 400 if gpu else 40, "out": True, "recv_slots": 2},
        {"backend": "nccl", "steps": 200 if gpu else 30, "metadata": False, "out": True},
        {"backend": "copy_engine", "steps": 400 if gpu else 30, "lag_ms": 0.0, "inline_bytes": 0},
        {"backend": "copy_engine", "steps": 200 if gpu else 20, "devices": "div", "lag_ms": 0.5,
         "inline_bytes": MIXED},
        {"backend": "copy_engine", "steps": 300 if gpu else 24, "views": True, "inline_bytes": MIXED},
    ]
    assert mixes_paths(5, 2, scenarios[3]["steps"])
    results = run_session(spawner, 2, platform_name, scenarios, seed=5, timeout=300 if gpu else 150)
    assert results[1][0]["checked"] > 0 and results[1][1]["checked"] > 0
    # nccl receivers own no device memory; senders own a ring of two slots
    assert results[1][1]["allocated"] == 0 and results[0][1]["allocated"] > 0
