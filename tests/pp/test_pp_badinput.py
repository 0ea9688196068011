"""Bad input: refused before any GPU work and before metadata goes out, with both ends kept consistent.

Unit tests of the spec table (validation, layout, metadata round trip and corrupted metadata), then
a 2-rank session per backend where the sender's refusals reach the receiver as BadInput and the
next valid step still arrives intact.
"""
from __future__ import annotations

import collections.abc
import os

import numpy as np
import pytest
import torch

from gpuxfer.errors import BadInput, GpuxferError, ProtocolError
from gpuxfer.pp.spec import ALIGN, as_bytes, Refusal, SpecTable
from gpuxfer.pp.transport import resolve_timeout
from test_pp_chain import check_equal, specs, step_shapes, step_tensors

CPU = torch.device("cpu")


def good(n=5, w=40):
    return {"hidden": torch.zeros(n, w, dtype=torch.bfloat16), "pos": torch.zeros(n, dtype=torch.int64),
            "residual": torch.zeros(n, w, dtype=torch.float32)}


def bad_inputs():
    """(label, tensors, refusal code) for every kind of bad input."""
    g = good()
    yield "dtype", {**g, "pos": g["pos"].int()}, 3
    yield "too large", good(n=49), 6
    yield "non-contiguous", {**g, "residual": torch.zeros(40, 5).t()}, 5
    yield "missing key", {k: v for k, v in g.items() if k != "pos"}, 2
    yield "extra key", {**g, "extra": torch.zeros(1)}, 2
    yield "wrong device", {**g, "pos": torch.zeros(5, dtype=torch.int64, device="meta")}, 4
    yield "not a tensor", {**g, "pos": [1, 2, 3]}, 1
    yield "not a dict", [g["hidden"]], 1
    yield "too many dims", {**g, "pos": torch.zeros((1,) * 9, dtype=torch.int64)}, 7
    yield "negated view", {**g, "residual": torch._neg_view(g["residual"])}, 8     # its bytes are not its values
    yield "sparse", {**g, "residual": g["residual"].to_sparse_csr()}, 9     # (is_contiguous raised RuntimeError)
    yield "nested", {**g, "pos": torch.nested.nested_tensor([g["pos"]])}, 9


def to_device(t, dev):
    """``t.to(dev)``, keeping a negated view negated (``.to`` on another device materializes the negation)."""
    if t.is_neg():
        return torch._neg_view(torch._neg_view(t).to(dev))
    return t.to(dev)


def test_to_device_keeps_a_negated_view():
    n = torch._neg_view(torch.arange(4.0))
    moved = to_device(n, CPU)
    assert moved.is_neg() and torch.equal(moved, -torch.arange(4.0))


def test_spec_table_layout():
    t = SpecTable(specs())
    assert t.names == ("hidden", "pos", "residual")
    assert t.slot_bytes == 48 * 40 * 2 + 48 * 8 + 48 * 40 * 4 + (ALIGN - 48 * 8 % ALIGN) % ALIGN
    lay = t.layout(((3, 40), (3,), (3, 40)))
    assert lay.offsets == (0, 256, 512) and lay.nbytes == (240, 24, 480) and lay.total == 992
    assert all(o % ALIGN == 0 for o in lay.offsets)
    assert t.layout(((3, 40), (3,), (3, 40))) is lay          # cached
    empty = t.layout(((0, 40), (0,), (0, 40)))
    assert empty.total == 0
    assert t.check_tensors(good(), CPU) == ((5, 40), (5,), (5, 40))


@pytest.mark.parametrize("n,w", [(3, 40), (0, 40), (48, 1)])
def test_spec_table_views_unpack_a_packed_buffer(n, w):
    """views() gives every tensor back from its packed bytes: shapes, dtypes and values, zero sizes included."""
    t = SpecTable({**specs(), "scale": ((), torch.float64)})
    g = torch.Generator().manual_seed(n * 100 + w)
    want = {"hidden": torch.randn(n, w, generator=g).bfloat16(), "pos": torch.randint(0, 9, (n,), generator=g),
            "residual": torch.randn(n, w, generator=g), "scale": torch.tensor(2.5, dtype=torch.float64)}
    lay = t.layout(t.check_tensors(want, CPU))
    buf = torch.full((lay.buffer_bytes,), 0xAB, dtype=torch.uint8)
    for name, off, nb in zip(t.names, lay.offsets, lay.nbytes):
        buf[off:off + nb] = as_bytes(want[name]).reshape(-1)
    got = t.views(buf, lay)
    assert lay.buffer_bytes % ALIGN == 0 and lay.buffer_bytes >= max(lay.total, 1)
    for name in t.names:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].is_contiguous() and torch.equal(as_bytes(got[name]), as_bytes(want[name])), name
    buf[lay.offsets[0]] ^= 1          # views, not copies: a flipped byte shows
    if n:
        assert not torch.equal(as_bytes(got["hidden"]), as_bytes(want["hidden"]))


