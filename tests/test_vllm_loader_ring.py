"""The loader process's shared-memory ring (gpuxfer.integrations.vllm.ring) and its load records
(gpuxfer.integrations.vllm.wire): no vLLM needed."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest

from gpuxfer.integrations.vllm.loads import Load
from gpuxfer.integrations.vllm.params import RemotePrefill, for_workers
from gpuxfer.integrations.vllm.ring import HEADER, ShmRing, ring_fd
from gpuxfer.integrations.vllm.wire import decode_load, encode_load, encode_loads


def _pair(size: int) -> tuple[ShmRing, ShmRing]:
    fd = ring_fd(size)
    try:
        return ShmRing(fd), ShmRing(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("ordered", [True, False])
def test_records_come_out_whole_and_in_order_across_the_wrap(ordered):
    w, r = _pair(1000)
    w.ordered = r.ordered = ordered
    rng = random.Random(7)
    sent, got = [], []
    for _ in range(2000):
        if rng.random() < 0.6:
            rec = rng.randbytes(rng.randrange(0, 300))
            if w.put(rec):
                sent.append(rec)
        else:
            while (x := r.get()) is not None:
                got.append(x)
    while (x := r.get()) is not None:
        got.append(x)
    assert got == sent and len(sent) > 500


def test_a_full_ring_refuses_without_writing():
    w, r = _pair(100)
    assert w.put(b"a" * 60)
    assert not w.put(b"b" * 40)          # 8 + 40 > 100 - 68
    assert r.get() == b"a" * 60 and r.get() is None
    assert w.put(b"b" * 40) and r.get() == b"b" * 40
    assert not w.put(b"c" * 93)          # larger than the ring
    assert not r.pending()


def test_a_record_whose_payload_is_not_whole_is_not_taken():
    """Weakly ordered memory (the CRC): a payload whose bytes are not the ones its header's CRC covers -- read
    before they became visible -- is not taken, and is taken once they are."""
    w, r = _pair(256)
    w.ordered = r.ordered = False
    assert w.put(b"0123456789")
    data = r._data
    data[8:10] = b"XX"                    # (the payload as a reader could see it early)
    assert r.get() is None and r.pending()
    data[8:10] = b"01"
    assert r.get() == b"0123456789" and not r.pending()


def test_the_record_a_previous_lap_left_is_not_taken_again():
    """Weakly ordered memory: the writer's position seen moved before its record's bytes are. What lies there is
    the whole record of a lap before (its header and payload checked out then): it is not taken again."""
    w, r = _pair(256)
    w.ordered = r.ordered = False
    for i in range(8):                   # one lap of 32-byte records: the next one goes where the first went
        assert w.put(bytes([i]) * 24) and r.get() == bytes([i]) * 24
    w._pos[0] = 256 + 32                  # (the position, visible before the record's bytes)
    assert r.get() is None
    assert r.pending()
    w._pos[0] = 256
    assert w.put(b"new" * 8) and r.get() == b"new" * 8


def test_a_record_filling_the_ring_exactly_goes_through_at_any_offset():
    w, r = _pair(100)
    for shift in range(0, 100, 7):
        w._pos[0] = w._pos[8] = 1000 + shift
        assert not w.put(b"x" * (w.room() + 1))
        assert w.put(bytes(range(w.room()))) and not w.put(b"")
        assert r.get() == bytes(range(w.room())) and r.get() is None and not r.pending()


def test_a_header_past_what_was_written_is_not_taken():
    w, r = _pair(256)
    assert w.put(b"x" * 16)
    r._data[0:4] = (1000).to_bytes(4, "little")     # a length past the written bytes
    assert r.get() is None


def test_ring_memory_needs_room_for_a_header():
    fd = os.memfd_create("t")
    try:
        os.ftruncate(fd, HEADER + 4)
        with pytest.raises(ValueError):
            ShmRing(fd)
    finally:
        os.close(fd)


def _load(rng: random.Random, groups: int) -> Load:
    ids = tuple(np.array([rng.randrange(1, 1 << 40) for _ in range(rng.randrange(1, 40))], dtype=np.int64)
                for _ in range(groups))
    rp = RemotePrefill(engine_id=f"e{rng.random()}", host="10.0.0.1", port=rng.randrange(1, 65535),
                       request_id=f"r{rng.random()}", block_ids=ids, block_sizes=(16,) * groups,
                       lease_deadline=rng.random() * 1e6, endpoints=(("h", 1), ("g", 2)) if groups > 1 else (),
                       key=None if rng.random() < 0.5 else "k" * 32, seal=rng.randbytes(32), token="t" * 16,
                       prompt=rng.randbytes(16))
    local = tuple(np.array([rng.randrange(0, 1 << 20) for _ in range(len(a) + 1)],
                           dtype=np.int64 if rng.random() < 0.5 else np.int32) for a in ids)
    return Load(f"d-{rng.random()}", for_workers(rp), local, rng.randrange(0, 99), rng.randrange(100, 999))


def test_a_load_comes_out_as_it_went_in():
    rng = random.Random(3)
    for groups in (1, 2, 4):
        for _ in range(20):
            ld = _load(rng, groups)
            back = decode_load(encode_load(ld))
            assert (back.req_id, back.start, back.end) == (ld.req_id, ld.start, ld.end)
            assert [a.tolist() for a in back.local_ids] == [a.tolist() for a in ld.local_ids]
            assert all(a.dtype == np.int64 for a in back.local_ids + back.remote.block_ids)
            for f in ("engine_id", "host", "port", "request_id", "block_sizes", "lease_deadline", "endpoints",
                      "key", "seal", "ids_digest", "token", "prompt"):
                assert getattr(back.remote, f) == getattr(ld.remote, f), f
            assert [a.tolist() for a in back.remote.block_ids] == [a.tolist() for a in ld.remote.block_ids]
            assert back.remote.signed == ld.remote.signed


def test_a_step_uses_the_records_the_scheduler_made():
    import pickle
    rng = random.Random(5)
    a, b = _load(rng, 1), _load(rng, 1)
    a.wire = b"made-by-the-scheduler"
    kind, recs = pickle.loads(encode_loads([a, b]))
    assert kind == "start" and recs[0] == b"made-by-the-scheduler" and decode_load(recs[1]).req_id == b.req_id
