"""gpuxfer's SGLang backend over the NIXL route of its agents: the two-process exchange of
tests/integrations/test_sglang_backend.py (SGLang's own prefill and decode queues, tests/integrations/sglang_instance.py)
with both ranks' agents made with NIXL (``GPUXFER_KV_REMOTE=nixl``) and every peer taking the NIXL route
(``GPUXFER_KV_ROUTE=nixl``: one machine stands in for two hosts), UCX over loopback (``UCX_NET_DEVICES=lo``), the
KV pools registered with NIXL as DRAM on the host emulation. Every byte of every page and metadata row is
checked; a room ends on the decode by the prefill's Success message alone (a NIXL notification follows its own
transfer, not the room's earlier ones); a dead rank fails the survivor's requests within its timeout.

Without SGLang these skip (unless GPUXFER_REQUIRE_SGLANG=1); without NIXL they skip with the reason, unless
GPUXFER_TEST_REQUIRE_NIXL=1, which makes a missing NIXL a failure.
"""
from __future__ import annotations

import random

import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from test_sglang_backend import (ENV, WAITING_TIMEOUT_S, _close, _kill_decode_under_posted_rooms,  # noqa: E402
                                 _kill_prefill_under_waiting_rooms, _land_through_queue, _Pages,
                                 _queued_then_direct, _ready_pair, _send_directly)

NIXL_ENV = {**ENV, "GPUXFER_KV_REMOTE": "nixl", "GPUXFER_KV_ROUTE": "nixl", "UCX_NET_DEVICES": "lo"}


def _need_nixl() -> None:
    from gpuxfer import config
    from gpuxfer.kv.nixl_route import nixl_reason
    from gpuxfer.platforms.host import HostPlatform
    why = nixl_reason(HostPlatform)
    if why is not None:
        if config.get("GPUXFER_TEST_REQUIRE_NIXL"):
            pytest.fail(f"GPUXFER_TEST_REQUIRE_NIXL=1 but the NIXL route cannot run: {why}")
        pytest.skip(why)


def _pair(page_size: int, mla: bool = False):
    """A prefill and a decode rank over the NIXL route, started together and ready."""
    _need_nixl()
    return _ready_pair(page_size, NIXL_ENV, mla)


def _took_nixl(p, d) -> None:
    """Both agents have a NIXL side, the prefill added the decode rank on the NIXL route, and neither rank
    logged an error (a control message that failed)."""
    routes, decode = p.call("routes"), d.call("routes")
    assert routes["nixl"] and decode["nixl"], (routes, decode)
    assert list(routes["peers"].values()) == ["nixl"], routes
    assert routes["errors"] == decode["errors"] == [], (routes, decode)


@pytest.fixture(scope="module")
def pair():
    """MHA pool, 16-token pages."""
    p, d = _pair(16)
    try:
        yield p, d, _Pages(10)
    finally:
        codes = _close(p, d)
        assert codes == [0, 0], codes


def test_rooms_land_byte_for_byte_over_nixl(pair):
    """64 concurrent requests of 1 to 9 pages through both sides' queues (chunked prefill, partial last pages),
    then 16 with the prefill's ``KVSender`` called directly: every page of every KV entry and every metadata row
    lands where the decode's queue put it, nothing else changes; the decode rank was added on the NIXL route."""
    p, d, pages = pair
    _queued_then_direct(p, d, pages, 7000, random.Random(11))
    _took_nixl(p, d)


def test_a_room_whose_success_message_is_lost_is_not_ended_by_a_word(pair):
    """The prefill's Success messages dropped: on the NIXL route a room's notification would follow its last
    push alone, so the prefill announces no value and the decode, its pages written, still waits for the
    message (then its scheduler aborts the rooms: Failed with SGLang's reason, never Success)."""
    p, d, pages = pair
    plan = [pages.take(room, 3) for room in range(7200, 7204)]
    rooms = [r for r, _ in plan]
    rows = {r: pages.rows.pop() for r in rooms}
    assert p.call("drop_success", True)
    try:
        prefill = _send_directly(p, d, plan, {r: (1, "send") for r in rooms}, rows)
        assert {s for s, _ in prefill.values()} == {"Success"}, prefill
        decode = d.call("finish", rooms, 2, timeout=60)
        assert {s for s, _, _ in decode.values()} == {"Pending"}, decode
        res = d.call("check", rooms, 1, (), rows, dict(plan))   # the bytes are there all the same
        assert res["bad"] == {r: 0 for r in rooms} and res["others_changed"] == 0, res
        d.call("abort", rooms)
        decode = d.call("finish", rooms, 30, timeout=60)
        assert {s for s, _, _ in decode.values()} == {"Failed"}, decode
    finally:
        p.call("drop_success", False)
    p.call("clear", rooms)


def test_mla_pool_over_nixl_then_killed_prefill_fails_the_decode_within_its_timeout():
    """An MLA pool at 1-token pages: requests of 1 to 301 pages land byte for byte; then the prefill rank is
    killed while the decode's next requests wait: SGLang's heartbeat fails each well within the waiting timeout,
    nothing written."""
    p, d = _pair(1, mla=True)
    try:
        pages = _Pages(12)
        _land_through_queue(p, d, [pages.take(room, n) for room, n in ((7300, 1), (7301, 7), (7302, 33), (7303, 301))],
                            1, random.Random(12))
        _took_nixl(p, d)
        _kill_prefill_under_waiting_rooms(p, d, [pages.take(room, 3) for room in range(7310, 7318)])
    finally:
        codes = _close(p, d)
    assert codes == [-9, 0], codes


def test_killed_decode_fails_the_prefill_over_nixl_within_its_timeout():
    """64-token pages: 16 requests land byte for byte; then the decode rank is killed once its next requests'
    pages reached the prefill: their NIXL pushes to the dead rank end in NIXL's error or the timeout, never a
    Success, and every request ends Failed within the timeout."""
    p, d = _pair(64)
    try:
        pages = _Pages(13)
        rng = random.Random(13)
        _land_through_queue(p, d, [pages.take(room, rng.randint(1, 5)) for room in range(7400, 7416)], 64, rng)
        _took_nixl(p, d)
        plan = [pages.take(room, 3) for room in range(7500, 7506)]
        prefill, reasons, took = _kill_decode_under_posted_rooms(p, d, plan)
        assert took < WAITING_TIMEOUT_S, prefill
        assert all("NixlError" in r or "TransferTimeout" in r for r in reasons.values()), reasons
    finally:
        codes = _close(p, d)
    assert codes == [0, -9], codes


def test_mha_pool_at_different_tp_sizes_lands_over_nixl():
    """Head slicing over the NIXL route: an MHA pool of 4 KV heads from a prefill at TP 2 to a decode at TP 1
    (each prefill rank's two heads into its half of every token row of the decode's pages: one NIXL descriptor
    per token row, page and entry); every byte of the decode's heads checked, nothing else written, and both
    prefill ranks added the decode rank on the NIXL route."""
    _need_nixl()
    from test_sglang_tp import _mha_lands
    _mha_lands(2, 1, 4, 36, env=NIXL_ENV, after=lambda prefill, decode: [_took_nixl(p, decode[0]) for p in prefill])
