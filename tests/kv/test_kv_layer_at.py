"""``memory_at`` / ``KVAgent.layer_at``: a layer known only by a pointer, a length and a page size (SGLang's
``KVArgs``) registers as the tensor over the same memory would, aliases it, and bad descriptions are refused."""
from __future__ import annotations

import pytest
import torch

from gpuxfer.errors import BadInput
from gpuxfer.kv import KVAgent, memory_at


def _host():
    from gpuxfer.platforms import get_platform
    return get_platform("host")


def test_memory_at_aliases_the_bytes():
    buf = torch.arange(64, dtype=torch.uint8)
    view = memory_at(buf.data_ptr() + 8, 16, "cpu")
    assert view.data_ptr() == buf.data_ptr() + 8 and view.numel() == 16
    assert view.tolist() == list(range(8, 24))
    view[0] = 200
    assert int(buf[8]) == 200


@pytest.mark.parametrize("ptr,nbytes", [(0, 16), (-8, 16), (4096, 0), (4096, True), (4096.0, 16)])
def test_memory_at_refuses_bad_descriptions(ptr, nbytes):
    with pytest.raises(BadInput, match="memory_at"):
        memory_at(ptr, nbytes, "cpu")


def test_layer_at_registers_like_the_tensor():
    plat = _host()
    pages, page_bytes = 9, 3 * 64
    buf = torch.zeros(pages * page_bytes + 100, dtype=torch.uint8)      # a tail shorter than a page
    with KVAgent("raw", platform=plat, engine="copy_engine") as agent:
        spec = agent.layer_at(buf.data_ptr(), buf.numel(), page_bytes, index=3)
        assert spec.num_blocks == pages and spec.block_stride_bytes == page_bytes
        agent.register_group("kv", 3, {"k.3": spec})
        assert agent.groups == {"kv": (3, pages, 1)}
        with pytest.raises(BadInput, match="page"):
            agent.layer_at(buf.data_ptr(), 10, page_bytes)
        with pytest.raises(BadInput, match="page_bytes"):
            agent.layer_at(buf.data_ptr(), buf.numel(), 0)
        # memory meeting a registered layer other than page for page is refused, as for tensors
        with pytest.raises(BadInput, match="overlaps"):
            agent.register_group("again", 3, {"k.4": agent.layer_at(buf.data_ptr() + 64, 4 * page_bytes,
                                                                     page_bytes)})
