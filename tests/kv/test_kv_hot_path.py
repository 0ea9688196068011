"""The ``triton`` engine's prepare and post with their helpers written out (a Python call is a post's host time
inside an engine's step): what the written-out parts must still do. A transfer carries every attribute the base
class sets; a device-ID tensor's strides are read in one call where they are (1,) and asked in full otherwise; a
post failing at its event (after its launch) leaves its slot out of the ring; a ``post_many``'s Python calls do
not grow with the number of requests (structural: counted with ``sys.setprofile``, not timed); the posts of a
failed or closed agent still raise having queued nothing."""
from __future__ import annotations

import gc
import sys

import pytest
import torch

from gpuxfer.errors import BlockIdError
from gpuxfer.kv.transfer import KVTransfer

from _agent_arena import same_bytes, triton_pair


@pytest.fixture
def hpair(platform):
    with triton_pair(platform, 48) as (dec, peer, src, dst, _):
        yield dec, peer, src, dst


def _ids(agent, values, device: bool):
    if not device:
        return list(values)
    return torch.tensor(list(values), dtype=torch.int64, device=agent._torch_device())


def _prepare(dec, peer, mine, theirs, device: bool, **kw):
    return dec.prepare(peer, "pull", local_blocks={"full": _ids(dec, mine, device)},
                       remote_blocks={"full": _ids(dec, theirs, device)}, device_ids=device, **kw)


@pytest.mark.parametrize("device", [False, True])
def test_a_triton_transfer_has_every_attribute_of_the_base(hpair, device):
    """The triton engine's transfers set the base class's attributes themselves (no call to its ``__init__``):
    each of them, with the values the base would give."""
    dec, peer, _, _ = hpair
    x = _prepare(dec, peer, [1, 2], [3, 4], device, name="attrs", )
    base = KVTransfer.__new__(KVTransfer)
    KVTransfer.__init__(base, x.poster, x.peer, x.route, x.op, x.name, x.n_seg, x._host_req, x.notify_slot,
                        x.descriptors, x.nbytes)
    for k, v in vars(base).items():
        assert k in vars(x) and getattr(x, k) is v, k
    assert x.agent is dec and x.name == "attrs" and x.op == "pull" and x._host_req is x._pooled[0]
    base.poster = None          # (its __del__ must not give the transfer's pooled array back)


def test_device_id_strides_read_in_one_call_where_they_are_unit(hpair):
    """A one-element view whose stride is not 1 is a contiguous 1-D tensor (taken, its bytes moved); a 0-d
    tensor, a 2-D one and a strided view are refused at prepare, as before."""
    dec, peer, src, dst = hpair
    dev = dec._torch_device()
    wide_mine = torch.tensor([7, 0, 0, 0, 0], dtype=torch.int64, device=dev)[::5]        # shape (1,), stride (5,)
    wide_theirs = torch.tensor([0, 0, 9, 0, 0, 0], dtype=torch.int64, device=dev)[2::5]
    assert wide_mine.stride() == (5,) and wide_mine.is_contiguous()
    dec.prepare(peer, "pull", local_blocks={"full": wide_mine}, remote_blocks={"full": wide_theirs},
                device_ids=True).post().wait(60)
    for k in src:
        assert same_bytes(dst[k][:, 7], src[k][:, 9])
    for bad in (torch.tensor(3, device=dev), torch.tensor([[1, 2]], device=dev),
                torch.tensor([1, 2, 3, 4], device=dev)[::2]):
        other = torch.zeros(bad.numel() if bad.dim() else 1, dtype=torch.int64, device=dev)
        with pytest.raises(BlockIdError, match="int32 or int64"):
            dec.prepare(peer, "pull", local_blocks={"full": bad}, remote_blocks={"full": other}, device_ids=True)


