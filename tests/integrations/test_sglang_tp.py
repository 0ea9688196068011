"""gpuxfer's SGLang backend with tensor parallelism: every rank of a prefill and a decode server in a process of
its own (tests/integrations/sglang_instance.py, ``tp=(rank, size)``), SGLang's own rank mapping (the bootstrap
server's ``/route`` per prefill rank, each receiver's target prefill ranks) deciding who sends to whom.

* Equal TP sizes with an MHA pool (each rank holds a slice of the KV heads): decode rank ``i`` gets prefill rank
  ``i``'s pages, every byte checked against that rank's (the ranks' bytes differ).
* An MLA pool (every rank holds all of it) at different TP sizes (2 -> 1, 1 -> 2): SGLang picks the prefill
  rank each decode rank reads from; every byte checked.
* An MHA pool at different TP sizes (2 -> 1, 1 -> 2, and 1 -> 4 with fewer KV heads than decode ranks: pairs of
  decode ranks replicate a head): each rank holds total heads / TP of them (one where ranks outnumber heads),
  each head's bytes the same on every rank holding it; the prefill pushes the heads a decode rank shares with it
  (head slicing), every byte of every decode rank checked against the prefill server's bytes of its heads.
* The head slices against SGLang's own rank mapping and Mooncake's head slice arithmetic, over TP sizes and head
  counts (no process).
* Heads that do not split evenly over a TP size: refused, every request Failed on both sides naming it,
  nothing written.

Each rank runs SGLang's queues alone (its polls are not all-reduced over the TP group); the test drives every
rank of a server with the same requests, as SGLang's scheduler does. Skipped without SGLang, unless
GPUXFER_REQUIRE_SGLANG=1.
"""
from __future__ import annotations

import random

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from gpuxfer.integrations.sglang.layout import GROUP, head_share  # noqa: E402
from sglang_instance import Rank  # noqa: E402
from test_sglang_backend import ENV, PAGES, _close, _free_port, _Pages  # noqa: E402


