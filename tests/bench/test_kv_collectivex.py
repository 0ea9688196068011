"""The CollectiveX suite's facts (gpuxfer.bench.kv.collectivex): grid, seeds, tables, sampled check, rows.

Expected numbers come from running the suite's own ``run_kv._grid`` / ``kv_workload`` at
SemiAnalysisAI/InferenceX dc95b1fc0ce7 (docs/kv_bench.md, "The CollectiveX suite");
formulas are re-derived here independently of the module under test.
"""
from __future__ import annotations

import numpy as np
import pytest

from gpuxfer.errors import BadInput
from gpuxfer.kernels import reference
from gpuxfer.bench.kv import collectivex as C
from gpuxfer.bench.kv.grid import SHED_DESC

# (isl, page) -> (descriptors per request, request bytes, batches kept, pool bytes per rank,
#                 pool pages csa, csa-idx, hca, window): the suite's _grid, run
SUITE_GRID = {
    (8192, 16): (33192, 49139712, (1, 2, 4, 8, 16, 32, 64), 3936496896, (40968, 40968, 5128, 648)),
    (8192, 64): (9786, 49139712, (1, 2, 4, 8, 16, 32, 64), 3952028160, (10248, 10248, 5128, 168)),
    (32768, 16): (131304, 183066624, (1, 2, 4, 8, 16), 3666652416, (40968, 40968, 5128, 168)),
    (32768, 64): (38778, 183066624, (1, 2, 4, 8, 16, 32), 7343516160, (20488, 20488, 10248, 88)),
    (131072, 16): (523752, 718774272, (1, 2, 4), 3599191296, (40968, 40968, 5128, 48)),
    (131072, 64): (154746, 718774272, (1, 2, 4, 8), 7208593920, (20488, 20488, 10248, 28)),
    (524288, 16): (2093544, 2861604864, (1, 2), 7159332096, (81928, 81928, 10248, 28)),
    (524288, 64): (618618, 2861604864, (1, 2), 7174863360, (20488, 20488, 10248, 13)),
}


def test_grid_equals_the_suite_at_every_isl_and_page():
    g = C.build_grid()
    assert g.desc_budget == 2_250_000 and g.pool_budget_bytes == 64 << 30 and g.floor_batches == 2
    assert [(p.isl_tokens, p.page_tokens) for p in g.points] == list(SUITE_GRID)
    for p in g.points:
        descs, nbytes, kept, pool, pages = SUITE_GRID[(p.isl_tokens, p.page_tokens)]
        assert (p.request_descriptors, p.request_bytes, p.batches, p.pool_bytes) == (descs, nbytes, kept, pool)
        assert p.pool_pages == tuple(zip(("csa", "csa-idx", "hca", "window"), pages))
        shed = tuple(b for b in C.BATCHES if b not in kept)
        assert tuple(s.batch for s in p.shed) == shed
        assert all(s.reason == SHED_DESC for s in p.shed)          # only the descriptor budget sheds here
        for b in kept:                                             # kept: within budget, or the floor
            assert b * descs <= C.DESC_BUDGET or b in (1, 2)
    assert g.max_pool_bytes == 7343516160                          # "the largest pool stays ~7.4 GB"
    # 512k page 16: batch 2 rides ~2x over the budget by design (the two-batch floor)
    p512 = g.points[6]
    assert p512.burst_descriptors(2) == 4187088 > C.DESC_BUDGET


def test_the_pool_budget_pops_largest_batches_even_under_the_floor():
    g = C.build_grid(free_memory_bytes=3_700_000_000)
    p = {(q.isl_tokens, q.page_tokens): q for q in g.points}
    assert p[(32768, 16)].batches == (1, 2, 4, 8, 16)                  # 3.67 GB fits
    assert p[(32768, 64)].batches[-1] < 32 and p[(8192, 64)].batches[-1] < 64
    g2 = C.build_grid(free_memory_bytes=1 << 20)
    assert all(not q.batches and q.pool_bytes == 0 for q in g2.points)   # even batch 1 is popped


