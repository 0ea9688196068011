"""KVAgent's public calls given odd but plausible arguments: block IDs that are ragged sequences, nested tensors
or negated (neg-bit) views, on the host and on the device; a peer looked up by a name that is not a string; a
KVLayerSpec whose pieces are not a sequence; posts on a stream of another device. Each raises its typed error
naming what is wrong, queues nothing, and leaves the agent usable."""
from __future__ import annotations

import warnings

import pytest
import torch

from gpuxfer.errors import BadInput, BadMetadata, BlockIdError, LayoutMismatch, NotRegistered
from gpuxfer.kv.agent import KVAgent
from gpuxfer.kv.layers import KVLayerSpec

from _agent_arena import Arena, connect, same_bytes, vllm_layers


def _pulls(pre, dec, a0, a1):
    """One group of 8 blocks on each side, decode's peer of prefill; (decode's caches, a copy of them, peer)."""
    pre.register_group("full", 4, vllm_layers(a0, 1, 8, 4, seed=1))
    dst = vllm_layers(a1, 1, 8, 4, seed=2)
    dec.register_group("full", 4, dst)
    p, _ = connect(pre, dec)
    return dst, {k: v.clone() for k, v in dst.items()}, p


def _nested(ids: list[int]):
    with warnings.catch_warnings():             # (torch calls nested tensors a prototype)
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.tensor(ids)])


def _negated(ids: list[int]):
    """A tensor whose values are ``-ids`` over memory holding ``ids`` (a neg-bit view)."""
    t = torch.tensor(ids)._neg_view()
    assert t.is_neg() and t.tolist() == [-i for i in ids]
    return t


def _unchanged(dst, before) -> bool:
    return all(same_bytes(dst[k], before[k]) for k in dst)


@pytest.mark.parametrize("where", ["local", "remote"])
def test_host_ids_ragged_nested_or_negated_are_block_id_errors(pair, where):
    """Host block IDs given as a ragged list, a nested tensor, or a negated view (values -1, memory 1): a
    BlockIdError naming the request, not NumPy's ValueError or torch's RuntimeError; the negated view is read
    by its values (out of range), never by its memory (block 1)."""
    pre, dec, a0, a1 = pair
    dst, before, p = _pulls(pre, dec, a0, a1)
    for odd in ([[1], [1, 2]], [1, [2, 3]], _nested([1]), _negated([1])):
        ids = {"local": {"full": odd}, "remote": {"full": [0]}}
        if where == "remote":
            ids = {"local": {"full": [0]}, "remote": {"full": odd}}
        with pytest.raises(BlockIdError, match="request 'odd'"):
            dec.prepare(p, "pull", local_blocks=ids["local"], remote_blocks=ids["remote"], name="odd")
    assert _unchanged(dst, before)
    dec.prepare(p, "pull", local_blocks={"full": [1]}, remote_blocks={"full": [0]}).post().wait(60)
    assert not _unchanged(dst, before)


@pytest.mark.parametrize("where", ["local", "remote"])
def test_device_ids_nested_or_negated_are_refused_and_move_nothing(pair, where):
    """Device block IDs (``device_ids=True``; the host emulation's device is the CPU) given as a nested tensor or
    a negated view: a BlockIdError at prepare. The check reads a tensor's memory, so a negated view of IDs
    ``[1]`` (values ``[-1]``) would move block 1 and report success."""
    pre, dec, a0, a1 = pair
    dst, before, p = _pulls(pre, dec, a0, a1)
    for odd, what in ((_nested([1]), "nested"), (_negated([1]), "negated")):
        ids = ({"full": odd}, {"full": torch.tensor([0])})
        if where == "remote":
            ids = ids[::-1]
        try:
            h = dec.prepare(p, "pull", local_blocks=ids[0], remote_blocks=ids[1], name="odd", device_ids=True).post()
            h.wait(60)
        except BlockIdError as exc:
            assert "request 'odd'" in str(exc) and what in str(exc)
        else:
            raise AssertionError(f"a {what} tensor of device IDs was taken")
        assert _unchanged(dst, before)
    dec.prepare(p, "pull", local_blocks={"full": torch.tensor([1])}, remote_blocks={"full": torch.tensor([0])},
                device_ids=True).post().wait(60)
    assert not _unchanged(dst, before)


