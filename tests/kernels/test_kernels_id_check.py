"""The device ID check's kernels (gpuxfer.kernels.id_check_kernel) on the CPU interpreter: what they find in a
well-formed request, and that no content of the request -- a forged header, counts, offsets, IDs -- makes them
read or write outside their buffers (each a window of a larger buffer whose guard bytes must not change)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from gpuxfer.errors import BadInput
from gpuxfer.kernels.blocks import check_ids_launchers, request_header_len
from gpuxfer.kernels.id_check_kernel import CHECK_DEST_RANGE, CHECK_DEST_TWICE, CHECK_SOURCE_RANGE

GUARD = 64


def _window(n: int, dtype, fill: int = 0):
    """A tensor of ``n`` entries inside a larger one: ``(window, whole, guard value)``."""
    whole = torch.full((n + 2 * GUARD,), 0x5A, dtype=dtype)
    w = whole[GUARD:GUARD + n]
    w.fill_(fill)
    return w, whole


def _guards_intact(whole, n: int) -> bool:
    return bool((whole[:GUARD] == 0x5A).all() and (whole[GUARD + n:] == 0x5A).all())


def _request(P: int, groups: list[tuple[list[int], list[int]]], wide: bool):
    """A well-formed request array of ``P`` planes for ``groups`` (source, destination IDs each; one request), the
    IDs in tensors of their own (int64 or int32), one piece each: ``(request, its whole, the tensors, header
    length, entries, the pieces' entries)``."""
    G = len(groups)
    head = request_header_len(P, G)
    p0 = head + 2 + 3 * G
    first = p0 + 8 * G
    lens = [len(s) for s, _ in groups] + [len(d) for _, d in groups]
    starts = np.cumsum([first] + lens)
    n = int(starts[-1])
    req, req_whole = _window(n, torch.int64)
    dtype = torch.int64 if wide else torch.int32
    tensors = [torch.tensor(ids, dtype=dtype) for ids in [s for s, _ in groups] + [d for _, d in groups]]
    req[head + 1] = 1 if wide else 0
    for g, (s, d) in enumerate(groups):
        req[P + 1 + g] = max(len(s), len(d))
        req[P + 1 + G + g] = int(starts[g])
        req[P + 1 + 2 * G + g] = int(starts[G + g])
        req[head + 2 + g] = len(d)
        req[head + 2 + G + g] = p0 + 8 * g
        req[head + 2 + 2 * G + g] = 2
        req[p0 + 8 * g:p0 + 8 * g + 8] = torch.tensor(
            [0, tensors[g].data_ptr(), len(s), int(starts[g]), 1, tensors[G + g].data_ptr(), len(d), int(starts[G + g])])
    pieces = {e for g in range(G) for e in range(p0 + 8 * g, p0 + 8 * g + 8)}
    return req, req_whole, tensors, head, n, pieces


def _run(req, gtab, marks, P, G):
    check, settle = check_ids_launchers(req, gtab, marks, n_planes=P, n_groups=G, programs_per_group=2)
    check()
    settle()


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("groups, bits", [
    ([([0, 3, 5], [1, 2, 9])], 0),
    ([([0, 3, 8], [1, 2, 9])], CHECK_SOURCE_RANGE),
    ([([0, 3, 5], [1, 2, 10])], CHECK_DEST_RANGE),
    ([([0, 3, 5], [1, -2, 3])], CHECK_DEST_RANGE),
    ([([0, 3, 5], [4, 2, 4])], CHECK_DEST_TWICE),
    ([([0, 1], [4, 2]), ([2, 3], [4, 5])], CHECK_DEST_TWICE),        # groups 0 and 1 share destination memory
    ([([0, 1], [4, 2]), ([2, 9], [4, 5])], CHECK_DEST_TWICE | CHECK_SOURCE_RANGE),
])
def test_findings_and_settle(wide, groups, bits):
    P, G = 3, len(groups)
    req, _, tensors, head, n, _ = _request(P, groups, wide)
    req[:P + 1] = torch.arange(1, P + 2)
    gtab = torch.tensor([[8, 10, 0]] * G, dtype=torch.int64)      # one destination class: mark offset 0 for all
    marks = torch.zeros(1, dtype=torch.int32)
    before = req.clone()
    _run(req, gtab, marks, P, G)
    assert int(req[head]) == bits
    assert int(marks.abs().sum()) == 0                             # every mark the request set is cleared
    first = head + 2 + 3 * G + 8 * G
    ids = [x for s, _ in groups for x in s] + [x for _, d in groups for x in d]
    assert req[first:first + len(ids)].tolist() == ids              # read from the tensors, as int64
    if bits:
        assert int(req[:P + 1 + G].abs().sum()) == 0                # nothing for the expansion and copies
        assert torch.equal(req[P + 1 + G:head], before[P + 1 + G:head])
    else:
        assert torch.equal(req[:head], before[:head])


def test_launcher_checks_its_tensors():
    req = torch.zeros(64, dtype=torch.int64)
    gtab = torch.zeros((1, 3), dtype=torch.int64)
    marks = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(BadInput, match="marks"):
        check_ids_launchers(req, gtab, marks.long(), n_planes=2, n_groups=1)
    with pytest.raises(BadInput, match="gtab"):
        check_ids_launchers(req, gtab, marks, n_planes=2, n_groups=2)
    with pytest.raises(BadInput, match="header and check fields need"):
        check_ids_launchers(req[:8], gtab, marks, n_planes=2, n_groups=1)


@pytest.mark.parametrize("target", ["header", "own piece", "other group's piece"])
def test_forged_id_positions_never_overwrite_the_fields_or_pieces(target):
    """A piece whose IDs are sent to the header, to the position field of its group's next piece or to another
    group's piece: the check writes no ID there (a piece's fields are what later pieces and other programs
    read), only at and after the end of the pieces."""
    P, groups = 2, [([0, 1, 2], [3, 4, 5]), ([1, 2], [6, 7])]
    G = len(groups)
    req, req_whole, tensors, head, n, pieces = _request(P, groups, wide=True)
    p0 = head + 2 + 3 * G
    req[p0 + 3] = {"header": 0, "own piece": p0 + 7, "other group's piece": p0 + 8 + 3}[target]
    before = req.clone()
    marks = torch.zeros(1, dtype=torch.int32)
    _run(req, torch.tensor([[8, 10, 0]] * G, dtype=torch.int64), marks, P, G)
    assert _guards_intact(req_whole, n)
    assert torch.equal(req[P + 1 + G:head], before[P + 1 + G:head])
    assert torch.equal(req[head + 1:p0 + 8 * G], before[head + 1:p0 + 8 * G])
    first = p0 + 8 * G
    assert req[first + 3:first + 10].tolist() == [1, 2, 3, 4, 5, 6, 7]      # the well-placed pieces' IDs


word = st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-40, 80))


