"""KVAgent over caches allocated the way vLLM's CPU worker allocates them -- plain torch CPU tensors, per-layer
strided views of one buffer -- between two spawned processes on the host emulation: registered as they are
(cma handles), pulled and pushed with ``copy_engine`` (what ``engine="auto"`` picks for such a peer), every
byte checked; a peer killed mid-transfer gives a typed error on the survivor, never a hang."""
from __future__ import annotations

import os
import time

import pytest
import torch

from gpuxfer.errors import BackendUnavailable, PeerLost, TransferTimeout
from gpuxfer.kv import KVAgent

T = 60.0
LAYERS, BS, HEADS, DIM = 3, 4, 2, 8


def _caches(num_blocks: int, seed: int, swa_blocks: int = 6):
    """vLLM 0.33's shape on the CPU: one buffer ``[blocks, layers, 2, block_size, heads, dim]``, layer i its
    strided view ``[:, i]`` (K and V of a block side by side), filled from ``seed``; plus a sliding-window
    group of its own plain tensor ``[blocks, block_size, heads, dim]``."""
    g = torch.Generator().manual_seed(seed)
    big = torch.zeros((num_blocks, LAYERS, 2, BS, HEADS, DIM), dtype=torch.bfloat16)
    big.view(torch.int16).copy_(torch.randint(-30000, 30000, big.shape, generator=g, dtype=torch.int16))
    swa = torch.zeros((swa_blocks, 2 * BS, HEADS, DIM), dtype=torch.float16)
    swa.view(torch.int16).copy_(torch.randint(-30000, 30000, swa.shape, generator=g, dtype=torch.int16))
    full = {f"model.layers.{i}.self_attn": big[:, i] for i in range(LAYERS)}
    return big, swa, full


def _blocks(t, ids):
    return t.view(torch.int16)[list(ids)].clone()


def _host():
    from gpuxfer.platforms import get_platform
    return get_platform("host")


def _prefill(conn, engine: str, kill_mode: bool):
    """Process A: plain caches registered, metadata sent; then checks what decode pushed into its blocks."""
    plat = _host()
    big, swa, full = _caches(10, seed=1)
    agent = KVAgent("prefill", platform=plat, engine=engine, timeout_s=T)
    agent.register_group("full", BS, full)
    agent.register_group("swa", 2 * BS, {"model.layers.0.swa": swa})
    conn.send(agent.metadata())
    if kill_mode:
        conn.recv()                         # the parent kills this process while decode pulls
        time.sleep(T)
        return None
    assert agent.wait_notification(0, 1, T) == 1            # decode read our blocks
    ids_here, ids_there, swa_here, swa_there = conn.recv()
    assert agent.wait_notification(1, 1, T) == 1            # decode's push landed
    dbig, dswa, _ = _caches(8, seed=2)
    wrong = int((_blocks(big, ids_here) != _blocks(dbig, ids_there)).sum())
    wrong += int((_blocks(swa, swa_here) != _blocks(dswa, swa_there)).sum())
    untouched = [b for b in range(10) if b not in ids_here]
    wrong += int((_blocks(big, untouched) != _blocks(_caches(10, seed=1)[0], untouched)).sum())
    agent.close()
    plat.close()
    return wrong


def _decode(conn, engine: str):
    """Process B: plain caches too; adds prefill, pulls, checks every byte, pushes."""
    plat = _host()
    big, swa, full = _caches(8, seed=2)
    agent = KVAgent("decode", platform=plat, engine=engine, timeout_s=T)
    agent.register_group("full", BS, full)
    agent.register_group("swa", 2 * BS, {"model.layers.0.swa": swa})
    meta = conn.recv()
    if engine == "triton":
        with pytest.raises(BackendUnavailable, match="cannot address"):
            agent.add_peer(meta)
        agent.close()
        return "refused"
    try:
        peer = agent.add_peer(meta)
    except BackendUnavailable as exc:
        if "ptrace" not in str(exc):
            raise
        return f"skip: {exc}"       # the kernel denies cross-memory attach here
    assert peer.engine == "copy_engine" and not peer.addressable
    src, dst = [9, 0, 4, 5], [1, 7, 2, 3]
    agent.prepare(peer, "pull", local_blocks={"full": dst, "swa": [5, 0]}, remote_blocks={"full": src, "swa": [1, 2]},
                  notify_slot=0).post().wait(T)
    pbig, pswa, _ = _caches(10, seed=1)
    wrong = int((_blocks(big, dst) != _blocks(pbig, src)).sum()) + \
        int((_blocks(swa, [5, 0]) != _blocks(pswa, [1, 2])).sum())
    untouched = [b for b in range(8) if b not in dst]
    wrong += int((_blocks(big, untouched) != _blocks(_caches(8, seed=2)[0], untouched)).sum())
    there = [3, 8, 6]
    agent.prepare(peer, "push", local_blocks={"full": [0, 5, 6], "swa": [4]},
                  remote_blocks={"full": there, "swa": [0]}, notify_slot=1).post().wait(T)
    conn.send(([3, 8, 6], [0, 5, 6], [0], [4]))
    agent.close()
    plat.close()
    return wrong


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["auto", "copy_engine", "triton"])
def test_plain_caches_pull_and_push_across_processes(spawner, engine):
    import multiprocessing as mp
    a, b = mp.get_context("spawn").Pipe()
    pre = spawner.start(_prefill, a, "auto", False, name="prefill")
    dec = spawner.start(_decode, b, engine, name="decode")
    if engine == "triton":
        assert dec.result(T * 2) == "refused"
        dec.join(T)
        pre.proc.kill()
        pre.proc.join(T)
        return
    got = dec.result(T * 2)
    if isinstance(got, str) and got.startswith("skip:"):
        pre.proc.kill()
        pytest.skip(got)
    assert got == 0, "wrong bytes on decode after the pull"
    assert pre.result(T * 2) == 0, "wrong bytes on prefill after the push"
    dec.join(T)
    pre.join(T)