@pytest.mark.parametrize("label,tensors,code", list(bad_inputs()), ids=[b[0] for b in bad_inputs()])
def test_spec_table_refuses(label, tensors, code):
    with pytest.raises(Refusal) as ei:
        SpecTable(specs()).check_tensors(tensors, CPU)
    assert ei.value.code == code


def test_spec_table_fast_path_agrees():
    """The per-step fast path (GPUs) returns the layout of the checked path once that layout is cached, and
    None (go and find out what is wrong) for every bad input, its shapes cached or not; CPU tensors stand in
    for a device with index -1."""
    t = SpecTable(specs())
    assert t.fast_layout(good(), -1) is None        # shapes not seen yet: the checked path
    lay = t.layout(t.check_tensors(good(), CPU))
    assert t.fast_layout(good(), -1) is lay
    for label, tensors, _code in bad_inputs():
        if isinstance(tensors, dict) and tensors.keys() == t.nameset:
            try:                                    # a bad tensor's shapes cached where they fit the spec
                t.layout(tuple(tuple(tensors[n].shape) if isinstance(tensors[n], torch.Tensor) else ()
                               for n in t.names))
            except (BadInput, RuntimeError):        # (a nested tensor has no shape)
                pass
            index = 0 if label == "wrong device" else -1     # a meta tensor's index is -1 too
            assert t.fast_layout(tensors, index) is None, label


def test_spec_table_layout_refuses_shapes_outside_the_spec():
    """Only shapes within the spec get a (cached) layout: the fast path's cache hit stands for the size checks."""
    t = SpecTable(specs())
    for bad in (((49, 40), (1,), (1, 1)), ((1, 1), (49,), (1, 1)), ((1,) * 9, (1,), (1, 1)), ((1, -1), (1,), (1, 1)),
                ((1, 1), (1,)), ((1, "x"), (1,), (1, 1)), ((1, 1), 3, (1, 1)), None):
        with pytest.raises(BadInput):
            t.layout(bad)
    assert not t._layouts
    assert t.layout([[2, 3], [2], (2, 3)]).shapes == ((2, 3), (2,), (2, 3))


def test_spec_table_bad_specs():
    for bad in ({}, {"x": ((2,), "float32")}, {"x": ((2,), torch.qint8)}, {"x": ((2,), torch.quint4x2)}, {"x": ((-1,), torch.float32)}, {"": ((1,), torch.float32)},
                {"x": ((1,) * 9, torch.float32)}, {"x": (3, torch.float32)}, {"x": "nope"}):
        with pytest.raises(BadInput):
            SpecTable(bad)
    t = SpecTable({"x": torch.zeros(4, 2, dtype=torch.float16)})   # a tensor works as its own spec
    assert t.max_shapes == ((4, 2),) and t.dtypes == (torch.float16,)


def test_check_shapes_and_out():
    t = SpecTable(specs())
    assert t.check_shapes({"hidden": (2, 3), "pos": [2], "residual": (2, 3)}) == ((2, 3), (2,), (2, 3))
    with pytest.raises(BadInput, match="larger than its slot"):
        t.check_shapes({"hidden": (49, 40), "pos": (49,), "residual": (1, 1)})
    with pytest.raises(BadInput, match="exactly the keys"):
        t.check_shapes({"hidden": (1, 1)})
    with pytest.raises(BadInput):
        t.check_shapes({"hidden": (1, -1), "pos": (1,), "residual": (1, 1)})
    with pytest.raises(BadInput, match="out"):
        t.check_out({"hidden": torch.zeros(10, dtype=torch.bfloat16), "pos": torch.zeros(48, dtype=torch.int64),
                     "residual": torch.zeros(48 * 40)}, CPU)
    with pytest.raises(BadInput, match="negated"):
        t.check_out({"hidden": torch.zeros(48 * 40, dtype=torch.bfloat16), "pos": torch.zeros(48, dtype=torch.int64),
                     "residual": torch._neg_view(torch.zeros(48, 40))}, CPU)
    t.check_out({"hidden": torch.zeros(48 * 40, dtype=torch.bfloat16), "pos": torch.zeros(48, dtype=torch.int64),
                 "residual": torch.zeros(48, 40)}, CPU)


