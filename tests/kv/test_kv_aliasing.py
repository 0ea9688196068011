"""Registration refuses memory a request's copies could write twice at once (gpuxfer.kv.layers.check_disjoint):
one tensor as two layers, groups over the same memory shifted by part of a block, overlapping pieces; and keeps
what is meant: groups laid over the same memory block for block, K and V halves, interleaved planes."""
from __future__ import annotations

import random

import pytest

from gpuxfer.errors import BadInput, BlockIdError
from gpuxfer.kv.agent import KVAgent, KVLayerSpec
from gpuxfer.kv.layers import _runs_overlap


@pytest.fixture
def agent():
    from gpuxfer.platforms.host import HostPlatform
    plat = HostPlatform()
    buf = plat.alloc(1 << 16, 0)
    a = KVAgent("a", platform=plat, device=0, timeout_s=60)
    a.flat = plat.as_tensor(buf)
    yield a
    a.close()
    buf.close()
    plat.close()


def test_one_tensor_as_two_layers_is_refused(agent):
    t = agent.flat[:8 * 64].view(8, 64)
    with pytest.raises(BadInput, match=r"layer 'l1' overlaps layer 'l0'"):
        agent.register_group("g", 16, {"l0": t, "l1": t})
    with pytest.raises(BadInput, match="overlaps"):          # a view of part of it too
        agent.register_group("g", 16, {"l0": t, "l1": agent.flat[32:32 + 8 * 64].view(8, 64)})
    agent.register_group("g", 16, {"l0": t})                  # nothing of the refused ones stayed
    assert agent.groups == {"g": (16, 8, 1)}


def test_groups_shifted_by_part_of_a_block_are_refused(agent):
    slab = agent.flat[:8 * 96]
    agent.register_group("mla", 4, {"mla": KVLayerSpec(slab.view(8, 96), 8, 96, [(0, 96)])})
    with pytest.raises(BadInput, match="layer 'swa' overlaps layer 'mla' of group 'mla'"):
        agent.register_group("swa", 4, {"swa": KVLayerSpec(agent.flat[48:48 + 7 * 96], 7, 96, [(0, 96)])})
    with pytest.raises(BadInput, match="overlaps"):          # another block stride over the same bytes
        agent.register_group("other", 4, {"o": KVLayerSpec(slab, 4, 192, [(0, 64)])})
    assert set(agent.groups) == {"mla"}


def test_overlapping_pieces_are_refused(agent):
    with pytest.raises(BadInput, match="pieces 0 and 1 overlap"):
        agent.register_group("g", 16, {"l": KVLayerSpec(agent.flat[:8 * 128], 8, 128, [(0, 64), (32, 64)])})
    with pytest.raises(BadInput, match="pieces 0 and 1 overlap"):    # block i's second piece on block i + 1's first
        agent.register_group("g", 16, {"l": KVLayerSpec(agent.flat[:9 * 128], 8, 128, [(0, 64), (160, 64)])})


def test_meant_sharing_is_kept(agent):
    """Groups laid over one slab block for block (other pieces of each block) register, and a request still
    names a block once across them; K/V halves and planes interleaved in a page register."""
    slab = agent.flat[:8 * 96]
    agent.register_group("mla", 4, {"mla": KVLayerSpec(slab, 8, 96, [(0, 64)])})
    agent.register_group("swa", 4, {"swa": KVLayerSpec(slab, 8, 96, [(0, 32)])})
    agent.register_group("idx", 4, {"idx": KVLayerSpec(agent.flat[16:16 + 8 * 96], 8, 96, [(0, 32)])})
    kv = agent.flat[1024:1024 + 2 * 8 * 64].view(2, 8, 4, 16)                 # (2, blocks, ...)
    agent.register_group("full", 4, {"k0": kv})
    pool = agent.flat[4096:4096 + 8 * 4 * 32]                                   # 4 planes of 32 B in 128-B pages
    agent.register_group("planes", 4, {f"p.{i}": KVLayerSpec(pool[32 * i:], 8, 128, [(0, 32)], index=i)
                                       for i in range(4)})
    other = KVAgent("b", platform=agent.platform, device=0, timeout_s=60)
    try:
        buf = agent.platform.alloc(1 << 12, 0)
        flat = agent.platform.as_tensor(buf)
        other.register_group("mla", 4, {"mla": KVLayerSpec(flat[:8 * 96], 8, 96, [(0, 64)])})
        other.register_group("swa", 4, {"swa": KVLayerSpec(flat[:8 * 96], 8, 96, [(0, 32)])})
        peer = other.add_peer(agent.metadata())
        with pytest.raises(BlockIdError, match="more than once"):
            other.prepare(peer, "pull", local_blocks={"mla": [1], "swa": [1]}, remote_blocks={"mla": [0], "swa": [2]})
    finally:
        other.close()
        buf.close()


def test_runs_overlap_matches_brute_force():
    def brute(a0, na, sa, ca, b0, nb, sb, cb, same_block):
        return any(a0 + i * sa < b0 + j * sb + nb and b0 + j * sb < a0 + i * sa + na and not (same_block and i == j)
                   for i in range(ca) for j in range(cb))
    r = random.Random(5)
    for _ in range(5000):
        sa = r.randint(1, 24)
        sb = sa if r.random() < 0.5 else r.randint(1, 24)
        args = (r.randint(0, 80), r.randint(1, sa), sa, r.randint(1, 9), r.randint(0, 80), r.randint(1, sb), sb,
                r.randint(1, 9))
        same = sa == sb and r.random() < 0.5       # across groups: block i meeting block i only is allowed
        assert _runs_overlap(*args, same_block=same) == brute(*args, same), args