def _decode_survives(conn, ready, healthy_meta):
    plat = _host()
    big, swa, full = _caches(8, seed=2)
    agent = KVAgent("decode", platform=plat, timeout_s=T)
    agent.register_group("full", BS, full)
    healthy = agent.add_peer(healthy_meta)
    try:
        peer = agent.add_peer(conn.recv())
    except BackendUnavailable as exc:
        if "ptrace" not in str(exc):
            raise
        ready.put(0)
        return f"skip: {exc}"       # the kernel denies cross-memory attach here
    xfer = agent.prepare(peer, "pull", local_blocks={"full": list(range(8))}, remote_blocks={"full": list(range(8))})
    xfer.post().wait(T)
    ready.put(os.getpid())
    deadline = time.monotonic() + T
    err = None
    while time.monotonic() < deadline:          # pulls while the parent kills prefill
        try:
            xfer.post().wait(T)
        except TransferTimeout as exc:
            err = exc
            break
    assert isinstance(err, PeerLost), f"expected PeerLost, got {err!r}"
    with pytest.raises(PeerLost):               # every later post of that peer fails alike, none hangs
        xfer.post().wait(T)
    other = agent.prepare(healthy, "pull", local_blocks={"full": [0, 1]}, remote_blocks={"full": [5, 2]})
    for _ in range(40):                         # another peer's transfers run on (past the kept posts' reaping)
        big.zero_()
        other.post().wait(T)
        assert torch.equal(_blocks(big, [0, 1]), _blocks(_caches(6, seed=3)[0], [5, 2]))
    t0 = time.monotonic()
    agent.remove_peer(peer)
    agent.close()
    plat.close()
    return time.monotonic() - t0 < T


@pytest.mark.timeout(300)
def test_peer_killed_mid_transfer_typed_error_no_hang(spawner):
    import multiprocessing as mp
    a, b = mp.get_context("spawn").Pipe()
    ready = spawner.queue()
    plat = _host()          # a healthy prefill in this process, beside the one killed
    big, _, full = _caches(6, seed=3)
    healthy = KVAgent("prefill-2", platform=plat, timeout_s=T)
    healthy.register_group("full", BS, full)
    pre = spawner.start(_prefill, a, "auto", True, name="prefill")
    dec = spawner.start(_decode_survives, b, ready, healthy.metadata(), name="decode")
    ready.get(timeout=T * 2)
    time.sleep(0.2)
    pre.proc.kill()
    pre.proc.join(T)
    try:
        got = dec.result(T * 2)
    finally:
        healthy.close()
        plat.close()
    if isinstance(got, str) and got.startswith("skip:"):
        pytest.skip(got)
    assert got is True
    dec.join(T)


def _pack_side(conn, source: bool):
    """Both sides run ``pack`` over plain caches: each touches only its own caches and the peer's staging
    (shared memory), so it needs no cross-memory attach at all once registered."""
    plat = _host()
    big, swa, full = _caches(10 if source else 8, seed=1 if source else 2)
    agent = KVAgent("prefill" if source else "decode", platform=plat, engine="pack", timeout_s=T)
    agent.register_group("full", BS, full)
    conn.send(agent.metadata())
    peer = agent.add_peer(conn.recv())
    assert peer.engine == "pack" and not peer.addressable
    src, dst = [9, 0, 4], [1, 7, 2]
    mine, theirs = (src, dst) if source else (dst, src)
    x = agent.prepare(peer, "push" if source else "pull", local_blocks={"full": mine}, remote_blocks={"full": theirs},
                      name="req")
    x.post().wait(T)
    wrong = 0 if source else int((_blocks(big, dst) != _blocks(_caches(10, seed=1)[0], src)).sum())
    conn.send("done")
    conn.recv()
    agent.close()
    plat.close()
    return wrong


@pytest.mark.timeout(300)
def test_pack_over_plain_caches_across_processes(spawner):
    import multiprocessing as mp
    a, b = mp.get_context("spawn").Pipe()
    pre = spawner.start(_pack_side, a, True, name="prefill")
    dec = spawner.start(_pack_side, b, False, name="decode")
    assert dec.result(T * 3) == 0 and pre.result(T * 3) == 0
    dec.join(T)
    pre.join(T)