def test_pool_layout_is_the_suites():
    lay = C.layout(8192, 16, 64)
    bases = {r.name: r.base_offset_bytes for r in lay.regions}
    # regions back to back, [layer][page] inside, no alignment
    assert bases == {"csa": 0, "csa-idx": 30 * 40968 * 2304, "hca": 30 * 40968 * 2304 + 30 * 40968 * 528,
                     "window": 3572206848}
    assert lay.pool_bytes == 3936496896
    assert C.pool_pages(524288, 64, 2)["window"] == int(2 * 2.5) + 8 == 13


def test_seeds_reproduce_the_formula():
    for isl in C.ISL_LADDER:
        for page in C.PAGES:
            base = isl * 31 + page + 7 * len("dsv4")
            assert C.table_seed(isl, page, "target") == base
            assert C.table_seed(isl, page, "initiator") == base + 1000
    assert C.table_seed(8192, 16, "initiator") == 254996 and C.table_seed(8192, 16, "target") == 253996
    assert C.RUN_SEED == 67
    with pytest.raises(BadInput, match="side"):
        C.table_seed(8192, 16, "local")


def test_block_tables_are_the_suites_permutations():
    lay = C.layout(8192, 16, 64)
    seed = C.table_seed(8192, 16, "initiator")
    tables = C.block_tables(lay, 8192, seed, 4)
    # request 3 of the suite's block_table(cfg, 254996, 3) at this point
    want = {"csa": [39020, 35083, 35068, 38540, 4678], "csa-idx": [23731, 28461, 33473, 26981, 11791],
            "hca": [1509, 2086, 115, 1789, 63], "window": [632, 560, 64, 261, 550]}
    assert {k: v[:5].tolist() for k, v in tables[3].items()} == want
    # independently: one rng, one permutation per region in order, request r's slice
    rng = np.random.default_rng(seed)
    for reg, need in zip(lay.regions, (512, 512, 64, 8)):
        perm = rng.permutation(reg.pool_pages)
        for r in range(4):
            np.testing.assert_array_equal(tables[r][reg.name], perm[r * need:(r + 1) * need])
    with pytest.raises(BadInput, match="pool too small"):
        C.block_tables(C.layout(8192, 16, 1), 8192, seed, 64)


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_burst_offsets_follow_the_suites_tables(direction):
    isl, page, batch = 512, 16, 2
    lay = C.layout(isl, page, batch)
    b = C.burst(isl, page, batch, direction, lay=lay)
    ini = C.block_tables(lay, isl, C.table_seed(isl, page, "initiator"), batch)
    tgt = C.block_tables(lay, isl, C.table_seed(isl, page, "target"), batch)
    src_t, dst_t = (tgt, ini) if direction == "pull" else (ini, tgt)
    for r, (a, _) in enumerate(b.request_rows):
        row = a
        for reg in lay.regions:
            pages = len(src_t[r][reg.name])
            for layer in range(reg.planes):
                for i in range(pages):
                    s = (layer * reg.pool_pages + int(src_t[r][reg.name][i])) * reg.desc_bytes + reg.base_offset_bytes
                    d = (layer * reg.pool_pages + int(dst_t[r][reg.name][i])) * reg.desc_bytes + reg.base_offset_bytes
                    assert tuple(b.plan[row]) == (s, d, reg.desc_bytes)
                    row += 1
    assert b.descriptors == batch * (30 * 32 * 2 + 31 * 4 + 61 * 8)
    with pytest.raises(BadInput, match="direction"):
        C.burst(isl, page, batch, "sideways", lay=lay)


def test_bulk_row_bytes():
    g = C.build_grid()
    assert [C.bulk_bytes(isl, g) for isl in C.ISL_LADDER] == [49139712, 183066624, 718774272, 2861604864]
    small = C.build_grid(isls=(8192,), pages=(16,))
    assert C.bulk_bytes(524288, small) == 49139712            # capped at the largest paged request


