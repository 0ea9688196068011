"""A request's metadata rows in the decode's host memory (:mod:`gpuxfer.integrations.sglang.rows`): the transfer
thread's own ``_post`` over two real agents of this process (host emulation,
tests/integrations/test_sglang_pipeline.py's ``RealAgents``) with SGLang's aux buffers on both sides, the
decode's rows in shared memory the prefill mapped from its registration, the decode's :class:`Inbox` over the
decode agent's notification words and rows. Every byte of the rows is checked; a row whose push did not land, a
stamp of another request, a torn stamp, a row read while it was rewritten or a forged row index never lets the
request end Success.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402

from gpuxfer.errors import BadInput, BadMetadata, DriverError, GpuxferError  # noqa: E402
from gpuxfer.integrations.sglang.inbox import Inbox  # noqa: E402
from gpuxfer.integrations.sglang.landing import READ_EVERY_S, Landings  # noqa: E402
from gpuxfer.integrations.sglang.requests import TransferInfo  # noqa: E402
from gpuxfer.integrations.sglang.rows import (STAMP_BYTES, AuxRows, RowSegment, advertised, decode_stamp,  # noqa: E402
                                               encode_stamp)
from gpuxfer.platforms.host_cma import wrap_scoped  # noqa: E402
from test_sglang_pipeline import DECODE, ROOM, Decode, RealAgents  # noqa: E402

SLOT, AUX, ROWS = 3, (16, 40), 8
SRC_ROW, DST_ROW = 5, 2


class RowAgents(RealAgents):
    """:class:`RealAgents` with SGLang's aux buffers (``AUX`` row sizes, ``ROWS`` rows) on both sides, the decode's
    rows in shared memory its registration names (``decode_rows``), the decode's registration giving notification
    ``SLOT``; ``decode``: the decode manager's message handling over the decode agent's words and rows."""

    def __init__(self, decode_rows=True):
        super().__init__()
        import torch
        gen = torch.Generator().manual_seed(5)
        self.src_aux = [torch.randint(0, 256, (ROWS * n,), dtype=torch.uint8, generator=gen) for n in AUX]
        self.dst_aux = [torch.zeros(ROWS * n, dtype=torch.uint8) for n in AUX]
        for agent, bufs in ((self.agent, self.src_aux), (self.dec, self.dst_aux)):
            args = self.args[agent]
            args.aux_data_ptrs, args.aux_data_lens = [t.data_ptr() for t in bufs], [t.numel() for t in bufs]
            args.aux_item_lens = list(AUX)
        self.pushes.kv_args = self.args[self.agent]
        self.pre_rows = self.pushes.rows = AuxRows.create(self.args[self.agent])
        self.dec_rows = AuxRows.create(self.args[self.dec], self.dec.uid) if decode_rows else None
        self.pushes.add_decode("decode", self.dec.metadata(), {}, SLOT, DECODE,
                               registration=advertised(self.dec_rows))
        self.decode = Decode(slots_handed=0)
        self.decode.kv_args = self.args[self.dec]
        self.decode.landings = Landings(self.dec.notification, self.dec.host_notification)
        for _ in range(SLOT + 1):
            self.decode.landings.new_slot()
        self.decode.inbox = Inbox(self.decode, self.decode.landings, KVPoll, self.dec_rows)

    def close(self):
        self.pre_rows.close()
        super().close()
        if self.dec_rows is not None:
            self.dec_rows.close()

    def stamp_row(self, stamp, index=DST_ROW):
        """Write ``stamp`` over the decode's row ``index``'s stamp (as a prefill would): bytes, or ``(token, slot,
        value)``, a whole stamp of the rows the row holds now."""
        seg = self.dec_rows.segment
        if isinstance(stamp, tuple):
            stamp = encode_stamp(*stamp, seg.read(index)[STAMP_BYTES:])
        seg._set(index * self.dec_rows.row_bytes, stamp)

    def segment_bytes(self):
        return self.dec_rows.segment._get(0, self.dec_rows.segment.nbytes)

    def row(self, bufs, index):
        return [bytes(t[index * n:(index + 1) * n].numpy()) for t, n in zip(bufs, AUX)]

    def name(self, room=ROOM, index=DST_ROW):
        """The decode names ``room``'s pages and row ``index``: its token."""
        d = self.decode
        d.update_status(room, KVPoll.Bootstrapping)
        d.update_status(room, KVPoll.WaitingForInput)
        d.required_prefill_response_num_table[room] = 1
        token = d.inbox.name_request(room, index)
        d.inbox.prefill_slot(room, SLOT)        # (the receiver's send_metadata: its one prefill rank's slot)
        return token

    def send(self, token, room=ROOM, dst_row=DST_ROW, dst=(9, 10, 11, 12), chunks=((1, 2), (3, 4))):
        """The prefill's request of ``room`` to the decode's pages ``dst`` and row ``dst_row``, sent as
        ``chunks`` (one push each)."""
        self.update_status(room, KVPoll.Bootstrapping)
        self.transfer_infos[room] = {"decode": TransferInfo(
            room=room, endpoint=DECODE[0], dst_port=DECODE[1], session="decode",
            dst_kv_indices=np.array(dst, np.int32), dst_aux_index=dst_row, required_dst_info_num=1, is_dummy=False,
            token=token)}
        self.update_status(room, KVPoll.WaitingForInput)
        start = 0
        for i, pages in enumerate(chunks):
            self.add_transfer_request(room, np.array(pages), slice(start, start + len(pages)), i == len(chunks) - 1,
                                      aux_index=SRC_ROW)
            start += len(pages)
        while not self.pushes._queue.empty():
            self.run(self.pushes._queue.get_nowait())

    def landed(self, room=ROOM, tries=200):
        """Whether the decode's poll ends ``room`` by its word within ``tries`` polls (its reads are spaced), once
        the pushes posted so far ran (however slow the machine: the polls then find what they will ever find)."""
        assert self.agent.platform.synchronize(self.agent.stream, 60.0)
        for _ in range(tries):
            if self.decode.inbox.landed_by_row(room):
                return True
            time.sleep(1e-4)
        return False