def _servers(prefill_tp: int, decode_tp: int, page_size: int, *, mla: bool = False, replicas: bool = False,
             total_heads: int | None = None, decode_heads: int | None = None, env: dict = ENV, **extra):
    """Every rank of a prefill server of TP ``prefill_tp`` (rank r seeded ``1 + 10 r``, or all ``1`` with
    ``replicas``: an MLA pool is the same on every rank) and of a decode server of TP ``decode_tp`` (rank r
    seeded ``2 + 10 r``), started together and ready; ``extra``: :class:`Rank`'s (``device``).
    ``total_heads``: an MHA pool of that many KV heads, each rank holding its global heads (total / TP, or one
    where ranks outnumber heads: ``tp / total`` consecutive ranks hold it), the same bytes of a head on every
    rank of a server holding it (prefill ranks seeded ``1``, decode ranks ``2``); ``decode_heads``: the decode
    ranks' heads instead (a split SGLang's mapping cannot make)."""
    port = _free_port()

    def ranks(role, tp, seed):
        out = []
        for r in range(tp):
            kw = dict(seed=seed(r), tp=(r, tp), env=env, mla=mla, **extra)
            if total_heads is not None:
                n = total_heads // tp if total_heads >= tp else 1
                n = decode_heads if role == "decode" and decode_heads else n
                first = (r * n if total_heads >= tp else r // (tp // total_heads)) % total_heads
                kw.update(seed=1 if role == "prefill" else 2, heads=n, heads_at=(first, n), total_heads=total_heads)
            out.append(Rank(role, port=port, page_size=page_size, pages=PAGES, **kw))
        return out

    prefill = ranks("prefill", prefill_tp, lambda r: 1 if replicas else 1 + 10 * r)
    decode = ranks("decode", decode_tp, lambda r: 2 + 10 * r)
    try:
        for rank in prefill + decode:
            rank.ready(timeout=600)
    except BaseException:
        _close(*prefill, *decode)
        raise
    return prefill, decode


def _exchange(prefill, decode, plan, page_size, rng):
    """``plan``'s requests through every rank's queues (the prefill's chunked, most last pages partial): the
    prefill ranks' ``{room: status}`` and rows, the decode ranks' ``{room: (status, seconds, reason)}``."""
    rooms = [r for r, _ in plan]
    tokens = {r: len(src) * page_size - rng.randrange(page_size) for r, src in plan}
    chunks = {r: rng.choice([page_size, 3 * page_size + 5, 40, 300]) for r in rooms}
    for p in prefill:
        assert set(p.call("queue_add", [(r, src, tokens[r], chunks[r]) for r, src in plan]).values()) \
            == {"Bootstrapping"}
    for d in decode:
        d.call("requests", [(r, tokens[r]) for r in rooms], 60, timeout=120)
    ran = [p.call("queue_run", 60, timeout=120) for p in prefill]
    assert all(x["left"] == [] for x in ran), ran
    done = [p.call("wait", rooms, 60, timeout=120) for p in prefill]
    ends = [d.call("finish", rooms, 60, timeout=120) for d in decode]
    return done, [x["rows"] for x in ran], ends


def _all(statuses, want):
    return all({v[0] for v in s.values()} == {want} for s in statuses)


def test_equal_tp_mha_lands_rank_to_rank():
    """Prefill and decode at TP 2, MHA pool, 16-token pages: 32 concurrent requests; decode rank ``i``'s pages
    and metadata rows hold prefill rank ``i``'s bytes (each rank's differ), nothing else changed."""
    equal_tp_lands_rank_to_rank(*_servers(2, 2, 16))


def equal_tp_lands_rank_to_rank(prefill, decode):
    try:
        pages = _Pages(30)
        rng = random.Random(30)
        plan = [pages.take(room, rng.randint(1, 9)) for room in range(9000, 9032)]
        done, rows, ends = _exchange(prefill, decode, plan, 16, rng)
        assert _all(done, "Success") and _all(ends, "Success"), (done, ends)
        rooms = [r for r, _ in plan]
        for r, d in enumerate(decode):
            res = d.call("check", rooms, 1 + 10 * r, (), rows[r], dict(plan))
            assert res["bad"] == {room: 0 for room in rooms} and res["checked"] > 0, (r, res)
            assert res["others_changed"] == 0, (r, res)
        for p in prefill:
            assert set(p.call("clear", rooms).values()) == {None}
    finally:
        codes = _close(*prefill, *decode)
    assert codes == [0, 0, 0, 0], codes


def test_mla_pool_at_different_tp_sizes_lands():
    """An MLA pool (the same on every rank) from a prefill at TP 2 to a decode at TP 1, then from TP 1 to
    TP 2: every request lands on every decode rank byte for byte."""
    for prefill_tp, decode_tp in ((2, 1), (1, 2)):
        prefill, decode = _servers(prefill_tp, decode_tp, 16, mla=True, replicas=True)
        try:
            pages = _Pages(31)
            rng = random.Random(31)
            plan = [pages.take(room, rng.randint(1, 9)) for room in range(9100, 9108)]
            done, rows, ends = _exchange(prefill, decode, plan, 16, rng)
            assert _all(done, "Success") and _all(ends, "Success"), (prefill_tp, decode_tp, done, ends)
            rooms = [r for r, _ in plan]
            for d in decode:
                res = d.call("check", rooms, 1, (), rows[0], dict(plan))
                assert res["bad"] == {room: 0 for room in rooms} and res["others_changed"] == 0, res
        finally:
            codes = _close(*prefill, *decode)
        assert codes == [0] * (prefill_tp + decode_tp), codes


def _mha_lands(prefill_tp: int, decode_tp: int, total_heads: int, seed: int, env: dict = ENV, after=None):
    """An MHA pool of ``total_heads`` KV heads from a prefill at ``prefill_tp`` to a decode at ``decode_tp``: 16
    requests, every byte of every decode rank's heads checked; ``after(prefill, decode)`` before they close."""
    prefill, decode = _servers(prefill_tp, decode_tp, 16, total_heads=total_heads, env=env)
    try:
        pages = _Pages(seed)
        rng = random.Random(seed)
        plan = [pages.take(room, rng.randint(1, 9)) for room in range(9300 + 100 * seed, 9316 + 100 * seed)]
        done, rows, ends = _exchange(prefill, decode, plan, 16, rng)
        assert _all(done, "Success") and _all(ends, "Success"), (prefill_tp, decode_tp, done, ends)
        rooms = [r for r, _ in plan]
        for r, d in enumerate(decode):      # every byte of the decode rank's heads: the prefill server's
            res = d.call("check", rooms, 1, (), rows[0], dict(plan))
            assert res["bad"] == {room: 0 for room in rooms} and res["checked"] > 0, (r, res)
            assert res["others_changed"] == 0, (r, res)
        for p in prefill:
            assert set(p.call("clear", rooms).values()) == {None}
        if after is not None:
            after(prefill, decode)
    finally:
        codes = _close(*prefill, *decode)
    assert codes == [0] * (prefill_tp + decode_tp), codes


def test_mha_pool_from_tp_2_to_tp_1_lands_sliced_heads():
    """4 KV heads: prefill ranks 0 and 1 (heads 0-1, 2-3) each push their heads into their half of every token
    row of the one decode rank's pages (4 heads); the decode waits for both."""
    _mha_lands(2, 1, 4, 33)


def test_mha_pool_from_tp_1_to_tp_2_lands_sliced_heads():
    """4 KV heads: the one prefill rank pushes heads 0-1 of every token row to decode rank 0 and heads 2-3 to
    decode rank 1 (2 heads each)."""
    _mha_lands(1, 2, 4, 34)


def test_mha_pool_with_replicated_heads_lands():
    """2 KV heads, decode at TP 4: decode ranks 0 and 1 each hold head 0, ranks 2 and 3 head 1 (SGLang's
    replication); the one prefill rank (2 heads) pushes each its head."""
    _mha_lands(1, 4, 2, 35)


def _sglang_targets(prefill_tp: int, decode_tp: int, decode_rank: int):
    """SGLang's rank mapping of an MHA decode rank: the prefill ranks it registers with (each of which sends it
    KV) and the responses it waits for."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    me = SimpleNamespace(is_mla_backend=False, is_hybrid_mla_backend=False, attn_tp_size=decode_tp,
                         kv_args=SimpleNamespace(engine_rank=decode_rank), attn_cp_size=1, attn_cp_rank=0, pp_size=1,
                         pp_rank=0, enable_all_cp_ranks_for_transfer=False)
    info = SimpleNamespace(attn_tp_size=prefill_tp, enable_kv_cache_sharding=False, attn_cp_size=1, pp_size=1,
                           enable_dsa_cache_layer_split=False)
    CommonKVManager._resolve_rank_mapping(me, info)
    return info.target_tp_ranks, info.required_prefill_response_num


@pytest.mark.parametrize("total", [1, 2, 4, 8])
def test_head_slices_follow_sglangs_mapping_and_mooncakes_slices(total):
    """For every prefill/decode pair SGLang's mapping makes (TP sizes 1..8, either dividing the heads or
    divided by them), the bytes the prefill pushes are Mooncake's head slice (``compute_head_slice_params``),
    and the prefill ranks a decode rank waits for cover each of its heads."""
    from sglang.srt.disaggregation.common.staging_buffer import compute_head_slice_params
    hb, sizes = 16, [1, 2, 4, 8]
    for ptp in sizes:
        for dtp in sizes:
            if ptp == dtp:
                continue
            hp, hd = max(1, total // ptp), max(1, total // dtp)
            for drank in range(dtp):
                targets, responses = _sglang_targets(ptp, dtp, drank)
                assert len(targets) == responses
                covered = set()
                for prank in targets:
                    views = head_share({"page_size": 4, "kv_item_lens": [4 * hp * hb] * 2, "attn_tp_size": ptp,
                                        "attn_tp_rank": prank},
                                       {"page_size": 4, "kv_item_lens": [4 * hd * hb] * 2, "attn_tp_size": dtp,
                                        "attn_tp_rank": drank}, total, hp)
                    src, n, dst, _ = compute_head_slice_params(ptp, dtp, prank, drank, total)
                    mine, theirs = (src * hb, (src + n) * hb), (dst * hb, (dst + n) * hb)
                    if mine == (0, hp * hb) and theirs == (0, hd * hb):
                        assert views == {}, (ptp, dtp, prank, drank)
                    else:
                        assert views == {"local_token_slice": {GROUP: mine}, "token_slice": {GROUP: theirs}}, \
                            (ptp, dtp, prank, drank, views)
                    covered.update(range(dst, dst + n))
                assert covered == set(range(hd)), (ptp, dtp, drank, covered)


def test_mha_heads_that_do_not_split_evenly_are_refused():
    """3 KV heads, prefill at TP 1, decode at TP 2 (each decode rank given 1 head, as no even split exists): the
    prefill refuses both decode ranks' registrations naming the heads that do not split, every request ends
    Failed on both sides, and no byte of the decode's pools is written."""
    prefill, decode = _servers(1, 2, 16, total_heads=3, decode_heads=1)
    try:
        pages = _Pages(32)
        rng = random.Random(32)
        plan = [pages.take(room, rng.randint(1, 5)) for room in range(9200, 9208)]
        done, _, ends = _exchange(prefill, decode, plan, 16, rng)
        assert _all(done, "Failed") and _all(ends, "Failed"), (done, ends)
        for e in ends:
            assert all("3 KV heads do not split evenly over the decode's attention TP size 2" in reason
                       for _, _, reason in e.values()), e
        for d in decode:
            assert d.call("check", [], 1)["others_changed"] == 0
        reasons = prefill[0].call("clear", [r for r, _ in plan])
        assert all("do not split evenly" in (why or "") or "Aborted by the decode" in (why or "")
                   for why in reasons.values()), reasons
    finally:
        codes = _close(*prefill, *decode)
    assert codes == [0, 0, 0], codes
