"""A second hostile review of the metadata rows in the decode's host memory (:mod:`gpuxfer.integrations.sglang.rows`):
two prefill processes writing one decode row at once (a request given up on the decode, whose row index SGLang hands
the next request while the given-up request's prefill is still writing it), a late Success message for a room the
decode already gave up, and the notification words' host copy cut short by another process (no SIGBUS: the words are
a memory file sealed at its size). Over
tests/integrations/test_sglang_rows.py's two real agents (host emulation).
"""
from __future__ import annotations

import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402

from gpuxfer.integrations.sglang.rows import STAMP_BYTES, RowSegment, encode_stamp  # noqa: E402
from test_sglang_rows import AUX, DST_ROW, ROOM, SLOT, SRC_ROW, rows  # noqa: E402,F401 (rows: the fixture)


def _stale_writer(mgr):
    """Another prefill process's handle on the decode's rows (it opened them from its own registration of the rank),
    and the rows of the request it still writes: its own bytes, never this request's."""
    seg = mgr.dec_rows.segment
    other = RowSegment.open(seg.name, mgr.dec.uid, mgr.dec_rows.rows, mgr.dec_rows.row_bytes)
    return other, bytes([0xA5]) * (mgr.dec_rows.row_bytes - STAMP_BYTES)


@pytest.mark.parametrize("ends_by", ["word", "success-message"])
def test_rows_another_prefill_wrote_between_this_requests_rows_and_stamp_never_end_success(rows, monkeypatch,
                                                                                           ends_by):
    """Request A was given up on the decode (an abort without the deferred release, its waiting timeout) while its
    prefill P1 was writing A's row; SGLang hands A's row index to request B, whose prefill P2 writes B's row. The
    writes of each (stamp zeroed and rows, then stamp) interleave: P2 zeroes the stamp and writes B's rows, P1 zeroes
    the stamp and writes A's rows, P2 writes B's stamp (P1's stamp comes later: its thread waits for the GIL behind
    SGLang's scheduler, or P1 died). The row then holds A's rows under B's whole stamp, read the same before and
    after them: B must not end Success over A's rows, by its word nor by its Success message."""
    token = rows.name()
    other, stale = _stale_writer(rows)
    seg = rows.pushes._aux_rows["decode"]
    at = DST_ROW * rows.dec_rows.row_bytes
    real_set, calls = seg._set, []

    def set_then_stale(where, data):
        real_set(where, data)
        calls.append(where)
        if len(calls) == 1:                 # B's rows written, its stamp not yet: P1's zero and rows
            other._set(at, bytes(STAMP_BYTES))
            other._set(at + STAMP_BYTES, stale)
    monkeypatch.setattr(seg, "_set", set_then_stale)
    try:
        rows.send(token)
        assert rows.request_status[ROOM] == KVPoll.Success      # (the prefill's side went as always)
        if ends_by == "word":
            landed = rows.landed(tries=50)
            if landed:
                rows.decode.inbox.end_by_word(ROOM)
        else:
            rows.decode.inbox.on_message([ROOM, KVPoll.Success, 0, None, token])
        # (the fake decode manager records the Success a status message applies)
        ended = KVPoll.Success if (ROOM, KVPoll.Success) in rows.decode.applied else rows.decode.request_status[ROOM]
        got = rows.row(rows.dst_aux, DST_ROW)
        assert got != [stale[:AUX[0]], stale[AUX[0]:]], (ended, got)
        assert ended != KVPoll.Success or got == rows.row(rows.src_aux, SRC_ROW), (ended, got)
    finally:
        other.close()


def test_a_whole_row_still_ends_success_by_its_word_and_by_its_success_message(rows):
    """(The check above refuses torn rows only: a row written whole by its own prefill lands, byte for byte.)"""
    token = rows.name()
    rows.send(token)
    assert rows.landed()
    rows.decode.inbox.end_by_word(ROOM)
    assert rows.decode.request_status[ROOM] == KVPoll.Success
    assert rows.row(rows.dst_aux, DST_ROW) == rows.row(rows.src_aux, SRC_ROW)


def test_a_stamp_names_the_rows_it_was_written_with():
    """A stamp is bound to its rows: the same stamp over other rows (a byte of them changed) is no stamp."""
    from gpuxfer.integrations.sglang.rows import decode_stamp
    rows_bytes = bytes(range(56))
    whole = encode_stamp(7, SLOT, 3, rows_bytes) + rows_bytes
    assert decode_stamp(whole) == (7, SLOT, 3)
    for at in range(STAMP_BYTES, len(whole)):
        torn = bytearray(whole)
        torn[at] ^= 0x01
        assert decode_stamp(bytes(torn)) is None, at


