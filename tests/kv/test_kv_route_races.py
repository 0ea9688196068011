"""An agent's route cache raced from several threads: device_bytes against close dropping the cached routes, and
transfers whose routes left the cache (evicted, their peer removed, the agent closed) posted later. Every call ends
in success or a typed gpuxfer error, and a post on an evicted route moves its bytes.

Interleavings are forced with hooks, not sleeps; a hook that a correct lock keeps out waits a bounded time and
goes on."""
from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping

import pytest
import torch

from gpuxfer.errors import BlockIdError
from gpuxfer.kv import routes as kv_routes
from gpuxfer.kv.peers import KVPeer

from _agent_arena import same_bytes
from test_kv_route_cache import _gapped, _routes

#: how long a hook that a correct lock keeps out waits before it goes on (never reached without the lock)
HOOK_S = 3.0
NAME = "model.layers.{}.self_attn"


def _prep(dec, p, d, s, layer):
    return dec.prepare(p, "pull", local_blocks={"full": [d]}, remote_blocks={"full": [s]}, layers=(layer, layer + 1))


def test_device_bytes_while_close_drops_the_cached_routes(pair, monkeypatch):
    """device_bytes reading the dropped routes while close drops the cached ones (close paused between clearing
    its peers and dropping the routes, device_bytes paused part way through its reading): device_bytes returns
    counts (no "dictionary changed size" RuntimeError), and close completes."""
    monkeypatch.setattr(kv_routes, "ROUTES_PER_PEER", 1, raising=False)
    pre, dec, a0, a1 = pair
    dst, src, p = _gapped(pre, dec, a0, a1, range(2))
    held = [_prep(dec, p, 1, 2, 0), _prep(dec, p, 3, 4, 1)]      # the first's route dropped, the second's cached
    assert dec.device_bytes()["held_routes"] == 1
    at_close, entered, closed = threading.Event(), threading.Event(), threading.Event()
    peer_close = KVPeer.close

    def hooked_close(self):
        at_close.set()
        entered.wait(30)            # (set by device_bytes below: bounded either way)
        return peer_close(self)

    monkeypatch.setattr(KVPeer, "close", hooked_close)

    class Paused(weakref.WeakValueDictionary):
        def items(self):
            for kv in super().items():
                entered.set()
                closed.wait(HOOK_S)     # close's drop_all runs here unless a lock keeps it out
                yield kv

    dec._routes.dropped = Paused(dec._routes.dropped)
    out: dict = {}

    def closer():
        try:
            dec.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["close"] = exc
        finally:
            closed.set()

    def reader():
        try:
            at_close.wait(30)
            out["bytes"] = dec.device_bytes()
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["bytes_error"] = exc
        finally:
            entered.set()

    ts = [threading.Thread(target=closer), threading.Thread(target=reader)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts)
    assert "close" not in out and "bytes_error" not in out, out
    assert out["bytes"]["held_routes"] >= 1, out
    assert dec.device_bytes()["routes"] == 0 and dec.device_bytes()["held_routes"] == 2
    del held


@pytest.mark.parametrize("evict", ["lru", "register_group"])
def test_a_batch_over_a_dropped_route_and_its_rebuilt_one_keeps_its_order(pair, monkeypatch, evict):
    """Requests of one peer, direction, groups and layers, some prepared before their route left the cache (the
    least recently used dropped, or every route dropped by register_group) and some after (on the route built
    again): post_many runs two of them writing one destination block in the batch's order, as it does within
    one route -- the later one's bytes land."""
    monkeypatch.setattr(kv_routes, "ROUTES_PER_PEER", 1, raising=False)
    pre, dec, a0, a1 = pair
    dst, src, p = _gapped(pre, dec, a0, a1, range(2))
    a, c = _prep(dec, p, 1, 2, 0), _prep(dec, p, 3, 5, 0)       # the old route
    if evict == "lru":
        _prep(dec, p, 6, 6, 1).post().wait(60)
    else:
        dec.register_group("more", 4, {"model.layers.0.more": a1.tensor((2, 8, 4, 2, 4), torch.bfloat16, seed=3)})
    b = _prep(dec, p, 3, 4, 0)                                    # its key's route built again
    assert b.route is not a.route and id(a.route) not in _routes(dec)
    for h in dec.post_many([a, b, c]):
        h.wait(60)
    name = NAME.format(0)
    assert same_bytes(dst[name][:, 1], src[name][:, 2])
    assert same_bytes(dst[name][:, 3], src[name][:, 5])          # c after b, as in the batch


