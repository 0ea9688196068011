"""KVAgent's two-sided engines: the pack engine (both sides post; timeouts, failures part way, closing with
a stuck peer, staging checks), the copy_engine engine, and ``gpuxfer bench kv`` through the API.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gpuxfer.errors import BadInput, LayoutMismatch, NotRegistered, TransferTimeout
from gpuxfer.kv.agent import KVAgent

from _agent_arena import Arena, connect, held_pull, same_bytes, token_oracle, vllm_layers


# ----------------------------------------------------------------------------- the pack engine (two-sided)


def test_pack_both_sides_post_every_byte(pack_pair):
    """Both sides post the same request; small slots force many chunks and slot reuse; two requests in a row
    (chunk numbers carry on); different block sizes on the two sides; registration in different orders."""
    pre, dec, a0, a1 = pack_pair
    src = vllm_layers(a0, 2, 6, 4, seed=1)
    dst = vllm_layers(a1, 2, 12, 2, seed=2)
    slab_s, slab_d = a0.tensor((5, 4, 100), seed=3), a1.tensor((5, 4, 100), seed=4)
    pre.register_group("full", 4, src)
    pre.register_group("mla", 4, {"m": slab_s})
    dec.register_group("mla", 4, {"m": slab_d})            # the other order: chunks follow names, not order
    dec.register_group("full", 2, dict(reversed(list(dst.items()))))
    p_of_dec, p_of_pre = connect(pre, dec)
    for s_full, d_full, s_mla, d_mla in (([4, 0, 2], [1, 5, 3, 11, 0, 7], [1, 3], [4, 0]),
                                         ([5], [2, 9], [0], [1])):
        expect = {k: token_oracle(src[k], dst[k], s_full, d_full, 4, 2, kv_first=True) for k in src}
        want_slab = slab_d.clone()
        want_slab[d_mla] = slab_s[s_mla]
        xd = dec.prepare(p_of_dec, "pull", local_blocks={"full": d_full, "mla": d_mla},
                         remote_blocks={"full": s_full, "mla": s_mla}, name="req")
        xs = pre.prepare(p_of_pre, "push", local_blocks={"full": s_full, "mla": s_mla},
                         remote_blocks={"full": d_full, "mla": d_mla}, name="req")
        assert len(xs._chunks) == len(xd._chunks) >= 2
        hd = xd.post()
        hs = xs.post()
        hd.wait(60)
        hs.wait(60)
        for k in src:
            assert np.array_equal(dst[k].view(torch.int16).numpy(), expect[k]), k
        assert same_bytes(slab_d, want_slab)


def test_pack_without_the_source_times_out_naming_the_request(pack_pair):
    pre, dec, a0, a1 = pack_pair
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    dec.register_group("g", 4, [a1.tensor((4, 4, 8))])
    p_of_dec, _ = connect(pre, dec)
    h = dec.prepare(p_of_dec, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}, name="lonely").post()
    with pytest.raises(TransferTimeout, match="lonely"):
        h.wait(0.2)
    # the agent failed: it released its stream's waits (the stream drains, nothing landed) and raises the
    # error from every later call; close still works (the fixture)
    assert dec.failed is not None
    assert dec.platform.synchronize(dec.stream, 60)
    with pytest.raises(TransferTimeout, match="lonely"):
        h.wait(60)
    with pytest.raises(TransferTimeout, match="lonely"):
        dec.prepare(p_of_dec, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
    with pytest.raises(TransferTimeout, match="lonely"):
        dec.wait_notification(0, 1, timeout_s=1)
    assert pre.failed is None


def test_pack_post_failing_part_way_fails_the_agent(pack_pair, monkeypatch):
    """An operation of a pack post that raises after others were queued (the peer may have seen them) fails the
    agent: its waits are released, the error comes from every later call, the pair's transfer count stays."""
    pre, dec, a0, a1 = pack_pair
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    dec.register_group("g", 4, [a1.tensor((4, 4, 8))])
    p_of_dec, _ = connect(pre, dec)
    x = dec.prepare(p_of_dec, "pull", local_blocks={"g": [0, 1]}, remote_blocks={"g": [1, 2]}, name="torn")
    plat = dec.platform
    calls = []

    def flaky(orig):            # the post's second flag operation (a write, or the go signal's copy) refused
        def op(s, *a):
            calls.append(a[0])
            if len(calls) == 2:
                raise BadInput("injected: the stream refused a flag operation")
            orig(s, *a)
        return op
    monkeypatch.setattr(plat, "write_flag", flaky(plat.write_flag))
    monkeypatch.setattr(plat, "copy_async", flaky(plat.copy_async))
    with pytest.raises(BadInput, match="injected"):
        x.post()
    monkeypatch.undo()
    assert len(calls) == 2 and p_of_dec.pack_recv == 0
    assert isinstance(dec.failed, BadInput)
    assert plat.synchronize(dec.stream, 60)             # nothing of the torn post waits any more
    with pytest.raises(BadInput, match="injected"):
        x.post()
    with pytest.raises(BadInput, match="not an open stream"):
        pre.prepare(pre.peer("decode"), "push", local_blocks={"g": [1, 2]}, remote_blocks={"g": [0, 1]}).post(
            stream=object())
    assert pre.failed is None