@pytest.fixture
def rows():
    mgr = RowAgents()
    yield mgr
    mgr.close()


def _earlier_row(mgr):
    """An earlier request's row and a whole stamp of another token left at the decode's row."""
    for t, n in zip(mgr.dst_aux, AUX):
        t[DST_ROW * n:(DST_ROW + 1) * n] = 0xEE
    mgr.stamp_row((999, SLOT, 1))


def test_the_rows_go_before_the_last_push_and_land_byte_for_byte(rows, monkeypatch):
    """The rows go into the decode's host memory, not with the push (its blocks are the pages alone), and no device
    copy of a row is made on either side."""
    _earlier_row(rows)
    token = rows.name()
    assert rows.dec_rows.stamp(DST_ROW) is None              # naming the row zeroed the earlier stamp
    groups, prepare = [], rows.agent.prepare
    monkeypatch.setattr(rows.agent, "prepare",
                        lambda *a, **k: groups.append(set(k["local_blocks"])) or prepare(*a, **k))
    rows.send(token)
    assert groups == [{"kv"}, {"kv"}]
    assert rows.request_status[ROOM] == KVPoll.Success and ("aux", ROOM) not in rows.log     # no row message
    assert rows.landed()
    rows.decode.inbox.end_by_word(ROOM)
    assert rows.decode.request_status[ROOM] == KVPoll.Success
    assert rows.row(rows.dst_aux, DST_ROW) == rows.row(rows.src_aux, SRC_ROW)
    assert rows.decode_pages_equal([1, 2, 3, 4], [9, 10, 11, 12])
    for i in set(range(ROWS)) - {DST_ROW}:                    # no other row written
        assert not any(any(r) for r in rows.row(rows.dst_aux, i))


def test_the_success_message_takes_the_row_from_the_agent(rows):
    token = rows.name()
    rows.send(token)
    rows.decode.inbox.on_message([ROOM, KVPoll.Success, 0, None, token])
    assert rows.decode.applied == [(ROOM, KVPoll.Success)]
    assert rows.row(rows.dst_aux, DST_ROW) == rows.row(rows.src_aux, SRC_ROW)


def _fail_copies_into(monkeypatch, mgr, lo, hi):
    """The prefill's copies land but those into bytes ``[lo, hi)`` of the decode's memory (the decode's rows),
    and the post then fails on the stream as a cross-memory-attach copy that moved less than asked does."""
    plat = mgr.agent.platform
    copy = plat.copy_batch_async

    def copy_batch_async(stream, dsts, srcs, sizes):
        keep = [i for i, d in enumerate(dsts) if not lo <= int(d) < hi]
        if len(keep) == len(dsts):
            return copy(stream, dsts, srcs, sizes)
        copy(stream, [dsts[i] for i in keep], [srcs[i] for i in keep], [sizes[i] for i in keep])

        def short():
            raise DriverError("process_vm_writev", "SHORT_COPY", 0, "an injected push", "moved 0 bytes")
        plat._stream(stream)._enqueue("injected failing copies", wrap_scoped(short))
    monkeypatch.setattr(plat, "copy_batch_async", copy_batch_async)


