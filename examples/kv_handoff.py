"""Hand one request's KV cache from a prefill process to a decode process with gpuxfer's KV API.

What a prefill/decode engine author writes, end to end:

* two processes, one per GPU (both on one GPU if there is one; the CPU emulation if none);
* each allocates its KV caches the way vLLM does, with torch: per layer a
  ``(2, num_blocks, block_tokens, kv_heads, head_dim)`` bf16 tensor (full attention) and a
  ``(num_blocks, block_tokens, 584)`` uint8 tensor (DeepSeek-V4's 584-byte fp8 slots), all carved
  from one allocation;
* prefill uses 64-token blocks, decode 16-token blocks: the transfer matches tokens, not blocks;
* each registers its caches as two KV-cache groups with a :class:`gpuxfer.kv.KVAgent`, and the
  two swap ``agent.metadata()`` bytes over a pipe (any channel will do: no torch.distributed);
* the engine is the one the link between the two devices favours (``triton`` on one GPU, ``pack``
  over NVLink, ``copy_engine`` on the host emulation; ``--engine`` picks another);
* decode pulls the request by block IDs (``agent.prepare`` + ``post``; with ``pack`` prefill posts
  its side too), prefill learns from its notification word that its blocks were read and may be freed;
* decode checks every byte of every token against what prefill wrote.

Run:  python examples/kv_handoff.py [--tokens 4096] [--layers 61] [--engine auto] [--platform host]
      (the defaults shown; on the host emulation 200 tokens and 2 layers)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

PREFILL_BLOCK, DECODE_BLOCK = 64, 16
HEADS, HEAD_DIM, SLOT = 4, 64, 584
#: what the first transfer of an engine pays once (copy_engine launches no kernel)
FIRST_COST = {"triton": "compiling and loading its kernels", "pack": "compiling and loading its pack kernels",
              "copy_engine": "building its copy lists"}


def token_bytes(torch, layer: int, piece: int, tokens, nbytes: int):
    """The bytes prefill writes for ``tokens`` (a 1-D int64 tensor) of one layer's piece: a hash of
    (layer, piece, token, byte), so a byte misplaced anywhere is caught."""
    b = torch.arange(nbytes, dtype=torch.int64, device=tokens.device)
    x = tokens[:, None] * 0x9E3779B1 + b[None, :] * 0x85EBCA77 + layer * 0xC2B2AE3D + piece * 0x27D4EB2F
    x = (x ^ (x >> 15)) * 0x2C1B3C6D
    return ((x ^ (x >> 12)) & 0xFF).to(torch.uint8)


def allocate_caches(torch, plat, device: int, layers: int, blocks: int, block_tokens: int, keep: list):
    """vLLM-shaped caches carved from one allocation: torch's on a GPU, a shared-memory buffer on the
    emulation (the only host memory another process can open)."""
    kv_shape = (2, blocks, block_tokens, HEADS, HEAD_DIM)
    slot_shape = (blocks, block_tokens, SLOT)
    kv_bytes, slot_bytes = 2 * blocks * block_tokens * HEADS * HEAD_DIM * 2, blocks * block_tokens * SLOT
    total = layers * (kv_bytes + slot_bytes)
    if plat.is_emulation:
        buf = plat.alloc(total, device)
        keep.append(buf)
        arena = plat.as_tensor(buf)
    else:
        arena = torch.empty(total, dtype=torch.uint8, device=f"cuda:{device}")
    full, mla, at = {}, {}, 0
    for i in range(layers):
        full[f"model.layers.{i}.self_attn"] = arena[at:at + kv_bytes].view(torch.bfloat16).view(kv_shape)
        at += kv_bytes
        mla[f"model.layers.{i}.mla_attn"] = arena[at:at + slot_bytes].view(slot_shape)
        at += slot_bytes
    return full, mla


def request_views(torch, full, mla, block_tokens: int):
    """Per (layer, piece): a ``(blocks, block_tokens, bytes per token)`` uint8 view of the cache."""
    out = []
    for li, t in enumerate(full.values()):
        u = t.view(torch.uint8).reshape(2, t.shape[1], block_tokens, -1)
        out += [((li, 0), u[0]), ((li, 1), u[1])]
    out += [((li, 2), t) for li, t in enumerate(mla.values())]
    return out


def side_main(rank: int, conn, args) -> None:
    import torch
    from gpuxfer.kv import KVAgent
    from gpuxfer.kv.engine_choice import default_engine_choice
    from gpuxfer.platforms import get_platform

    plat = get_platform(args.platform)
    device = rank if plat.device_count() > 1 else 0
    plat.set_device(device)
    keep: list = []
    prefill = rank == 0
    block_tokens = PREFILL_BLOCK if prefill else DECODE_BLOCK
    blocks = 2 * -(-args.tokens // block_tokens) + 3
    full, mla = allocate_caches(torch, plat, device, args.layers, blocks, block_tokens, keep)

    # The request's blocks on each side (the engines' block managers would hand these out).
    need = -(-args.tokens // block_tokens)
    ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(rank))[:need].tolist()
    dev = full[next(iter(full))].device
    index = torch.as_tensor(ids, dtype=torch.int64, device=dev)
    tok = torch.arange(need * block_tokens, dtype=torch.int64, device=dev)
    if prefill:      # "the model wrote the KV": every byte a hash of (layer, piece, token, byte)
        for (li, k), v in request_views(torch, full, mla, block_tokens):
            data = token_bytes(torch, li, k, tok, v.shape[-1]).view(need, block_tokens, -1)
            v.index_copy_(0, index, data)

    # The engine: the link between the two devices picks it (the same answer on both sides), unless asked.
    devices = (0, 1) if plat.device_count() > 1 else (0, 0)
    choice = default_engine_choice(plat, *devices)
    engine = choice.name if args.engine == "auto" else args.engine
    agent = KVAgent("prefill" if prefill else "decode", platform=plat, device=device, engine=engine,
                    timeout_s=120)
    keep.append(agent)
    agent.register_group("full", block_tokens, full)
    agent.register_group("mla", block_tokens, mla)
    conn.send((agent.metadata(), ids))            # bytes over any channel
    peer_meta, peer_ids = conn.recv()
    peer = agent.add_peer(peer_meta)

    if prefill:
        if engine == "pack":                      # two-sided: prefill posts its side (a push) too
            agent.transfer(peer, "push", local_blocks={"full": ids, "mla": ids},
                           remote_blocks={"full": peer_ids, "mla": peer_ids}, name="request-0").wait()
        else:
            agent.wait_notification(0, 1)         # decode read our blocks (or they landed): they may be freed
        conn.send("freed")
    else:
        t0 = time.perf_counter()
        x = agent.prepare(peer, "pull", local_blocks={"full": ids, "mla": ids},
                          remote_blocks={"full": peer_ids, "mla": peer_ids}, notify_slot=0, name="request-0")
        t1 = time.perf_counter()
        h = x.post()
        t2 = time.perf_counter()
        h.wait()
        t3 = time.perf_counter()
        assert conn.recv() == "freed"
        wrong = 0      # every byte of every token of the request (the last block's tail past it too)
        for (li, k), v in request_views(torch, full, mla, block_tokens):
            got = v[index].reshape(need * block_tokens, -1)
            wrong += int((got != token_bytes(torch, li, k, tok, v.shape[-1])).sum())
        print(f"engine: {engine} ({'asked for' if args.engine != 'auto' else choice.reason})")
        print(f"pull of one request ({args.tokens} tokens, {args.layers} layers x (K, V, 584-byte slots), "
              f"{PREFILL_BLOCK}-token blocks -> {DECODE_BLOCK}-token blocks, {x.descriptors:,} descriptors, "
              f"{x.nbytes / 1e6:.1f} MB) on {plat.label}: setup {1e6 * (t1 - t0):.0f} us, post "
              f"{1e6 * (t2 - t1):.0f} us, post -> complete {1e3 * (t3 - t1):.3f} ms (the first transfer: it "
              f"includes {FIRST_COST.get(engine, 'setting up the engine')}); wrong bytes: {wrong}")
        if wrong:
            raise SystemExit(3)
    for r in keep[::-1]:
        r.close()
    plat.close()


def usable_platform(name: str | None) -> str | None:
    """The platform to run on, checked here before any process starts (no device is touched): the first
    usable one for ``auto``; a named one that cannot run here is one line on stderr (None is returned)."""
    from gpuxfer.platforms import PLATFORMS, unavailable_reason
    name = (name or "auto").strip().lower()
    if name == "auto":
        return next((n for n in PLATFORMS if unavailable_reason(n) is None), "host")
    why = f"unknown platform; known: auto, {', '.join(PLATFORMS)}" if name not in PLATFORMS else unavailable_reason(name)
    if why is not None:
        print(f"{os.path.basename(sys.argv[0])}: error: platform {name} cannot run here: {why}", file=sys.stderr)
        return None
    return name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=None, help="request length (default 4096; 200 on the emulation)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default 61; 2 on the emulation)")
    ap.add_argument("--engine", default="auto", choices=("auto", "triton", "pack", "copy_engine"),
                    help="auto: the engine the link between the two devices favours (gpuxfer.kv.engine_choice)")
    ap.add_argument("--platform", default=None, help="cuda, rocm or host (default: the first usable)")
    args = ap.parse_args()
    name = usable_platform(args.platform or os.environ.get("GPUXFER_PLATFORM"))
    if name is None:
        return 2
    args.platform = name
    emulated = name == "host"
    args.tokens = args.tokens or (200 if emulated else 4096)
    args.layers = args.layers or (2 if emulated else 61)
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    procs = [ctx.Process(target=side_main, args=(r, c, args)) for r, c in ((0, a), (1, b))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        if p.is_alive():
            p.kill()
            p.join(5)
    codes = [p.exitcode for p in procs]
    if codes != [0, 0]:
        print(f"hand-off failed: exit codes {codes}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
