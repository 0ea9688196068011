"""What a broken or hostile decode's metadata message may make the SGLang backend's prefill do, beyond
tests/integrations/test_sglang_bounds.py: the manager's ``DecodeRanks`` driven in this process with the stand-in
prefill of tests/integrations/test_sglang_pipeline.py (no agent, no sockets). A destination whose decode prefix
length no SGLang scheduler could send through is refused on arrival, its room failed and its rank told.
"""
from __future__ import annotations

import numpy as np
import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402

from gpuxfer.integrations.sglang.requests import TransferInfo  # noqa: E402
from test_sglang_bounds import _failed_told, _prefill  # noqa: E402
from test_sglang_pipeline import DECODE, ROOM  # noqa: E402


def _meta(room, prefix_len, pages=(9, 10), token=b"1"):
    """Decode rank ``decode``'s metadata message for ``room`` naming ``pages`` past a ``prefix_len``-token prefix
    its own cache holds (SGLang's ``decode_prefix_len``)."""
    return TransferInfo.from_zmq([str(room).encode(), DECODE[0].encode(), str(DECODE[1]).encode(), b"decode",
                                  np.array(pages, dtype=np.int32).tobytes(), b"3", b"1",
                                  str(prefix_len).encode(), token])


@pytest.mark.parametrize("prefix_len", [-16, -1, -(10 ** 30)])
def test_a_negative_decode_prefix_len_is_refused_and_told_failed(prefix_len):
    """SGLang's prefill starts sending a request at the decode's prefix length (``start_send_idx``) and counts its
    pages from the prompt's length less it: a negative one makes the first chunk's slice of the request's tokens
    empty and the page count one the chunks never reach, so no chunk is ever the last and the request holds its
    prefill KV with no timeout (a decode that never aborts it keeps it forever). Refused on arrival instead:
    stored nowhere, the room the request holds failed, the rank told."""
    mgr = _prefill()
    mgr.hold_room(ROOM)
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, prefix_len))
    assert ROOM not in mgr.transfer_infos and ROOM not in mgr.req_to_decode_prefix_len
    assert mgr.request_status[ROOM] == KVPoll.Failed and "prefix length" in mgr.failure_records[ROOM]
    assert "prefix length" in _failed_told(mgr, ROOM)[0][3]


def test_a_decode_prefix_len_of_zero_or_more_is_taken():
    mgr = _prefill()
    mgr.hold_room(ROOM)
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, 64))
    assert mgr.request_status[ROOM] == KVPoll.WaitingForInput and mgr.req_to_decode_prefix_len[ROOM] == 64
    assert not mgr.statuses()
