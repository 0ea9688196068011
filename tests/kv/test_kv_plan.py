"""Pool layouts, block tables and descriptor plans: properties and every error path."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gpuxfer.errors import BadInput
from gpuxfer.bench.kv.model.blocktable import burst_tables, derive_seed, space_permutation
from gpuxfer.bench.kv.model.layout import (POOL_ALIGN_BYTES, build_layout, layout_for_burst, max_batch_for_budget,
                               pages_for_burst, pool_bytes_for_burst, pool_pages_for_budget)
from gpuxfer.bench.kv.model.plan import (PlanSpan, build_burst, bulk_plan, coalesce, find_dst_overlap, request_plan,
                             validate_plan)
from gpuxfer.bench.kv.model.workloads import WORKLOADS, Region, Workload, get_workload

SETTINGS = settings(max_examples=30, deadline=None)

# small ISLs per preset so a burst stays at most a few hundred thousand descriptors
MAX_ISL = {"kv-dsv4": 2048, "kv-dsv4-vllm": 4096, "kv-mla": 1024, "kv-gqa": 512}


@st.composite
def burst_args(draw, names=tuple(sorted(WORKLOADS))):
    name = draw(st.sampled_from(names))
    w = get_workload(name)
    if w.allowed_pages:
        page = draw(st.sampled_from(w.allowed_pages))
    else:
        page = draw(st.sampled_from([p for p in (4, 8, 16, 32, 64, 128) if w.supports_page(p)]))
    isl = draw(st.integers(1, MAX_ISL[name]))
    batch = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2 ** 32))
    return w, isl, page, batch, seed


def _sorted_disjoint(start: np.ndarray, size: np.ndarray) -> bool:
    o = np.argsort(start, kind="stable")
    s, e = start[o], start[o] + size[o]
    return bool(np.all(s[1:] >= e[:-1]))


def _canonical_map(plan: np.ndarray) -> np.ndarray:
    """The byte map of a plan with disjoint sources, as maximal (src, dst - src, length) runs."""
    p = plan[np.argsort(plan[:, 0], kind="stable")]
    src, delta, n = p[:, 0], p[:, 1] - p[:, 0], p[:, 2]
    new = np.ones(len(p), dtype=bool)
    new[1:] = (src[:-1] + n[:-1] != src[1:]) | (delta[:-1] != delta[1:])
    starts = np.flatnonzero(new)
    return np.stack([src[starts], delta[starts], np.add.reduceat(n, starts)], axis=1)


# ---------------------------------------------------------------------------- plans


@SETTINGS
@given(args=burst_args())
def test_burst_descriptors_are_in_bounds_disjoint_and_complete(args):
    w, isl, page, batch, seed = args
    burst = build_burst(w, isl, page, batch, seed=seed)
    plan = burst.plan
    assert plan.dtype == np.int64 and plan.shape == (batch * w.descriptors_per_request(isl, page), 3)
    # never overlapping on the destination (nor on the source), checked independently here
    assert _sorted_disjoint(plan[:, 1], plan[:, 2])
    assert _sorted_disjoint(plan[:, 0], plan[:, 2])
    assert find_dst_overlap(plan) is None
    # each descriptor inside its region and its pool, on both sides
    for sp in burst.spans:
        rows = plan[sp.start:sp.stop]
        for col, lay in ((0, burst.src_layout), (1, burst.dst_layout)):
            reg = lay.region(sp.region)
            assert np.all(rows[:, col] >= reg.base_offset_bytes)
            assert np.all(rows[:, col] + rows[:, 2] <= reg.end_offset_bytes)
            assert reg.end_offset_bytes <= lay.pool_bytes
            assert np.all(rows[:, 2] == reg.desc_bytes)
    # every request moves exactly the preset's bytes, in region order
    assert burst.request_bytes == [w.bytes_per_request(isl, page)] * batch
    assert burst.total_bytes == batch * w.bytes_per_request(isl, page)
    names = [t.name for t in w.transfer_regions(page)]
    for r, req in enumerate(burst.requests):
        assert [s.region for s in burst.spans if s.request == r] == names
        assert req.base is plan or req.base is plan.base  # a view, not a copy
    assert sum(len(r) for r in burst.requests) == burst.descriptors


@SETTINGS
@given(args=burst_args(), order=st.sampled_from(["random", "sequential"]))
def test_coalescing_keeps_the_byte_map(args, order):
    w, isl, page, batch, seed = args
    burst = build_burst(w, isl, page, batch, seed=seed, order=order)
    merged = burst.coalesce()
    assert merged.coalesced and merged.total_bytes == burst.total_bytes
    assert merged.descriptors <= burst.descriptors
    np.testing.assert_array_equal(_canonical_map(merged.plan), _canonical_map(burst.plan))
    merged.validate()       # merged runs stay inside their (request, region) spans
    assert [int(r[:, 2].sum()) for r in merged.requests] == burst.request_bytes
    # the free function agrees with the method when given the same breaks
    np.testing.assert_array_equal(coalesce(burst.plan, breaks=[s.start for s in burst.spans]), merged.plan)


def test_coalescing_byte_map_exact_on_a_tiny_workload():
    tiny = Workload("tiny", regions=(Region("a", layers=3, bytes_per_entry=2, tokens_per_entry=1),
                                     Region("b", layers=2, bytes_per_entry=3, tokens_per_entry=2)),
                    default_pages=(2, 4))
    for order in ("random", "sequential"):
        for isl in (1, 5, 17):
            burst = build_burst(tiny, isl, 4, 3, seed=isl, order=order)

            def pairs(plan):
                return {(int(s) + i, int(d) + i) for s, d, n in plan for i in range(int(n))}

            assert pairs(burst.coalesce().plan) == pairs(burst.plan)


def test_sequential_tables_coalesce_to_one_descriptor_per_region():
    w = get_workload("kv-mla")
    pages = w.pages_per_request(1024, 16)["latent"]
    layout = build_layout(w, 16, pages)                 # exactly one request's pages
    burst = build_burst(w, 1024, 16, 1, layout=layout, order="sequential")
    assert burst.descriptors == 61 * pages
    merged = burst.coalesce()
    assert merged.descriptors == 1 and merged.plan[0, 2] == w.bytes_per_request(1024, 16)


def test_packed_vllm_burst_shares_one_slab_space():
    w = get_workload("kv-dsv4-vllm")
    burst = build_burst(w, 32768, 256, 4, seed=3)
    assert burst.descriptors == 4 * 132
    lay = burst.src_layout
    assert lay.spaces == ("slab",)
    slabs = (burst.plan[:, 0] - lay.region("mla").base_offset_bytes) // lay.region("mla").page_stride_bytes
    assert len(np.unique(slabs)) == burst.descriptors     # every descriptor its own slab
    assert np.all((burst.plan[:, 0] % lay.region("mla").page_stride_bytes) == 0)


def test_request_plan_matches_the_burst_rows():
    w = get_workload("kv-dsv4")
    burst = build_burst(w, 300, 16, 3, seed=11)
    src = burst_tables(burst.src_layout, 300, 3, seed=11, side="src")
    dst = burst_tables(burst.dst_layout, 300, 3, seed=11, side="dst")
    for r in range(3):
        np.testing.assert_array_equal(request_plan(burst.src_layout, burst.dst_layout, src[r], dst[r]),
                                      burst.requests[r])


def test_bulk_plan_moves_the_burst_bytes_in_one_descriptor():
    burst = build_burst("kv-dsv4", 4096, 64, 2, seed=1)
    bulk = burst.bulk_plan()
    assert bulk.shape == (1, 3) and bulk.dtype == np.int64
    assert int(bulk[0, 2]) == burst.total_bytes and bulk[0, 0] == 0 and bulk[0, 1] == 0


def test_suite_sized_bursts_materialise_with_the_analytic_counts():
    w = get_workload("kv-dsv4")
    burst = build_burst(w, 32768, 16, 2, seed=67)
    assert burst.descriptors == 2 * 131_304 and burst.total_bytes == 2 * 183_066_624
    assert build_burst(w, 32768, 64, 1, seed=67).descriptors == 38_778


# ---------------------------------------------------------------------------- block tables


def test_block_tables_reproduce_from_the_seed_and_differ_across_seeds():
    lay = layout_for_burst("kv-dsv4", 1024, 16, 4)

    def tables(seed, side):
        return burst_tables(lay, 1024, 4, seed=seed, side=side)

    a, b = tables(5, "src"), tables(5, "src")
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            np.testing.assert_array_equal(ra[k], rb[k])
    assert not all(np.array_equal(x["csa"], y["csa"]) for x, y in zip(a, tables(6, "src")))
    assert not all(np.array_equal(x["csa"], y["csa"]) for x, y in zip(a, tables(5, "dst")))
    # the derivation is a stable hash, not Python's salted hash(): pinned value
    assert derive_seed(67, "block-table", "kv-dsv4", 16, "csa", 100, "src") == 15928623864770587095


@SETTINGS
@given(args=burst_args(), side=st.sampled_from(["src", "dst"]))
def test_requests_take_disjoint_slices_of_one_permutation(args, side):
    w, isl, page, batch, seed = args
    lay = layout_for_burst(w, isl, page, batch)
    tables = burst_tables(lay, isl, batch, seed=seed, side=side)
    for space in lay.spaces:
        perm = space_permutation(lay, space, seed=seed, side=side)
        assert sorted(perm.tolist()) == list(range(lay.pages_in(space)))
        members = [t.name for t in w.transfer_regions(page) if t.page_space == space]
        used = np.concatenate([tables[r][m] for r in range(batch) for m in members])
        np.testing.assert_array_equal(used, perm[:used.size])   # consecutive, disjoint slices
    # a smaller burst in the same pool is a prefix of the larger one
    smaller = burst_tables(lay, isl, 1, seed=seed, side=side)
    for k in smaller[0]:
        np.testing.assert_array_equal(smaller[0][k], tables[0][k])


def test_block_table_errors():
    lay = layout_for_burst("kv-dsv4", 1024, 16, 2)
    with pytest.raises(BadInput, match="side"):
        burst_tables(lay, 1024, 1, seed=0, side="left")
    with pytest.raises(BadInput, match="order"):
        space_permutation(lay, "csa", seed=0, side="src", order="shuffled")
    with pytest.raises(BadInput, match="page space"):
        space_permutation(lay, "nope", seed=0, side="src")
    with pytest.raises(BadInput, match="batch"):
        burst_tables(lay, 1024, 0, seed=0, side="src")
    with pytest.raises(BadInput, match="seed"):
        derive_seed("1")
    with pytest.raises(BadInput, match="seed parts"):
        derive_seed(1, 2.5)


def test_pool_too_small_for_the_burst():
    w = get_workload("kv-dsv4")
    small = layout_for_burst(w, 1024, 16, 1)
    with pytest.raises(BadInput, match="pool too small"):
        build_burst(w, 1024, 16, 8, layout=small)
    with pytest.raises(BadInput, match="pool too small"):
        build_burst(w, 1024, 16, 1, layout=build_layout(w, 16, 1))


# ---------------------------------------------------------------------------- layouts


@SETTINGS
@given(name=st.sampled_from(sorted(WORKLOADS)), pool_pages=st.integers(1, 5000), data=st.data())
def test_layout_regions_are_aligned_and_disjoint(name, pool_pages, data):
    w = get_workload(name)
    page = data.draw(st.sampled_from(w.allowed_pages or (4, 16, 64, 128)))
    lay = build_layout(w, page, pool_pages)
    assert lay.pool_bytes % POOL_ALIGN_BYTES == 0
    extents = {}
    for r in lay.regions:
        assert r.base_offset_bytes % POOL_ALIGN_BYTES == 0
        assert r.end_offset_bytes <= lay.pool_bytes
        assert r.desc_bytes <= r.page_stride_bytes
        # the last descriptor of the last plane ends inside the region
        last = r.base_offset_bytes + (r.planes - 1) * r.plane_stride_bytes + (r.pool_pages - 1) * r.page_stride_bytes
        assert last + r.desc_bytes <= r.end_offset_bytes
        extents[r.page_space] = (r.base_offset_bytes, r.end_offset_bytes)
    ordered = sorted(extents.values())
    assert all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:]))   # page spaces never overlap
    assert lay.min_alignment_bytes >= 4 and lay.as_dict()["pool_bytes"] == lay.pool_bytes


def test_pool_sizing_rules():
    w = get_workload("kv-dsv4")
    per_req = w.pages_per_request(32768, 16)
    assert pages_for_burst(w, 32768, 16, 1) == {k: 2 * v + 8 for k, v in per_req.items()}
    assert pages_for_burst(w, 32768, 16, 16) == {k: 20 * v + 8 for k, v in per_req.items()}
    assert pool_bytes_for_burst(w, 32768, 16, 16) >= 16 * w.bytes_per_request(32768, 16)
    budget = 10 << 30
    n = pool_pages_for_budget(w, 16, budget)
    assert build_layout(w, 16, n).pool_bytes <= budget < build_layout(w, 16, n + 1).pool_bytes
    assert pool_pages_for_budget(w, 16, 100) == 0
    b = max_batch_for_budget(w, 32768, 16, budget)
    assert pool_bytes_for_burst(w, 32768, 16, b) <= budget < pool_bytes_for_burst(w, 32768, 16, b + 1)
    assert max_batch_for_budget(w, 32768, 16, 1000) == 0


def test_layout_errors():
    w = get_workload("kv-dsv4")
    with pytest.raises(BadInput, match="page spaces"):
        build_layout(w, 16, {"csa": 10})
    with pytest.raises(BadInput, match="page spaces"):
        build_layout(w, 16, {"csa": 10, "csa-idx": 10, "hca": 10, "window": 10, "extra": 1})
    with pytest.raises(BadInput, match="pool pages"):
        build_layout(w, 16, 0)
    with pytest.raises(BadInput, match="power of two"):
        build_layout(w, 16, 10, align_bytes=100)
    with pytest.raises(BadInput, match="no region"):
        build_layout(w, 16, 10).region("nope")
    with pytest.raises(BadInput, match="native block"):
        build_layout("kv-dsv4-vllm", 64, 10)
    with pytest.raises(BadInput, match="multiple of 4"):
        layout_for_burst(w, 1024, 6, 1)


# ---------------------------------------------------------------------------- validators fed bad data


@pytest.fixture(scope="module")
def small_burst():
    return build_burst("kv-dsv4", 512, 16, 2, seed=9)


def _corrupt(burst, row, col, value):
    plan = burst.plan.copy()
    plan[row, col] = value
    return plan


def _validate(burst, plan):
    validate_plan(plan, burst.src_layout, burst.dst_layout, spans=burst.spans, describe=burst.describe_row)


def test_validate_rejects_destination_overlap(small_burst):
    b = small_burst
    plan = _corrupt(b, 40, 1, b.plan[7, 1])                 # row 40 now lands on row 7's destination
    with pytest.raises(BadInput, match=r"descriptor 40 .*overlaps descriptor 7 .*destination"):
        _validate(b, plan)
    plan = _corrupt(b, 41, 1, b.plan[7, 1] + 1)             # a partial overlap is an overlap too
    with pytest.raises(BadInput, match="overlaps"):
        validate_plan(plan, b.src_layout)


@pytest.mark.parametrize("col,side", [(0, "source"), (1, "destination")])
def test_validate_rejects_out_of_pool(small_burst, col, side):
    b = small_burst
    pool = (b.src_layout if col == 0 else b.dst_layout).pool_bytes
    with pytest.raises(BadInput, match=rf"descriptor 5 .*{side} range .*outside the {side} pool"):
        _validate(b, _corrupt(b, 5, col, pool - 1))
    with pytest.raises(BadInput, match=rf"descriptor 6 .*outside the {side} pool"):
        _validate(b, _corrupt(b, 6, col, -8))


@pytest.mark.parametrize("col,side", [(0, "source"), (1, "destination")])
def test_validate_rejects_out_of_region(small_burst, col, side):
    b = small_burst
    lay = b.src_layout if col == 0 else b.dst_layout
    hca = lay.region("hca")
    row = next(s for s in b.spans if s.region == "csa").start + 3
    # inside the pool, but in the hca region while the row belongs to csa
    with pytest.raises(BadInput, match=rf"request 0, region 'csa'.*{side} range .*outside its region 'csa'"):
        _validate(b, _corrupt(b, row, col, hca.base_offset_bytes))


def test_validate_rejects_empty_descriptors_and_bad_arrays(small_burst):
    b = small_burst
    with pytest.raises(BadInput, match="descriptor 3 .*moves 0 bytes"):
        _validate(b, _corrupt(b, 3, 2, 0))
    with pytest.raises(BadInput, match="moves -4 bytes"):
        _validate(b, _corrupt(b, 3, 2, -4))
    with pytest.raises(BadInput, match="int64 of shape"):
        validate_plan(b.plan.astype(np.int32), b.src_layout)
    with pytest.raises(BadInput, match="int64 of shape"):
        validate_plan(b.plan[:, :2].copy(), b.src_layout)
    with pytest.raises(BadInput, match="numpy array"):
        validate_plan(b.plan.tolist(), b.src_layout)
    with pytest.raises(BadInput, match="span"):
        validate_plan(b.plan, b.src_layout, spans=[PlanSpan(0, "csa", 0, b.descriptors + 5)])
    validate_plan(np.empty((0, 3), dtype=np.int64), b.src_layout)    # empty is fine


def test_find_dst_overlap():
    plan = np.array([[0, 50, 10], [0, 0, 100], [0, 200, 10], [0, 300, 5], [0, 305, 5]], dtype=np.int64)
    assert find_dst_overlap(plan) == (0, 1)                 # [0, 100) contains [50, 60)
    assert find_dst_overlap(plan[2:]) is None               # touching is not overlapping
    assert find_dst_overlap(plan[:1]) is None


def test_bulk_and_burst_errors(small_burst):
    b = small_burst
    with pytest.raises(BadInput, match="bulk bytes"):
        bulk_plan(0)
    with pytest.raises(BadInput, match="offset"):
        bulk_plan(10, src_offset=-1)
    with pytest.raises(BadInput, match="outside the source pool"):
        validate_plan(bulk_plan(b.src_layout.pool_bytes + 1), b.src_layout)
    with pytest.raises(BadInput, match="layout is for"):
        build_burst("kv-mla", 512, 16, 1, layout=b.src_layout)
    with pytest.raises(BadInput, match="same regions"):
        build_burst("kv-dsv4", 512, 16, 1, layout=b.src_layout, dst_layout=layout_for_burst("kv-dsv4", 512, 64, 1))
    with pytest.raises(BadInput, match="batch"):
        build_burst("kv-dsv4", 512, 16, 0)
    with pytest.raises(BadInput, match="one length"):
        tables = burst_tables(b.src_layout, 512, 1, seed=0, side="src")[0]
        short = dict(tables, csa=tables["csa"][:-1])
        request_plan(b.src_layout, b.dst_layout, tables, short)