# ----------------------------------------------------------------------------- verification


def test_pattern_is_the_suites_and_64k_periodic():
    o = np.arange(0, 1 << 18, 97, dtype=np.int64)
    assert (C.pattern_at(o) == np.array([((x >> 8) * 131 + 7) & 0xFF for x in o.tolist()], np.uint8)).all()
    assert (C.pattern_at(o) == C.pattern_at(o + C.PATTERN_PERIOD_BYTES)).all() and C.PATTERN_PERIOD_BYTES == 65536
    torch = pytest.importorskip("torch")
    t = torch.zeros(5 * 256 + 77, dtype=torch.uint8)
    C.fill_pattern(t)
    n = np.zeros(5 * 256 + 77, np.uint8)
    C.fill_pattern(n)
    assert (t.numpy() == n).all() and (n == C.pattern_at(np.arange(n.size))).all()


def _transfer(burst, src: np.ndarray, dst: np.ndarray, *, skew: dict | None = None) -> None:
    """Move every descriptor; ``skew`` maps a row to a wrong source offset delta (a misdirected page)."""
    for k, (s, d, n) in enumerate(burst.plan.tolist()):
        s += (skew or {}).get(k, 0)
        dst[d:d + n] = src[s:s + n]


def _suite_check(burst, src, dst):
    return C.sampled_verify(lambda offs: dst[offs[:, None] + np.arange(8)], burst)


@pytest.fixture
def small():
    isl, page, batch = 512, 16, 2
    lay = C.layout(isl, page, batch)
    b = C.burst(isl, page, batch, "pull", lay=lay)
    src = np.empty(lay.pool_bytes, np.uint8)
    dst = np.empty(lay.pool_bytes, np.uint8)
    C.fill_pattern(src)
    C.fill_pattern(dst)              # both pools painted, as the suite paints them
    return b, src, dst


def test_sampled_verifier_passes_a_good_transfer_and_fails_a_corrupted_sample(small):
    b, src, dst = small
    _transfer(b, src, dst)
    assert _suite_check(b, src, dst) == (True, "")
    samples = C.sample_positions(b)
    assert len(samples) == 16 * b.batch
    # every request draws the same positions (a fresh rng(7) per request), each in its own pages
    assert [(s.region, s.layer, s.index) for s in samples[:16]] == [(s.region, s.layer, s.index) for s in samples[16:]]
    victim = samples[16 + 5]                       # request 1's sixth sample
    dst[victim.dst_offset + 3] ^= 0xFF
    ok, detail = _suite_check(b, src, dst)
    assert not ok and detail.startswith("request=1 ") and f"region={victim.region}" in detail


def test_full_verification_catches_what_sampling_misses(small):
    b, src, dst = small
    sampled = {s.dst_offset for s in C.sample_positions(b)}
    # a page moved from the wrong source, 64 KiB away: the suite's periodic pattern cannot tell
    row = next(k for k, (s, d, n) in enumerate(b.plan.tolist())
               if d not in sampled and s + n + C.PATTERN_PERIOD_BYTES <= src.size)
    _transfer(b, src, dst, skew={row: C.PATTERN_PERIOD_BYTES})
    assert _suite_check(b, src, dst) == (True, "")
    # ... and one wrong byte outside the 16 x 8 sampled bytes per request
    unsampled = int(b.plan[row + 1, 1]) + 17
    dst[unsampled] ^= 0x5A
    assert _suite_check(b, src, dst) == (True, "")
    # gpuxfer's full verification (its own seeded pattern, every byte) on the same faulty transfer
    seed = 12345
    reference.fill(src, seed)
    reference.fill(dst, seed + 1)
    _transfer(b, src, dst, skew={row: C.PATTERN_PERIOD_BYTES})
    dst[unsampled] ^= 0x5A
    wrong, first = reference.verify(dst, b.plan, seed)
    assert wrong > int(b.plan[row, 2]) // 2 and first == row


