"""gpuxfer as SGLang 0.5.23's transfer backend, through SGLang's own classes: two spawned processes (a
prefill rank with SGLang's real bootstrap server, ``PrefillBootstrapQueue`` and ``send_kv_chunk``; a decode
rank with SGLang's ``DecodePreallocQueue`` and ``DecodeTransferQueue`` run by ``process_decode_queue``), the
backend chosen by name through the ``sglang.srt.plugins`` entry point (tests/integrations/sglang_instance.py,
sglang_queues.py), MHA and MLA pools at 1-, 16- and 64-token pages, every byte of every page and metadata row
checked.

SGLang is not a dependency: without it these tests skip, unless GPUXFER_REQUIRE_SGLANG=1 (CI's SGLang step),
which makes a missing SGLang a failure.
"""
from __future__ import annotations

import random
import time
import socket

import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang_instance import Rank  # noqa: E402

WAITING_TIMEOUT_S = 20          # SGLang's decode-side limit for a room's transfer (and the backend's waits)
HEARTBEAT_S = 2                 # SGLang's minimum heartbeat interval; one miss marks the prefill dead
ENV = {"GPUXFER_PLATFORM": "host", "SGLANG_HOST_IP": "127.0.0.1",
       "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S),
       "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT_S),
       "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1"}
PAGES = 1024                    # pages per KV entry on each side (page 0: SGLang's padding, never handed out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(page_size: int, mla: bool = False):
    port = _free_port()
    p = Rank("prefill", port=port, page_size=page_size, pages=PAGES, seed=1, env=ENV, mla=mla)
    d = Rank("decode", port=port, page_size=page_size, pages=PAGES, seed=2, env=ENV, mla=mla)
    return p, d


def _ready_pair(page_size: int, env: dict, mla: bool = False, **extra):
    """A prefill (seed 1) and a decode (seed 2) rank with ``env`` (``extra``: :class:`Rank`'s), started
    together and ready."""
    port = _free_port()
    p = Rank("prefill", port=port, page_size=page_size, pages=PAGES, seed=1, env=env, mla=mla, **extra)
    d = Rank("decode", port=port, page_size=page_size, pages=PAGES, seed=2, env=env, mla=mla, **extra)
    try:
        p.ready(timeout=600)
        d.ready(timeout=600)
    except BaseException:
        _close(p, d)
        raise
    return p, d


def _close(*ranks):
    codes = [r.close() for r in ranks]
    for r in ranks:
        assert not r.proc.is_alive(), f"{r.role} did not exit"
    return codes


class _Pages:
    """Disjoint prefill page and metadata-row numbers, drawn as an allocator hands them out (the decode's come
    from SGLang's own allocators in its queue)."""

    def __init__(self, seed: int):
        rng = random.Random(seed)
        self.src = list(range(1, PAGES))
        rng.shuffle(self.src)
        self.rows = list(range(128))
        rng.shuffle(self.rows)

    def take(self, room: int, n: int):
        src, self.src = self.src[:n], self.src[n:]
        return room, src


@pytest.fixture(scope="module")
def pair():
    """A prefill and a decode rank with 16-token pages, started together (SGLang's import takes seconds)."""
    p, d = _pair(16)
    try:
        p.ready(timeout=600)
        d.ready(timeout=600)
        yield p, d, _Pages(0)
    finally:
        codes = _close(p, d)
        assert codes == [0, 0], codes


def _decode_requests(d, plan, tokens):
    """The decode's requests through SGLang's ``DecodePreallocQueue`` until each one's pages and metadata row
    went to the prefill: each got as many pages as its prefill pages, its receiver WaitingForInput."""
    sent = d.call("requests", [(r, tokens[r]) for r, _ in plan], 60, timeout=120)
    for room, src in plan:
        pages, row, status = sent[room]
        assert status == "WaitingForInput" and len(pages) == len(src) and row is not None, (room, sent[room])
    return sent


def _landed(p, d, plan, prefill, src_rows):
    """Both sides Success (the decode's through ``pop_transferred``), every byte of every page and row
    checked, nothing else changed, the prefill's requests cleared."""
    rooms = [r for r, _ in plan]
    decode = d.call("finish", rooms, 60, timeout=120)
    assert {s for s, _ in prefill.values()} == {"Success"}, prefill
    assert {s for s, _, _ in decode.values()} == {"Success"}, decode
    res = d.call("check", rooms, 1, (), src_rows, dict(plan))
    assert res["bad"] == {r: 0 for r in rooms} and res["checked"] > 0, res
    assert res["others_changed"] == 0, res
    assert set(p.call("clear", rooms).values()) == {None}


