"""KV workload presets: the suite's counts exactly, vLLM's geometry, and every validator fed bad data."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from gpuxfer.errors import BadInput
from gpuxfer.bench.kv.model.workloads import (WORKLOADS, PageMap, Region, Workload, dsv4_vllm_workload, get_workload,
                                  workload_names)

SETTINGS = settings(max_examples=40, deadline=None)

# The CollectiveX suite's per-request counts for kv-dsv4 (SemiAnalysisAI/InferenceX PR #2510,
# plan_config; the issue quotes 131,304 / 38,778 / ~183 MB / ~2.09 M).
SUITE_COUNTS = {
    # (isl, page): (descriptors, bytes)
    (8192, 16): (33_192, 49_139_712),
    (8192, 64): (9_786, 49_139_712),
    (32768, 16): (131_304, 183_066_624),
    (32768, 64): (38_778, 183_066_624),
    (131072, 16): (523_752, 718_774_272),
    (131072, 64): (154_746, 718_774_272),
    (524288, 16): (2_093_544, 2_861_604_864),
    (524288, 64): (618_618, 2_861_604_864),
}


@pytest.mark.parametrize("isl,page", sorted(SUITE_COUNTS))
def test_kv_dsv4_matches_the_suite_exactly(isl, page):
    w = get_workload("kv-dsv4")
    descs, nbytes = SUITE_COUNTS[(isl, page)]
    assert w.descriptors_per_request(isl, page) == descs
    assert w.bytes_per_request(isl, page) == nbytes


def test_kv_dsv4_issue_numbers():
    w = get_workload("kv-dsv4")
    assert w.descriptors_per_request(32 * 1024, 16) == 131_304
    assert w.descriptors_per_request(32 * 1024, 64) == 38_778
    assert round(w.bytes_per_request(32 * 1024, 16) / 1e6) == 183
    assert round(w.bytes_per_request(32 * 1024, 64) / 1e6) == 183
    assert round(w.descriptors_per_request(512 * 1024, 16) / 1e6, 2) == 2.09


def test_kv_dsv4_region_breakdown_at_32k_p16():
    shape = get_workload("kv-dsv4").request_shape(32768, 16)
    # (name, planes, pages, desc_bytes)
    assert shape.regions == (("csa", 30, 2048, 2304), ("csa-idx", 30, 2048, 528), ("hca", 31, 256, 576),
                             ("window", 61, 8, 9216))
    assert shape.descriptors == 131_304 and shape.bytes == 183_066_624


def test_kv_dsv4_vllm_geometry():
    w = get_workload("kv-dsv4-vllm")
    by_name = {r.name: r for r in w.regions}
    assert by_name["c4a"].page_bytes(256) == 37_440          # 64 x 584 = 37,376 padded to 576
    assert by_name["c4a-idx"].page_bytes(256) == 8_640       # 64 x 132 = 8,448 padded
    assert by_name["c128a"].page_bytes(256) == 1_728         # 2 x 584 = 1,168 padded
    assert by_name["swa-0"].page_bytes(256) == 37_440        # fixed 64-token block
    assert by_name["c4a"].entries_per_page(256) == 64 and by_name["c128a"].entries_per_page(256) == 2
    trs = {t.name: t for t in w.transfer_regions(256)}
    assert trs["mla"].desc_bytes == 30 * 37_440 + 30 * 8_640 + 31 * 1_728 == 1_435_968
    assert trs["swa-0"].desc_bytes == 31 * 37_440 and trs["swa-1"].desc_bytes == 30 * 37_440
    assert all(t.planes == 1 and t.packed and t.page_space == "slab" for t in trs.values())
    assert sum(r.layers for r in w.regions if r.name.startswith("swa")) == 61
    # 32k: 128 blocks of the full-MLA slab + 2 SWA blocks per tuple-group
    assert w.descriptors_per_request(32768, 256) == 132
    assert w.bytes_per_request(32768, 256) == 128 * 1_435_968 + 2 * (31 + 30) * 37_440


def test_kv_dsv4_vllm_mxfp4_indexer_matches_vllm_reported_stride():
    # vLLM PR #48993 reports a 1,315,008 B FlashMLA block stride for V4-Pro with the MXFP4 indexer.
    w = dsv4_vllm_workload(68, name="kv-dsv4-vllm-mxfp4")
    assert w.transfer_regions(256)[0].desc_bytes == 1_315_008


@pytest.mark.parametrize("page", [16, 64, 128, 512])
def test_kv_dsv4_vllm_only_takes_its_native_block(page):
    with pytest.raises(BadInput, match="native block size 256"):
        get_workload("kv-dsv4-vllm").descriptors_per_request(32768, page)


def test_kv_mla_and_kv_gqa_shapes():
    mla, gqa = get_workload("kv-mla"), get_workload("kv-gqa")
    assert mla.bytes_per_request(32768, 16) == 61 * 576 * 32768
    assert mla.descriptors_per_request(32768, 16) == 61 * 2048
    assert [r.name for r in gqa.regions] == ["k", "v"]
    assert all(r.layers == 94 and r.bytes_per_entry == 4 * 128 * 2 for r in gqa.regions)
    assert gqa.bytes_per_request(32768, 64) == 94 * 2 * 4 * 128 * 2 * 32768
    assert gqa.descriptors_per_request(32768, 64) == 2 * 94 * 512
    # a partly filled last page moves whole
    assert mla.bytes_per_request(17, 16) == 61 * 32 * 576


def _page_for(workload, data):
    if workload.allowed_pages:
        return data.draw(st.sampled_from(workload.allowed_pages))
    return data.draw(st.sampled_from([p for p in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if workload.supports_page(p)]))


@SETTINGS
@given(name=st.sampled_from(sorted(WORKLOADS)), isl=st.integers(1, 1 << 20), data=st.data())
def test_counts_follow_the_formula(name, isl, data):
    w = get_workload(name)
    page = _page_for(w, data)
    descs = bytes_ = 0
    for t in w.transfer_regions(page):
        tokens = isl if t.window_tokens is None else min(isl, t.window_tokens)
        pages = math.ceil(tokens / t.tokens_per_page)
        descs += t.planes * pages
        bytes_ += t.planes * pages * t.desc_bytes
    assert w.descriptors_per_request(isl, page) == descs
    assert w.bytes_per_request(isl, page) == bytes_
    shape = w.request_shape(isl, page)
    assert (shape.descriptors, shape.bytes) == (descs, bytes_)
    # at least the stored bytes of every token it holds, and monotone in the input length
    assert w.bytes_per_request(isl + 1, page) >= bytes_


@SETTINGS
@given(name=st.sampled_from(["kv-dsv4", "kv-mla", "kv-gqa"]), isl=st.integers(1, 1 << 19))
def test_page_size_never_changes_bytes_of_whole_pages(name, isl):
    # with an ISL that fills whole 64-token pages, 16- and 64-token pages move the same bytes
    w = get_workload(name)
    isl = -(-isl // 128) * 128
    assert w.bytes_per_request(isl, 16) == w.bytes_per_request(isl, 64)


# ---------------------------------------------------------------------------- errors


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(BadInput) as exc:
        get_workload("kv-llama")
    for name in WORKLOADS:
        assert name in str(exc.value)
    with pytest.raises(BadInput):
        get_workload(None)
    assert get_workload(WORKLOADS["kv-mla"]) is WORKLOADS["kv-mla"]
    assert workload_names() == list(WORKLOADS)


@pytest.mark.parametrize("page,match", [(6, "multiple of 4"), (12, "divide 128"), (0, "positive"),
                                        (-16, "positive"), (16.0, "integer"), (True, "integer")])
def test_unmappable_page_sizes(page, match):
    w = get_workload("kv-dsv4")
    with pytest.raises(BadInput, match=match):
        w.descriptors_per_request(32768, page)
    assert not w.supports_page(page)


@pytest.mark.parametrize("isl", [0, -1, 1.5])
def test_bad_input_length(isl):
    with pytest.raises(BadInput):
        get_workload("kv-dsv4").bytes_per_request(isl, 16)


@pytest.mark.parametrize("kwargs,match", [
    (dict(name=""), "name"),
    (dict(layers=0), "layers"),
    (dict(layers=2.0), "layers"),
    (dict(bytes_per_entry=-1), "bytes_per_entry"),
    (dict(tokens_per_entry=0), "tokens_per_entry"),
    (dict(page_align_bytes=0), "page_align_bytes"),
    (dict(page_map="sideways"), "unknown page_map"),
    (dict(window_tokens=0), "window_tokens"),
    (dict(page_map=PageMap.FIXED), "needs fixed_page_tokens"),
    (dict(page_map=PageMap.FIXED, fixed_page_tokens=6, tokens_per_entry=4), "not a multiple"),
    (dict(fixed_page_tokens=64), "only for page_map 'fixed'"),
    (dict(pack_group=""), "pack_group"),
])
def test_region_validation(kwargs, match):
    base = dict(name="r", layers=2, bytes_per_entry=8, tokens_per_entry=1)
    base.update(kwargs)
    with pytest.raises(BadInput, match=match):
        Region(**base)


def test_region_accepts_page_map_strings():
    assert Region("r", 1, 8, 4, page_map="at-least-one").page_map is PageMap.AT_LEAST_ONE


def _r(name, **kw):
    return Region(name, layers=kw.pop("layers", 2), bytes_per_entry=kw.pop("bytes_per_entry", 8),
                  tokens_per_entry=kw.pop("tokens_per_entry", 1), **kw)


@pytest.mark.parametrize("kwargs,match", [
    (dict(regions=()), "non-empty"),
    (dict(regions=("not a region",)), "non-empty"),
    (dict(regions=(_r("a"), _r("a"))), "duplicate"),
    (dict(regions=(_r("a"), _r("b", pack_group="a"))), "must differ"),
    (dict(regions=(_r("slab"),)), "reserved"),
    (dict(allowed_pages=()), "allowed_pages"),
    (dict(allowed_pages=(0,)), "allowed page"),
    (dict(default_pages=()), "default_pages"),
    (dict(regions=(_r("a", tokens_per_entry=4),), default_pages=(6,)), "multiple of 4"),
    (dict(name=""), "name"),
])
def test_workload_validation(kwargs, match):
    base = dict(name="w", regions=(_r("a"),))
    base.update(kwargs)
    with pytest.raises(BadInput, match=match):
        Workload(**base)


def test_pack_group_mixing_block_spans_is_refused():
    w = Workload("w", regions=(_r("a", pack_group="g"), _r("b", tokens_per_entry=4, pack_group="g",
                                                           page_map=PageMap.FIXED, fixed_page_tokens=64)),
                 default_pages=(64,))
    assert w.descriptors_per_request(100, 64) == 2        # same 64-token span: fine
    with pytest.raises(BadInput, match="one slab"):
        w.transfer_regions(16)                            # a: 16-token blocks, b: 64-token blocks
