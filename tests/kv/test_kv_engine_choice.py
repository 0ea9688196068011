"""The default KV engine follows the link between the two devices (no device is touched)."""
from __future__ import annotations

import pytest

from gpuxfer.kv import engine_choice as C
from gpuxfer.platforms.base import LinkInfo


class FakePlatform:
    kernels_interpreted = False

    def __init__(self, kind: str, peer_access: bool = True):
        self.kind, self.peer_access = kind, peer_access

    def link(self, src, dst):
        return LinkInfo(src, dst, "same-device" if src == dst else self.kind, self.peer_access)


@pytest.mark.parametrize("kind, peer, src, dst, want", [
    ("nvlink", True, 0, 1, "pack"),
    ("xgmi", True, 1, 0, "pack"),
    ("pcie", True, 0, 1, "pack"),
    ("pcie", False, 0, 1, "copy_engine"),
    ("nvlink", True, 0, 0, "triton"),
])
def test_the_link_picks_the_engine(monkeypatch, kind, peer, src, dst, want):
    monkeypatch.setattr("gpuxfer.kv.engine_choice.engine_unavailable_reason", lambda name, plat: None)
    choice = C.default_engine_choice(FakePlatform(kind, peer), src, dst)
    assert choice.name == want == C.default_engine(FakePlatform(kind, peer), src, dst)
    assert choice.reason


def test_an_engine_that_cannot_run_is_passed_over_with_its_reason(monkeypatch):
    monkeypatch.setattr("gpuxfer.kv.engine_choice.engine_unavailable_reason",
                        lambda name, plat: "no Triton here" if name in ("pack", "triton") else None)
    choice = C.default_engine_choice(FakePlatform("nvlink"), 0, 1)
    assert choice.name == "copy_engine" and "pack cannot run here: no Triton here" in choice.reason


def test_the_emulation_uses_copy_engine(host):
    assert C.default_engine(host, 0, 1) == "copy_engine"
    assert C.default_engine(host, 0, 0) == "copy_engine"


def test_peer_engine_for_memory_this_process_cannot_address():
    from gpuxfer.errors import BackendUnavailable
    from gpuxfer.kv.engine_choice import peer_engine
    for engine in ("triton", "pack", "copy_engine"):
        assert peer_engine(engine, False, "p", True) == engine          # addressable: the agent's engine
    assert peer_engine("triton", True, "p", False) == "copy_engine"     # auto: the copies reach it
    assert peer_engine("pack", False, "p", False) == "pack"             # own caches + the peer's staging
    assert peer_engine("copy_engine", False, "p", False) == "copy_engine"
    with pytest.raises(BackendUnavailable, match="cannot address"):
        peer_engine("triton", False, "p", False)


def test_auto_agent_takes_the_choice_one_side_can_make(host):
    """``engine="auto"``: ``agent_engine_choice`` -- triton where kernels run natively (never ``pack``, which
    both agents of a pair must ask for), copy_engine on the emulation; the agent says which and why."""
    assert C.agent_engine_choice(FakePlatform("nvlink")).name == "triton"
    choice = C.agent_engine_choice(host)
    assert choice.name == "copy_engine" and "emulation" in choice.reason
    from gpuxfer.kv import KVAgent
    with KVAgent("a", platform=host, engine="auto") as auto, KVAgent("t", platform=host, engine="triton") as t:
        assert (auto.engine, auto.engine_reason) == tuple(choice)
        assert t.engine == "triton" and "asked" in t.engine_reason
