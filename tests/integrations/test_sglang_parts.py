"""The SGLang backend's parts that need no SGLang (in the default suite): importing them imports no SGLang,
the entry point SGLang finds it by, ``KVArgs`` registration (raw pointers) and the geometry check, the
registration payload's bounds, and the metadata rows' copy. The backend inside SGLang:
tests/integrations/test_sglang_backend.py."""
from __future__ import annotations

import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from gpuxfer.errors import BadInput, BadMetadata, GpuxferError
from gpuxfer.integrations.sglang.landing import Landings, landing_frame, parse_landing, parse_slot, slot_frame
from gpuxfer.platforms.base import RELEASE_VALUE
from gpuxfer.integrations.sglang.layout import (GROUP, decode_registration, encode_registration, geometry,
                                                geometry_differences, head_share, read_aux_rows, register_kv_args,
                                                total_kv_heads, write_aux_rows)
from gpuxfer.kv import KVAgent

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _kv_args(page_size=4, pages=8, entries=4, rows=5, **extra):
    """A KVArgs as SGLang's MHA pool hands it over: one buffer per entry (K layers then V layers)."""
    item = page_size * 2 * 8 * 2
    kv = [torch.full((pages * item,), e, dtype=torch.uint8) for e in range(entries)]
    aux = [torch.arange(rows * n, dtype=torch.int64).to(torch.uint8) for n in (64, 128)]
    args = SimpleNamespace(kv_data_ptrs=[t.data_ptr() for t in kv], kv_data_lens=[t.numel() for t in kv],
                           kv_item_lens=[item] * entries, page_size=page_size,
                           aux_data_ptrs=[t.data_ptr() for t in aux], aux_data_lens=[t.numel() for t in aux],
                           aux_item_lens=[64, 128], kv_cache_dtype_str="bfloat16", kv_layout=None,
                           num_draft_entries=0, state_types=[], host_kv_data_ptrs=None)
    for k, v in extra.items():
        setattr(args, k, v)
    return args, kv, aux


def test_importing_the_backend_imports_no_sglang():
    """Every module of the backend but ``conn`` (the one that imports SGLang) imports none."""
    code = ("import importlib, pkgutil, sys, gpuxfer, gpuxfer.integrations, gpuxfer.integrations.sglang as pkg\n"
            "names = [m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name != 'conn']\n"
            "assert {'plugin', 'layout', 'pushes'} <= set(names), names\n"
            "for name in names:\n"
            "    importlib.import_module(f'{pkg.__name__}.{name}')\n"
            "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_entry_point_names_the_plugin():
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points."sglang.srt.plugins"]\ngpuxfer = "gpuxfer.integrations.sglang.plugin:register"' in text
    from gpuxfer.integrations.sglang import plugin
    assert callable(plugin.register) and plugin.BACKEND == "gpuxfer"


def test_kv_args_register_page_for_page():
    from gpuxfer.platforms import get_platform
    args, kv, _ = _kv_args()
    with KVAgent("sglang-parts", platform=get_platform("host"), engine="copy_engine") as agent:
        register_kv_args(agent, args)
        assert agent.groups == {"kv": (4, 8, 4)}


@pytest.mark.parametrize("change,says", [
    (dict(state_types=["mamba"]), "state buffers"),
    (dict(host_kv_data_ptrs=[1]), "host"),
    (dict(kv_data_ptrs=[]), "empty"),
    (dict(kv_item_lens=[128]), "as many"),
])
def test_unsupported_kv_args_are_refused(change, says):
    from gpuxfer.platforms import get_platform
    args, kv, _ = _kv_args(**change)
    with KVAgent("sglang-parts", platform=get_platform("host"), engine="copy_engine") as agent:
        with pytest.raises(BadInput, match=says):
            register_kv_args(agent, args)