def test_peer_names_that_are_not_strings_are_not_registered(pair):
    """``agent.peer(name)`` with a name that is no string (unhashable ones included): NotRegistered, as
    ``remove_peer`` and ``prepare`` raise, not a TypeError."""
    pre, dec, a0, a1 = pair
    _, _, p = _pulls(pre, dec, a0, a1)
    for name in (["prefill"], {"prefill": 1}, None, 1, b"prefill"):
        with pytest.raises(NotRegistered, match="has no peer"):
            dec.peer(name)
        with pytest.raises(NotRegistered):
            dec.prepare(name, "pull", local_blocks={"full": [1]}, remote_blocks={"full": [0]})
    assert dec.peer("prefill") is p


def test_layer_spec_pieces_that_are_no_sequence_are_bad_input(pair):
    """``KVLayerSpec(..., pieces=None)`` (or an int): BadInput naming the layer, not a TypeError; nothing is
    registered, and the right spec then registers."""
    _, dec, _, a1 = pair
    t = a1.tensor((8, 64))
    for pieces in (None, 5, 2.5):
        with pytest.raises(BadInput, match="layer 'a'.*pieces"):
            dec.register_group("g", 4, {"a": KVLayerSpec(t, 8, 64, pieces)})
    assert dec.groups == {}
    dec.register_group("g", 4, {"a": KVLayerSpec(t, 8, 64, [(0, 64)])})
    assert dec.groups == {"g": (4, 8, 1)}


@pytest.mark.parametrize("engine", ["triton", "copy_engine"])
def test_posts_on_a_stream_of_another_device_are_refused(plat, engine):
    """``post`` and ``post_many`` on a stream of another device than the agent's (its slots, graphs and words are
    that device's), or on something that is no open stream: BadInput naming both devices, nothing queued; the
    agent's own and its device's streams still post."""
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("prefill", platform=plat, device=0, engine=engine)
    dec = KVAgent("decode", platform=plat, device=1, engine=engine)
    other, mine = plat.create_stream(0), plat.create_stream(1)
    closed = plat.create_stream(1)
    closed.close()
    try:
        dst, before, p = _pulls(pre, dec, a0, a1)
        xs = [dec.prepare(p, "pull", local_blocks={"full": [i]}, remote_blocks={"full": [0]}) for i in (1, 2)]
        for s in (other, closed, "stream"):
            for post in (lambda: xs[0].post(s), lambda: dec.post_many(xs, s), lambda: dec.post_many(xs[:1], s)):
                with pytest.raises(BadInput, match="not an open stream of the platform on its device 1") as err:
                    post()
                assert s is not other or "device 0" in str(err.value)
        assert plat.synchronize(other, 60) and _unchanged(dst, before)
        assert dec.failed is None
        xs[0].post(mine).wait(60)
        for h in dec.post_many(xs):
            h.wait(60)
        assert not _unchanged(dst, before)
    finally:
        for x in (dec, pre, other, mine, a0, a1):
            x.close()