def test_out_tensors_sharing_memory_are_refused():
    """recv(out=...) copies each tensor into its out: two outs over the same bytes would hand out one tensor's
    data as the other's."""
    t = SpecTable({"a": ((64,), torch.float32), "b": ((64,), torch.float32), "e": ((0,), torch.float32)})
    buf = torch.zeros(160)
    for a, b in ((buf[:64], buf[:64]), (buf[:64], buf[32:96]), (buf[63:127], buf[:64]), (buf[:160], buf[40:104])):
        with pytest.raises(BadInput, match="share memory"):
            t.check_out({"a": a, "b": b, "e": buf[:0]}, CPU)
    t.check_out({"a": buf[:64], "b": buf[64:128], "e": buf[64:64]}, CPU)     # adjacent; an empty one anywhere
    t.check_out({"a": buf[96:160], "b": buf[:96], "e": buf[:0]}, CPU)          # a larger out: its first 64 used


def test_metadata_round_trip_and_corruption():
    t = SpecTable(specs())
    buf = np.zeros(t.meta_len, dtype=np.int64)
    shapes = ((7, 40), (7,), (7, 40))
    t.encode(buf, 12, shapes)
    assert t.decode(buf, step=12, peer=0, rank=1) == shapes
    wrong_step = buf.copy()
    with pytest.raises(GpuxferError, match="out of order"):
        t.decode(wrong_step, step=13, peer=0, rank=1)
    corrupt = buf.copy()
    corrupt[0] ^= 1
    with pytest.raises(GpuxferError, match="out of order"):
        t.decode(corrupt, step=12, peer=0, rank=1)
    t.encode_refusal(buf, 12, Refusal(6, 2, "x"))
    with pytest.raises(BadInput, match="refused its input for step 12 \\('residual'\\).*larger than its slot"):
        t.decode(buf, step=12, peer=0, rank=1)


def test_resolve_timeout(monkeypatch):
    monkeypatch.delenv("GPUXFER_PP_TIMEOUT_S", raising=False)
    assert resolve_timeout(None) == 300.0
    monkeypatch.setenv("GPUXFER_PP_TIMEOUT_S", "2.5")
    assert resolve_timeout(None) == 2.5 and resolve_timeout(7) == 7.0
    for bad in ("x", "0", "-1"):
        monkeypatch.setenv("GPUXFER_PP_TIMEOUT_S", bad)
        with pytest.raises(BadInput):
            resolve_timeout(None)


def test_inline_bytes(monkeypatch):
    from gpuxfer.pp.copy_engine import DEFAULT_INLINE_BYTES, ENV_INLINE_BYTES, inline_bytes_from_env
    monkeypatch.delenv(ENV_INLINE_BYTES, raising=False)
    assert inline_bytes_from_env(None) == DEFAULT_INLINE_BYTES == 1 << 20
    assert inline_bytes_from_env(0) == 0 and inline_bytes_from_env("0") == 0
    assert inline_bytes_from_env("64K") == 65536 and inline_bytes_from_env(4096) == 4096
    monkeypatch.setenv(ENV_INLINE_BYTES, "2M")
    assert inline_bytes_from_env(None) == 2 << 20 and inline_bytes_from_env(7) == 7
    monkeypatch.setenv(ENV_INLINE_BYTES, "0")
    assert inline_bytes_from_env(None) == 0
    for bad in ("x", "-1", "1.5"):
        monkeypatch.setenv(ENV_INLINE_BYTES, bad)
        with pytest.raises(BadInput, match=ENV_INLINE_BYTES):
            inline_bytes_from_env(None)
    with pytest.raises(BadInput, match="inline_bytes"):
        inline_bytes_from_env(-4)


# --------------------------------------------------------------------------- two ranks


