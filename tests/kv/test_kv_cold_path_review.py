"""The KV post path's cold corners: a request's IDs checked and ordered alike by the marks (dense) and the sort
(sparse) paths of :class:`~gpuxfer.kv.ids._RouteIds`, whatever integer type and layout they come in; uploads that
read the posted request's own pooled array; ``post_many`` of one item refusing what a batch refuses; posts kept
until their events completed however far the reaps are spaced."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from gpuxfer.errors import BadInput, BlockIdError, GpuxferError
from gpuxfer.kv import ids as kids
from gpuxfer.kv.agent import KVAgent
from gpuxfer.kv.ids import _RouteIds

from _agent_arena import connect, held_pull, same_bytes, vllm_layers


def _run(args, push, local, remote):
    """``check`` then ``write`` of a fresh ``_RouteIds(*args)``: the ordered IDs, or the error's type."""
    r = _RouteIds(*args)
    try:
        _, ls, ld, ordered = r.check("r", push, local, remote)
    except BlockIdError:
        return "refused"
    out_s, out_d = np.empty(sum(ls), np.int64), np.empty(sum(ld), np.int64)
    r.write(ordered, out_s, out_d)
    return out_s.tolist(), out_d.tolist()


def _random_route(rng):
    G = int(rng.integers(1, 4))
    groups = tuple(f"g{i}" for i in range(G))
    big = rng.random() < 0.3
    limits = [(int(rng.integers(1, 300 if big else 12)), int(rng.integers(1, 300 if big else 12))) for _ in range(G)]
    classes = [[i] for i in range(G)]
    if G > 1 and rng.random() < 0.5:
        order = [int(i) for i in rng.permutation(G)]
        cut = int(rng.integers(1, G))
        classes = [sorted(order[:cut]), sorted(order[cut:])] if rng.random() < 0.7 else [list(range(G))]
    return groups, limits, [(1, 1)] * G, classes, bool(rng.random() < 0.5)


def _random_ids(rng, groups, limits, push):
    local, remote = {}, {}
    for g, (ls, ld) in zip(groups, limits):
        n = int(rng.integers(0, 9))
        s = rng.integers(-1 if rng.random() < 0.05 else 0, ls + (rng.random() < 0.05), n)
        d = rng.permutation(ld)[:n] if n <= ld and rng.random() < 0.6 else \
            rng.integers(-1 if rng.random() < 0.05 else 0, ld + (rng.random() < 0.05), n + (rng.random() < 0.05))
        if rng.random() < 0.3:
            s, d = np.sort(s), np.sort(d)
        s, d = np.asarray(s, np.int64), np.asarray(d, np.int64)
        local[g], remote[g] = (s, d) if push else (d, s)
    return local, remote


def test_guard_marks_and_sort_paths_order_and_refuse_alike(monkeypatch):
    """Guard: random paired routes (one to three groups, groups sharing destination memory or not, either key
    side) and requests (duplicates, out-of-range IDs, uneven counts): the marks path -- each group's keys marked
    through views of the marks -- gives the sort path's order and refuses what it refuses."""
    rng = np.random.default_rng(35)
    for _ in range(1500):
        args = _random_route(rng)
        push = bool(rng.random() < 0.5)
        local, remote = _random_ids(rng, args[0], args[1], push)
        monkeypatch.setattr(kids, "_DENSE", 1 << 30)        # every request by the marks
        dense = _run(args, push, local, remote)
        monkeypatch.setattr(kids, "_DENSE", 0)              # every request by the sort, per-class duplicate check
        sparse = _run(args, push, local, remote)
        assert dense == sparse, (args, push, local, remote)


_KINDS = {
    "int32": lambda a: a.astype(np.int32),
    "uint64": lambda a: a.astype(np.uint64) if (a >= 0).all() else a,
    "big-endian": lambda a: a.astype(np.dtype(">i8")),
    "strided": lambda a: np.repeat(a, 2)[::2],
    "pickled": lambda a: pickle.loads(pickle.dumps(a)),
    "longlong": lambda a: a.astype(np.longlong),
    "metadata": lambda a: a.astype(np.dtype(np.int64, metadata={"m": 1})),
    "list": lambda a: a.tolist(),
    "torch": lambda a: torch.from_numpy(a.copy()),
    "torch int16": lambda a: torch.from_numpy(a.astype(np.int16)),
    "torch strided": lambda a: torch.from_numpy(np.repeat(a, 2))[::2],
}


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_guard_ids_of_any_integer_type_or_layout_are_taken_as_int64(kind):
    """Guard: IDs as int32, uint64, big-endian int64, a strided view, an unpickled int64 array (its dtype is not
    numpy's int64 object), long long, int64 with metadata, a list or a CPU tensor are checked and ordered as the
    same native int64 array is -- accepted or refused alike."""
    rng = np.random.default_rng(hash(kind) & 0xFFFF)
    conv = _KINDS[kind]
    for _ in range(300):
        args = _random_route(rng)
        push = bool(rng.random() < 0.5)
        local, remote = _random_ids(rng, args[0], args[1], push)
        want = _run(args, push, local, remote)
        got = _run(args, push, {g: conv(v) for g, v in local.items()}, {g: conv(v) for g, v in remote.items()})
        assert got == want, (kind, args, push, local, remote)