def _run_child(code: str, env=None):
    """``code`` run in a child process (a signal ends it, not this run); the shared-memory segments it names
    (``segment <name>`` lines) unlinked once it ended, as a process killed by a signal leaves them."""
    import subprocess
    import sys
    from gpuxfer.common import unlink_shm
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    for line in r.stdout.splitlines():
        if line.startswith("segment "):
            unlink_shm(line.split()[1])
    return r


#: a child's code that truncates host words (by every path a process of the user has to them: the segment's name in
#: /dev/shm, the memory file's descriptor through /proc), printing ``cut`` or ``sealed`` (refused) for each
_CUT_SHORT = r"""
import os


def cut_short(name):
    paths = ["/dev/shm" + name]
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink("/proc/self/fd/" + fd) == "/memfd:" + name[1:] + " (deleted)":
                paths.append("/proc/self/fd/" + fd)
        except OSError:
            pass
    for path in paths:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            os.ftruncate(fd, 0)
            print("cut", path, flush=True)
        except PermissionError:
            print("sealed", path, flush=True)
        finally:
            os.close(fd)
"""

_WORDS_SHRUNK = _CUT_SHORT + r"""
from gpuxfer.errors import GpuxferError
from gpuxfer.integrations.sglang.landing import Landings
from gpuxfer.kv import KVAgent
from gpuxfer.platforms import get_platform
dec = KVAgent("sglang-decode-test", platform=get_platform("host"), timeout_s=5, host_notify=True)
print("segment", dec.host_words.name, flush=True)
landings = Landings(dec.notification, dec.host_notification)
slot = landings.new_slot()
print("word", landings.word(slot), flush=True)
cut_short(dec.host_words.name)     # (any process of the user: a prefill opens it read-write)
try:
    print("word", landings.word(slot), flush=True)
except GpuxferError as exc:
    print("refused", type(exc).__name__, flush=True)
dec.close()
print("ended")
"""


def test_host_words_another_process_cut_short_are_no_signal_in_the_decodes_poll():
    """The decode's poll reads its notification words' host copy with a load (:class:`.landing.Landings`). A process
    of the same user (a hostile or broken prefill of the host, which opened the segment to write it) truncates the
    segment: the poll must return or raise a typed error, never end the decode with a SIGBUS. In a child process."""
    r = _run_child(_WORDS_SHRUNK)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert r.stdout.splitlines()[-1] == "ended" and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert _tried_to_cut(r.stdout), r.stdout


def test_a_success_message_for_a_room_the_decode_already_failed_writes_no_row(rows):
    """The decode gave the request up (its abort, its waiting timeout: Failed) while its prefill, which had not seen
    the ABORT yet, wrote its row and sent Success. The row index is the given-up request's until SGLang releases it,
    and then the next request's: the late Success message writes nothing into SGLang's aux buffers (a row message
    after the room ended is dropped the same way)."""
    token = rows.name()
    rows.send(token)
    rows.decode.update_status(ROOM, KVPoll.Failed)          # (the receiver's abort)
    rows.decode.inbox.on_message([ROOM, KVPoll.Success, 0, None, token])
    assert rows.decode.request_status[ROOM] == KVPoll.Failed
    assert not any(any(r) for r in rows.row(rows.dst_aux, DST_ROW))


_PUSH_INTO_SHRUNK_WORDS = _CUT_SHORT + r"""
from sglang.srt.disaggregation.base.conn import KVPoll
from test_sglang_rows import RowAgents
mgr = RowAgents()
print("segment", mgr.dec.host_words.name, flush=True)
print("segment", mgr.dec_rows.segment.name, flush=True)
cut_short(mgr.dec.host_words.name)     # (the decode owns them: it may cut them short)
mgr.send(mgr.name())
mgr.agent.platform.synchronize(mgr.agent.stream, 30)
print("prefill", mgr.request_status, flush=True)
mgr.close()
print("ended")
"""


def test_host_words_their_decode_cut_short_are_no_signal_in_the_prefills_push():
    """A decode truncates its notification words' segment after the prefill mapped it (add_peer); the prefill's next
    last push notifies it: the prefill must fail that request (or land it), never end with a SIGBUS. In a child."""
    import os
    import pathlib
    env = {**os.environ, "PYTHONPATH": f"{pathlib.Path(__file__).resolve().parent}:{os.environ.get('PYTHONPATH', '')}"}
    r = _run_child(_PUSH_INTO_SHRUNK_WORDS, env)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert r.stdout.splitlines()[-1] == "ended" and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert _tried_to_cut(r.stdout), r.stdout


def _tried_to_cut(stdout: str) -> bool:
    """Whether the child found the words to cut short (a path to them it opened read-write)."""
    return any(line.startswith(("cut ", "sealed ")) for line in stdout.splitlines())