def _land_through_queue(p, d, plan, page_size, rng):
    """``plan``'s requests (``(room, prefill pages)``, a partial last page for most) through both sides'
    queues, the prefill sending in chunks of a size that is no page multiple for most: the decode's
    requests preallocated and their pages sent (``DecodePreallocQueue``), the prefill's queue popped and
    each request's chunks sent with ``send_kv_chunk``, the decode's ``DecodeTransferQueue`` handing each to
    its batch; every byte checked."""
    rooms = [r for r, _ in plan]
    tokens = {r: len(src) * page_size - rng.randrange(page_size) for r, src in plan}
    chunks = {r: rng.choice([page_size, 3 * page_size + 5, 40, 300]) for r in rooms}
    assert set(p.call("queue_add", [(r, src, tokens[r], chunks[r]) for r, src in plan]).values()) \
        == {"Bootstrapping"}
    _decode_requests(d, plan, tokens)
    ran = p.call("queue_run", 60, timeout=120)
    assert ran["left"] == [] and ran["failed"] == [], ran
    prefill = p.call("wait", rooms, 60, timeout=120)
    _landed(p, d, plan, prefill, {r: ran["rows"][r] for r in rooms})


def _send_directly(p, d, plan, actions, rows):
    """The prefill's ``KVSender`` s made and driven by direct calls (``actions``: room -> (chunk pages,
    send | abort | hold); ``rows``: room -> the prefill's metadata row), the decode's requests through its
    queues; the prefill's final statuses."""
    rooms = [r for r, _ in plan]
    assert set(p.call("senders", rooms).values()) == {"Bootstrapping"}
    _decode_requests(d, plan, {r: len(src) * 16 for r, src in plan})
    never = p.call("send", [(r, src, rows[r], *actions[r]) for r, src in plan], 60, timeout=120)
    assert never == [], f"the prefill never saw the decode's pages of rooms {never}"
    return p.call("wait", rooms, 60, timeout=120)


def _queued_then_direct(p, d, pages, first_room: int, rng) -> None:
    """64 concurrent requests of 1 to 9 pages (16-token pages) through both sides' queues, then 16 with the
    prefill's ``KVSender`` called directly (chunks of 1, 2 or all pages): every byte checked."""
    _land_through_queue(p, d, [pages.take(room, rng.randint(1, 9)) for room in range(first_room, first_room + 64)],
                        16, rng)
    plan = [pages.take(room, rng.randint(1, 9)) for room in range(first_room + 100, first_room + 116)]
    rows = {r: pages.rows.pop() for r, _ in plan}
    prefill = _send_directly(p, d, plan, {r: (rng.choice([1, 2, 16]), "send") for r, _ in plan}, rows)
    _landed(p, d, plan, prefill, rows)


def test_rooms_land_byte_for_byte(pair):
    """64 concurrent requests of 1 to 9 pages through both sides' SGLang queues (chunked prefill of 16 to 300
    tokens, a partial last page held back to the last chunk): every page of every KV entry and every metadata
    row lands on the pages and row the decode's queue allocated, nothing else changes, both sides Success."""
    p, d, pages = pair
    rng = random.Random(1)
    _land_through_queue(p, d, [pages.take(room, rng.randint(1, 9)) for room in range(1000, 1064)], 16, rng)


def test_sender_calls_land_byte_for_byte(pair):
    """The same exchange with the prefill's ``KVSender.init`` and chunked ``send`` called directly (chunks
    of 1, 2 or all pages), as a scheduler of another SGLang version may make them."""
    p, d, pages = pair
    rng = random.Random(2)
    plan = [pages.take(room, rng.randint(1, 9)) for room in range(1100, 1116)]
    rows = {r: pages.rows.pop() for r, _ in plan}
    prefill = _send_directly(p, d, plan, {r: (rng.choice([1, 2, 16]), "send") for r, _ in plan}, rows)
    _landed(p, d, plan, prefill, rows)