@pytest.mark.parametrize("bad", [np.int64(3), np.zeros((1, 2), np.int64), np.array([1.0, 2.0]),
                                 np.array([True]), torch.tensor(2), "12"])
def test_guard_ids_not_a_1d_integer_sequence_are_refused(bad):
    """Guard: a 0-d array or tensor, a 2-D array, floats, bools, a string: BlockIdError, in either path."""
    for args in ((("a",), [(8, 8)], [(1, 1)], [[0]], False), (("a", "b"), [(8, 8), (8, 8)], [(1, 1)] * 2,
                                                               [[0, 1]], True)):
        local = {g: bad for g in args[0]}
        remote = {g: np.array([1, 2], np.int64) for g in args[0]}
        assert _run(args, True, local, remote) == "refused"


def _full(pre, dec, a0, a1):
    src, dst = vllm_layers(a0, 1, 16, 2, seed=3), vllm_layers(a1, 1, 16, 2, seed=4)
    pre.register_group("full", 2, src)
    dec.register_group("full", 2, dst)
    return src, dst


def test_guard_post_many_of_one_refuses_what_a_batch_refuses(pair, plat):
    """Guard: ``post_many`` of one item that is a string, a non-transfer, another agent's transfer or a closed
    agent's: the typed error a batch with that item gives, and nothing moves."""
    pre, dec, a0, a1 = pair
    src, dst = _full(pre, dec, a0, a1)
    peer, _ = connect(pre, dec)
    before = {k: v.clone() for k, v in dst.items()}
    with pytest.raises(BadInput, match="sequence"):
        dec.post_many("x")
    for item in ("x", 3, None, [1], object()):
        with pytest.raises(BadInput, match="item 0"):
            dec.post_many([item])
    other = KVAgent("other", platform=plat, device=1, engine="triton", timeout_s=30)
    try:
        other.register_group("full", 2, vllm_layers(a1, 1, 16, 2, seed=5))
        z = other.prepare(other.add_peer(pre.metadata()), "pull", local_blocks={"full": [0]},
                          remote_blocks={"full": [1]})
        with pytest.raises(BadInput, match="item 0 .* not a transfer prepared by agent 'decode'"):
            dec.post_many([z])
        other.close()
        with pytest.raises(BadInput, match="item 0"):
            dec.post_many([z])
        with pytest.raises(GpuxferError) as info:
            other.post_many([z])
        assert info.value.handles == [None]
    finally:
        other.close()
    x = dec.prepare(peer, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [1]})
    with pytest.raises(BadInput, match="cannot post on"):
        dec.post_many([x], stream="s")
    for k in dst:
        assert same_bytes(dst[k], before[k])
    dec.close()
    with pytest.raises(BadInput, match="closed") as info:
        dec.post_many([x])
    assert info.value.handles == [None]
    for k in dst:
        assert same_bytes(dst[k], before[k])