# ----------------------------------------------------------------------------- statistics and rows


def test_statistics_are_the_suites():
    samples = [float(x) for x in range(24, 0, -1)]          # 3 trials x 8 reps
    st = C.pcts(samples)
    assert st == {"p50": 13.0, "p95": 23.0, "min": 1.0, "max": 24.0, "n": 24}
    assert C.gbps_p50(183066624, 4, 13.0) == pytest.approx(183066624 * 4 / 13.0 / 1e6)
    with pytest.raises(BadInput):
        C.pcts([])


def _rows():
    g = C.build_grid(isls=(32768,))
    paged = C.paged_row(32768, 16, 2, "pull", samples_ms=[2.0, 3.0, 2.5], prep_ms=1.23456,
                        verify={"passed": True, "detail": ""})
    bulk = C.bulk_row(32768, C.bulk_bytes(32768, g), "pull", samples_ms=[1.0, 1.1])
    return paged, bulk


def test_rows_and_document_validate():
    paged, bulk = _rows()
    assert paged["gbps_p50"] == round(183066624 * 2 / 2.5 / 1e6, 2) and paged["prep_ms"] == 1.235
    assert (paged["layers"], paged["page_bytes"], paged["descs"]) == (61, 2304, 131304)
    assert (bulk["descs"], bulk["batch"], bulk["page_tokens"], bulk["verify"]["passed"]) == (1, 1, None, True)
    doc = C.document([paged, bulk], backend="triton", fabric="nvlink", runner="h200", device_product="H200",
                     framework="2.9", vendor="nvidia", extra={"full_verification": "passed"})
    assert doc["outcome"] == {"reasons": [], "status": "success"}
    assert doc["identity"]["case_factors"]["case"]["suite"] == "kv-transfer"
    assert doc["measurement"]["sampling"] == {"reps_per_trial": 8, "trials": 3, "warmup_per_trial": 2}
    bad = dict(paged, verify={"passed": False, "detail": "request=0 ..."})
    doc2 = C.document([bad, bulk], backend="triton", fabric="nvlink", runner="h200", device_product=None,
                      framework=None, vendor=None)
    assert doc2["outcome"] == {"reasons": ["transfer verification failed"], "status": "invalid"}


@pytest.mark.parametrize("mutate, match", [
    (lambda r: r.pop("gbps_p50"), "lacks 'gbps_p50'"),
    (lambda r: r.update(kind="dense"), "kind"),
    (lambda r: r.update(op="pushpull"), "op"),
    (lambda r: r.update(isl="32k"), "'isl'"),
    (lambda r: r.update(batch=True), "'batch'"),
    (lambda r: r["latency_ms"].pop("p95"), "p95"),
    (lambda r: r["latency_ms"].update(p95=0.1), "ordered"),
    (lambda r: r.update(verify={"passed": "yes", "detail": ""}), "verify"),
    (lambda r: r.update(page_tokens=None), "paged suite row"),
])
def test_bad_rows_are_named(mutate, match):
    paged, _ = _rows()
    paged = dict(paged, latency_ms=dict(paged["latency_ms"]))
    mutate(paged)
    with pytest.raises(BadInput, match=match):
        C.validate_row(paged)


def test_bad_documents_are_named():
    paged, bulk = _rows()
    doc = C.document([paged, bulk], backend="b", fabric="f", runner="r", device_product=None, framework=None,
                     vendor=None)
    doc["measurement"]["rows"][0]["verify"] = {"passed": False, "detail": "request=0 ..."}
    with pytest.raises(BadInput, match="disagrees"):
        C.validate_document(doc)
    del doc["identity"]["case_factors"]["sku"]
    with pytest.raises(BadInput, match="sku"):
        C.validate_document(doc)


# ----------------------------------------------------------------------------- the command