def test_a_push_that_failed_after_its_rows_were_written_never_ends_success(rows, monkeypatch):
    """The rows were written, stamped, and the last push then failed (its last pages did not land): the prefill
    fails the request, its word never reaches the value, and the decode ends it Success neither by its poll nor by
    a Success message (a late or forged one): the stamp alone is no landing."""
    lo = rows.dst[0].data_ptr() + 11 * rows.dst[0][0].numel() * rows.dst[0].element_size()
    _fail_copies_into(monkeypatch, rows, lo, lo + rows.dst[0][0].numel() * rows.dst[0].element_size())
    token = rows.name()
    rows.send(token)
    assert rows.request_status[ROOM] == KVPoll.Failed
    assert rows.dec_rows.stamp(DST_ROW) is not None             # the rows are there, stamped
    assert not rows.landed(tries=20)
    rows.decode.inbox.on_message([ROOM, KVPoll.Success, 0, None, token])
    assert rows.decode.request_status[ROOM] == KVPoll.Failed and rows.decode.applied == []
    assert "metadata row" in rows.decode.failure_records[ROOM]
    assert not any(any(r) for r in rows.row(rows.dst_aux, DST_ROW))


def test_rows_read_before_their_word_held_the_stamps_value_are_not_taken(rows, monkeypatch):
    """The decode reads a row's stamp and rows in one copy, after its word: a whole row read while the word read
    before it was one short of the stamp's value (its push had not landed) is never taken, even where the word reads
    the value right after; the row read once the word held it is."""
    token = rows.name()
    rows.send(token)
    value = rows.dec.notification(SLOT)
    whole = rows.dec_rows.row(DST_ROW)
    torn = whole
    assert decode_stamp(torn) == (int(token), SLOT, value)
    words, reads = iter([value - 1]), []
    landings = rows.decode.landings
    monkeypatch.setattr(landings, "_host_read", None)       # (the device word alone, as without a host copy)
    monkeypatch.setattr(landings, "_read_every", READ_EVERY_S)
    monkeypatch.setattr(landings, "_read", lambda slot: next(words, value))
    real = rows.dec_rows.row

    def row(index):
        reads.append(index)
        time.sleep(READ_EVERY_S * 5)    # (a device read takes longer than the words' read spacing)
        return torn if len(reads) == 1 else real(index)
    monkeypatch.setattr(rows.dec_rows, "row", row)
    assert rows.landed()
    assert len(reads) == 2              # the torn read was not taken; the one after the word was
    assert rows.row(rows.dst_aux, DST_ROW) == rows.row(rows.src_aux, SRC_ROW)


def test_a_room_named_with_its_words_value_reads_its_row_once_the_word_grew(rows, monkeypatch):
    """The receiver hands the inbox the word's value it knew before its metadata left (no push of the room can
    have bumped it yet): polls read no row until the word grows past it, then the row once; without that value
    the first poll reads the row (an earlier request's) and finds no stamp of this one."""
    reads = []
    real = rows.dec_rows.row
    monkeypatch.setattr(rows.dec_rows, "row", lambda index: reads.append(index) or real(index))
    rows.send(rows.name())                  # (a first request: the word moved once)
    assert rows.landed()
    for room, with_seen in ((ROOM + 1, True), (ROOM + 2, False)):
        reads.clear()
        landings, inbox = rows.decode.landings, rows.decode.inbox
        seen = landings.seen(SLOT)
        token = rows.name(room=room)
        if with_seen:
            inbox.prefill_slot(room, SLOT, seen)
        for _ in range(5):
            assert not inbox.landed_by_row(room)
        assert reads == ([] if with_seen else [DST_ROW])
        rows.send(token, room=room)
        assert rows.landed(room=room)
        assert reads == ([DST_ROW] if with_seen else [DST_ROW, DST_ROW])
        assert rows.row(rows.dst_aux, DST_ROW) == rows.row(rows.src_aux, SRC_ROW)