def test_rooms_end_by_their_notification_with_no_success_message(pair):
    """The prefill's Success messages dropped: the decode ends each room when the notification word its
    registration gave the prefill reaches the value the room's metadata row named (its last push bumps it once
    every push of the room landed), and every byte is there."""
    p, d, pages = pair
    rng = random.Random(4)
    assert p.call("drop_success", True)
    try:
        _land_through_queue(p, d, [pages.take(room, rng.randint(1, 9)) for room in range(1300, 1308)], 16, rng)
    finally:
        p.call("drop_success", False)


def test_aborts_on_either_side_fail_both_and_write_nothing(pair):
    """A request the decode's scheduler aborts while its queue waits for the KV (its prefill holding it) and
    one the prefill aborts once the decode's pages arrived: the decode's transfer queue fails and releases
    both at once (not at its timeout) with SGLang's reason, the prefill's end Failed; a request beside them
    lands; the aborted requests' pages and rows keep the decode's own bytes."""
    p, d, pages = pair
    plan = [pages.take(room, 4) for room in (2000, 2001, 2002)]
    rooms = [r for r, _ in plan]
    rows = {r: pages.rows.pop() for r in rooms}
    assert set(p.call("senders", rooms).values()) == {"Bootstrapping"}
    _decode_requests(d, plan, {r: 4 * 16 for r in rooms})
    d.call("abort", [2000])
    actions = {2000: (2, "hold"), 2001: (2, "abort"), 2002: (2, "send")}
    assert p.call("send", [(r, src, rows[r], *actions[r]) for r, src in plan], 60, timeout=120) == []
    decode = d.call("finish", rooms, 60, timeout=120)
    prefill = p.call("wait", rooms, 60, timeout=120)
    assert decode[2002][0] == prefill[2002][0] == "Success", (decode, prefill)
    for room in (2000, 2001):
        assert decode[room][0] == "Failed" and prefill[room][0] == "Failed", (room, decode, prefill)
        assert decode[room][1] < WAITING_TIMEOUT_S / 2, (room, decode)
        assert "Aborted" in decode[room][2], decode[room]
    res = d.call("check", [2002], 1, (), rows, dict(plan))
    assert res["bad"] == {2002: 0} and res["others_changed"] == 0, res
    reasons = p.call("clear", rooms)
    assert "Aborted by the decode" in reasons[2000] and "Aborted" in reasons[2001], reasons


def test_mla_pool_then_killed_prefill_fails_the_decode_within_its_timeout():
    """An MLA pool (one buffer per layer, SGLang's MLA manager path) with 1-token pages: requests of 1 to 301
    pages land byte for byte through both sides' queues; then the prefill rank is killed while the decode's
    next requests wait in its transfer queue: the queue fails and releases every one well within SGLang's
    waiting timeout (its heartbeat finds the dead bootstrap server), without a byte written anywhere."""
    p, d = _pair(1, mla=True)
    try:
        p.ready(timeout=600)
        d.ready(timeout=600)
        pages = _Pages(5)
        landed = [pages.take(room, n) for room, n in ((3100, 1), (3101, 7), (3102, 33), (3103, 301))]
        _land_through_queue(p, d, landed, 1, random.Random(3))
        _kill_prefill_under_waiting_rooms(p, d, [pages.take(room, 3) for room in range(3000, 3008)])
    finally:
        codes = _close(p, d)
    assert codes == [-9, 0], codes


def _kill_decode_under_posted_rooms(p, d, plan) -> tuple[dict, dict, float]:
    """Queue ``plan``'s 3-page rooms (64-token pages) on both sides, kill the decode once its pages reached the
    prefill, run the prefill's queue (their chunks' pushes fail): every room ends Failed on the prefill.
    Returns the prefill's ``{room: (status, seconds)}``, its failure reasons and the seconds from the queue run."""
    rooms = [r for r, _ in plan]
    assert set(p.call("queue_add", [(r, src, 3 * 64, 64) for r, src in plan]).values()) == {"Bootstrapping"}
    _decode_requests(d, plan, {r: 3 * 64 for r in rooms})
    assert p.call("await_status", rooms, "WaitingForInput", 60, timeout=120) == []
    d.proc.kill()
    d.proc.join(30)
    assert d.proc.exitcode == -9, d.proc.exitcode
    t0 = time.monotonic()
    ran = p.call("queue_run", 60, timeout=120)          # popped as bootstrapped
    assert ran["left"] == [] and ran["failed"] == [], ran
    prefill = p.call("wait", rooms, WAITING_TIMEOUT_S + 10, timeout=WAITING_TIMEOUT_S + 60)
    assert {s for s, _ in prefill.values()} == {"Failed"}, prefill
    return prefill, p.call("clear", rooms), time.monotonic() - t0


