"""Plain helpers of the KVAgent tests: host-emulation arenas, vLLM-shaped layers, byte equality, pairing two
agents, the token oracle and metadata blobs taken apart and put back together."""
from __future__ import annotations

import contextlib
import json
import struct

import numpy as np
import torch

from gpuxfer.kv.metadata import METADATA_VERSION


class Arena:
    """Host-emulation 'device memory': a shared-memory buffer carved into torch tensors."""

    def __init__(self, plat, device: int, nbytes: int = 1 << 16):
        self.buf = plat.alloc(nbytes, device)
        self.flat = plat.as_tensor(self.buf)
        self.at = 0

    def tensor(self, shape, dtype=torch.uint8, seed=None):
        item = torch.empty((), dtype=dtype).element_size()
        self.at = -(-self.at // 16) * 16
        n = int(np.prod(shape)) * item
        t = self.flat[self.at:self.at + n].view(dtype).view(shape)
        self.at += n
        if seed is not None:
            g = np.random.default_rng(seed)
            t.view(torch.uint8).reshape(-1).copy_(torch.from_numpy(g.integers(0, 256, n, dtype=np.uint8)))
        return t

    def close(self):
        self.buf.close()


def vllm_layers(arena, layers, blocks, bt, seed):
    """vLLM flash-attention layout: (2, blocks, block_tokens, heads, dim) bf16 per layer."""
    return {f"model.layers.{i}.self_attn": arena.tensor((2, blocks, bt, 2, 4), torch.bfloat16, seed=seed + i)
            for i in range(layers)}


def same_bytes(a, b) -> bool:
    """Bytewise equality (random bytes viewed as floats hold NaNs)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def connect(pre, dec):
    """Each agent adds the other as a peer: (decode's peer, prefill's peer)."""
    return dec.add_peer(pre.metadata()), pre.add_peer(dec.metadata())


@contextlib.contextmanager
def triton_pair(platform, blocks: int):
    """A prefill and a decode ``triton`` agent (on two devices where there are two), each with two vLLM-shaped
    layers of ``blocks`` 4-token blocks registered as group ``full``, paired: ``(decode, its peer, prefill's
    layers, decode's layers, decode's arena)``; agents and arenas closed on exit."""
    from gpuxfer.kv.agent import KVAgent
    d1 = 1 if platform.device_count() > 1 else 0
    a0, a1 = Arena(platform, 0, 1 << 20), Arena(platform, d1, 1 << 20)
    pre = KVAgent("prefill", platform=platform, device=0, engine="triton", timeout_s=60)
    dec = KVAgent("decode", platform=platform, device=d1, engine="triton", timeout_s=60)
    try:
        src, dst = vllm_layers(a0, 2, blocks, 4, seed=1), vllm_layers(a1, 2, blocks, 4, seed=2)
        pre.register_group("full", 4, src)
        dec.register_group("full", 4, dst)
        peer, _ = connect(pre, dec)
        yield dec, peer, src, dst, a1
    finally:
        dec.close()
        pre.close()
        a0.close()
        a1.close()


def held_pull(pre, dec, a0, a1):
    """A pull with a notification posted on a stream of its own held by a gate: (src, dst, peer, gate, stream,
    handle). The notification goes through the peer link's stage word (an in-process peer maps nothing)."""
    src, dst = vllm_layers(a0, 1, 4, 4, seed=1), vllm_layers(a1, 1, 4, 4, seed=2)
    pre.register_group("full", 4, src)
    dec.register_group("full", 4, dst)
    p_of_dec, _ = connect(pre, dec)
    plat = dec.platform
    gate = plat.alloc(64, 1)
    s = plat.create_stream(1)
    plat.memset_async(s, gate.ptr, 0, 64)
    plat.wait_flag(s, gate.ptr, 1)
    h = dec.transfer(p_of_dec, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [3]}, stream=s,
                     notify_slot=2)
    return src, dst, p_of_dec, gate, s, h


def token_oracle(src, dst, s_ids, d_ids, bs, bd, kv_first):
    """What the destination must hold after a transfer matching tokens (numpy, independent of the API)."""
    if src.dtype == torch.bfloat16:         # numpy has no bf16: the same bits as int16
        src, dst = src.view(torch.int16), dst.view(torch.int16)
    s = src.clone().numpy()
    out = dst.clone().numpy()
    tokens = min(len(s_ids) * bs, len(d_ids) * bd)
    for t in range(tokens):
        sb, so = s_ids[t // bs], t % bs
        db, do = d_ids[t // bd], t % bd
        if kv_first:
            out[:, db, do] = s[:, sb, so]
        else:
            out[db, do] = s[sb, so]
    return out


def meta_body(blob: bytes) -> dict:
    """The JSON body of a metadata blob (after its 12-byte header)."""
    return json.loads(blob[12:])


def reblob(body: dict, version: int = METADATA_VERSION) -> bytes:
    """A metadata blob around ``body``: the header with ``version`` and the length, then the JSON."""
    raw = json.dumps(body).encode()
    return struct.pack("<4sHHI", b"GXKV", version, 0, len(raw)) + raw