def test_the_decode_learns_a_landing_from_the_host_copy_with_no_device_read(rows, monkeypatch):
    """The decode agent's notification words have a host copy the prefill's push writes after the word: once the
    slot's copy moved (the first request), the poll ends a request by a load of it, the device word not read
    (its reads spaced past the test)."""
    landings = rows.decode.landings
    monkeypatch.setattr(landings, "_read_every", 1e9)
    device_reads = []
    monkeypatch.setattr(landings, "_read", lambda slot: device_reads.append(slot) or rows.dec.notification(slot))
    rows.send(rows.name())
    assert rows.landed() and landings._copy_moved[SLOT]
    device_reads.clear()
    token = rows.name(room=ROOM + 1)
    rows.send(token, room=ROOM + 1)
    assert rows.landed(room=ROOM + 1) and device_reads == []
    assert rows.row(rows.dst_aux, DST_ROW) == rows.row(rows.src_aux, SRC_ROW)


def test_a_prefill_that_does_not_write_the_host_copy_is_heard_by_the_device_word(rows, monkeypatch):
    """A prefill rank whose peer of the decode has no host copy mapped (an earlier gpuxfer, another host): the
    host copy stays behind, and the decode's device reads beside it end the request."""
    peer = next(iter(rows.pushes._peers.values()))
    monkeypatch.setattr(peer, "host_words", None)
    monkeypatch.setattr(rows.decode.landings, "_read_every", 1e9)     # (a slot whose copy never moved: 20 us)
    token = rows.name()
    rows.send(token)
    assert rows.dec.host_notification(SLOT) == 0 and rows.dec.notification(SLOT) == 1
    assert rows.landed()
    assert rows.row(rows.dst_aux, DST_ROW) == rows.row(rows.src_aux, SRC_ROW)


@pytest.mark.parametrize("other", ["token", "slot"])
def test_a_row_stamped_for_another_request_never_ends_success(rows, other):
    """The row at the room's index holds another request's stamp (an earlier request's late push, a stamp
    corrupted whole; or one naming another word than the room's prefill rank's): the word reaching its value
    does not end the room, and a Success message (by token) fails it where the token is another."""
    token = rows.name()
    rows.decode.landings.new_slot()
    rows.send(token)
    value = rows.dec.notification(SLOT)
    # another token at the value the word holds; or the token on another word, at a value that word holds
    stamp = (int(token) + 1, SLOT, value) if other == "token" else (int(token), SLOT + 1, 0)
    rows.stamp_row(stamp)
    if other == "slot":
        assert not rows.landed(tries=20)
        return
    assert not rows.landed(tries=20)
    rows.decode.inbox.on_message([ROOM, KVPoll.Success, 0, None, token])
    assert rows.decode.request_status[ROOM] == KVPoll.Failed and rows.decode.applied == []
    assert not any(any(r) for r in rows.row(rows.dst_aux, DST_ROW))


@pytest.mark.parametrize("token, value", [(12, 7), ((1 << 60) + 3, 1 << 40)])
def test_a_stamp_read_while_it_is_written_is_no_stamp(token, value):
    """Any byte of a stamp still zero where the whole stamp's is not (a push writing it as it is read): the
    complement check refuses it; so do a zeroed stamp and one byte changed anywhere."""
    whole = encode_stamp(token, SLOT, value)
    assert decode_stamp(whole) == (token, SLOT, value) and decode_stamp(bytes(STAMP_BYTES)) is None
    for at in range(STAMP_BYTES):
        torn = bytearray(whole)
        torn[at] ^= 0xFF if whole[at] == 0 else whole[at]
        assert decode_stamp(bytes(torn)) is None, at


@pytest.mark.parametrize("dst_row", [ROWS, 1 << 31], ids=["past-the-rows", "far-past"])
def test_a_forged_row_index_fails_the_request_and_writes_nothing(rows, dst_row):
    """A metadata message naming a row past the rows the decode registered: the request fails on the prefill,
    typed, before anything is posted; nothing of the decode's rows (nor past them) is written."""
    token = rows.name()
    before = rows.segment_bytes()
    rows.send(token, dst_row=dst_row)
    assert rows.request_status[ROOM] == KVPoll.Failed
    assert "metadata row" in rows.failure_records[ROOM] and "BadInput" in rows.failure_records[ROOM]
    assert rows.segment_bytes() == before and not rows.landed(tries=20)


def test_a_decode_row_index_outside_its_rows_is_refused_when_named():
    mgr = RowAgents()
    try:
        with pytest.raises(BadInput):
            mgr.name(index=ROWS)
    finally:
        mgr.close()