def test_stuck_peer_releases_stream_waits_on_notifications(pair):
    """A notification that never comes: wait_notification times out, fails the agent, and the stream made to
    wait on that slot is released (it drains); every later call raises the error."""
    pre, dec, a0, a1 = pair
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    dec.register_group("g", 4, [a1.tensor((4, 4, 8))])
    p_of_dec, _ = connect(pre, dec)
    plat = dec.platform
    s = plat.create_stream(1)
    try:
        dec.stream_wait_notification(s, 7, 1)            # nobody will notify slot 7
        with pytest.raises(TransferTimeout, match="notification slot 7"):
            dec.wait_notification(7, 1, timeout_s=0.1)
        assert plat.synchronize(s, 60)                  # released by the failure
        with pytest.raises(TransferTimeout, match="notification slot 7"):
            dec.prepare(p_of_dec, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
        with pytest.raises(TransferTimeout, match="notification slot 7"):
            dec.notification(7)
        x = pre.prepare(pre.peer("decode"), "push", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
        x.post().wait(60)                               # the other agent is unaffected
    finally:
        s.close()


def test_close_releases_a_post_on_the_callers_stream_stuck_on_a_dead_peer(pack_pair):
    """A pack destination posted on the caller's stream, its source never posts: close waits (bounded) for the
    post, releases the waits, drains that stream too, then frees the flag words and the staging."""
    pre, dec, a0, a1 = pack_pair
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    dec.register_group("g", 4, [a1.tensor((4, 4, 8))])
    p_of_dec, _ = connect(pre, dec)
    plat = dec.platform
    s = plat.create_stream(1)
    try:
        dec.timeout_s = 2.0
        h = dec.prepare(p_of_dec, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}).post(s)
        waiter = plat.create_stream(1)
        dec.stream_wait_notification(waiter, 9, 1)          # nobody notifies slot 9 either
        words, staging = dec.flags, dec.staging
        dec.close()
        assert h.done() and plat.event_wait(plat.record_event(waiter), 60)
        assert not words.closed and dec.flags is None       # prefill's link to decode holds them
        pre.remove_peer("decode")
        assert words.closed and staging.closed
        assert all(m.closed for m in p_of_dec._mappings) and p_of_dec.flags.stage_mem.closed
    finally:
        s.close()
        waiter.close()


def test_close_keeps_memory_a_wait_it_cannot_release_may_touch(pair):
    """A post held on the caller's stream by a wait the agent cannot release: close gives up after its
    timeout and keeps the flag words and the peer's mappings and flag link (the post later reads and
    writes them) instead of freeing them under it."""
    from gpuxfer.kv import agent as agent_mod
    pre, dec, a0, a1 = pair
    src, dst, p_of_dec, gate, s, h = held_pull(pre, dec, a0, a1)
    plat = dec.platform
    kept = []
    try:
        dec.timeout_s = 0.1
        expect = [dec.flags, p_of_dec.flags, *p_of_dec._mappings]     # (an in-process peer maps nothing)
        dec.close()
        kept = [m for m in agent_mod._LEAKED if any(m is e for e in expect)]
        assert len(kept) == len(expect) and not any(m.closed for m in kept) and not h.done()
        plat.host_write_flag(gate.ptr, 1, 1)
        assert plat.event_wait(h.event, 60)             # ran through the memory close kept
        assert pre.notification(2) == 1
        for name in src:
            assert same_bytes(dst[name][:, 0], src[name][:, 3])
    finally:
        plat.host_write_flag(gate.ptr, 1, 1)
        plat.synchronize(s, 30)
        s.close()
        gate.close()
        for m in kept:
            agent_mod._LEAKED.remove(m)
            m.close()


def test_pack_goes_to_one_peer(plat, pack_pair):
    pre, dec, a0, a1 = pack_pair
    other = KVAgent("other", platform=plat, device=1, engine="pack", slot_bytes=512)
    try:
        for ag, ar in ((pre, a0), (dec, a1), (other, a1)):
            ag.register_group("g", 4, [ar.tensor((4, 4, 8))])
        p1, p2 = pre.add_peer(dec.metadata()), pre.add_peer(other.metadata())
        x = pre.prepare(p1, "push", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
        dec.prepare(dec.add_peer(pre.metadata()), "pull", local_blocks={"g": [1]}, remote_blocks={"g": [0]}).post()
        x.post().wait(60)
        with pytest.raises(BadInput, match="another peer"):
            pre.prepare(p2, "push", local_blocks={"g": [0]}, remote_blocks={"g": [1]}).post()
    finally:
        other.close()


def test_flag_probe_bounded_and_keeps_a_stream_with_a_pending_write(pack_pair, monkeypatch):
    """The remote-write probe waits at most the agent's timeout (at most the set-up bound); a write that did not
    complete in time leaves its stream open (kept, not destroyed under it) and signals go by copies."""
    from gpuxfer import flaglink
    pre, dec, a0, a1 = pack_pair
    monkeypatch.setenv("GPUXFER_FLAG_PATH", "auto")
    pre.timeout_s = 0.25
    peer = pre.add_peer(dec.metadata())
    plat = pre.platform
    seen = []

    def stuck(s, timeout_s=60.0):
        seen.append((s, timeout_s))
        return False
    monkeypatch.setattr(plat, "synchronize", stuck)
    try:
        assert peer.flags.probe_one_sided(pre.timeout_s) is False and peer.remote_flags is False
        (s, t), = seen
        assert t == 0.25 and not s.closed and s in flaglink._KEPT
    finally:
        monkeypatch.undo()
        flaglink._KEPT.remove(s)
        plat.synchronize(s, 30)
        s.close()
    assert peer.flags.probe_one_sided(pre.timeout_s) is True      # the host emulation's stream writes land


def test_pack_needs_staging_on_both_sides(plat, pack_pair):
    pre, dec, a0, a1 = pack_pair
    tri = KVAgent("tri", platform=plat, device=1)
    try:
        tri.register_group("g", 4, [a1.tensor((4, 4, 8))])
        pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
        p = pre.add_peer(tri.metadata())
        with pytest.raises(BadInput, match="no staging buffer"):
            pre.prepare(p, "push", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
        with pytest.raises(BadInput, match="do not fit"):
            big = KVAgent("big", platform=plat, device=0, engine="pack", slot_bytes=256)
            big2 = KVAgent("big2", platform=plat, device=1, engine="pack", slot_bytes=256)
            try:
                big.register_group("g", 4, [a0.tensor((4, 4, 128))])
                big2.register_group("g", 4, [a1.tensor((4, 4, 128))])
                big.prepare(big.add_peer(big2.metadata()), "push", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
            finally:
                big2.close()
                big.close()
    finally:
        tri.close()


def test_pack_peers_with_other_staging_slots_are_refused(plat, pack_pair):
    """Each side addresses the pair's staging slots by its own slot size: a peer whose slots differ would take
    chunks past its slots (past its staging) and unpack the wrong bytes; add_peer refuses it, naming both."""
    pre, dec, a0, a1 = pack_pair
    other = KVAgent("other", platform=plat, device=1, engine="pack", slot_bytes=256)
    try:
        with pytest.raises(LayoutMismatch, match="256-byte staging slots.*512"):
            pre.add_peer(other.metadata())
        with pytest.raises(LayoutMismatch, match="512-byte staging slots.*256"):
            other.add_peer(pre.metadata())
        for agent, name in ((pre, "other"), (other, "prefill")):     # nothing of the refused peer kept
            with pytest.raises(NotRegistered):
                agent.peer(name)
        pre.add_peer(dec.metadata())                # equal slots: fine
    finally:
        other.close()


# ----------------------------------------------------------------------------- the copy_engine engine


@pytest.mark.parametrize("op", ["pull", "push"])
def test_copy_engine_moves_tokens_and_matches_the_kernel(plat, op):
    """copy_engine expands on the host (its driver API takes host arrays): the same descriptors as the
    device expansion, the same bytes, different block sizes included."""
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    agents = {}
    try:
        for eng in ("copy_engine", "triton"):
            agents[eng] = (KVAgent(f"p-{eng}", platform=plat, device=0, engine=eng),
                           KVAgent(f"d-{eng}", platform=plat, device=1, engine=eng))
        src = a0.tensor((2, 8, 8, 3, 2), torch.float16, seed=5)
        dst = a1.tensor((2, 32, 2, 3, 2), torch.float16, seed=6)
        s_ids, d_ids = [3, 6], [9, 1, 30, 4, 7, 0, 12, 2]
        expect = token_oracle(src, dst, s_ids, d_ids, 8, 2, kv_first=True)
        got = {}
        for eng, (pre, dec) in agents.items():
            pre.register_group("g", 8, {"l": src})
            dec.register_group("g", 2, {"l": dst})
            if op == "pull":
                x = dec.prepare(dec.add_peer(pre.metadata()), "pull", local_blocks={"g": d_ids},
                                remote_blocks={"g": s_ids})
            else:
                x = pre.prepare(pre.add_peer(dec.metadata()), "push", local_blocks={"g": s_ids},
                                remote_blocks={"g": d_ids})
            got[eng] = x.expanded_descriptors()
            if eng == "copy_engine":
                x.post().wait(60)
                assert np.array_equal(dst.numpy().view(np.uint8), expect.view(np.uint8))
        key = lambda a: a[np.lexsort((a[:, 2], a[:, 1], a[:, 0]))]   # noqa: E731
        assert np.array_equal(key(got["copy_engine"]), key(got["triton"]))
    finally:
        for pre, dec in agents.values():
            dec.close()
            pre.close()
        a0.close()
        a1.close()


# ----------------------------------------------------------------------------- the benchmark through the API


@pytest.mark.slow
def test_bench_pack_rows_through_the_agent_at_batch_2(tmp_path, capsys):
    """``gpuxfer bench kv --engine pack``: both sides post every request of a batch by block ID through
    KVAgent's pack engine, every byte verified, with post and setup host costs per request (the default
    run's rows go through KVAgent too: test_kv_bench's end-to-end test)."""
    from gpuxfer.cli import main
    out = tmp_path / "out"
    rc = main(["bench", "kv", "--platform", "host", "--workload", "kv-mla", "--isl", "16", "--page", "16",
               "--batch", "2", "--warmup", "0", "--trials", "1", "--timeout", "60", "--engine", "pack,bulk",
               "--direction", "pull", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = {r["engine"]: r for r in json.loads((out / "kv_bench.json").read_text())["rows"]}
    assert set(rows) == {"pack", "bulk"}
    r = rows["pack"]
    assert r["valid"] and r["wrong_bytes"] == 0 and r["post"] == "host" and r["api"] == "KVAgent"
    assert r["post_p50_us"] > 0 and r["setup_us"] > 0 and r["register_ms"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["pull", "push"])
def test_cuda_reposts_through_the_bound_launchers(op):
    """On CUDA a transfer's posts launch the compiled kernels directly (arguments bound once, the compiled
    kernel found by the arguments' kind); every post moves the current bytes: the source changes between
    posts, the destination follows, on three kinds of stream; a fresh request over other blocks too."""
    from _skips import platform_reason
    why = platform_reason("cuda")
    if why:
        pytest.skip(why)
    from gpuxfer.platforms import get_platform
    plat = get_platform("cuda")
    try:
        g = torch.Generator(device="cuda:0").manual_seed(3)
        src = {f"layers.{i}": torch.randint(-1000, 1000, (2, 32, 16, 2, 64), generator=g, device="cuda:0",
                                            dtype=torch.int16).view(torch.bfloat16) for i in range(3)}
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        a = KVAgent("pre", platform=plat, device=0)
        b = KVAgent("dec", platform=plat, device=0)
        try:
            a.register_group("full", 16, src)
            b.register_group("full", 16, dst)
            if op == "pull":
                agent, peer = b, b.add_peer(a.metadata())
            else:
                agent, peer = a, a.add_peer(b.metadata())
            own = plat.create_stream(0)
            # the agent's stream and a created one launch on their driver handles; torch's current (default)
            # stream goes through Platform.launch
            streams = (None, own, plat.current_stream(0))
            for s_ids, d_ids in (([3, 9, 0, 31], [1, 2, 30, 7]), ([5, 6], [8, 4])):
                mine, theirs = (d_ids, s_ids) if op == "pull" else (s_ids, d_ids)
                x = agent.prepare(peer, op, local_blocks={"full": mine}, remote_blocks={"full": theirs})
                for k in range(4):
                    for t in src.values():
                        t.view(torch.int16)[:, s_ids] += 1
                    torch.cuda.synchronize()            # the agent's stream does not follow torch's
                    x.post(streams[k % 3]).wait(60)
                    for name in src:
                        assert torch.equal(dst[name].view(torch.int16)[:, d_ids],
                                           src[name].view(torch.int16)[:, s_ids]), (name, k)
            own.close()
        finally:
            b.close()
            a.close()
    finally:
        plat.close()
