"""gpuxfer's SGLang backend with CUDA KV buffers: a prefill and a decode rank in two processes on one GPU,
SGLang's ``PrefillBootstrapQueue`` and ``send_kv_chunk`` on the prefill, its decode queues on the decode
(tests/integrations/sglang_instance.py), every byte of every page and metadata row checked; and both servers at
TP 2 (four rank processes on the GPU, tests/integrations/test_sglang_tp.py's exchange).

Run on a GPU machine with SGLang's pure-Python tree on PYTHONPATH (scripts/sglang_device_tree.py):
``GPUXFER_REQUIRE_SGLANG=1 python -m pytest -m gpu tests/integrations/test_sglang_backend_gpu.py``.
"""
from __future__ import annotations

import random

import pytest

from _requires import require

pytestmark = pytest.mark.gpu

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang_instance import Rank  # noqa: E402
from test_sglang_backend import PAGES, _free_port, _land_through_queue, _Pages  # noqa: E402

ENV = {"GPUXFER_PLATFORM": "cuda", "SGLANG_HOST_IP": "127.0.0.1", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60"}


@pytest.mark.parametrize("page_size,mla", [(16, False), (64, True), (1, True)])
def test_gpu_rooms_land_byte_for_byte(page_size, mla):
    """64 concurrent requests (1-9 pages) through SGLang's prefill queue onto CUDA KV buffers."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    port = _free_port()
    p = Rank("prefill", port=port, page_size=page_size, pages=PAGES, seed=1, env=ENV, mla=mla, device="cuda")
    d = Rank("decode", port=port, page_size=page_size, pages=PAGES, seed=2, env=ENV, mla=mla, device="cuda")
    try:
        p.ready(timeout=600)
        d.ready(timeout=600)
        pages, rng = _Pages(7), random.Random(7)
        _land_through_queue(p, d, [pages.take(room, rng.randint(1, 9)) for room in range(6000, 6064)], page_size, rng)
    finally:
        codes = [p.close(), d.close()]
    assert codes == [0, 0], codes


def test_gpu_equal_tp_lands_rank_to_rank():
    """Prefill and decode at TP 2 on CUDA KV buffers (every rank a process on GPU 0), MHA pool: decode rank
    ``i`` gets prefill rank ``i``'s bytes."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from test_sglang_tp import _servers, equal_tp_lands_rank_to_rank
    equal_tp_lands_rank_to_rank(*_servers(2, 2, 16, env=ENV, device="cuda"))