def badinput_session(rank: int, world: int, init_method: str, platform_name: str) -> dict:
    os.environ["GPUXFER_PLATFORM"] = platform_name
    import torch.distributed as dist

    from gpuxfer.platforms import get_platform
    from gpuxfer.pp import connect
    from gpuxfer.pp.launch import init_cpu_group
    init_cpu_group(rank, world, init_method)
    plat = get_platform(platform_name)
    device = rank % plat.device_count()
    dev = CPU if plat.is_emulation else torch.device("cuda", device)
    if not plat.is_emulation:
        torch.cuda.set_device(device)
    cases = list(bad_inputs())
    out = {}
    try:
        for backend in ("copy_engine", "nccl"):
            for metadata in (True, False):
                conn = connect(send_to=1 if rank == 0 else None, recv_from=0 if rank else None, specs=specs(),
                               backend=backend, platform=plat, device=device, timeout_s=30, metadata=metadata)
                with conn:
                    seed = 6
                    if rank == 0:
                        s = conn.sender()
                        s.send(step_tensors(seed, 0, 1, dev))
                        for label, tensors, _code in cases:
                            if isinstance(tensors, dict):
                                tensors = {k: (to_device(v, dev) if isinstance(v, torch.Tensor)
                                               and v.device.type != "meta" else v) for k, v in tensors.items()}
                            with pytest.raises(BadInput, match="nothing sent"):
                                s.send(tensors)
                            assert s.step == 1
                        s.send(step_tensors(seed, 0, 2, dev))
                    else:
                        r = conn.receiver()
                        kw = (lambda k: {}) if metadata else (lambda k: {"shapes": step_shapes(seed, 0, k)})
                        check_equal(r.recv(**kw(1)).tensors, step_tensors(seed, 0, 1, "cpu"), "step 1")
                        if metadata:
                            with pytest.raises(BadInput, match="metadata=False"):
                                r.recv(shapes=step_shapes(seed, 0, 2))
                            msgs = []
                            for label, _t, _code in cases:     # every refusal reaches the receiver
                                with pytest.raises(BadInput, match="refused its input for step 2") as ei:
                                    r.recv()
                                msgs.append(str(ei.value))
                                assert r.step == 1
                            out[f"{backend}:refusals"] = msgs
                        else:
                            with pytest.raises(BadInput, match="needs shapes"):
                                r.recv()
                            with pytest.raises(BadInput, match="larger than its slot"):
                                r.recv(shapes={"hidden": (49, 40), "pos": (49,), "residual": (49, 40)})
                        with pytest.raises(BadInput, match="out"):
                            r.recv(**kw(2), out={"hidden": torch.zeros(1)})
                        assert r.step == 1
                        check_equal(r.recv(**kw(2)).tensors, step_tensors(seed, 0, 2, "cpu"), "step 2")
                        with pytest.raises(BadInput, match="cannot send"):
                            r.send(step_tensors(seed, 0, 3, dev))
                    conn.synchronize(30)
    finally:
        dist.destroy_process_group()
        plat.close()
    return out


def test_bad_input_two_ranks(spawner, platform_name, nccl_pairs):
    _, receiver = spawner.run_ranks(badinput_session, 2, platform_name, timeout=180)
    msgs = receiver["copy_engine:refusals"]
    assert any("dtype differs" in m for m in msgs) and any("larger than its slot" in m for m in msgs)
    assert any("keys differ" in m for m in msgs) and any("not contiguous" in m for m in msgs)
    assert any("wrong device" in m for m in msgs)
    assert receiver["nccl:refusals"] == msgs


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_copy_bytes_is_bit_exact(where):
    """Every bit pattern survives the pack/unpack copies (a same-dtype float-list copy on GPU rewrites NaN payloads)."""
    from gpuxfer.pp.spec import as_bytes, copy_bytes
    if where == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(torch.bfloat16).to(where)
            for n in (4096, 8192, 2)]
    dsts = [torch.empty_like(t) for t in srcs]
    copy_bytes([as_bytes(d) for d in dsts], [as_bytes(t) for t in srcs])
    for d, t in zip(dsts, srcs):
        assert torch.equal(as_bytes(d).cpu(), as_bytes(t).cpu())


@pytest.mark.parametrize("shape, why", [(("a", 2), "not a sequence of integers"), (5, "not a sequence of integers"),
                                        ((2, -1), r"each in \[0, 2\*\*63 - 1\]"), ((1,) * 9, "<= 8 dims"),
                                        ((2, 1.5), "not a sequence of integers"), ((True, 2), "not a sequence of integers"),
                                        ("12", "not a sequence of integers"), ((0, 1 << 63), r"each in \[0")])
def test_a_shape_that_is_not_dims_is_named_in_the_spec_and_in_a_layout(shape, why):
    """A spec's shape and a step's expected shape go through one check: each names its tensor and the fault."""
    with pytest.raises(BadInput, match=f"spec of 'hidden': shape .*{why}"):
        SpecTable({**specs(), "hidden": (shape, torch.bfloat16)})
    t = SpecTable(specs())
    shapes = [shape if n == "hidden" else sh for n, sh in zip(t.names, t.max_shapes)]
    with pytest.raises(BadInput, match=f"tensor 'hidden': shape .*{why}"):
        t.layout(shapes)


