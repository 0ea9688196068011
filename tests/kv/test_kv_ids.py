"""A request's block-ID checks and order (gpuxfer.kv.ids._RouteIds), against a per-group reference.

Pure NumPy: random routes (group limits, block-size ratios, groups sharing destination memory) and
requests; the checked, ordered IDs equal a group-by-group stable sort by the key side, and a corrupted ID
in any group, on either side, raises :class:`BlockIdError` naming the request, the group and the ID.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gpuxfer.errors import BlockIdError
from gpuxfer.kv.ids import _RouteIds


@st.composite
def routes(draw):
    G = draw(st.integers(1, 4), label="groups")
    groups = tuple(f"g{i}" for i in range(G))
    limits = [(draw(st.integers(1, 40)), draw(st.integers(1, 40))) for _ in range(G)]
    splits = [draw(st.sampled_from([(1, 1), (1, 1), (2, 1), (1, 4)])) for _ in range(G)]
    # groups in one class share destination memory (a block ID serves one of them)
    labels = [draw(st.integers(0, G - 1)) for _ in range(G)]
    classes: dict[int, list[int]] = {}
    for gi, lab in enumerate(labels):
        classes.setdefault(lab, []).append(gi)
    return groups, limits, splits, list(classes.values()), draw(st.booleans(), label="sort_by_dst")


def _request(draw_ids, groups, limits, splits, classes):
    """Valid IDs per group: distinct destinations within each class, any sources."""
    src, dst = {}, {}
    for cls in classes:
        pool = draw_ids(st.permutations(range(max(limits[gi][1] for gi in cls))))
        for gi in cls:
            rs, rd = splits[gi]
            ls, ld = limits[gi]
            room = [b for b in pool if b < ld]
            d = room[:draw_ids(st.integers(0, min(len(room), 8)))]
            pool = [b for b in pool if b not in d]
            n = len(d) * rd             # tokens in segments: the destination blocks cover them
            src[groups[gi]] = np.array([draw_ids(st.integers(0, ls - 1)) for _ in range(-(-n // rs))],
                                       dtype=np.int64)
            dst[groups[gi]] = np.array(d, dtype=np.int64)
    return src, dst


def _reference(groups, splits, sort_by_dst, src, dst):
    out_s, out_d = [], []
    for g, (rs, rd) in zip(groups, splits):
        s, d = src[g], dst[g]
        if rs == rd == 1 and s.size > 1:
            order = np.argsort(d if sort_by_dst else s, kind="stable")
            s, d = s[order], d[order]
        out_s.append(s)
        out_d.append(d)
    return np.concatenate(out_s), np.concatenate(out_d)


def _check_and_write(ids, push, src, dst, name="req"):
    local, remote = (src, dst) if push else (dst, src)
    n_seg, lens_s, lens_d, checked = ids.check(name, push, local, remote)
    out_s, out_d = np.full(sum(lens_s), -7, np.int64), np.full(sum(lens_d), -7, np.int64)
    ids.write(checked, out_s, out_d)
    return n_seg, lens_s, lens_d, out_s, out_d


@settings(max_examples=150, deadline=None)
@given(route=routes(), data=st.data(), push=st.booleans())
def test_order_and_counts_match_the_reference(route, data, push):
    groups, limits, splits, classes, sort_by_dst = route
    ids = _RouteIds(groups, limits, splits, classes, sort_by_dst)
    src, dst = _request(data.draw, groups, limits, splits, classes)
    n_seg, lens_s, lens_d, out_s, out_d = _check_and_write(ids, push, src, dst)
    want_s, want_d = _reference(groups, splits, sort_by_dst, src, dst)
    assert np.array_equal(out_s, want_s) and np.array_equal(out_d, want_d)
    assert lens_s == [src[g].size for g in groups] and lens_d == [dst[g].size for g in groups]
    assert n_seg == [src[g].size if rs == 1 else dst[g].size for g, (rs, _) in zip(groups, splits)]


@settings(max_examples=150, deadline=None)
@given(route=routes(), data=st.data(), push=st.booleans())
def test_a_corrupted_id_in_any_group_is_named(route, data, push):
    groups, limits, splits, classes, sort_by_dst = route
    ids = _RouteIds(groups, limits, splits, classes, sort_by_dst)
    src, dst = _request(data.draw, groups, limits, splits, classes)
    filled = [(g, side) for g in groups for side in ("src", "dst") if (src if side == "src" else dst)[g].size]
    if not filled:
        return
    g, side = data.draw(st.sampled_from(filled), label="where")
    gi = groups.index(g)
    arr = (src if side == "src" else dst)[g]
    pos = data.draw(st.integers(0, arr.size - 1), label="position")
    limit = limits[gi][0 if side == "src" else 1]
    bad = data.draw(st.sampled_from([limit, limit + 1, 2 * limit + 50, -1, -limit, -(1 << 62), (1 << 62) - 1]),
                    label="bad ID")
    arr[pos] = bad
    with pytest.raises(BlockIdError, match=rf"request 'r9', group '{g}', "
                       rf"{'source' if side == 'src' else 'destination'} .*block ID {bad} at position"):
        _check_and_write(ids, push, src, dst, name="r9")


@settings(max_examples=100, deadline=None)
@given(route=routes(), data=st.data(), push=st.booleans())
def test_a_repeated_destination_is_named(route, data, push):
    groups, limits, splits, classes, sort_by_dst = route
    ids = _RouteIds(groups, limits, splits, classes, sort_by_dst)
    src, dst = _request(data.draw, groups, limits, splits, classes)
    # a destination block of one group given again to a group of its class (or to the group itself)
    cands = [(gi, gj) for cls in classes for gi in cls for gj in cls if dst[groups[gi]].size
             and (gi != gj or dst[groups[gi]].size > 1) and dst[groups[gj]].size]
    if not cands:
        return
    gi, gj = data.draw(st.sampled_from(cands), label="groups")
    a, b = dst[groups[gi]], dst[groups[gj]]
    i = data.draw(st.integers(0, a.size - 1), label="from")
    j = data.draw(st.sampled_from([k for k in range(b.size) if gi != gj or k != i]), label="to")
    if a[i] >= limits[gj][1]:
        return                      # out of the other group's range: a range error, tested above
    b[j] = a[i]
    cls = next(c for c in classes if gi in c)
    with pytest.raises(BlockIdError, match=rf"request 'r9', group\(s\) {', '.join(groups[k] for k in cls)}: "
                       rf"destination block {a[i]} appears more than once"):
        _check_and_write(ids, push, src, dst, name="r9")


def test_counts_that_cover_different_tokens_are_named():
    ids = _RouteIds(("a", "b"), [(8, 8), (8, 8)], [(1, 1), (2, 1)], [[0], [1]], False)
    ids.check("r", True, {"a": [0], "b": [0, 1]}, {"a": [1], "b": [0, 1, 2]})    # 2-block sources cover 3
    with pytest.raises(BlockIdError, match="group 'b': 2 source and 5 destination"):
        ids.check("r", True, {"a": [0], "b": [0, 1]}, {"a": [1], "b": [0, 1, 2, 3, 4]})
    with pytest.raises(BlockIdError, match="group 'a': 1 source and 2 destination"):
        ids.check("r", True, {"a": [0], "b": [0]}, {"a": [1, 2], "b": [0, 1]})


def test_large_sparse_ranges_and_repeated_sources():
    """Few IDs in a large range (the comparison-sort path) and a source block read twice (sorted stably)."""
    ids = _RouteIds(("a", "b"), [(1 << 20, 1 << 20), (50, 50)], [(1, 1), (1, 1)], [[0], [1]], False)
    src = {"a": np.array([900_000, 5, 70_000], np.int64), "b": np.array([7, 3, 7, 3, 1], np.int64)}
    dst = {"a": np.array([1, 2, 3], np.int64), "b": np.array([10, 11, 12, 13, 14], np.int64)}
    _, _, _, out_s, out_d = _check_and_write(ids, False, src, dst)
    assert out_s.tolist() == [5, 70_000, 900_000, 1, 3, 3, 7, 7]
    assert out_d.tolist() == [2, 3, 1, 14, 11, 13, 10, 12]
    dst["a"] = np.array([1, 2, 1], np.int64)
    with pytest.raises(BlockIdError, match="group\\(s\\) a: destination block 1 appears more than once"):
        _check_and_write(ids, False, src, dst)


@pytest.mark.parametrize("sort_by_dst", [False, True])
@pytest.mark.parametrize("push", [False, True])
def test_one_group_few_ids_in_a_large_range(sort_by_dst, push):
    """One group of 1:1 blocks, few IDs in a large range (an engine's request: its own shortcut) orders and
    refuses as the reference does."""
    ids = _RouteIds(("a",), [(1 << 20, 1 << 16)], [(1, 1)], [[0]], sort_by_dst)
    assert ids.single
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(0, 40))
        src = {"a": rng.integers(0, 1 << 20, n)}
        dst = {"a": rng.permutation(1 << 16)[:n].astype(np.int64)}
        _, lens_s, lens_d, out_s, out_d = _check_and_write(ids, push, src, dst)
        want_s, want_d = _reference(("a",), [(1, 1)], sort_by_dst, src, dst)
        assert np.array_equal(out_s, want_s) and np.array_equal(out_d, want_d) and lens_s == lens_d == [n]
    src, dst = {"a": np.array([5, 9, 5], np.int64)}, {"a": np.array([4, 4, 1], np.int64)}
    with pytest.raises(BlockIdError, match="group\\(s\\) a: destination block 4 appears more than once"):
        _check_and_write(ids, push, src, dst)
    with pytest.raises(BlockIdError, match="group 'a', destination .*block ID 65536 at position 1"):
        _check_and_write(ids, push, src, {"a": np.array([4, 1 << 16, 1], np.int64)})
    with pytest.raises(BlockIdError, match="group 'a', source .*block ID -3 at position 2"):
        _check_and_write(ids, push, {"a": np.array([5, 9, -3], np.int64)}, {"a": np.array([4, 2, 1], np.int64)})
    with pytest.raises(BlockIdError, match="group 'a': 3 source and 2 destination"):
        _check_and_write(ids, push, src, {"a": np.array([4, 2], np.int64)})


@pytest.mark.parametrize("sort_by_dst", [False, True])
@pytest.mark.parametrize("push", [False, True])
def test_one_group_rising_ids_out_of_range_are_named(sort_by_dst, push):
    """Rising IDs (whose range the one-group shortcut reads from their ends) past the group's blocks, or negative,
    on either side, are refused as any others are, naming the side, the ID and its position."""
    ids = _RouteIds(("a",), [(1 << 20, 1 << 16)], [(1, 1)], [[0]], sort_by_dst)
    rising = np.arange(3, 3 + 7 * 40, 7, dtype=np.int64)
    for side, limit in (("source", 1 << 20), ("destination", 1 << 16)):
        for bad, pos in ((limit, 39), (limit + 5, 39), (1 << 62, 39), (-1, 0), (-(1 << 62), 0)):
            ours = rising.copy()
            ours[pos] = bad
            src, dst = ({"a": ours}, {"a": rising}) if side == "source" else ({"a": rising}, {"a": ours})
            with pytest.raises(BlockIdError, match=rf"group 'a', {side} .*block ID {bad} at position {pos}"):
                _check_and_write(ids, push, src, dst)
    _check_and_write(ids, push, {"a": rising}, {"a": rising + (1 << 16) - 1 - int(rising[-1])})     # (at the ends)


def test_tensors_of_other_dtypes_are_named_not_crashed():
    """CPU tensors of IDs that are not integers (bf16, a float that requires grad, bool) raise BlockIdError
    naming the request, the group and the dtype, not torch's conversion error; integer tensors pass."""
    torch = pytest.importorskip("torch")
    from gpuxfer.kv.ids import _as_ids
    for bad in (torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.0], requires_grad=True),
                torch.tensor([True])):
        with pytest.raises(BlockIdError, match=r"request 'r', group 'g', local blocks: .*integers"):
            _as_ids(bad, "r", "g", "local blocks")
    assert _as_ids(torch.tensor([3, 1], dtype=torch.int32), "r", "g", "local blocks").tolist() == [3, 1]