def test_geometry_differences_name_each_field():
    ours = geometry(_kv_args()[0])
    assert geometry_differences(ours, dict(ours)) == []
    theirs = geometry(_kv_args(page_size=8)[0])
    diffs = geometry_differences(ours, theirs)
    assert any(d.startswith("page_size: prefill 4, decode 8") for d in diffs)
    assert any(d.startswith("kv_item_lens") for d in diffs)
    # an MHA pool's pages hold a TP slice of the heads: at different attention TP sizes their sizes differ and
    # head_share pairs them; an MHA pool and an MLA pool (None: every rank holds all of it) never pair
    tp2, tp1 = geometry(_kv_args()[0], 2), geometry(_kv_args(page_size=4)[0], 1)
    assert geometry_differences(tp2, dict(tp1, kv_item_lens=[1] * 4)) == []
    assert geometry_differences(tp2, dict(tp2, kv_item_lens=[1] * 4))[0].startswith("kv_item_lens")
    assert [d for d in geometry_differences(tp2, geometry(_kv_args()[0])) if d.startswith("attention TP size")]
    assert geometry_differences(tp2, dict(tp2)) == [] and geometry_differences(ours, geometry(_kv_args()[0])) == []
    older = {k: v for k, v in tp1.items() if k != "attn_tp_size"}       # a decode of a version without the key
    assert geometry_differences(tp1, older) == []
    assert geometry(_kv_args(engine_rank=5)[0], 2)["attn_tp_rank"] == 1 and ours["attn_tp_rank"] is None
    for tp in (0, -2, 1.5):         # (a rank modulo a TP size of 0 would divide by zero)
        with pytest.raises(BadInput, match="attention TP size"):
            geometry(_kv_args()[0], tp)


def _geom(tp, rank, heads, page=4, hb=16, entries=4):
    """An MHA rank's geometry: ``heads`` heads of ``hb`` bytes per token in each of ``entries`` entries."""
    return {"page_size": page, "kv_item_lens": [page * heads * hb] * entries, "attn_tp_size": tp, "attn_tp_rank": rank}