def test_a_peer_that_is_not_a_rank_is_bad_input():
    from gpuxfer.pp.selection import Connection
    conn = Connection("copy_engine", {1: "to 1"}, {2: "from 2"}, {}, rank=0)
    assert conn.sender(1) == "to 1" and conn.receiver(np.int64(2)) == "from 2" and conn.sender() == "to 1"
    for peer in ([1], {1: 1}, "1", True, 1.0, 3):
        with pytest.raises(BadInput):
            conn.sender(peer)


@pytest.mark.parametrize("shape", [(0, 1 << 62, 1 << 62), (0, 1 << 62), (5, 0, 1 << 61, 4)])
def test_an_empty_shape_whose_strides_overflow_int64_is_refused(shape):
    """No elements, so within any slot, but its contiguous strides (or its last dimension in bytes) pass 2**63:
    torch cannot view or allocate it. Refused in the spec, in a step's layout (recv(shapes=...) of the caller:
    BadInput, the transport unbroken) and in the peer's metadata (ProtocolError), before any view is made."""
    with pytest.raises(BadInput, match="spec of 'hidden'.*strides"):
        SpecTable({**specs(), "hidden": (shape, torch.bfloat16)})
    t = SpecTable(specs())
    shapes = [shape if n == "hidden" else sh for n, sh in zip(t.names, t.max_shapes)]
    with pytest.raises(BadInput, match="tensor 'hidden'.*strides"):
        t.layout(shapes)
    buf = np.zeros(t.meta_len, dtype=np.int64)
    t.encode(buf, 3, tuple(tuple(s) for s in shapes))
    with pytest.raises(ProtocolError, match="'hidden'.*strides"):
        t.decode(buf, step=3, peer=0, rank=1)
    lay = t.layout([(0, 1 << 20, 1 << 20) if n == "hidden" else sh for n, sh in zip(t.names, t.max_shapes)])
    assert t.views(torch.zeros(lay.buffer_bytes, dtype=torch.uint8), lay)["hidden"].shape == (0, 1 << 20, 1 << 20)
    assert t.fresh(lay, CPU)[0]["hidden"].shape == (0, 1 << 20, 1 << 20)


class _Fickle(collections.abc.Mapping):
    """A mapping whose "x" is a whole tensor the first time it is read and a one-element view of a buffer of
    0x55 bytes after that (a mapping that builds its values on access)."""

    def __init__(self, first):
        self.first, self.reads = first, 0
        self.later = torch.full((64 * first.numel() * first.element_size(),), 0x55, dtype=torch.uint8,
                                device=first.device).view(first.dtype)[:1]

    def __getitem__(self, key):
        if key != "x":
            raise KeyError(key)
        self.reads += 1
        return self.first if self.reads == 1 else self.later

    def __iter__(self):
        return iter(["x"])

    def __len__(self):
        return 1


def fickle_session(rank: int, world: int, init_method: str, platform_name: str, backend: str) -> dict:
    os.environ["GPUXFER_PLATFORM"] = platform_name
    import torch.distributed as dist

    from gpuxfer.platforms import get_platform
    from gpuxfer.pp import connect
    from gpuxfer.pp.launch import init_cpu_group
    init_cpu_group(rank, world, init_method)
    plat = get_platform(platform_name)
    device = rank % plat.device_count()
    dev = CPU if plat.is_emulation else torch.device("cuda", device)
    want = torch.arange(64, dtype=torch.float32, device=dev)
    res = {}
    with connect(send_to=1 if rank == 0 else None, recv_from=0 if rank == 1 else None,
                 specs={"x": ((64,), torch.float32)}, backend=backend, platform=plat, device=device,
                 timeout_s=20) as conn:
        if rank == 0:
            conn.sender().send(_Fickle(want))
        else:
            got = conn.receiver().recv().tensors["x"]
            res["shape"], res["bytes"] = tuple(got.shape), bool(torch.equal(got.cpu(), want.cpu()))
        conn.synchronize()
    dist.destroy_process_group()
    plat.close()
    return res


@pytest.mark.parametrize("backend", ["copy_engine", "nccl"])
def test_send_moves_the_tensors_it_checked(spawner, platform_name, nccl_pairs, backend):
    """send() of a mapping reads each tensor once: what it checked is what it sends (a second read
    returns a 4-byte tensor: sending the step's 256 bytes from it would read past its end)."""
    got = spawner.run_ranks(fickle_session, 2, platform_name, backend, timeout=120)
    assert got[1] == {"shape": (64,), "bytes": True}
