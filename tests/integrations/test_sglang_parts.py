"""The SGLang backend's parts that need no SGLang (in the default suite): importing them imports no SGLang,
the entry point SGLang finds it by, ``KVArgs`` registration (raw pointers) and the geometry check, the
registration payload's bounds, and the metadata rows' copy. The backend inside SGLang:
tests/integrations/test_sglang_backend.py."""
from __future__ import annotations

import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from gpuxfer.errors import BadInput, BadMetadata
from gpuxfer.integrations.sglang.layout import (decode_registration, encode_registration, geometry,
                                                geometry_differences, read_aux_rows, register_kv_args,
                                                write_aux_rows)
from gpuxfer.kv import KVAgent

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _kv_args(page_size=4, pages=8, entries=4, rows=5, **extra):
    """A KVArgs as SGLang's MHA pool hands it over: one buffer per entry (K layers then V layers)."""
    item = page_size * 2 * 8 * 2
    kv = [torch.full((pages * item,), e, dtype=torch.uint8) for e in range(entries)]
    aux = [torch.arange(rows * n, dtype=torch.int64).to(torch.uint8) for n in (64, 128)]
    args = SimpleNamespace(kv_data_ptrs=[t.data_ptr() for t in kv], kv_data_lens=[t.numel() for t in kv],
                           kv_item_lens=[item] * entries, page_size=page_size,
                           aux_data_ptrs=[t.data_ptr() for t in aux], aux_data_lens=[t.numel() for t in aux],
                           aux_item_lens=[64, 128], kv_cache_dtype_str="bfloat16", kv_layout=None,
                           num_draft_entries=0, state_types=[], host_kv_data_ptrs=None)
    for k, v in extra.items():
        setattr(args, k, v)
    return args, kv, aux


def test_importing_the_backend_imports_no_sglang():
    code = ("import sys, gpuxfer, gpuxfer.integrations, gpuxfer.integrations.sglang, "
            "gpuxfer.integrations.sglang.plugin, gpuxfer.integrations.sglang.layout\n"
            "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_entry_point_names_the_plugin():
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points."sglang.srt.plugins"]\ngpuxfer = "gpuxfer.integrations.sglang.plugin:register"' in text
    from gpuxfer.integrations.sglang import plugin
    assert callable(plugin.register) and plugin.BACKEND == "gpuxfer"


def test_kv_args_register_page_for_page():
    from gpuxfer.platforms import get_platform
    args, kv, _ = _kv_args()
    with KVAgent("sglang-parts", platform=get_platform("host"), engine="copy_engine") as agent:
        register_kv_args(agent, args)
        assert agent.groups == {"kv": (4, 8, 4)}


@pytest.mark.parametrize("change,says", [
    (dict(state_types=["mamba"]), "state buffers"),
    (dict(host_kv_data_ptrs=[1]), "host"),
    (dict(kv_data_ptrs=[]), "empty"),
    (dict(kv_item_lens=[128]), "as many"),
])
def test_unsupported_kv_args_are_refused(change, says):
    from gpuxfer.platforms import get_platform
    args, kv, _ = _kv_args(**change)
    with KVAgent("sglang-parts", platform=get_platform("host"), engine="copy_engine") as agent:
        with pytest.raises(BadInput, match=says):
            register_kv_args(agent, args)


def test_geometry_differences_name_each_field():
    ours = geometry(_kv_args()[0])
    assert geometry_differences(ours, dict(ours)) == []
    theirs = geometry(_kv_args(page_size=8)[0])
    diffs = geometry_differences(ours, theirs)
    assert any(d.startswith("page_size: prefill 4, decode 8") for d in diffs)
    assert any(d.startswith("kv_item_lens") for d in diffs)


def test_registration_payload_round_trip_and_bounds():
    geom = geometry(_kv_args()[0])
    assert decode_registration(encode_registration(geom, b"GXKV...")) == (geom, b"GXKV...")
    for bad in (b"", b"\x01", (1000).to_bytes(4, "little") + b"{}", (2).to_bytes(4, "little") + b"[]",
                (3).to_bytes(4, "little") + b"{x}"):
        with pytest.raises(BadMetadata):
            decode_registration(bad)


def test_metadata_rows_copy_and_bounds():
    src, _, src_aux = _kv_args()
    dst, _, dst_aux = _kv_args()
    for t in dst_aux:
        t.zero_()
    rows = read_aux_rows(src, 3)
    assert [len(r) for r in rows] == [64, 128]
    write_aux_rows(dst, 1, rows)
    for s, d, n in zip(src_aux, dst_aux, (64, 128)):
        assert torch.equal(d.view(-1, n)[1], s.view(-1, n)[3])
        assert int(d.view(-1, n)[[0, 2, 3, 4]].count_nonzero()) == 0
    with pytest.raises(BadInput):
        read_aux_rows(src, 5)
    with pytest.raises(BadInput):
        write_aux_rows(dst, 0, rows[:1])
    with pytest.raises(BadInput):                       # a short row: nothing written, not even the first
        write_aux_rows(dst, 0, [rows[0], rows[1][:10]])
    assert int(dst_aux[0].view(-1, 64)[0].count_nonzero()) == 0