@pytest.mark.parametrize("total, ptp, prank, dtp, drank, mine, theirs", [
    (4, 2, 1, 1, 0, (0, 32), (32, 64)),         # prefill rank 1's heads 2-3: the decode's second half
    (4, 1, 0, 2, 1, (32, 64), (0, 32)),         # decode rank 1's heads 2-3: the prefill's second half
    (8, 4, 1, 2, 0, (0, 32), (32, 64)),
    (2, 1, 0, 4, 2, (16, 32), (0, 16)),         # decode ranks 2 and 3 replicate head 1
    (2, 1, 0, 4, 1, (0, 16), (0, 16)),          # decode ranks 0 and 1 replicate head 0
    (2, 4, 3, 1, 0, (0, 16), (16, 32)),         # prefill ranks 2 and 3 replicate head 1: each sends it
    (2, 4, 0, 1, 0, (0, 16), (0, 16)),
    (1, 2, 1, 1, 0, None, None),                # one head everywhere: whole pages
    (2, 4, 2, 2, 1, None, None),                # both hold head 1 alone
    (4, 2, 0, 2, 0, None, None),                # equal TP sizes
])
def test_head_share_slices_the_heads_two_ranks_share(total, ptp, prank, dtp, drank, mine, theirs):
    hp, hd = max(1, total // ptp), max(1, total // dtp)
    views = head_share(_geom(ptp, prank, hp), _geom(dtp, drank, hd), total, hp)
    assert views == ({} if mine is None else {"local_token_slice": {GROUP: mine}, "token_slice": {GROUP: theirs}})


@pytest.mark.parametrize("ours, theirs, total, says", [
    (_geom(1, 0, 3), _geom(2, 0, 1), 3, "3 KV heads do not split evenly over the decode's attention TP size 2"),
    (_geom(2, 0, 2), _geom(1, None, 4), 4, "decode's attention TP rank None"),     # a decode naming no rank
    (_geom(2, 0, 2), _geom(1, 1, 4), 4, "decode's attention TP rank 1"),
    (_geom(2, 0, 2), _geom(1, 0, 4), 0, "no KV head count"),
    (_geom(2, 0, 2), _geom(1, 0, 4, entries=2), 4, "4 KV entries, the decode 2"),
    (_geom(2, 0, 2), _geom(1, 0, 4, hb=8), 4, "a head's bytes per token differ: prefill 16"),
    (_geom(2, 0, 2), dict(_geom(1, 0, 4), kv_item_lens=[250] * 4), 4, "250-byte pages are not 4 tokens of 4"),
    (dict(_geom(2, 0, 2), kv_item_lens=[128, 128, 64, 64]), dict(_geom(1, 0, 4), kv_item_lens=[256, 256, 128, 128]),
     4, "the KV entries' heads differ in size"),
    (_geom(2, 0, 2), _geom(4, 2, 1), 4, "neither holds the other's"),            # ranks SGLang does not pair
])
def test_head_share_refuses_what_cannot_be_sliced(ours, theirs, total, says):
    with pytest.raises(BadInput, match=says):
        head_share(ours, theirs, total)


_LEFT_OUT = object()        # a field the decode's geometry does not hold


@pytest.mark.parametrize("field, value, says", [
    ("attn_tp_size", "4", "TP size '4' is not a positive integer"),
    ("attn_tp_size", [4], "TP size \\[4\\] is not a positive integer"),
    ("attn_tp_size", 4.0, "TP size 4.0 is not a positive integer"),
    ("attn_tp_size", -4, "TP size -4 is not a positive integer"),
    ("kv_item_lens", "abcd", "kv_item_lens 'abcd' are not a list of integers"),
    ("kv_item_lens", None, "kv_item_lens None are not a list of integers"),
    ("kv_item_lens", _LEFT_OUT, "kv_item_lens None are not a list of integers"),
    ("kv_item_lens", ["x"] * 4, "are not a list of integers"),
    ("kv_item_lens", [64.0] * 4, "are not a list of integers"),
    ("kv_item_lens", [True] * 4, "are not a list of integers"),
])
def test_head_share_refuses_a_decodes_hostile_geometry(field, value, says):
    """A decode's geometry comes off the network (its registration message): fields of the wrong type are a
    refusal of that decode (BadInput, which the bootstrap thread records), never another exception."""
    theirs = {k: v for k, v in dict(_geom(2, 1, 2), **{field: value}).items() if v is not _LEFT_OUT}
    with pytest.raises(BadInput, match=says):
        head_share(_geom(1, 0, 4), theirs, 4)


def test_head_share_checks_the_prefills_own_heads_and_reads_the_total_from_kv_args():
    with pytest.raises(BadInput, match="holds 4 KV heads, not the 2 of 4"):
        head_share(_geom(2, 0, 2), _geom(1, 0, 4), 4, heads_here=4)
    assert total_kv_heads(SimpleNamespace(total_kv_head_num=8, kv_head_num=2), 2) == 8
    assert total_kv_heads(SimpleNamespace(total_kv_head_num=0, kv_head_num=2), 2) == 4
    assert total_kv_heads(SimpleNamespace(), 2) == 0


def test_registration_payload_round_trip_and_bounds():
    geom = geometry(_kv_args()[0])
    assert decode_registration(encode_registration(geom, b"GXKV...")) == (geom, b"GXKV...")
    for bad in (b"", b"\x01", (1000).to_bytes(4, "little") + b"{}", (2).to_bytes(4, "little") + b"[]",
                (3).to_bytes(4, "little") + b"{x}",
                (200000).to_bytes(4, "little") + b"[" * 100000 + b"]" * 100000,      # nested past the parser
                None, 5):
        with pytest.raises(BadMetadata):
            decode_registration(bad)


def test_metadata_rows_copy_and_bounds():
    src, _, src_aux = _kv_args()
    dst, _, dst_aux = _kv_args()
    for t in dst_aux:
        t.zero_()
    rows = read_aux_rows(src, 3)
    assert [len(r) for r in rows] == [64, 128]
    write_aux_rows(dst, 1, rows)
    for s, d, n in zip(src_aux, dst_aux, (64, 128)):
        assert torch.equal(d.view(-1, n)[1], s.view(-1, n)[3])
        assert int(d.view(-1, n)[[0, 2, 3, 4]].count_nonzero()) == 0
    with pytest.raises(BadInput):
        read_aux_rows(src, 5)
    with pytest.raises(BadInput):
        write_aux_rows(dst, 0, rows[:1])
    with pytest.raises(BadInput):                       # a short row: nothing written, not even the first
        write_aux_rows(dst, 0, [rows[0], rows[1][:10]])
    assert int(dst_aux[0].view(-1, 64)[0].count_nonzero()) == 0


def test_slot_and_landing_frames_round_trip_and_refuse_anything_else():
    assert parse_slot(slot_frame(7)) == 7 and parse_slot(slot_frame(None)) is None
    assert parse_landing(landing_frame((3, 12))) == (3, 12) and parse_landing(landing_frame(None)) is None
    for bad in (b"64", b"-1", b"x", b"00000"):
        with pytest.raises(BadInput, match="notification slot"):
            parse_slot(bad)
    for bad in (b"1", b"1:", b":3", b"1:0", b"64:1", b"1:x", b"1:" + b"9" * 20, b"1:%d" % RELEASE_VALUE):
        with pytest.raises(BadInput):
            parse_landing(bad)


class _Words:
    def __init__(self):
        self.values, self.reads, self.fail = {}, 0, False

    def __call__(self, slot):
        self.reads += 1
        if self.fail:
            raise GpuxferError("the agent failed")
        return self.values.get(slot, 0)


def _landings(handed=2):
    words = _Words()
    lands = Landings(words)
    for _ in range(handed):
        lands.new_slot()
    return lands, words


def _poll(lands, room):
    lands._read_at = [0.0] * len(lands._read_at)       # past the read interval: the next poll reads the word
    return lands.landed(room)


def test_a_room_lands_only_once_its_word_reaches_its_value():
    lands, words = _landings()
    assert not _poll(lands, 7)                           # nothing expected yet: nothing read
    assert lands.expect(7, (1, 3)) and words.reads == 0
    for seen in (0, 2):
        words.values[1] = seen
        assert not _poll(lands, 7)
    words.values[1] = 3
    assert _poll(lands, 7) and not lands.waiting(7)
    assert lands.expect(8, (1, 2))                       # an earlier value of the same word: no read
    reads = words.reads
    assert lands.landed(8) and words.reads == reads


def test_a_word_is_read_at_most_once_per_interval(monkeypatch):
    from gpuxfer.integrations.sglang import landing
    monkeypatch.setattr(landing, "READ_EVERY_S", 60.0)     # (the polls below all fall within one interval)
    lands, words = _landings()
    for room in range(8):
        lands.expect(room, (0, 5))
    words.values[0] = 1
    assert not _poll(lands, 0)
    assert not any(lands.landed(room) for room in range(1, 8))    # within the interval: the value read reused
    assert words.reads == 1


def test_a_released_word_a_failed_read_or_a_foreign_slot_never_lands_a_room():
    lands, words = _landings(handed=2)
    lands.expect(7, (0, 1))
    words.values[0] = RELEASE_VALUE                      # the agent failed: its words released, nothing landed
    assert not _poll(lands, 7)
    words.values[0], words.fail = 1, True
    assert not _poll(lands, 7)
    assert not lands.expect(8, (5, 1)) and not lands.waiting(8)    # never handed out
    lands.expect(9, (1, 1))
    lands.forget(9)                                      # a new request of the room: the old value forgotten
    words.fail, words.values[1] = False, 4
    assert not _poll(lands, 9)


def test_slots_are_handed_out_once_each():
    lands, _ = _landings(handed=0)
    from gpuxfer.kv import NOTIFY_SLOTS
    assert [lands.new_slot() for _ in range(NOTIFY_SLOTS)] == list(range(NOTIFY_SLOTS))
    assert lands.new_slot() is None and lands.new_slot() is None


def _chunks(*spans, room=7, infos="infos"):
    """Queued chunks of one request: ``(start, stop)`` page ranges, the last one the request's last chunk."""
    import numpy as np
    from gpuxfer.integrations.sglang.requests import _Chunk
    return [_Chunk(room, np.arange(a, b, dtype=np.int32) + 100, slice(a, b), i == len(spans) - 1,
                   5 if i == len(spans) - 1 else None, None, infos) for i, (a, b) in enumerate(spans)]


def _queue(*items):
    import queue
    q = queue.Queue()
    for item in items:
        q.put(item)
    return q


def test_chunks_queued_behind_one_another_become_one_push():
    import numpy as np
    from gpuxfer.integrations.sglang.requests import coalesce
    first, *rest = _chunks((0, 2), (2, 5), (5, 6), (6, 9))
    chunk, held = coalesce(first, _queue(*rest))
    assert held is None
    assert np.array_equal(chunk.pages, np.arange(100, 109)) and chunk.index_slice == slice(0, 9)
    assert chunk.is_last and chunk.aux_index == 5 and chunk.infos == "infos" and chunk.room == 7
    alone, held = coalesce(first, _queue())
    assert alone is first and held is None


@pytest.mark.parametrize("case", ["other room", "other request", "gap", "wait event", "abort marker",
                                  "after the last", "a step", "bools", "floats before", "2-D", "0-D",
                                  "fewer pages before", "more pages", "positions array", "from the end"])
def test_a_chunk_that_does_not_continue_the_one_before_stays_queued_in_order(case):
    """Only the same request's next pages join; the first item that does not is handed back, the rest stay
    queued behind it. Pages of another type or shape, or of another count than their positions, never join:
    joined, they would be cast (bools turned into page IDs 0 and 1), fail to join (an error out of the
    transfer thread) or land shifted onto positions another chunk named; alone, each is checked as given."""
    import dataclasses
    import numpy as np
    from gpuxfer.integrations.sglang.requests import _drain_marker, coalesce
    a, b, c = _chunks((0, 2), (2, 4), (4, 6))
    nxt = {"other room": dataclasses.replace(b, room=8), "other request": dataclasses.replace(b, infos="new"),
           "gap": dataclasses.replace(b, index_slice=slice(3, 5)), "wait event": dataclasses.replace(b, wait_event=1),
           "abort marker": _drain_marker(7), "a step": dataclasses.replace(b, index_slice=slice(2, 6, 2)),
           "bools": dataclasses.replace(b, pages=np.ones(2, dtype=bool)),
           "2-D": dataclasses.replace(b, pages=b.pages.reshape(1, 2)),
           "0-D": dataclasses.replace(b, pages=np.array(102, dtype=np.int32), index_slice=slice(2, 3)),
           "more pages": dataclasses.replace(b, pages=np.arange(102, 105, dtype=np.int32)),
           "positions array": dataclasses.replace(b, index_slice=np.arange(2, 4))}.get(case, b)
    if case == "after the last":
        a = dataclasses.replace(a, is_last=True)
    elif case == "floats before":       # np.array([]) of an empty list: float64, valid alone as no page at all
        a = dataclasses.replace(a, pages=np.array([]), index_slice=slice(2, 2))
    elif case == "fewer pages before":
        a = dataclasses.replace(a, pages=a.pages[:1])
    elif case == "from the end":        # positions counted from the list's end: two chunks' cuts of it
        a, nxt = (dataclasses.replace(a, index_slice=slice(-4, -2)), dataclasses.replace(b, index_slice=slice(-2, 0)))
    q = _queue(nxt, c)
    chunk, held = coalesce(a, q)
    assert chunk is a and held is nxt and q.get_nowait() is c


def test_unrequested_rooms_are_bounded_per_decode_rank_in_number_and_age():
    from gpuxfer.integrations.sglang.requests import Unrequested
    now = [0.0]
    rooms = Unrequested(max_rooms=3, max_age_s=10.0, clock=lambda: now[0])
    assert [rooms.note("a", r) for r in (1, 2, 3)] == [[], [], []]
    assert rooms.note("a", 2) == [] and rooms.note("a", 4) == [1]         # named again: kept from its first time
    now[0] = 5.0
    assert rooms.note("b", 2) == [] and rooms.note("b", 9) == []         # another rank's count is its own
    rooms.forget(3)                                                       # a request took it
    assert rooms.rooms("a") == [2, 4] and rooms.rooms("b") == [2, 9]
    now[0] = 10.0
    assert sorted(rooms.expired()) == [2, 4] and rooms.rooms("b") == [9]
    now[0] = 15.0
    assert rooms.expired() == [9] and rooms.rooms("a") == rooms.rooms("b") == []


def test_unrequested_rooms_are_bounded_per_decode_rank_in_the_pages_they_name():
    from gpuxfer.integrations.sglang.requests import Unrequested
    rooms = Unrequested(max_rooms=100, max_age_s=10.0, clock=lambda: 0.0)
    assert [rooms.note("a", r, 40, 100) for r in (1, 2)] == [[], []] and rooms.pages("a") == 80
    assert rooms.note("a", 3, 40, 100) == [1] and rooms.pages("a") == 80
    assert rooms.note("a", 2, 10, 100) == [] and rooms.pages("a") == 50       # named again: its latest pages
    assert rooms.note("a", 4, 90, 100) == [2, 3] and rooms.rooms("a") == [4]  # the room just named stays
    assert rooms.note("b", 5, 90, 100) == [] and rooms.pages("b") == 90       # another rank's pages are its own
    rooms.forget(4)
    assert rooms.pages("a") == 0 and rooms.rooms("a") == []


def test_a_landing_value_must_pass_every_value_named_on_its_slot():
    rooms = Landings(lambda slot: 0)
    rooms.new_slot(), rooms.new_slot()
    rooms.check((1, 2))
    assert rooms.expect(7, (1, 2))
    for again in ((1, 2), (1, 1)):
        with pytest.raises(BadInput, match="not past it"):
            rooms.check(again)
    rooms.check((1, 3)), rooms.check((0, 1))        # the next value; another slot counts its own
    rooms.check((5, 1))                             # a slot never handed out: expect ignores it
    assert not rooms.expect(8, (5, 1))


def test_a_success_messages_word_check_reads_the_word_itself_while_a_poll_reads_it():
    """A prefill's Success message checks the room's word on the control thread (:meth:`Landings.reached_now`: the
    device word, where the host copy stopped moving). A poll of the scheduler's thread that reads the word at that
    moment, its read not back yet, must not leave the check with the value from before the read: the room would fail
    with its KV landed."""
    import threading
    inside, release, polls = threading.Event(), threading.Event(), []
    checking, device = [False], [1]

    def read(slot):             # the device word: 1, then the push of value 2 landed
        if threading.current_thread() is not threading.main_thread():
            inside.set()        # (the poll's read, under way until the check is done)
            release.wait(10)
        return device[0]

    def host_read(slot):        # the copy moved once (1), then its prefill stopped writing it
        if checking[0] and not polls and threading.current_thread() is threading.main_thread():
            t = threading.Thread(target=lands.word, args=(0,))     # the scheduler's poll, between the check's steps
            polls.append(t)
            t.start()
            for _ in range(1000):               # (bounded: until the poll reads the word, or ends without a read)
                if inside.is_set() or not t.is_alive():
                    break
                t.join(0.01)
        return 1

    lands = Landings(read, host_read)
    lands.new_slot()
    assert lands.word(0) == 1 and lands._copy_moved[0]
    device[0], checking[0] = 2, True
    try:
        assert lands.reached_now(0, 2)
    finally:
        release.set()
        for t in polls:
            t.join(10)
    assert not any(t.is_alive() for t in polls)
