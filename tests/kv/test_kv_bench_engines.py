"""The benchmark's KVAgent engines (``triton``, ``pack``, ``copy_engine``): bursts by block ID through the
public KV API, at the grid points a sweep gives them and past them (batches, both page sizes, both
directions, different pool layouts on the two sides, armed and host posting), every byte checked against
the descriptor plan; a burst of descriptor tables only runs on the engine's descriptor-table twin, labelled.

Both sides run in one process, on two threads over two host platforms (:class:`test_kv_faults.Pair`), with
a workload small enough for Triton's interpreter.
"""
from __future__ import annotations

import numpy as np
import pytest

from _spawn import on_threads
from gpuxfer.errors import BadInput
from gpuxfer.bench.kv import engines as E
from gpuxfer.bench.kv.engines.kvagent import API, TABLES
from gpuxfer.bench.kv.model.layout import layout_for_burst
from gpuxfer.bench.kv.model.plan import DIRECTIONS, build_burst
from gpuxfer.bench.kv.model.workloads import Region, Workload
from test_kv_faults import Pair

#: two regions (two layers of 8 B per token, one of 16 B per token): a few dozen descriptors of 128-1,024 B
TINY = Workload("tiny-test", (Region("a", 2, 8, 1), Region("b", 1, 16, 1)))
ISL = 100
AGENT_ENGINES = ("triton", "pack", "copy_engine")


def _burst(page: int, batch: int, *, dst_batch: int | None = None):
    """A plan of ``batch`` requests; with ``dst_batch`` the destination's pool is sized for that many (its
    regions then have other page counts, strides and bases than the source's)."""
    src = layout_for_burst(TINY, ISL, page, batch)
    dst = src if dst_batch is None else layout_for_burst(TINY, ISL, page, dst_batch)
    return build_burst(TINY, ISL, page, batch, seed=3, layout=src, dst_layout=dst)


def _move(pair: Pair, engines, burst: E.DescriptorBurst, direction: str) -> dict:
    """Both sides prepare (together: a KVAgent engine's first burst registers and swaps metadata), arm
    (the passive side posts its flag-gated part; an armed initiator queues its work behind the gate), the
    initiator posts; both wait. The initiator's row fields."""
    ps = on_threads([lambda r=r: engines[r].prepare(burst, direction) for r in range(2)])
    ini = 1 if direction == "pull" else 0
    engines[1 - ini].arm(ps[1 - ini])
    engines[ini].arm(ps[ini])
    engines[ini].post(ps[ini])
    on_threads([lambda r=r: engines[r].wait(ps[r]) for r in range(2)])
    extra = engines[ini].row_extra()
    for r in range(2):
        engines[r].release(ps[r])
    return extra


def _check_moved(pair: Pair, plan: np.ndarray) -> None:
    """Every descriptor's bytes landed; nothing else of the destination changed (it was zeroed)."""
    src, dst = pair.array(0), pair.array(1)
    covered = np.zeros(dst.size, dtype=bool)
    for s, d, n in plan.tolist():
        assert np.array_equal(dst[d:d + n], src[s:s + n]), (s, d, n)
        covered[d:d + n] = True
    assert not dst[~covered].any(), "a byte outside every descriptor was written"


@pytest.mark.parametrize("page, armed", [(16, False), (64, True)], ids=["page16-host", "page64-armed"])
@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_agent_engines_move_batches_between_different_layouts(engine, page, armed):
    pb = _burst(page, 3, dst_batch=5)
    assert pb.src_layout.as_dict() != pb.dst_layout.as_dict()
    pool = max(pb.src_layout.pool_bytes, pb.dst_layout.pool_bytes)
    with Pair(pool_bytes=pool, armed=armed) as pair:
        pair.array(0)[:] = np.random.default_rng(page).integers(1, 256, pool, dtype=np.uint8)
        engines = pair.build(engine)
        for direction in DIRECTIONS:
            pair.array(1)[:] = 0
            extra = _move(pair, engines, E.DescriptorBurst.from_plan(pb), direction)
            _check_moved(pair, pb.plan)
            assert extra["api"] == API and extra["register_ms"] > 0, extra
            assert extra["setup_us"] > 0 and extra["first_setup_us"] > 0, extra
            if engine == "pack":
                assert extra["flag_path"] == "remote stream writes"
        # a burst of descriptor tables only: the engine's twin moves it, and says so
        pair.array(1)[:] = 0
        extra = _move(pair, engines, E.DescriptorBurst(pb.requests, plan=pb.plan), "pull")
        _check_moved(pair, pb.plan)
        assert extra["api"] == TABLES, extra
        # and by block ID again after it
        pair.array(1)[:] = 0
        assert _move(pair, engines, E.DescriptorBurst.from_plan(pb), "push")["api"] == API
        _check_moved(pair, pb.plan)