def test_a_decode_that_registered_no_rows_gets_them_in_a_message():
    """A decode of an earlier gpuxfer (no rows in its registration): the row goes on the control socket."""
    mgr = RowAgents(decode_rows=False)
    try:
        assert "decode" not in mgr.pushes._aux_rows
        token = mgr.name()
        mgr.send(token)
        assert mgr.request_status[ROOM] == KVPoll.Success and ("aux", ROOM) in mgr.log
    finally:
        mgr.close()


def test_a_room_of_two_decode_ranks_gets_its_rows_in_messages(rows):
    """Two decode ranks of one room (each its own token): one stamp cannot name both, so the rows go as messages."""
    token = rows.name()
    p = rows.pushes      # a second decode rank: the same decode agent under another name, its own slot
    p._peers["decode2"], p._notify_slots["decode2"] = p._peers["decode"], SLOT + 1
    p._aux_rows["decode2"] = p._aux_rows["decode"]
    rows.update_status(ROOM, KVPoll.Bootstrapping)
    infos = {s: TransferInfo(room=ROOM, endpoint=DECODE[0], dst_port=p, session=s,
                             dst_kv_indices=np.array(d, np.int32), dst_aux_index=DST_ROW, required_dst_info_num=2,
                             is_dummy=False, token=token)
             for s, p, d in (("decode", DECODE[1], [9, 10]), ("decode2", 5556, [11, 12]))}
    rows.transfer_infos[ROOM] = infos
    rows.update_status(ROOM, KVPoll.WaitingForInput)
    rows.add_transfer_request(ROOM, np.array([1, 2]), slice(0, 2), True, aux_index=SRC_ROW)
    rows.run(rows.pushes._queue.get_nowait())
    assert rows.request_status[ROOM] == KVPoll.Success and rows.log.count(("aux", ROOM)) == 2


def test_rows_without_shared_memory_go_in_messages(monkeypatch):
    """Where the decode cannot make its rows' shared memory, it keeps none and names none: its requests' rows go in
    messages, the rank still starts."""
    def refuse(*a, **k):
        raise OSError("an injected refusal")
    monkeypatch.setattr(RowSegment, "create", refuse)
    mgr = RowAgents(decode_rows=False)
    try:
        args = mgr.args[mgr.dec]
        assert AuxRows.create(args, mgr.dec.uid) is None
    finally:
        mgr.close()


def test_a_registration_naming_rows_not_its_agents_is_refused_and_one_of_another_host_uses_messages(rows):
    """The rows a registration names are mapped only where they are that agent's rows (their segment's mark) of the
    prefill's row size: another agent's rows, a name no decode gives or a count that is no int is ``BadMetadata``;
    a name of no segment here (a decode on another host) or rows of another size leaves the rank's rows in
    messages."""
    mine = rows.pushes.rows
    reg = advertised(rows.dec_rows)
    with pytest.raises(BadMetadata, match="another agent"):
        mine.open_peer(reg, rows.agent.uid)
    for bad in ({**reg, "rows_shm": "/dev/shm/x"}, {**reg, "rows_shm": "/gpuxfer-kvw-1-000000000000"},
                {**reg, "rows": True}, {**reg, "rows": -1}, {**reg, "rows": ROWS + 1}):
        with pytest.raises(BadMetadata):
            mine.open_peer(bad, rows.dec.uid)
    assert mine.open_peer({**reg, "rows_shm": "/gpuxfer-rows-1-0123456789ab"}, rows.dec.uid) is None
    assert mine.open_peer({**reg, "row_bytes": reg["row_bytes"] + 8}, rows.dec.uid) is None
    seg = mine.open_peer(reg, rows.dec.uid)
    assert seg is not None and seg.rows == ROWS and not seg.closed
    mine.close()                            # (the prefill's teardown: the peers' rows it opened close with its own)
    assert seg.closed


def test_a_row_read_while_it_is_rewritten_reads_no_stamp(rows, monkeypatch):
    """A reader whose stamp changed between its reads before and after the rows (a writer rewriting the row, as
    an earlier request's late write would) reads no stamp, so those rows are never taken."""
    token = rows.name()
    rows.send(token)
    seg = rows.dec_rows.segment
    assert decode_stamp(rows.dec_rows.row(DST_ROW)) is not None
    get, calls = seg._get, []

    def get_then_rewrite(at, n):
        out = get(at, n)
        calls.append(at)
        if len(calls) == 1:         # after the stamp and the rows were read: another write of the row begins
            seg._set(DST_ROW * rows.dec_rows.row_bytes, bytes(STAMP_BYTES))
        return out
    monkeypatch.setattr(seg, "_get", get_then_rewrite)
    assert decode_stamp(rows.dec_rows.row(DST_ROW)) is None