@settings(max_examples=60, deadline=None)
@given(P=st.integers(0, 3), wide=st.booleans(), groups=st.lists(
           st.tuples(st.lists(word, max_size=20), st.lists(word, max_size=20)), min_size=1, max_size=3),
       forged=st.lists(st.tuples(st.integers(0, 200), word), max_size=12),
       table=st.lists(st.integers(-(1 << 40), 1 << 40), min_size=9, max_size=9), n_words=st.integers(1, 3))
def test_any_request_content_stays_in_its_buffers(P, wide, groups, forged, table, n_words):
    """Forged requests -- any header (rows, counts, where each piece's IDs go, its side), any IDs, any group
    table -- with the host's own fields (where the pieces are, the tensors' addresses and how many IDs each
    holds) left as written: every write stays inside the request and the bitmap."""
    if not wide:
        groups = [([x % (1 << 31) for x in s], [x % (1 << 31) for x in d]) for s, d in groups]
    G = len(groups)
    req, req_whole, tensors, head, n, pieces = _request(P, groups, wide)
    # the host's own fields: each piece's address and count (a tensor it checked, of that many IDs), where the
    # pieces are
    trusted = {e for e in pieces if (e - head - 2 - 3 * G) % 4 in (1, 2)} | set(range(head + 2 + G, head + 2 + 3 * G)) \
        | {head + 1}         # and the width of the tensors' integers
    for at, value in forged:
        if at < n and at not in trusted:
            req[at] = value
    marks, marks_whole = _window(n_words, torch.int32)
    gtab = torch.tensor(table[:3 * G], dtype=torch.int64).reshape(G, 3)
    _run(req, gtab, marks, P, G)
    assert _guards_intact(req_whole, n) and _guards_intact(marks_whole, n_words)