def test_pack_posts_on_a_stream_of_another_device_are_refused(pack_pair):
    """A pack side posting on another device's stream: BadInput before any signal to the peer, and the agent
    does not fail (a pack post failing part way would fail it)."""
    pre, dec, a0, a1 = pack_pair
    for agent in (pre, dec):
        agent.timeout_s = 2.0           # (a post that went ahead would wait for the peer at most this long)
    src, dst = a0.tensor((8, 4, 16), seed=1), a1.tensor((8, 4, 16), seed=2)
    pre.register_group("g", 4, [src])
    dec.register_group("g", 4, [dst])
    p_of_dec, p_of_pre = connect(pre, dec)
    other = dec.platform.create_stream(0)
    try:
        x = dec.prepare(p_of_dec, "pull", local_blocks={"g": [1]}, remote_blocks={"g": [0]})
        with pytest.raises(BadInput, match="not an open stream of the platform on its device 1"):
            x.post(other)
        assert dec.failed is None and p_of_dec.pack_recv == 0
        xs = pre.prepare(p_of_pre, "push", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
        hd, hs = x.post(), xs.post()
        hs.wait(60)
        hd.wait(60)
        assert same_bytes(dst[1], src[0]) and dec.failed is None and pre.failed is None
    finally:
        other.close()


# ----------------------------------------------------------------------------- layer ranges


def _layers(arena, names: list[str], seed: int) -> dict:
    return {n: arena.tensor((2, 8, 4, 2, 4), torch.bfloat16, seed=seed + i) for i, n in enumerate(names)}


ALL = [f"model.layers.{i}.attn" for i in range(3)]


@pytest.mark.parametrize("engine", ["triton", "copy_engine"])
def test_a_push_over_a_layer_range_writes_every_destination_layer_in_it(plat, engine):
    """A source of layers 0 and 1 pushing to a destination of layers 0, 1 and 2 over the range (0, 3) (or (2, 3)):
    LayoutMismatch naming layer 2, as the pull over that range (and the push over every layer) raises, not a
    success that left the destination's layer 2 unwritten. The range both sides hold, (0, 2), moves."""
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("prefill", platform=plat, device=0, engine=engine)
    dec = KVAgent("decode", platform=plat, device=1, engine=engine)
    try:
        src, dst = _layers(a0, ALL[:2], seed=1), _layers(a1, ALL, seed=5)
        pre.register_group("full", 4, src)
        dec.register_group("full", 4, dst)
        p_of_dec, p_of_pre = connect(pre, dec)
        before = {k: v.clone() for k, v in dst.items()}
        kw = dict(local_blocks={"full": [1]}, remote_blocks={"full": [3]})
        for layers in (None, (0, 3), (2, 3), (1, 3)):
            with pytest.raises(LayoutMismatch, match=r"model\.layers\.2\.attn|layers here"):
                pre.prepare(p_of_pre, "push", layers=layers, **kw)
            with pytest.raises(LayoutMismatch, match=r"model\.layers\.2\.attn|layers here"):
                dec.prepare(p_of_dec, "pull", layers=layers, local_blocks={"full": [3]}, remote_blocks={"full": [1]})
        assert _unchanged(dst, before)
        pre.prepare(p_of_pre, "push", layers=(0, 2), **kw).post().wait(60)
        for name in ALL[:2]:
            assert same_bytes(dst[name][:, 3], src[name][:, 1])
        assert same_bytes(dst[ALL[2]], before[ALL[2]])
    finally:
        for x in (dec, pre, a0, a1):
            x.close()


def test_a_nixl_push_over_a_layer_range_writes_every_destination_layer_in_it(fake_nixl, host):
    """The same over the NIXL route (the fake NIXL copies): a push over a range holding a destination layer the
    source lacks raises LayoutMismatch naming it; the range both hold moves."""
    from gpuxfer.kv import nixl_ffi
    a0, a1 = Arena(host, 0), Arena(host, 1)
    agents = [KVAgent(f"n{r}", platform=host, device=r, timeout_s=5.0, remote="nixl") for r in (0, 1)]
    try:
        src, dst = _layers(a0, ALL[:2], seed=1), _layers(a1, ALL, seed=5)
        agents[0].register_group("full", 4, src)
        agents[1].register_group("full", 4, dst)
        peer = agents[0].add_peer(agents[1].metadata(), route="nixl")
        before = {k: v.clone() for k, v in dst.items()}
        kw = dict(local_blocks={"full": [1]}, remote_blocks={"full": [3]})
        for layers in (None, (0, 3), (2, 3)):
            with pytest.raises(LayoutMismatch, match=r"model\.layers\.2\.attn|layers here"):
                agents[0].prepare(peer, "push", layers=layers, **kw)
        assert _unchanged(dst, before)
        agents[0].prepare(peer, "push", layers=(0, 2), **kw).post().wait(5)
        for name in ALL[:2]:
            assert same_bytes(dst[name][:, 3], src[name][:, 1])
        assert same_bytes(dst[ALL[2]], before[ALL[2]])
    finally:
        for x in (*agents, a0, a1):
            x.close()
        nixl_ffi._KEPT.clear()


# ----------------------------------------------------------------------------- one agent, one peer


def test_an_agent_already_added_under_another_name_is_bad_metadata(pair):
    """Metadata of an agent in another process (its uid) already added as a peer, renamed: BadMetadata naming
    the peer it is, not a second peer whose notification counts and pack parities would run apart from the
    first's over the same words; once the first is removed, the renamed one is added."""
    import json
    from _agent_arena import meta_body, reblob
    pre, dec, a0, a1 = pair
    _pulls(pre, dec, a0, a1)
    dec.remove_peer("prefill")
    body = meta_body(pre.metadata())
    body.update(uid="e" * 32, namespace="another-boot/0:1")      # another process (see test_kv_hostile_peers)
    first = dec.add_peer(reblob(body))
    again = json.loads(json.dumps(body))
    again["agent"] = "prefill-again"
    with pytest.raises(BadMetadata, match="already added as peer 'prefill'"):
        dec.add_peer(reblob(again))
    assert dict(dec.peers) == {"prefill": first}
    dec.remove_peer(first)
    second = dec.add_peer(reblob(again))
    assert dict(dec.peers) == {"prefill-again": second}
    dec.transfer(second, "pull", local_blocks={"full": [2]}, remote_blocks={"full": [3]}).wait(60)


def test_notify_and_stream_waits_on_a_stream_of_another_device_are_refused(pair):
    """``KVPeer.notify`` and ``stream_wait_notification`` on a stream of another device than the agent's (its flag
    link and words are that device's): BadInput, nothing queued -- the next notification still writes 1, and
    no stream is held for close to drain."""
    pre, dec, a0, a1 = pair
    _, _, p = _pulls(pre, dec, a0, a1)
    plat = dec.platform
    other, mine = plat.create_stream(0), plat.create_stream(1)
    try:
        with pytest.raises(BadInput, match="its device 1"):
            p.notify(other, 3)
        with pytest.raises(BadInput, match="its device 1"):
            dec.stream_wait_notification(other, 3, 1)
        assert p.next_notification(3) == 1
        assert p.notify(mine, 3)[0] == 1
        assert pre.wait_notification(3, 1, timeout_s=30) == 1
        dec.stream_wait_notification(mine, 3, 0)
        assert plat.synchronize(mine, 30) and plat.synchronize(other, 30)
    finally:
        other.close()
        mine.close()


# ----------------------------------------------------------------------------- layer ranges and flags


def test_layer_ranges_past_the_model_share_the_route_of_the_model(pair):
    """Ranges wider than the model's layers (``(0, 10**9 + k)``, ``(0, 2**40 + k)``: a caller's or an engine's
    input): one route each range selecting the same layers, not a route with its own device slots per distinct
    range (device memory growing with the count of ranges); they move the bytes of the layers in them, and a
    range past every layer is still BadInput."""
    pre, dec, a0, a1 = pair
    dst, before, p = _pulls(pre, dec, a0, a1)
    kw = dict(local_blocks={"full": [1]}, remote_blocks={"full": [0]})
    dec.prepare(p, "pull", layers=(0, 1), **kw).post().wait(60)
    used = dec.device_bytes()
    for k in range(20):
        for layers in ((0, 10**9 + k), (0, 2**40 + k)):
            dec.prepare(p, "pull", layers=layers, **kw).post().wait(60)
    assert dec.device_bytes() == used
    assert not _unchanged(dst, before)
    with pytest.raises(BadInput, match="selects no layer"):
        dec.prepare(p, "pull", layers=(10**9, 10**9 + 1), **kw)
    assert dec.device_bytes() == used


@pytest.mark.parametrize("odd", ["yes", 1, 0, None, 1.0])
def test_token_major_must_be_a_bool(pair, odd):
    """``register_group(..., token_major=...)``, ``layer_at(..., token_major=...)`` and a KVLayerSpec's
    ``token_major`` given a string, a number or None: BadInput naming token_major, nothing registered."""
    pre, dec, a0, a1 = pair
    layers = vllm_layers(a0, 1, 8, 4, seed=1)
    with pytest.raises(BadInput, match="token_major must be a bool"):
        pre.register_group("full", 4, layers, token_major=odd)
    t = a0.tensor((8, 64), torch.uint8, seed=3)
    with pytest.raises(BadInput, match="token_major must be a bool"):
        pre.layer_at(t.data_ptr(), t.numel(), 64, token_major=odd)
    with pytest.raises(BadInput, match="token_major must be a bool"):
        pre.register_group("spec", 4, {"l.0": KVLayerSpec(t, 8, 64, [(0, 64)], token_major=odd)})
    assert pre.groups == {}
    pre.register_group("full", 4, layers, token_major=False)
    assert pre.groups == {"full": (4, 8, 1)}