def _kill_prefill_under_waiting_rooms(p, d, plan) -> None:
    """Queue ``plan``'s 3-page rooms on both sides, kill the prefill before its queue pops them (no chunk sent):
    every room fails on the decode within SGLang's waiting timeout, for the lost prefill, nothing written."""
    rooms = [r for r, _ in plan]
    assert set(p.call("queue_add", [(r, src, 3, 1) for r, src in plan]).values()) == {"Bootstrapping"}
    _decode_requests(d, plan, {r: 3 for r in rooms})
    assert p.call("await_status", rooms, "WaitingForInput", 60, timeout=120) == []
    p.proc.kill()
    p.proc.join(30)
    assert p.proc.exitcode == -9, p.proc.exitcode
    decode = d.call("finish", rooms, WAITING_TIMEOUT_S + 10, timeout=WAITING_TIMEOUT_S + 60)
    assert {s for s, _, _ in decode.values()} == {"Failed"}, decode
    assert max(t for _, t, _ in decode.values()) < WAITING_TIMEOUT_S, decode
    assert all("Lost connection with prefill" in r for _, _, r in decode.values()), decode
    assert d.call("check", [], 1)["others_changed"] == 0


def test_killed_decode_fails_the_prefill_within_its_timeout():
    """64-token pages: 16 requests land byte for byte through both sides' queues; then the decode rank is
    killed once its next requests' pages reached the prefill: the prefill's pushes find it gone and every
    request ends Failed well within the timeout, the transfer thread never stuck on the dead rank's socket
    (requests queued behind the first fail as fast)."""
    p, d = _pair(64)
    try:
        p.ready(timeout=600)
        d.ready(timeout=600)
        pages = _Pages(6)
        rng = random.Random(6)
        _land_through_queue(p, d, [pages.take(room, rng.randint(1, 5)) for room in range(4100, 4116)], 64, rng)
        prefill, reasons, _ = _kill_decode_under_posted_rooms(p, d, [pages.take(room, 3) for room in range(4000, 4006)])
        assert max(t for _, t in prefill.values()) < WAITING_TIMEOUT_S / 2, prefill
        assert all("gone" in r or "PeerLost" in r for r in reasons.values()), reasons
    finally:
        codes = _close(p, d)
    assert codes == [0, -9], codes


def test_decode_whose_pages_do_not_pair_is_refused(pair):
    """A decode rank whose pages hold other bytes per page (4 KV heads, the prefill 2; the same page size, so
    SGLang's own check passes): the prefill refuses its registration, naming the difference; its requests
    fail on both sides with that reason (the decode's queue aborting them) and none of its pages is written.
    The prefill serves on."""
    p, _, pages = pair
    d = Rank("decode", port=p.port, page_size=16, pages=PAGES, seed=3, env=ENV, heads=4)
    try:
        d.ready(timeout=600)
        plan = [pages.take(room, 2) for room in (5000, 5001)]
        rooms = [r for r, _ in plan]
        assert set(p.call("senders", rooms).values()) == {"Bootstrapping"}
        d.call("requests", [(r, 2 * 16) for r in rooms], 60, timeout=120)
        never = p.call("send", [(r, src, pages.rows.pop(), 2, "send") for r, src in plan], 60, timeout=120)
        assert never == [], never
        prefill = p.call("wait", rooms, 60, timeout=120)
        decode = d.call("finish", rooms, 60, timeout=120)
        assert {s for s, _ in prefill.values()} == {"Failed"}, prefill
        assert {s for s, _, _ in decode.values()} == {"Failed"}, decode
        assert all("kv_item_lens" in r and "does not pair" in r for _, _, r in decode.values()), decode
        assert d.call("check", [], 1)["others_changed"] == 0
        p.call("clear", rooms)
    finally:
        codes = _close(d)
    assert codes == [0], codes