def _distinct_reference(classes, per_group: list[np.ndarray]) -> bool:
    """No ID twice among the groups of any class (the groups of a class share destination memory)."""
    for cls in classes:
        ids = np.concatenate([per_group[gi] for gi in cls])
        if np.unique(ids).size != ids.size:
            return False
    return True


@settings(max_examples=150, deadline=None)
@given(route=routes(), data=st.data(), scale=st.sampled_from([1, 1 << 12]))
def test_a_batch_s_destinations_distinct_as_the_reference_says(route, data, scale):
    """``distinct`` over a batch's destinations (several requests, each valid alone, per group one after
    another; what :func:`gpuxfer.kv.batch._merge` asks) answers as a per-class reference does: a block two
    requests name, in one group or in two groups of one class, is found, in small ranges (one pass of marks)
    and in large ones (``scale``: few IDs in their range, class by class)."""
    groups, limits, splits, classes, sort_by_dst = route
    limits = [(a * scale, b * scale) for a, b in limits]
    ids = _RouteIds(groups, limits, splits, classes, sort_by_dst)
    draw = data.draw
    per_group: list[list[np.ndarray]] = [[] for _ in groups]
    for _ in range(draw(st.integers(1, 6), label="requests")):
        _, dst = _request(draw, groups, [(a, b // scale) for a, b in limits], splits, classes)
        for gi, g in enumerate(groups):
            per_group[gi].append(dst[g] * scale + draw(st.integers(0, scale - 1)))
    merged = [np.concatenate(p) for p in per_group]
    assert ids.distinct(merged) == _distinct_reference(classes, merged)
    # a block of one request named again by another request (same group, or a group of its class)
    cands = [(gi, gj) for cls in classes for gi in cls for gj in cls if per_group[gi][0].size
             and any(p.size for p in per_group[gj][1:])]
    if cands:
        gi, gj = draw(st.sampled_from(cands), label="groups")
        block = int(draw(st.sampled_from(per_group[gi][0].tolist()), label="block"))
        if block < limits[gj][1]:
            k = draw(st.sampled_from([k for k in range(1, len(per_group[gj])) if per_group[gj][k].size]))
            per_group[gj][k][0] = block
            merged = [np.concatenate(p) for p in per_group]
            assert not ids.distinct(merged)
            assert ids.distinct(merged) == _distinct_reference(classes, merged)


@pytest.mark.parametrize("kind", ["numpy", "tensor"])
@pytest.mark.parametrize("route", ["one group, sparse", "two groups"])
def test_ids_changed_by_another_thread_during_the_checks_are_not_written(monkeypatch, kind, route):
    """The caller's ID arrays changed while the checks run (another thread of theirs: numpy lets the GIL go) do not
    reach the request: what is written is what was checked, never an ID past the blocks."""
    import gpuxfer.kv.ids as ids_mod
    if route == "two groups":
        ids = _RouteIds(("a", "b"), [(64, 64), (64, 64)], [(1, 1), (1, 1)], [[0], [1]], False)
        src = {"a": np.array([3, 1, 2], np.int64), "b": np.array([5, 6], np.int64)}
        dst = {"a": np.array([7, 8, 9], np.int64), "b": np.array([10, 11], np.int64)}
        hook = "_past"
    else:
        ids = _RouteIds(("a",), [(1 << 20, 1 << 16)], [(1, 1)], [[0]], False)
        src, dst = {"a": np.array([1, 5, 9], np.int64)}, {"a": np.array([2, 4, 6], np.int64)}
        hook = "_beyond"
    want_s, want_d = _reference(ids.groups, ids.splits, False, src, dst)
    if kind == "tensor":
        torch = pytest.importorskip("torch")
        src = {g: torch.from_numpy(a) for g, a in src.items()}
        dst = {g: torch.from_numpy(a) for g, a in dst.items()}
    real = getattr(ids_mod, hook)

    def checked_then_changed(*args):
        out = real(*args)
        for side in (src, dst):
            for a in side.values():
                a[:] = 1 << 40          # past every group's blocks
        return out

    monkeypatch.setattr(ids_mod, hook, checked_then_changed)
    _, _, _, out_s, out_d = _check_and_write(ids, False, src, dst)
    assert np.array_equal(out_s, want_s) and np.array_equal(out_d, want_d)