@pytest.mark.parametrize("device", [False, True])
def test_a_post_failing_at_its_event_retires_its_slot(hpair, monkeypatch, device):
    """A post whose event fails to record (its upload and launch queued) leaves its slot out of the route's ring
    and keeps nothing of it among the posted transfers; the next post makes a slot and moves its bytes."""
    dec, peer, src, dst = hpair
    _prepare(dec, peer, [0], [0], device).post().wait(60)          # the route's slot
    route = next(iter(dec._routes.routes.values()))
    (before,) = route.slots
    plat = dec.platform
    record = plat.record_event

    def refused(stream, event=None):
        raise RuntimeError("record refused")
    monkeypatch.setattr(plat, "record_event", refused)
    x = _prepare(dec, peer, [1], [3], device, name="refused")
    kept = len(dec._poster.inflight)
    with pytest.raises(RuntimeError, match="record refused"):
        x.post()
    assert all(s is not before for s in route.slots)
    assert len(dec._poster.inflight) == kept
    monkeypatch.setattr(plat, "record_event", record)
    _prepare(dec, peer, [2], [4], device).post().wait(60)
    assert len(route.slots) == 1 and route.slots[0] is not before
    for k in src:
        assert same_bytes(dst[k][:, 2], src[k][:, 4])


def _calls(fn) -> tuple[int, object]:
    """The Python calls (``call`` events, this thread) and C calls from Python (``c_call``) of ``fn()``."""
    n = [0, 0]

    def count(frame, event, arg):
        if event == "call":
            n[0] += 1
        elif event == "c_call":
            n[1] += 1
    gc.disable()
    try:
        sys.setprofile(count)
        try:
            out = fn()
        finally:
            sys.setprofile(None)
    finally:
        gc.enable()
    return n, out


@pytest.mark.parametrize("device", [False, True])
def test_post_many_calls_do_not_grow_with_its_requests(hpair, device):
    """One route's requests posted together: as many Python and C calls (from Python) for 16 requests as for 8 --
    nothing per request runs a call of its own -- and every byte lands."""
    dec, peer, src, dst = hpair
    counts = {}
    for rnd in range(3):
        for n in (8, 16):
            xs = [_prepare(dec, peer, [i], [47 - i - rnd], device, name=f"r{n}.{i}") for i in range(n)]
            dec._poster.reap_locked()
            (calls, hs) = _calls(lambda: dec.post_many(xs))
            for h in hs:
                h.wait(60)
            dec._poster.reap_locked()
            counts.setdefault(n, []).append(calls)
            del xs, hs
        for k in src:
            for i in range(16):
                assert same_bytes(dst[k][:, i], src[k][:, 47 - i - rnd])
    # (the first rounds make the slot and the pooled arrays of each size)
    assert counts[8][-1] == counts[16][-1], counts


@pytest.mark.parametrize("device", [False, True])
def test_posts_of_a_failed_or_closed_agent_raise_having_queued_nothing(hpair, device):
    """A post on the agent's own stream (``stream=None``: the stream is read before the checks, under the post
    lock) of a failed agent raises its error, of a closed one BadInput -- alone, one through post_many, several
    merged --, every handle None."""
    from gpuxfer.errors import BadInput, TransferTimeout
    dec, peer, _, _ = hpair
    xs = [_prepare(dec, peer, [i], [i + 1], device, name=f"x{i}") for i in range(3)]
    err = TransferTimeout(rank=0, step=0, flag="probe", expected=1, seen=0, timeout_s=1.0, what="a probe")
    dec.failed = err
    with pytest.raises(TransferTimeout) as info:
        xs[0].post()
    assert info.value is err
    for batch in (xs[:1], xs):
        with pytest.raises(TransferTimeout) as info:
            dec.post_many(batch)
        assert info.value is err and info.value.handles == [None] * len(batch)
    dec.failed = None
    dec.close()
    with pytest.raises(BadInput, match="closed"):
        xs[0].post()
    for batch in (xs[:1], xs):
        with pytest.raises(BadInput, match="closed") as info:
            dec.post_many(batch)
        assert info.value.handles == [None] * len(batch)
