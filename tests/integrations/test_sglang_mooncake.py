"""The reference beside gpuxfer's SGLang backend: SGLang's built-in Mooncake backend (``mooncake``, Mooncake's
transfer engine over TCP: ``MC_FORCE_TCP=1``, ``MOONCAKE_PROTOCOL=tcp``) through the same harness
(tests/integrations/sglang_instance.py, sglang_queues.py): SGLang's own bootstrap server, queues and
``send_kv_chunk`` in two processes, the shared transfer engine made as SGLang's distributed bootstrap makes it,
every byte of every page and metadata row checked, the same faults. What both backends pass is what SGLang's
classes ask of a backend; where Mooncake's outcome differs from gpuxfer's, the test says so.

Mooncake's TCP wheel (``mooncake-transfer-engine-non-cuda``) links libibverbs and libnl; where the machine has
no system copy, the copies NIXL's wheel bundles are put on the spawned ranks' library path.

Without SGLang these skip (unless GPUXFER_REQUIRE_SGLANG=1); without Mooncake they skip with the reason, unless
GPUXFER_TEST_REQUIRE_MOONCAKE=1, which makes a missing Mooncake a failure.
"""
from __future__ import annotations

import os
import random

import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang_instance import MOONCAKE_ENV, mooncake_library_path  # noqa: E402
from test_sglang_backend import (ENV, WAITING_TIMEOUT_S, _close, _decode_requests,  # noqa: E402
                                 _kill_decode_under_posted_rooms, _kill_prefill_under_waiting_rooms,
                                 _land_through_queue, _Pages, _queued_then_direct, _ready_pair)


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    """Mooncake importable by the spawned ranks (``LD_LIBRARY_PATH`` set for them where needed), else a skip
    with the reason (a failure with GPUXFER_TEST_REQUIRE_MOONCAKE=1)."""
    from gpuxfer import config
    why, path = mooncake_library_path(str(tmp_path_factory.mktemp("mooncake-libs")))
    if why is not None:
        if config.get("GPUXFER_TEST_REQUIRE_MOONCAKE"):
            pytest.fail(f"GPUXFER_TEST_REQUIRE_MOONCAKE=1 but {why}")
        pytest.skip(why)
    old = os.environ.get("LD_LIBRARY_PATH")
    if path is not None:
        os.environ["LD_LIBRARY_PATH"] = path            # what spawn hands the ranks
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LD_LIBRARY_PATH", None)
        else:
            os.environ["LD_LIBRARY_PATH"] = old


def _pair(page_size: int, mla: bool = False):
    return _ready_pair(page_size, {**ENV, **MOONCAKE_ENV}, mla, backend="mooncake")


@pytest.fixture(scope="module")
def pair(mooncake):
    """MHA pool, 16-token pages."""
    p, d = _pair(16)
    try:
        yield p, d, _Pages(20)
    finally:
        codes = _close(p, d)
        assert codes == [0, 0], codes


def test_mooncake_rooms_land_byte_for_byte(pair):
    """64 concurrent requests of 1 to 9 pages through both sides' queues (chunked prefill, partial last pages),
    then 16 with the prefill's ``KVSender`` called directly: every page and metadata row lands where the
    decode's queue put it, nothing else changes, both sides Success: the exchange gpuxfer's backend passes."""
    p, d, pages = pair
    _queued_then_direct(p, d, pages, 8000, random.Random(21))


def test_mooncake_aborts_on_either_side_fail_both_and_write_nothing(pair):
    """gpuxfer's abort test on Mooncake: a request the decode aborts while the prefill holds it and one the
    prefill aborts once the decode's pages arrived end Failed on both sides (the second on the decode only at
    SGLang's waiting timeout); one beside them lands; the aborted requests' pages and rows keep the decode's own
    bytes."""
    p, d, pages = pair
    plan = [pages.take(room, 4) for room in (8200, 8201, 8202)]
    rooms = [r for r, _ in plan]
    rows = {r: pages.rows.pop() for r in rooms}
    assert set(p.call("senders", rooms).values()) == {"Bootstrapping"}
    _decode_requests(d, plan, {r: 4 * 16 for r in rooms})
    d.call("abort", [8200])
    actions = {8200: (2, "hold"), 8201: (2, "abort"), 8202: (2, "send")}
    assert p.call("send", [(r, src, rows[r], *actions[r]) for r, src in plan], 60, timeout=120) == []
    decode = d.call("finish", rooms, 60, timeout=120)
    prefill = p.call("wait", rooms, 60, timeout=120)
    assert decode[8202][0] == prefill[8202][0] == "Success", (decode, prefill)
    for room in (8200, 8201):
        assert decode[room][0] == "Failed" and prefill[room][0] == "Failed", (room, decode, prefill)
    # the decode's abort ends it at once; the prefill's reaches the decode only by its waiting timeout
    # (gpuxfer's backend sends the prefill's abort on: the decode fails it at once)
    assert decode[8200][1] < WAITING_TIMEOUT_S / 2 and "Aborted" in decode[8200][2], decode
    assert decode[8201][1] >= WAITING_TIMEOUT_S and "timed out" in decode[8201][2], decode
    res = d.call("check", [8202], 1, (), rows, dict(plan))
    assert res["bad"] == {8202: 0} and res["others_changed"] == 0, res
    p.call("clear", rooms)


def test_mooncake_mla_pool_then_killed_prefill_fails_the_decode_within_its_timeout(mooncake):
    """An MLA pool at 1-token pages: requests of 1 to 301 pages land byte for byte; then the prefill rank is
    killed while the decode's next requests wait: SGLang's heartbeat fails each within the waiting timeout,
    nothing written."""
    p, d = _pair(1, mla=True)
    try:
        pages = _Pages(22)
        _land_through_queue(p, d, [pages.take(room, n) for room, n in ((8300, 1), (8301, 7), (8302, 33), (8303, 301))],
                            1, random.Random(22))
        _kill_prefill_under_waiting_rooms(p, d, [pages.take(room, 3) for room in range(8310, 8318)])
    finally:
        codes = _close(p, d)
    assert codes == [-9, 0], codes


def test_mooncake_killed_decode_fails_the_prefill_within_its_timeout(mooncake):
    """64-token pages: 16 requests land byte for byte; then the decode rank is killed once its next requests'
    pages reached the prefill: every request ends Failed on the prefill within the waiting timeout."""
    p, d = _pair(64)
    try:
        pages = _Pages(23)
        rng = random.Random(23)
        _land_through_queue(p, d, [pages.take(room, rng.randint(1, 5)) for room in range(8400, 8416)], 64, rng)
        prefill, _, took = _kill_decode_under_posted_rooms(p, d, [pages.take(room, 3) for room in range(8500, 8506)])
        assert took < WAITING_TIMEOUT_S + 10, prefill
    finally:
        codes = _close(p, d)
    assert codes == [0, -9], codes
