"""A tiny two-stage model split over two GPUs (or two host processes) with gpuxfer's stage hand-off.

Stage 0 (rank 0) runs the first half of the layers and sends ``hidden`` and
``residual`` to stage 1 (rank 1), which runs the second half. The final outputs
are compared bit for bit with the whole model run on one device, for a few
batches of different sizes.

    python examples/pp_two_stage.py                     # CUDA with 2 GPUs, else the host emulation
    GPUXFER_PLATFORM=host python examples/pp_two_stage.py
    GPUXFER_PP_TRANSPORT=nccl python examples/pp_two_stage.py
"""
from __future__ import annotations

import argparse
import os
import sys

HIDDEN, LAYERS, MAX_TOKENS = 64, 4, 32
BATCHES = [5, 32, 1, 17, 32, 9]


def build_model(device, dtype):
    """A small residual MLP stack; the same seed gives the same weights in every process."""
    import torch
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(),
                                  torch.nn.Linear(2 * HIDDEN, HIDDEN)) for _ in range(LAYERS)]
    return [layer.to(device=device, dtype=dtype).eval() for layer in layers]


def run_layers(layers, hidden, residual):
    for layer in layers:
        residual = residual + hidden
        hidden = layer(residual)
    return hidden, residual


def batch_input(i: int, n: int, device, dtype):
    import torch
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(n, HIDDEN, generator=g).to(device=device, dtype=dtype)
    return x, torch.zeros_like(x)


def stage(rank: int, world: int, platform_name: str) -> list:
    import torch

    from gpuxfer.platforms import get_platform
    from gpuxfer.pp import connect
    plat = get_platform(platform_name)
    emu = plat.is_emulation
    device = rank % plat.device_count()
    tdev = torch.device("cpu") if emu else torch.device("cuda", device)
    if not emu:
        torch.cuda.set_device(device)
    dtype = torch.float32
    layers = build_model(tdev, dtype)
    mine = layers[: LAYERS // 2] if rank == 0 else layers[LAYERS // 2:]
    specs = {"hidden": ((MAX_TOKENS, HIDDEN), dtype), "residual": ((MAX_TOKENS, HIDDEN), dtype)}
    outputs = []
    try:
        with connect(send_to=1 if rank == 0 else None, recv_from=0 if rank == 1 else None, specs=specs,
                     platform=plat, device=device) as conn:
            print(f"rank {rank}: transport {conn.backend} on {plat.label}, device {device}, "
                  f"{conn.allocated_bytes} B of transfer buffers", flush=True)
            with torch.no_grad():
                for i, n in enumerate(BATCHES):
                    if rank == 0:
                        h, r = run_layers(mine, *batch_input(i, n, tdev, dtype))
                        conn.sender().send({"hidden": h, "residual": r})
                    else:
                        received = conn.receiver().recv()      # returns at once; nothing waits yet
                        t = received.tensors                   # the GPU wait and copy-out are queued here
                        h, r = run_layers(mine, t["hidden"], t["residual"])
                        outputs.append((h + r).cpu().numpy())   # plain data back to the parent
            conn.synchronize()
    finally:
        plat.close()
    return outputs


def reference(platform_name: str) -> list:
    """The whole model on one device."""
    import torch

    from gpuxfer.platforms import get_platform
    plat = get_platform(platform_name)
    emu = plat.is_emulation
    plat.close()
    tdev = torch.device("cpu") if emu else torch.device("cuda", 0)
    dtype = torch.float32
    layers = build_model(tdev, dtype)
    out = []
    with torch.no_grad():
        for i, n in enumerate(BATCHES):
            h, r = run_layers(layers, *batch_input(i, n, tdev, dtype))
            out.append((h + r).cpu().numpy())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", default=None, help="cuda, rocm or host (default: GPUXFER_PLATFORM, else the first "
                                                     "usable)")
    args = ap.parse_args(argv)
    import torch

    from gpuxfer.platforms import PLATFORMS, unavailable_reason
    from gpuxfer.spawn import run_ranks
    name = (args.platform or os.environ.get("GPUXFER_PLATFORM") or "auto").strip().lower()
    if name == "auto":
        name = next((n for n in PLATFORMS if unavailable_reason(n) is None), "host")
    why = f"unknown platform; known: auto, {', '.join(PLATFORMS)}" if name not in PLATFORMS else unavailable_reason(name)
    if why is not None:         # said here, once, before any process starts
        print(f"pp_two_stage.py: error: platform {name} cannot run here: {why}", file=sys.stderr)
        return 2
    print(f"platform {name}{' (EMULATION on the CPU: no GPU is used)' if name == 'host' else ''}")
    if name == "cuda" and torch.cuda.device_count() < 2:
        print("note: one GPU: both stages share GPU 0")
    results = run_ranks(stage, 2, (name,), timeout_s=300, env={"GPUXFER_PLATFORM": name})
    got, want = results[1], reference(name)
    ok = len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        same = g.shape == w.shape and g.tobytes() == w.tobytes()
        diff = "" if same or g.shape != w.shape else f" (max abs difference {abs(g - w).max():.3g})"
        print(f"batch {i}: {tuple(g.shape)} (tokens, hidden): {'identical' if same else 'DIFFERENT'} to the "
              f"one-device run{diff}")
        ok &= same
    print("PASS: the two-stage outputs are bit-identical to the one-device run" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
