"""A hostile review of the metadata rows in the decode's host memory (:mod:`gpuxfer.integrations.sglang.rows`): forged
row indices, inconsistent ``KVArgs`` aux lists, a room of several prefill ranks whose first rank's row message
arrives before the request is named to the next, rows closed while a thread reads or writes them, and a push whose
KV copy failed after its row was written. Over tests/integrations/test_sglang_rows.py's two real agents (host
emulation).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402

from gpuxfer.errors import BadInput, GpuxferError  # noqa: E402
from gpuxfer.integrations.sglang.landing import landing_frame  # noqa: E402
from gpuxfer.integrations.sglang.pushes import AUX_TAG  # noqa: E402
from gpuxfer.integrations.sglang.rows import AuxRows, advertised  # noqa: E402
from test_sglang_rows import (AUX, DECODE, DST_ROW, ROOM, ROWS, SLOT, RowAgents, _fail_copies_into,  # noqa: E402
                             rows)  # noqa: F401 (the fixture)


@pytest.mark.parametrize("index", [2.0, 2.7, -0.5, float("nan"), float("inf"), "2", b"2", None, True, False,
                                   -1, ROWS, 1 << 64, np.float32(1)],
                         ids=lambda v: repr(v))
def test_a_row_index_that_is_no_int_of_the_rows_is_refused_typed(rows, index):
    """Every public call of :class:`AuxRows` refuses an index that is not an int (a float truncated would name
    another row; a string, None or NaN raised Python's own errors), a bool, or one outside the rows: ``BadInput``,
    nothing written."""
    before = rows.segment_bytes()
    seg = rows.dec_rows.segment
    for call in (lambda: rows.dec_rows.clear(index), lambda: rows.dec_rows.stamp(index),
                 lambda: rows.dec_rows.take(index, 1), lambda: rows.pushes.rows.write(seg, 0, index, 1, SLOT, 1),
                 lambda: rows.pushes.rows.write(seg, index, 0, 1, SLOT, 1)):
        with pytest.raises(BadInput):
            call()
    assert rows.segment_bytes() == before


@pytest.mark.parametrize("index", [np.int64(DST_ROW), np.uint8(DST_ROW), np.int32(DST_ROW)], ids=repr)
def test_numpy_int_row_indices_name_their_row(rows, index):
    rows.dec_rows.clear(index)
    assert rows.dec_rows.stamp(index) is None


@pytest.mark.parametrize("ptrs", [1, 3], ids=["fewer-pointers", "more-pointers"])
def test_aux_lists_of_different_lengths_register_no_rows(rows, ptrs, monkeypatch):
    """``KVArgs`` naming another number of aux buffer pointers than row sizes: no rows are kept (each request's row
    then goes in a message, which the decode checks buffer for buffer)."""
    args = rows.args[rows.agent]
    args.aux_data_ptrs = (list(args.aux_data_ptrs) * 2)[:ptrs]
    assert AuxRows.create(args) is None and AuxRows.create(args, rows.dec.uid) is None


def test_a_row_read_from_fewer_buffers_than_its_row_never_lands_success(rows):
    """The prefill's aux pointers name fewer buffers than its rows were made for (its ``KVArgs`` changed under it):
    a row written from them would leave the rest of the decode's row as an earlier request left it, and the decode
    would end the request Success over those bytes. The write is refused (``BadInput``): the request fails, nothing
    of the decode's rows is written."""
    args = rows.args[rows.agent]
    args.aux_data_ptrs = list(args.aux_data_ptrs)[:1]
    token = rows.name()
    before = rows.segment_bytes()
    rows.send(token)
    assert rows.request_status[ROOM] == KVPoll.Failed and "BadInput" in rows.failure_records[ROOM]
    assert rows.segment_bytes() == before
    assert not rows.landed(tries=20)
    rows.decode.inbox.on_message([ROOM, KVPoll.Success, 0, None, token])
    assert rows.decode.request_status[ROOM] == KVPoll.Failed
    assert not any(any(r) for r in rows.row(rows.dst_aux, DST_ROW))


def test_a_room_of_two_prefill_ranks_whose_first_row_came_before_the_second_was_named(rows):
    """Two prefill ranks answer one room (rows in messages: no slot). SGLang's ``send_metadata`` names the request
    to each in turn; the first rank's row message may arrive before the request is named to the second. Naming it
    again must not arm the room for a row through the agent: its Success messages end it Success, with the row."""
    d = rows.decode
    d.update_status(ROOM, KVPoll.Bootstrapping)
    d.update_status(ROOM, KVPoll.WaitingForInput)
    d.required_prefill_response_num_table[ROOM] = 2
    token = d.inbox.name_request(ROOM, DST_ROW)             # to prefill rank A
    sent = rows.row(rows.src_aux, 5)
    d.inbox.on_message([AUX_TAG, str(ROOM).encode(), str(DST_ROW).encode(), landing_frame(None), token, *sent])
    assert d.inbox.name_request(ROOM, DST_ROW) == token     # to prefill rank B: the same request
    for rank in (0, 1):
        d.inbox.on_message([ROOM, KVPoll.Success, rank, None, token])
    assert d.request_status[ROOM] != KVPoll.Failed, d.failure_records.get(ROOM)
    assert d.applied == [(ROOM, KVPoll.Success)] * 2
    assert rows.row(rows.dst_aux, DST_ROW) == sent


def test_rows_closed_under_a_poll_are_typed_and_fail_the_room(rows):
    """The decode's rows closed (its teardown) while its threads still poll and take messages: the poll never
    raises into SGLang's scheduler, and the Success message fails the room, typed, instead of raising in the
    control thread."""
    token = rows.name()
    rows.send(token)
    rows.dec_rows.close()
    with pytest.raises(GpuxferError):
        rows.dec_rows.stamp(DST_ROW)
    assert not rows.landed(tries=20)
    rows.decode.inbox.on_message([ROOM, KVPoll.Success, 0, None, token])
    assert rows.decode.request_status[ROOM] == KVPoll.Failed and rows.decode.applied == []
    assert "metadata row" in rows.decode.failure_records[ROOM]


def test_closed_rows_cleared_or_written_are_typed(rows):
    """Naming a request whose row's stamp cannot be zeroed (its rows closed), or a prefill writing a row into a
    decode's rows it closed: a typed error (the receiver's ``send_metadata`` fails that room alone), never
    Python's, never a write into unmapped memory."""
    seg = rows.dec_rows.segment
    rows.dec_rows.close()
    with pytest.raises(GpuxferError):
        rows.name()
    with pytest.raises(GpuxferError):
        rows.pushes.rows.write(seg, 1, 1, 7, SLOT, 1)


def test_a_push_whose_kv_copy_failed_never_ends_success_by_its_row(rows, monkeypatch):
    """The last push wrote the row (stamp and rows) but not the KV pages and failed: the decode never ends the room
    Success, by its word or by any Success message."""
    lo = rows.dst[0].data_ptr()
    _fail_copies_into(monkeypatch, rows, lo, lo + rows.dst[0].numel() * rows.dst[0].element_size())
    token = rows.name()
    rows.send(token, chunks=((1, 2, 3, 4),))
    assert rows.request_status[ROOM] == KVPoll.Failed
    assert not rows.landed(tries=50)


def test_a_request_named_to_a_dummy_prefill_rank_first_still_takes_its_row_from_the_agent(rows):
    """SGLang names the request to a dummy prefill rank (no row) before its one real rank: the row that rank's
    push carries is still the one the Success message takes."""
    inbox = rows.decode.inbox
    rows.decode.update_status(ROOM, KVPoll.Bootstrapping)
    inbox.name_request(ROOM, None)
    token = rows.name()
    rows.send(token)
    rows.decode.inbox.on_message([ROOM, KVPoll.Success, 0, None, token])
    assert rows.decode.applied == [(ROOM, KVPoll.Success)]
    assert rows.row(rows.dst_aux, DST_ROW) == rows.row(rows.src_aux, 5)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_pair_where_one_side_has_no_rows_lands_every_byte_by_message(side):
    """One side registered no rows (an earlier gpuxfer, or rows its agent could not register): the row goes on
    the control socket (GXAUX3, with its landing value), and the decode ends the request by its word with every
    byte of the row and of the KV, whichever side it was."""
    from gpuxfer.integrations.sglang.pushes import Pushes
    mgr = RowAgents(decode_rows=side != "decode")
    try:
        if side == "prefill":
            mgr.pushes.rows = None
            mgr.pushes.add_decode("decode", mgr.dec.metadata(), {}, SLOT, mgr.pushes.endpoint("decode"),
                                  registration=advertised(mgr.dec_rows))
        assert "decode" not in mgr.pushes._aux_rows
        sent = []
        mgr.pushes._send_aux = Pushes._send_aux.__get__(mgr.pushes)
        mgr.send_to_decode = lambda info, parts: (sent.append(parts[0]), mgr.decode.inbox.on_message(parts))
        token = mgr.name()
        mgr.send(token)
        assert sent == [AUX_TAG] and mgr.request_status[ROOM] == KVPoll.Success
        for _ in range(200):
            if mgr.decode.landings.landed(ROOM):
                break
            time.sleep(1e-4)
        else:
            pytest.fail("the word never reached the value the row named")
        mgr.decode.inbox.end_by_word(ROOM)
        assert mgr.decode.request_status[ROOM] == KVPoll.Success
        assert mgr.row(mgr.dst_aux, DST_ROW) == mgr.row(mgr.src_aux, 5)
        assert mgr.decode_pages_equal([1, 2, 3, 4], [9, 10, 11, 12])
    finally:
        mgr.close()


@pytest.mark.parametrize("items", [[0, 40], [16, -8]], ids=["zero", "negative"])
def test_aux_row_sizes_of_no_bytes_are_refused_typed(rows, items):
    """``KVArgs`` with an aux row size of zero or less (both sides alike, so they pair): no rows are registered,
    and reading or writing a row for a message is ``BadInput`` (the prefill fails the request, the decode fails
    the room), never a division by zero in either thread."""
    from gpuxfer.integrations.sglang.layout import read_aux_rows, write_aux_rows
    args = rows.args[rows.dec]
    args.aux_item_lens = items
    assert AuxRows.create(args, rows.dec.uid) is None
    with pytest.raises(BadInput):
        read_aux_rows(args, 0)
    with pytest.raises(BadInput):
        write_aux_rows(args, 0, [b"", b""])


def test_a_landing_named_before_the_request_is_named_to_a_dummy_rank_is_kept():
    """SGLang names the request to its real prefill rank, whose row message (with its landing value) arrives
    before the request is named to a dummy rank: naming it again keeps that landing, and the word ends the room."""
    from gpuxfer.integrations.sglang.pushes import Pushes
    mgr = RowAgents(decode_rows=False)
    try:
        mgr.pushes._send_aux = Pushes._send_aux.__get__(mgr.pushes)
        mgr.send_to_decode = lambda info, parts: mgr.decode.inbox.on_message(parts)
        token = mgr.name()
        mgr.send(token)
        assert mgr.decode.landings.waiting(ROOM)
        assert mgr.decode.inbox.name_request(ROOM, None) == token       # the dummy rank's message
        assert mgr.decode.landings.waiting(ROOM)
    finally:
        mgr.close()


@pytest.mark.parametrize("index", [2.5, 2.0, -1, True, "2"], ids=repr)
def test_a_prefill_row_index_that_is_no_int_fails_its_room_sending_no_row(rows, index):
    """The prefill's own metadata row index (SGLang's ``aux_index`` of its request) that is not an int >= 0: the
    room fails, and no row goes out (a float cut to an int named another request's row)."""
    from gpuxfer.integrations.sglang.requests import TransferInfo
    token = rows.name()
    before = rows.segment_bytes()
    rows.update_status(ROOM, KVPoll.Bootstrapping)
    rows.transfer_infos[ROOM] = {"decode": TransferInfo(
        room=ROOM, endpoint=DECODE[0], dst_port=DECODE[1], session="decode", dst_kv_indices=np.array([9, 10], np.int32),
        dst_aux_index=DST_ROW, required_dst_info_num=1, is_dummy=False, token=token)}
    rows.update_status(ROOM, KVPoll.WaitingForInput)
    rows.add_transfer_request(ROOM, np.array([1, 2]), slice(0, 2), True, aux_index=index)
    while not rows.pushes._queue.empty():
        rows.run(rows.pushes._queue.get_nowait())
    assert rows.request_status[ROOM] == KVPoll.Failed
    assert not rows.log.count(("aux", ROOM))
    assert rows.segment_bytes() == before


_SHRUNK = r"""
import os
from gpuxfer.errors import GpuxferError
from gpuxfer.integrations.sglang.rows import STAMP_BYTES, RowSegment
owner = RowSegment.create("decode-uid", 4, 128)
peer = RowSegment.open(owner.name, "decode-uid", 4, 128)    # the prefill's, as its registration names it
for size in (0, 200):                                       # the segment cut to nothing, then into row 1
    fd = os.open("/dev/shm" + owner.name, os.O_RDWR)
    os.ftruncate(fd, size)
    os.close(fd)
    for what, call in (("read", lambda: owner.read(1)), ("stamp read", lambda: peer.read(3)),
                       ("write", lambda: peer.write(1, bytes(STAMP_BYTES), bytes(64))),
                       ("clear", lambda: owner.clear(3))):
        try:
            call()
            print(size, what, "done")
        except GpuxferError as exc:
            print(size, what, "refused", type(exc).__name__)
peer.close()
owner.close()
print("ended")
"""


def test_rows_their_owner_shrank_are_no_signal_on_either_side():
    """A decode (hostile, or dying) truncates its rows' segment after a prefill mapped it: the prefill's write of a
    request's rows, and either side's read of a row, never touch memory past the segment's end (a store or load
    there is a SIGBUS, killing the process): each returns or raises a typed error. In a child process (a signal
    would end it, not this run)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _SHRUNK], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert r.stdout.splitlines()[-1] == "ended" and "Traceback" not in r.stderr, (r.stdout, r.stderr)


def test_rows_a_full_dev_shm_cannot_hold_stay_in_messages(rows, monkeypatch):
    """``/dev/shm`` too full for a decode's rows (a container's small one): the rows are refused when the decode makes
    them (their pages taken then), so its requests' rows go in messages, and nothing of the segment is left; a
    segment made sparse would take its pages at the prefill's writes, where a store into a mapping of a full tmpfs is
    a SIGBUS."""
    import errno
    import os

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    before = set(os.listdir("/dev/shm"))
    assert AuxRows.create(rows.args[rows.dec], rows.dec.uid) is None
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("gpuxfer-rows-")]


def test_a_room_sent_after_its_decode_registered_again_takes_its_row_by_the_success_message(rows):
    """SGLang drops a prefill rank's cached bootstrap infos (a request's waiting timeout, a failed send) and its next
    receiver registers the decode rank again, with a new notification slot, while rooms named under the first
    registration are in flight: their last pushes then bump the new slot, and their rows are stamped with it. Every
    page and row of such a room landed; the poll does not end it (it watches the first slot), and its Success
    message takes the row where the word of the stamp's slot holds the stamp's value: Success, every byte, as a row
    message naming the new slot would have ended it."""
    token = rows.name()                                     # armed on SLOT, the first registration's
    new = rows.decode.landings.new_slot()
    rows.pushes.add_decode("decode", rows.dec.metadata(), {}, new, DECODE, registration=advertised(rows.dec_rows))
    rows.send(token)
    assert rows.request_status[ROOM] == KVPoll.Success
    assert rows.dec_rows.stamp(DST_ROW)[:2] == (int(token), new)
    rows.decode.inbox.on_message([ROOM, KVPoll.Success, 0, None, token])
    assert rows.decode.request_status[ROOM] != KVPoll.Failed, rows.decode.failure_records.get(ROOM)
    assert rows.decode.applied == [(ROOM, KVPoll.Success)]
    assert rows.row(rows.dst_aux, DST_ROW) == rows.row(rows.src_aux, 5)
    assert rows.decode_pages_equal([1, 2, 3, 4], [9, 10, 11, 12])


def test_a_success_message_over_a_stamp_whose_word_never_reached_its_value_fails(rows):
    """The Success message's check follows the stamp's slot: a stamp naming the request's token but a slot this rank
    never handed out, or a value past its word, still fails the room, nothing of the row written."""
    for room, slot, value in ((ROOM, 40, 1), (ROOM + 1, SLOT, 1 << 40)):      # (a room each: Failed is final)
        token = rows.name(room)
        rows.stamp_row((int(token), slot, value))
        rows.decode.inbox.on_message([room, KVPoll.Success, 0, None, token])
        assert rows.decode.request_status[room] == KVPoll.Failed and rows.decode.applied == []
        assert not any(any(r) for r in rows.row(rows.dst_aux, DST_ROW))
        rows.decode.inbox.forget(room)


def test_rows_left_by_a_killed_decode_are_swept_by_the_next_one_a_minute_on(tmp_path):
    """SGLang ends its processes without a teardown: a decode's rows outlive it. The next decode of the host removes
    those whose creator is gone and that no process holds, once a minute old (their pages are taken); younger ones,
    and those a live process holds, stay."""
    import os
    import time as _time
    from gpuxfer.common import hold_shm, open_shm, unlink_shm
    from gpuxfer.integrations.sglang.rows import ORPHAN_AGE_S, RowSegment
    gone = 0x7FFFFFF0                       # (no process has this pid)
    names = {k: f"/gpuxfer-rows-{gone:x}-{i:012x}" for i, k in enumerate(("old", "young", "held"), 0xA0)}
    fds = {k: open_shm(n, 4096, create=True) for k, n in names.items()}
    holder = hold_shm(names["held"])
    try:
        for k in ("old", "held"):
            past = _time.time() - ORPHAN_AGE_S - 5
            os.utime(f"/dev/shm{names[k]}", (past, past))
        seg = RowSegment.create("a-uid", 2, 128)
        seg.close()
        left = {k for k, n in names.items() if os.path.exists(f"/dev/shm{n}")}
        assert left == {"young", "held"}, left
    finally:
        os.close(holder)
        for k, n in names.items():
            os.close(fds[k])
            unlink_shm(n)