def test_a_new_layout_registers_again_on_both_sides():
    """A burst of another pool layout re-registers both sides (its rows' register_ms is its own) and moves."""
    small, big = _burst(16, 1), _burst(16, 2)
    pool = max(small.src_layout.pool_bytes, big.src_layout.pool_bytes)
    with Pair(pool_bytes=pool) as pair:
        pair.array(0)[:] = np.random.default_rng(0).integers(1, 256, pool, dtype=np.uint8)
        engines = pair.build("triton")
        agents = []
        for pb in (small, big, big):
            pair.array(1)[:] = 0
            _move(pair, engines, E.DescriptorBurst.from_plan(pb), "pull")
            _check_moved(pair, pb.plan)
            agents.append(engines[1].agent)
        assert agents[0] is not agents[1] and agents[1] is agents[2]


@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_agent_engines_refuse_hostile_descriptors_before_any_set_up(engine):
    """A descriptor past the pool: BadInput naming it on each side, before a twin or an agent is built."""
    good = np.array([[0, 0, 64]], dtype=np.int64)
    with Pair(pool_bytes=4096) as pair:
        engines = pair.build(engine)
        for r in range(2):
            with pytest.raises(BadInput, match=r"descriptor 1 \(request 1, row 0 of the request\)"):
                engines[r].prepare(E.DescriptorBurst([good, np.array([[0, 4090, 64]])]), "pull")
            assert engines[r]._table is None and engines[r].agent is None


def test_registry_names_the_agent_engines_and_their_table_twins():
    from gpuxfer.bench.kv.engines.kvagent import AgentCopyEngine, AgentPackEngine, AgentTritonEngine
    assert E.DEFAULT_ENGINES == ("triton", "pack", "copy_engine", "bulk")
    for name, cls, twin in (("triton", AgentTritonEngine, "triton-table"), ("pack", AgentPackEngine, "pack-table"),
                            ("copy_engine", AgentCopyEngine, "copy_engine-table")):
        assert E.engine_class(name) is cls and cls.name == name
        assert E.engine_class(twin) is cls.table_engine and cls.table_engine.name == twin
        assert "descriptor tables" in cls.table_engine.description
        assert cls.armable == cls.table_engine.armable and cls.needs_peer_mapping
    assert "pack-api" not in E.ENGINES


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_stuck_peer_fails_the_side_and_releases_the_agents_waits(direction):
    """``pack`` through KVAgent, the peer never posts: the initiator's wait times out, the side fails and
    releases the agent's control words too (its streams drain), every later call raises the same error."""
    from gpuxfer.errors import TransferTimeout
    pb = _burst(16, 1)
    with Pair(pool_bytes=pb.src_layout.pool_bytes) as pair:
        engines = pair.build("pack")
        burst = E.DescriptorBurst.from_plan(pb)
        ps = on_threads([lambda r=r: engines[r].prepare(burst, direction) for r in range(2)])
        ini = 1 if direction == "pull" else 0
        eng, side = engines[ini], pair.sides[ini]
        side.timeout_s = 1.0
        eng.post(ps[ini])               # the peer never posts its half
        with pytest.raises(TransferTimeout, match=f"pack {direction} burst") as info:
            eng.wait(ps[ini])
        assert pair.plats[ini].synchronize(eng.agent.stream, 10.0)
        for call in (lambda: eng.prepare(burst, direction), lambda: eng.post(ps[ini]), lambda: eng.wait(ps[ini])):
            with pytest.raises(TransferTimeout) as later:
                call()
            assert later.value is info.value
        for r in range(2):
            engines[r].release(ps[r])