def _cli(capsys, *argv):
    import json
    from gpuxfer.cli import main
    rc = main(["bench", "kv", "--suite", "collectivex", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err, (json.loads(cap.out) if "--json" in argv and rc == 0 else None)


def test_plan_only_shows_the_suites_grid(capsys):
    rc, out, err, doc = _cli(capsys, "--plan-only", "--json", "--full")
    assert rc == 0, err
    g = doc["grid"]
    assert g["desc_budget_descriptors"] == 2_250_000 and g["pool_budget_bytes"] == 64 << 30
    assert g["max_pool_per_rank_bytes"] == 7343516160
    for p in g["points"]:
        descs, nbytes, kept, pool, pages = SUITE_GRID[(p["isl_tokens"], p["page_tokens"])]
        assert (p["request_descriptors"], p["request_bytes"], tuple(p["batches"]), p["pool_per_rank_bytes"]) == \
            (descs, nbytes, kept, pool)
        assert tuple(p["pool_pages"].values()) == pages
        assert [s["batch"] for s in p["shed"]] == [b for b in C.BATCHES if b not in kept]
        base = p["isl_tokens"] * 31 + p["page_tokens"] + 28
        assert p["table_seeds"] == {"initiator": base + 1000, "target": base}
    assert len(g["points"]) == 8
    s = doc["suite"]
    assert s["timing"]["reps_per_trial"] == 8 and s["timing"]["trials"] == 3 and s["run_seed"] == 67
    assert [b["bytes"] for b in s["bulk_rows"]] == [49139712, 183066624, 718774272, 2861604864]
    assert doc["run"]["seed"] == 67
    rc, out, err, _ = _cli(capsys, "--plan-only", "--full")
    assert rc == 0 and "2,250,000" in out and "7.3 GB" in out and "bulk rows" in out


def test_plan_only_narrowed(capsys):
    rc, out, err, doc = _cli(capsys, "--plan-only", "--json", "--isl", "32k", "--page", "16", "--batch", "4,8,16,32")
    assert rc == 0, err
    (p,) = doc["grid"]["points"]
    # the suite's rules on the narrowed batch list: the two smallest (4, 8) always kept
    assert p["batches"] == [4, 8, 16] and [s["batch"] for s in p["shed"]] == [32]


@pytest.mark.parametrize("argv, match", [
    (["--suite", "nccl"], "unknown suite 'nccl'"),
    (["--desc-budget", "1M"], "--desc-budget: --suite collectivex fixes it"),
    (["--pool-budget", "8GiB"], "--pool-budget: --suite collectivex fixes it"),
    (["--workload", "kv-dsv4-vllm"], "--workload: --suite collectivex fixes it"),
    (["--page", "48"], "--page"),
    (["--trials", "3"], "fixes the timing"),
    (["--post", "armed", "--warmup", "1"], "fixes the timing"),
])
def test_bad_options_are_clear_errors(capsys, argv, match):
    from gpuxfer.cli import main
    full = ["bench", "kv", "--platform", "host", "--isl", "16"]
    if argv[0] != "--suite":
        full += ["--suite", "collectivex"]
    rc = main(full + argv)
    assert rc == 2
    assert match in capsys.readouterr().err


# Two spawned ranks on the host emulation, MoRI-IO over tests/fake_mori.py (GPUXFER_MORI_MODULE):
# the suite's timing, its sampled check and gpuxfer's full one, its rows next to gpuxfer's JSON.

def _suite_run(tmp_path, monkeypatch, flip=None):
    import json
    from gpuxfer.cli import main
    monkeypatch.setenv("GPUXFER_MORI_MODULE", "fake_mori")
    monkeypatch.delenv("GPUXFER_INJECT_FAULT", raising=False)
    if flip:
        monkeypatch.setenv("FAKE_MORI_FLIP", flip)
    else:
        monkeypatch.delenv("FAKE_MORI_FLIP", raising=False)
    out = tmp_path / "out"
    rc = main(["bench", "kv", "--suite", "collectivex", "--platform", "host", "--engine", "amd-mori",
               "--isl", "16", "--page", "16", "--batch", "1", "--timeout", "60", "--out", str(out)])
    own = json.loads((out / "kv_bench.json").read_text())
    suite = json.loads((out / "collectivex_amd-mori.json").read_text())
    return rc, own, suite


@pytest.mark.slow
def test_suite_run_writes_both_jsons(tmp_path, monkeypatch, capsys):
    rc, own, suite = _suite_run(tmp_path, monkeypatch)
    assert rc == 0, capsys.readouterr().out
    C.validate_document(suite)
    assert suite["outcome"] == {"reasons": [], "status": "success"}
    rows = suite["measurement"]["rows"]
    assert [(r["kind"], r["op"]) for r in rows] == [("paged", "pull"), ("paged", "push"), ("bulk", "pull"),
                                                    ("bulk", "push")]
    for r in rows:
        assert r["latency_ms"]["n"] == 24 and r["verify"]["passed"] and r["gpuxfer_full_verify"]["passed"]
    paged = rows[0]
    assert (paged["isl"], paged["page_tokens"], paged["descs"], paged["batch"]) == (16, 16, 152, 1)
    assert rows[2]["req_bytes"] == C.bulk_bytes(16, C.build_grid(isls=(16,), pages=(16,), batches=(1,)))
    # gpuxfer's rows: the suite's sampling and verdicts beside its own every-byte check
    for r in own["rows"]:
        assert r["suite"] == "collectivex" and r["post"] == "host" and r["trials"] == 24 and r["warmup"] == 6
        assert r["suite_verify"]["passed"] and r["wrong_bytes"] == 0 and r["valid"]
    assert own["parameters"]["desc_budget"] == 2_250_000
    assert own["artifacts"]["suite_json"][0].endswith("collectivex_amd-mori.json")


@pytest.mark.slow
def test_suite_run_fails_with_exit_3_when_only_full_verification_sees_it(tmp_path, monkeypatch, capsys):
    """The first byte of the first descriptor of each batch call wrong: the suite's 16 samples per request
    miss it, gpuxfer's every-byte check does not; the run exits 3 (the suite's sampled check failing is
    tests/bench/test_kv_collectivex.py::test_sampled_verifier_passes_a_good_transfer_and_fails_a_corrupted_sample)."""
    rc, own, suite = _suite_run(tmp_path, monkeypatch, "first")
    assert rc == C.EXIT_VERIFY_FAILED == 3
    assert suite["outcome"]["status"] == "invalid"
    paged = [r for r in suite["measurement"]["rows"] if r["kind"] == "paged"]
    assert paged and all(r["verify"]["passed"] and not r["gpuxfer_full_verify"]["passed"] for r in paged)
    assert all(r["gpuxfer_full_verify"]["wrong_bytes"] == 1 for r in paged)
    assert any("gpuxfer's full verification found" in x for x in suite["outcome"]["reasons"])
    assert all(not r["valid"] and r["suite_verify"]["passed"] for r in own["rows"] if r["kind"] == "paged")


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_suite_on_two_gpus(tmp_path, capsys):
    """The suite's 8k row on two CUDA GPUs: the suite's timing, both checks, its documents."""
    import json
    from gpuxfer.cli import main
    from gpuxfer.platforms import unavailable_reason
    if unavailable_reason("cuda") is not None:
        pytest.skip(unavailable_reason("cuda"))
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA GPUs, found {torch.cuda.device_count()}")
    out = tmp_path / "out"
    rc = main(["bench", "kv", "--suite", "collectivex", "--platform", "cuda", "--isl", "8k", "--batch", "1,2",
               "--engine", "triton,copy_engine,bulk", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    own = json.loads((out / "kv_bench.json").read_text())
    assert {r["kind"] for r in own["rows"]} == {"paged", "ceiling", "bulk"}
    for eng in ("triton", "copy_engine", "bulk"):
        doc = json.loads((out / f"collectivex_{eng}.json").read_text())
        C.validate_document(doc)
        assert doc["outcome"]["status"] == "success"
        rows = doc["measurement"]["rows"]
        assert {r["kind"] for r in rows} == ({"bulk"} if eng == "bulk" else {"paged", "bulk"})
        for r in rows:
            assert r["latency_ms"]["n"] == 24 and r["verify"]["passed"] and r["gpuxfer_full_verify"]["passed"]
        if eng != "bulk":
            assert {(r["page_tokens"], r["batch"], r["op"]) for r in rows if r["kind"] == "paged"} == \
                {(p, b, o) for p in (16, 64) for b in (1, 2) for o in ("pull", "push")}


def test_ceiling_engines_are_not_suite_rows():
    """``bulk`` and ``nixl-bulk`` move a burst as one contiguous copy: gpuxfer's ceiling, no sampled check."""
    from gpuxfer.bench.kv.engines import engine_class
    from gpuxfer.bench.kv.checks import _moves_one_copy
    assert _moves_one_copy(engine_class("bulk")) and _moves_one_copy(engine_class("nixl-bulk"))
    assert not any(_moves_one_copy(engine_class(n)) for n in ("triton", "pack", "copy_engine", "nixl", "amd-mori",
                                                               "mooncake-rdma"))
    rows = [{"engine": "bulk", "kind": "ceiling", "samples_ms": [1.0], "direction": "pull"}]
    assert C.documents_from_rows(rows, {}) == {}


@pytest.mark.slow
def test_suite_across_hosts_over_fake_libraries(tmp_path, monkeypatch, capsys):
    """--cross-host: NIXL (tests/fake_nixl_net.py) and MoRI-IO (tests/fake_mori.py) reach the peer's pool
    themselves; nixl-bulk is gpuxfer's ceiling there (kind ``ceiling``, no sampled check, no suite rows)."""
    import json
    from gpuxfer.cli import main
    mail = tmp_path / "nixl-mail"
    mail.mkdir()
    monkeypatch.setenv("GPUXFER_NIXL_MODULE", "fake_nixl_net")
    monkeypatch.setenv("FAKE_NIXL_NET_DIR", str(mail))
    monkeypatch.setenv("GPUXFER_MORI_MODULE", "fake_mori")
    monkeypatch.delenv("FAKE_MORI_FLIP", raising=False)
    monkeypatch.delenv("GPUXFER_INJECT_FAULT", raising=False)
    out = tmp_path / "out"
    rc = main(["bench", "kv", "--suite", "collectivex", "--platform", "host", "--cross-host",
               "--engine", "nixl,nixl-bulk,amd-mori", "--isl", "16", "--page", "16", "--batch", "1",
               "--direction", "pull", "--timeout", "60", "--out", str(out)])
    assert rc == 0, capsys.readouterr().out
    own = json.loads((out / "kv_bench.json").read_text())
    kinds = {(r["engine"], r["kind"]) for r in own["rows"]}
    assert kinds == {("nixl-bulk", "ceiling"), ("nixl", "paged"), ("amd-mori", "paged"),
                     ("nixl-bulk", "bulk"), ("nixl", "bulk"), ("amd-mori", "bulk")}
    ceiling = next(r for r in own["rows"] if r["kind"] == "ceiling")
    assert ceiling["suite_verify"]["detail"].startswith("not sampled") and ceiling["valid"]
    for eng in ("nixl", "amd-mori"):
        doc = json.loads((out / f"collectivex_{eng}.json").read_text())
        assert doc["outcome"]["status"] == "success"
        assert [r["kind"] for r in doc["measurement"]["rows"]] == ["paged", "bulk"]
    doc = json.loads((out / "collectivex_nixl-bulk.json").read_text())
    assert [r["kind"] for r in doc["measurement"]["rows"]] == ["bulk"]