def test_guard_uploads_read_each_request_s_pooled_array_as_the_pool_turns(pair, monkeypatch):
    """Guard: requests of many sizes prepared, posted alone and merged, dropped (their arrays back to the pool) and
    others prepared into the same arrays: every upload's address is its array's own, and every byte lands."""
    from gpuxfer.kv import triton_transfer as kt
    pre, dec, a0, a1 = pair
    src, dst = _full(pre, dec, a0, a1)
    peer, _ = connect(pre, dec)
    real = kt._enqueue
    seen = []

    def checking(poster, slot, s, array, ptr, rows, expand_only):
        seen.append(ptr)
        assert ptr == array.ctypes.data and array.base is not None
        return real(poster, slot, s, array, ptr, rows, expand_only)

    monkeypatch.setattr(kt, "_enqueue", checking)
    rng = np.random.default_rng(7)
    for rnd in range(6):
        dec._poster.reap_locked()
        n = int(rng.integers(1, 5))
        pairs = []
        for _ in range(n):
            k = int(rng.integers(1, 6))
            pairs.append(([int(v) for v in rng.permutation(16)[:k]], [int(v) for v in rng.permutation(16)[:k]]))
        # distinct destinations across the batch: no request overwrites another's
        taken, batch = set(), []
        for s_ids, d_ids in pairs:
            if taken.isdisjoint(d_ids):
                taken.update(d_ids)
                batch.append((s_ids, d_ids))
        xs = [dec.prepare(peer, "pull", local_blocks={"full": d}, remote_blocks={"full": s}) for s, d in batch]
        hs = dec.post_many(xs) if rnd % 2 else [x.post() for x in xs]
        for h in hs:
            h.wait(60)
        for s_ids, d_ids in batch:
            for k in src:
                for s, d in zip(s_ids, d_ids):
                    assert same_bytes(dst[k][:, d], src[k][:, s])
        del xs, hs
    assert seen


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_copied_transfer_never_gives_its_pooled_array_back_twice(pair, how):
    """A prepared transfer copied (``copy.copy``, ``copy.deepcopy``) or pickled: refused with BadInput. Else the
    copy and the original each give the one pooled request array back when collected, the pool holds it twice,
    two later requests are staged into the same array, and the first one's post uploads the second's IDs: other
    bytes moved than asked, and the handle reports success."""
    import copy
    import gc
    pre, dec, a0, a1 = pair
    src, dst = _full(pre, dec, a0, a1)
    peer, _ = connect(pre, dec)
    x = dec.prepare(peer, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [1]})
    y = None
    try:
        y = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda v: pickle.loads(pickle.dumps(v))}[how](x)
    except BadInput as exc:
        assert "cannot be copied" in str(exc)
    del x, y
    gc.collect()
    a = dec.prepare(peer, "pull", local_blocks={"full": [2]}, remote_blocks={"full": [3]})
    b = dec.prepare(peer, "pull", local_blocks={"full": [4]}, remote_blocks={"full": [5]})
    h = a.post()
    h.wait(60)
    b.post().wait(60)
    for k in src:
        assert same_bytes(dst[k][:, 2], src[k][:, 3]) and same_bytes(dst[k][:, 4], src[k][:, 5])
    with pytest.raises(BadInput, match="cannot be copied"):        # (a handle's deep copy copies its transfer)
        copy.deepcopy(h)


def test_guard_requests_dropped_behind_a_held_stream_keep_their_arrays_until_they_ran(pair):
    """Guard: requests posted on a stream held by a gate and dropped at once, more than the posts kept between
    reaps; meanwhile other requests are prepared (taking pooled arrays, reaping) and posted on the agent's stream.
    No held request's array is handed to another before its upload ran: once the gate opens, every held request
    moved its own blocks (the stream reads the arrays only then), and a reap then drops every kept post."""
    from gpuxfer.kv.posting import INFLIGHT_KEEP
    pre, dec, a0, a1 = pair
    src, dst = vllm_layers(a0, 1, 64, 2, seed=8), vllm_layers(a1, 1, 64, 2, seed=9)
    pre.register_group("full", 2, src)
    dec.register_group("full", 2, dst)
    peer, _ = connect(pre, dec)
    plat = dec.platform
    gate = plat.alloc(64, 1)
    s = plat.create_stream(1)
    try:
        plat.memset_async(s, gate.ptr, 0, 64)
        plat.wait_flag(s, gate.ptr, 1)
        n = 3 * INFLIGHT_KEEP
        held = []
        for i in range(n):
            x = dec.prepare(peer, "pull", local_blocks={"full": [i]}, remote_blocks={"full": [63 - i]})
            held.append(x.post(s))
            del x
            y = dec.prepare(peer, "pull", local_blocks={"full": [48 + i % 8]}, remote_blocks={"full": [i % 8]})
            y.post().wait(60)
            del y
        assert not any(h.done() for h in held)
    finally:
        plat.host_write_flag(gate.ptr, 1, 1)
        assert plat.synchronize(s, 60)
    for h in held:
        h.wait(60)
    for i in range(n):
        for k in src:
            assert same_bytes(dst[k][:, i], src[k][:, 63 - i])
    dec._poster.reap_locked()
    assert not dec._poster.inflight
    s.close()
    gate.close()


def test_posts_completed_behind_one_held_on_another_stream_are_reaped(pair):
    """A post held on one stream (a gate) while many others are posted and complete on the agent's stream: the
    completed ones behind the held one are dropped as posts go on (their host arrays back to the pool), so what
    is kept stays bounded while the held post still runs; once the gate opens it moves its own blocks."""
    from gpuxfer.kv.posting import INFLIGHT_KEEP
    pre, dec, a0, a1 = pair
    src, dst, peer, gate, s, held = held_pull(pre, dec, a0, a1)
    try:
        kept = []
        for i in range(8 * INFLIGHT_KEEP):
            dec.prepare(peer, "pull", local_blocks={"full": [1 + i % 3]}, remote_blocks={"full": [i % 3]}
                        ).post().wait(60)
            kept.append(len(dec._poster.inflight))
        assert not held.done()
        assert max(kept[2 * INFLIGHT_KEEP:]) <= 2 * INFLIGHT_KEEP + 1, kept
    finally:
        dec.platform.host_write_flag(gate.ptr, 1, 1)
        assert dec.platform.synchronize(s, 60)
    held.wait(60)
    for k in src:
        assert same_bytes(dst[k][:, 0], src[k][:, 3])
    s.close()
    gate.close()