class _Keys(Mapping):
    """A request mapping whose keys are ``keys`` (which need not hash)."""

    def __init__(self, ids: dict, keys: list):
        self.ids, self.keys_ = ids, keys

    def __getitem__(self, k):
        return self.ids[k]

    def __iter__(self):
        return iter(self.keys_)

    def __len__(self):
        return len(self.keys_)


def test_a_request_mapping_whose_keys_do_not_hash_is_a_block_id_error(pair):
    """local_blocks (or remote_blocks) a mapping whose keys are lists: BlockIdError naming them, not the TypeError
    of the route cache's key."""
    pre, dec, a0, a1 = pair
    dst, src, p = _gapped(pre, dec, a0, a1, range(2))
    bad = _Keys({"full": [1]}, [["full"]])
    for local, remote in ((bad, {"full": [2]}), ({"full": [1]}, bad)):
        with pytest.raises(BlockIdError, match="map group names"):
            dec.prepare(p, "pull", local_blocks=local, remote_blocks=remote, layers=(0, 1))
    _prep(dec, p, 1, 2, 0).post().wait(60)
    assert same_bytes(dst[NAME.format(0)][:, 1], src[NAME.format(0)][:, 2])


def test_two_threads_building_one_route_share_it(pair, monkeypatch):
    """Two threads preparing one key's first request at once (both build its route before either caches it): the
    second caches nothing of its own -- both transfers run on the one cached route (device_bytes counts every
    route something holds) -- and each moves its bytes."""
    pre, dec, a0, a1 = pair
    dst, src, p = _gapped(pre, dec, a0, a1, range(2))
    base = dec.device_bytes()["routes"]
    both = threading.Barrier(2)
    build = kv_routes.RouteCache.build

    def hooked(self, *a, **kw):
        r = build(self, *a, **kw)
        try:
            both.wait(HOOK_S)           # (the other thread builds too; bounded)
        except threading.BrokenBarrierError:
            pass
        return r

    monkeypatch.setattr(kv_routes.RouteCache, "build", hooked)
    out: dict = {}

    def run(k):
        try:
            out[k] = _prep(dec, p, k, 4 + k, 0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[k] = exc

    ts = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts)
    assert all(not isinstance(x, BaseException) for x in out.values()), out
    assert out[0].route is out[1].route, "two routes built for one key, one of them cached"
    assert dec.device_bytes()["routes"] == base + 1 and dec.device_bytes()["held_routes"] == 0
    for h in dec.post_many([out[0], out[1]]):
        h.wait(60)
    for k in range(2):
        assert same_bytes(dst[NAME.format(0)][:, k], src[NAME.format(0)][:, 4 + k])


def test_a_route_built_while_its_peer_was_removed_counts_while_held(pair, monkeypatch):
    """remove_peer while a prepare builds the peer's route (the route not cached): the transfer it prepares still
    holds the route's memory, and device_bytes counts it (held_routes) until the transfer goes; its post raises
    NotRegistered."""
    import gc
    from gpuxfer.errors import NotRegistered
    pre, dec, a0, a1 = pair
    dst, src, p = _gapped(pre, dec, a0, a1, range(2))
    build = kv_routes.RouteCache.build

    def hooked(self, *a, **kw):
        r = build(self, *a, **kw)
        dec.remove_peer(p)
        return r

    monkeypatch.setattr(kv_routes.RouteCache, "build", hooked)
    x = _prep(dec, p, 1, 2, 0)
    monkeypatch.setattr(kv_routes.RouteCache, "build", build)
    got = dec.device_bytes()
    assert got["routes"] == 0 and got["held_routes"] == 1, got
    with pytest.raises(NotRegistered):
        x.post()
    del x
    gc.collect()
    assert dec.device_bytes()["held_routes"] == 0


def test_remove_peer_while_a_prepare_clamps_its_range_keeps_nothing_of_the_peer(pair):
    """remove_peer while a prepare reads the layer indices for its range (the groups' values hooked): the agent's
    route cache keeps nothing of the removed peer (no layer bounds, no route), and the transfer's post raises
    NotRegistered."""
    from gpuxfer.errors import NotRegistered
    pre, dec, a0, a1 = pair
    dst, src, p = _gapped(pre, dec, a0, a1, range(2))
    fired = []

    class Hooked(dict):
        def values(self):
            if not fired:
                fired.append(1)
                dec.remove_peer(p)
            return super().values()

    dec._registry.groups = Hooked(dec._registry.groups)
    dec._routes.bounds.clear()
    x = _prep(dec, p, 1, 2, 0)
    assert fired
    assert p not in dec._routes.bounds and all(k[0] is not p for k in dec._routes.routes)
    with pytest.raises(NotRegistered):
        x.post()
