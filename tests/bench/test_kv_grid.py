"""The sweep grid: budgets never exceeded, the floor always kept, every shed batch explained."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from gpuxfer.errors import BadInput
from gpuxfer.bench.kv.grid import (DEFAULT_BATCHES, DEFAULT_DESC_BUDGET, DEFAULT_ISLS, DEFAULT_PAGES,
                             DEFAULT_POOL_BUDGET_BYTES, FLOOR_BATCHES, SHED_DESC, SHED_POOL, build_grid)
from gpuxfer.bench.kv.model.layout import pool_bytes_for_burst
from gpuxfer.bench.kv.model.workloads import get_workload

SETTINGS = settings(max_examples=30, deadline=None)
GiB = 1 << 30


def _check_invariants(grid, batches):
    batches = sorted(set(batches))
    floor = set(batches[:FLOOR_BATCHES])
    for p in grid.points:
        kept, shed = list(p.batches), [s.batch for s in p.shed]
        # every requested batch is kept or shed, exactly once, and reported in order
        assert sorted(kept + shed) == batches and kept == sorted(kept) and shed == sorted(shed)
        for b in kept:
            pool = pool_bytes_for_burst(p.workload, p.isl_tokens, p.page_tokens, b)
            assert grid.pools_per_device * pool <= grid.pool_budget_bytes            # the pool budget is hard
            assert b in floor or b * p.request_descriptors <= grid.desc_budget       # desc budget, but the floor
        for s in p.shed:
            pool = pool_bytes_for_burst(p.workload, p.isl_tokens, p.page_tokens, s.batch)
            assert s.pool_bytes == pool and s.burst_descriptors == s.batch * p.request_descriptors
            if s.reason == SHED_DESC:
                assert s.batch not in floor and s.burst_descriptors > grid.desc_budget
            else:
                assert s.reason == SHED_POOL and grid.pools_per_device * pool > grid.pool_budget_bytes
            assert s.detail
        # the floor stays unless the pool budget forbids it
        for b in floor:
            if grid.pools_per_device * pool_bytes_for_burst(p.workload, p.isl_tokens, p.page_tokens, b) \
                    <= grid.pool_budget_bytes:
                assert b in kept
        # shedding takes the largest batches: whatever is kept is a prefix of the request
        assert kept == batches[:len(kept)]
        if kept:
            assert p.pool_bytes == pool_bytes_for_burst(p.workload, p.isl_tokens, p.page_tokens, kept[-1])
        else:
            assert p.pool_bytes == 0


def test_default_grid():
    grid = build_grid()
    assert [(p.isl_tokens, p.page_tokens) for p in grid.points] == \
        [(i, pg) for i in DEFAULT_ISLS for pg in DEFAULT_PAGES]
    assert grid.pool_budget_bytes == DEFAULT_POOL_BUDGET_BYTES == 64 * GiB
    assert grid.desc_budget == DEFAULT_DESC_BUDGET
    _check_invariants(grid, DEFAULT_BATCHES)
    kept = {(p.isl_tokens, p.page_tokens): p.batches for p in grid.points}
    # the benchmark's target grid (32k, pages 16 and 64, batches 1..64) is kept whole
    assert kept[(32768, 16)] == kept[(32768, 64)] == DEFAULT_BATCHES
    assert kept[(524288, 16)] == (1, 2, 4, 8)
    p = next(p for p in grid.points if (p.isl_tokens, p.page_tokens) == (32768, 16))
    assert p.request_descriptors == 131_304 and p.request_bytes == 183_066_624
    assert p.burst_descriptors(64) == 64 * 131_304


def test_the_suites_descriptor_budget_reproduces_the_suites_grid():
    # CollectiveX DESC_BUDGET = 2,250,000 (run_kv._grid); its derived batches per point
    grid = build_grid(desc_budget=2_250_000)
    kept = {(p.isl_tokens, p.page_tokens): p.batches for p in grid.points}
    assert kept == {
        (8192, 16): (1, 2, 4, 8, 16, 32, 64), (8192, 64): (1, 2, 4, 8, 16, 32, 64),
        (32768, 16): (1, 2, 4, 8, 16), (32768, 64): (1, 2, 4, 8, 16, 32),
        (131072, 16): (1, 2, 4), (131072, 64): (1, 2, 4, 8),
        (524288, 16): (1, 2), (524288, 64): (1, 2),
    }
    # batch 2 at 512k page 16 is twice the budget and kept as floor
    p = next(p for p in grid.points if (p.isl_tokens, p.page_tokens) == (524288, 16))
    assert p.burst_descriptors(2) == 4_187_088 > 2_250_000
    _check_invariants(grid, DEFAULT_BATCHES)


def test_pool_budget_can_shed_the_floor():
    w = get_workload("kv-dsv4")
    b1 = pool_bytes_for_burst(w, 524288, 16, 1)
    b2 = pool_bytes_for_burst(w, 524288, 16, 2)
    grid = build_grid(isls=[524288], pages=[16], pool_budget_bytes=(b1 + b2) // 2)
    (p,) = grid.points
    assert p.batches == (1,)
    assert {s.batch: s.reason for s in p.shed}[2] == SHED_POOL
    grid = build_grid(isls=[524288], pages=[16], pool_budget_bytes=b1 - 1)
    (p,) = grid.points
    assert p.batches == () and p.pool_bytes == 0
    assert [s.reason for s in p.shed[:2]] == [SHED_POOL, SHED_POOL]
    with pytest.raises(BadInput, match="keeps no batch"):
        p.layout()


def test_free_memory_caps_the_pool_budget_and_two_pools_per_device_double_it():
    grid = build_grid(isls=[32768], pages=[16], pool_budget_bytes=64 * GiB, free_memory_bytes=4 * GiB)
    assert grid.pool_budget_bytes == 4 * GiB and grid.asked_pool_budget_bytes == 64 * GiB
    one = build_grid(isls=[32768], pages=[16], pool_budget_bytes=8 * GiB)
    two = build_grid(isls=[32768], pages=[16], pool_budget_bytes=8 * GiB, pools_per_device=2)
    assert len(two.points[0].batches) < len(one.points[0].batches)
    _check_invariants(two, DEFAULT_BATCHES)
    assert "2 pools on one device" in two.points[0].shed[0].detail


@SETTINGS
@given(
    names=st.lists(st.sampled_from(["kv-dsv4", "kv-mla", "kv-gqa", "kv-dsv4-vllm"]), min_size=1, max_size=2),
    isls=st.lists(st.sampled_from([1024, 8192, 32768, 131072, 524288]), min_size=1, max_size=3),
    batches=st.lists(st.integers(1, 128), min_size=1, max_size=8),
    pool_budget=st.integers(1 << 20, 200 * GiB),
    free=st.one_of(st.none(), st.integers(0, 200 * GiB)),
    desc_budget=st.integers(1, 1 << 26),
    pools_per_device=st.integers(1, 2),
)
def test_grid_never_exceeds_its_budgets_and_keeps_its_floor(names, isls, batches, pool_budget, free, desc_budget,
                                                            pools_per_device):
    grid = build_grid(names, None, isls, batches, pool_budget_bytes=pool_budget, free_memory_bytes=free,
                      desc_budget=desc_budget, pools_per_device=pools_per_device)
    assert grid.pool_budget_bytes == (pool_budget if free is None else min(pool_budget, free))
    _check_invariants(grid, batches)
    assert grid.max_pool_bytes * pools_per_device <= grid.pool_budget_bytes
    assert grid.as_dict()["points"][0]["isl_tokens"] == grid.points[0].isl_tokens


def test_points_build_their_bursts():
    grid = build_grid(["kv-dsv4"], [16], [1024], [1, 2, 4])
    (p,) = grid.points
    lay = p.layout()
    burst = p.burst(2, seed=4, layout=lay)
    assert burst.descriptors == 2 * p.request_descriptors and burst.src_layout is lay
    assert lay.pool_bytes == p.pool_bytes
    with pytest.raises(BadInput, match="not kept"):
        p.burst(3)


def test_pages_default_per_workload_and_explicit_pages_must_map():
    grid = build_grid(["kv-dsv4", "kv-dsv4-vllm"], None, [8192], [1])
    assert [(p.workload.name, p.page_tokens) for p in grid.points] == \
        [("kv-dsv4", 16), ("kv-dsv4", 64), ("kv-dsv4-vllm", 256)]
    with pytest.raises(BadInput, match="native block"):
        build_grid(["kv-dsv4-vllm"], [16], [8192], [1])
    with pytest.raises(BadInput, match="multiple of 4"):
        build_grid(["kv-dsv4"], [6], [8192], [1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(workloads=[]), "workload"),
    (dict(workloads=["kv-nope"]), "unknown KV workload"),
    (dict(isls=[]), "input length"),
    (dict(isls=[0]), "input length"),
    (dict(batches=[]), "batch"),
    (dict(batches=[1, -2]), "batch"),
    (dict(pages=[]), "page size"),
    (dict(pool_budget_bytes=0), "pool budget"),
    (dict(free_memory_bytes=-1), "free memory"),
    (dict(desc_budget=0), "descriptor budget"),
    (dict(pools_per_device=0), "pools per device"),
])
def test_grid_rejects_bad_input(kwargs, match):
    with pytest.raises(BadInput, match=match):
        build_grid(**kwargs)