def test_closed_rows_read_and_write_nothing(rows):
    """Rows closed (a teardown beside a thread still using them) raise a typed error, touching no memory."""
    seg = rows.dec_rows.segment
    rows.dec_rows.close()
    rows.dec_rows.close()
    for call in (lambda: seg.read(0), lambda: seg.clear(0),
                 lambda: seg.write(0, bytes(STAMP_BYTES), bytes(rows.dec_rows.row_bytes - STAMP_BYTES))):
        with pytest.raises(GpuxferError, match="closed"):
            call()


def test_once_a_slots_host_copy_moved_polls_read_no_device_word_but_a_success_message_does(rows, monkeypatch):
    """A slot whose host copy moved (its prefill rank writes it after every word it bumps): the polls read the copy
    alone, however long a request waits (no device read every millisecond, each queued behind the other process's
    work on a shared GPU); a prefill's Success message still reads the device word (a copy that stopped moving
    leaves the request to that message)."""
    landings = rows.decode.landings
    device_reads = []
    monkeypatch.setattr(landings, "_read", lambda slot: device_reads.append(slot) or rows.dec.notification(slot))
    rows.send(rows.name())
    assert rows.landed() and landings._copy_moved[SLOT]
    token = rows.name(room=ROOM + 1)
    device_reads.clear()
    for _ in range(3):                      # a waiting request, polled past several milliseconds
        assert not rows.decode.inbox.landed_by_row(ROOM + 1)
        time.sleep(3e-3)
    assert device_reads == []
    value = rows.dec.notification(SLOT)
    assert landings.reached_now(SLOT, value) and device_reads == []     # (the copy holds it: no read needed)
    assert not landings.reached_now(SLOT, value + 1) and device_reads == [SLOT]
    rows.send(token, room=ROOM + 1)
    assert rows.landed(room=ROOM + 1)
    assert rows.row(rows.dst_aux, DST_ROW) == rows.row(rows.src_aux, SRC_ROW)


def test_a_row_is_written_in_two_stores_and_read_in_two_loads_its_stamp_decoded_once(rows, monkeypatch):
    """The prefill writes a row as the stamp zeroed with the rows (one ``pwrite``), then its stamp; the decode reads
    the stamp with the rows (one ``pread``), then the stamp again, and decodes the stamp once per row it takes."""
    import gpuxfer.integrations.sglang.inbox as inbox_mod
    import gpuxfer.integrations.sglang.rows as rows_mod
    seg_w, seg_r = rows.pushes._aux_rows["decode"], rows.dec_rows.segment
    sets, gets, decodes = [], [], []
    real_set, real_get, real_decode = seg_w._set, seg_r._get, rows_mod.decode_stamp
    monkeypatch.setattr(seg_w, "_set", lambda at, data: sets.append(len(data)) or real_set(at, data))
    monkeypatch.setattr(seg_r, "_get", lambda at, n: gets.append(n) or real_get(at, n))
    counted = lambda raw: decodes.append(1) or real_decode(raw)     # noqa: E731
    monkeypatch.setattr(rows_mod, "decode_stamp", counted)
    monkeypatch.setattr(inbox_mod, "decode_stamp", counted)
    rows.send(rows.name())
    assert sets == [rows.dec_rows.row_bytes, STAMP_BYTES]
    assert rows.landed()
    assert gets == [rows.dec_rows.row_bytes, STAMP_BYTES] and len(decodes) == 1
    assert rows.row(rows.dst_aux, DST_ROW) == rows.row(rows.src_aux, SRC_ROW)


def test_a_decode_whose_aux_lists_changed_takes_no_row_into_them(rows):
    """The decode's ``KVArgs`` aux lists changed after its rows were made (a row size other than the rows'): the row
    is refused (the room fails), nothing written into SGLang's aux buffers by the lists the rows were made from."""
    token = rows.name()
    rows.send(token)
    rows.decode.kv_args.aux_item_lens = [AUX[0] + 8, AUX[1] - 8]
    assert not rows.landed(tries=20)
    assert rows.decode.request_status[ROOM] == KVPoll.Failed
    assert not any(any(r) for r in rows.row(rows.dst_aux, DST_ROW))
