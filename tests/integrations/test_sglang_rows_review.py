"""A hostile review of the metadata rows through the agent (:mod:`gpuxfer.integrations.sglang.rows`): forged row
indices, inconsistent ``KVArgs`` aux lists, a room of several prefill ranks whose first rank's row message arrives
before the request is named to the next, a device error while a row is read or written, and a push whose KV copy
failed while its row landed. Over tests/integrations/test_sglang_rows.py's two real agents (host emulation).
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402

from gpuxfer.errors import BadInput, GpuxferError  # noqa: E402
from gpuxfer.integrations.sglang.landing import landing_frame  # noqa: E402
from gpuxfer.integrations.sglang.pushes import AUX_TAG  # noqa: E402
from gpuxfer.integrations.sglang.rows import AuxRows  # noqa: E402
from test_sglang_rows import AUX, DECODE, DST_ROW, ROOM, ROWS, SLOT, RowAgents, _fail_copies_into  # noqa: E402


@pytest.fixture
def rows():
    mgr = RowAgents()
    yield mgr
    mgr.close()


@pytest.mark.parametrize("index", [2.0, 2.7, -0.5, float("nan"), float("inf"), "2", b"2", None, True, False,
                                   -1, ROWS, 1 << 64, np.float32(1)],
                         ids=lambda v: repr(v))
def test_a_row_index_that_is_no_int_of_the_rows_is_refused_typed(rows, index):
    """Every public call of :class:`AuxRows` refuses an index that is not an int (a float truncated would name
    another row; a string, None or NaN raised Python's own errors), a bool, or one outside the rows: ``BadInput``,
    nothing written."""
    before = rows.dec_rows.tensor.clone()
    for call in (lambda: rows.dec_rows.clear(index), lambda: rows.dec_rows.stamp(index),
                 lambda: rows.dec_rows.take(index, 1), lambda: rows.pushes.rows.stage(index, 1, SLOT, 1, rows.agent.stream)):
        with pytest.raises(BadInput):
            call()
    assert bool((rows.dec_rows.tensor == before).all())


@pytest.mark.parametrize("index", [np.int64(DST_ROW), np.uint8(DST_ROW), np.int32(DST_ROW)], ids=repr)
def test_numpy_int_row_indices_name_their_row(rows, index):
    rows.dec_rows.clear(index)
    assert rows.dec_rows.stamp(index) is None


@pytest.mark.parametrize("ptrs", [1, 3], ids=["fewer-pointers", "more-pointers"])
def test_aux_lists_of_different_lengths_register_no_rows(rows, ptrs, monkeypatch):
    """``KVArgs`` naming another number of aux buffer pointers than row sizes: no rows are registered (each
    request's row then goes in a message, which the decode checks buffer for buffer)."""
    args = rows.args[rows.agent]
    args.aux_data_ptrs = (list(args.aux_data_ptrs) * 2)[:ptrs]
    monkeypatch.setattr(rows.agent, "register_group", lambda *a, **k: None)     # (its group is registered)
    assert AuxRows.create(rows.agent, args) is None


def test_a_row_staged_from_fewer_buffers_than_its_block_never_lands_success(rows):
    """The prefill's aux pointers name fewer buffers than the rows registered (its ``KVArgs`` changed under it):
    a row staged from them would leave the rest of its block as an earlier request left it, and the decode would
    end the request Success over those bytes. The stage is refused (``BadInput``): the request fails, nothing of
    the block is written."""
    src = rows.pushes.rows
    src._write(5, 0, bytes([0xEE]) * src.row_bytes)        # an earlier request's row left in the block
    args = rows.args[rows.agent]
    args.aux_data_ptrs = list(args.aux_data_ptrs)[:1]
    token = rows.name()
    rows.send(token)
    assert rows.request_status[ROOM] == KVPoll.Failed and "BadInput" in rows.failure_records[ROOM]
    assert src._read(5, 0, src.row_bytes) == bytes([0xEE]) * src.row_bytes
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


def _device_error(*a, **k):
    raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")


def test_a_device_error_reading_a_row_is_typed_and_fails_the_room(rows, monkeypatch):
    """The decode's reads of its rows fail on the device (a GPU's sticky error): the poll never raises into
    SGLang's scheduler, and the Success message fails the room, typed, instead of raising in the control thread."""
    token = rows.name()
    rows.send(token)
    monkeypatch.setattr(rows.dec_rows, "_read", _device_error)
    with pytest.raises(GpuxferError):
        rows.dec_rows.stamp(DST_ROW)
    assert not rows.landed(tries=20)
    rows.decode.inbox.on_message([ROOM, KVPoll.Success, 0, None, token])
    assert rows.decode.request_status[ROOM] == KVPoll.Failed and rows.decode.applied == []
    assert "metadata row" in rows.decode.failure_records[ROOM]


def test_a_device_error_clearing_a_row_is_typed(rows, monkeypatch):
    """Naming a request whose row's stamp cannot be zeroed: a typed error (the receiver's ``send_metadata`` fails
    that room alone), never Python's."""
    monkeypatch.setattr(rows.dec_rows, "_write", _device_error)
    with pytest.raises(GpuxferError):
        rows.name()
    monkeypatch.setattr(rows.pushes.rows, "_platform", SimpleNamespace(copy_async=_device_error))
    with pytest.raises(GpuxferError):
        rows.pushes.rows.stage(1, 7, SLOT, 1, rows.agent.stream)


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
            mgr.pushes.add_decode("decode", mgr.dec.metadata(), {}, SLOT, mgr.pushes.endpoint("decode"))
        assert mgr.pushes._aux_rows["decode"] == 0
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
    assert AuxRows.create(rows.dec, args) is None
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


def test_a_row_copy_the_device_never_ends_times_out_typed():
    """A device that never completes a row's copy: the wait gives up after the agent's timeout with
    ``TransferTimeout`` naming what it was doing (an SGLang thread is never held for good)."""
    import time
    from gpuxfer.errors import TransferTimeout
    from gpuxfer.integrations.sglang.rows import wait_until
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout, match="reading metadata row 3"):
        wait_until(lambda: False, 0.05, "reading metadata row 3")
    assert time.monotonic() - t0 < 30           # (bounded: a hang guard)
    calls = iter([False, False, True])
    wait_until(lambda: next(calls), 5.0, "writing metadata row 1")


@pytest.mark.parametrize("index", [2.5, 2.0, -1, True, "2"], ids=repr)
def test_a_prefill_row_index_that_is_no_int_fails_its_room_sending_no_row(rows, index):
    """The prefill's own metadata row index (SGLang's ``aux_index`` of its request) that is not an int >= 0: the
    room fails, and no row goes out (a float cut to an int named another request's row)."""
    from gpuxfer.integrations.sglang.requests import TransferInfo
    token = rows.name()
    before = rows.dec_rows.tensor.clone()
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
    assert bool((rows.dec_rows.tensor == before).all())
