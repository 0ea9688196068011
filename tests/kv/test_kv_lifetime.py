"""What a KVAgent's memory lives through: timeouts that cannot be waited on, streams the caller dropped, a peer
agent of this process closed under the other, posts racing remove_peer and close, and many threads at once.

Every case that ended in a signal before runs in a spawned child (``tests/_spawn.py``), so a crash is a non-zero
exit code asserted here rather than the end of pytest; the child's own checks raise AssertionError.
"""
from __future__ import annotations

import gc
import math

import numpy as np
import pytest
import torch

from gpuxfer.errors import BadInput, GpuxferError, NotRegistered, PeerLost, TransferTimeout
from gpuxfer.kv.agent import KVAgent
from gpuxfer.kv.control import NOTIFY
from gpuxfer.platforms.base import RELEASE_VALUE
from gpuxfer.sync import MAX_TIMEOUT_S, check_timeout

BLOCKS, BT = 8, 4


def _host():
    from gpuxfer.platforms.host import HostPlatform
    return HostPlatform()


def _platform(name: str):
    """A platform of ``name`` the caller closes (``host``: the emulation with two devices)."""
    if name == "host":
        return _host()
    from gpuxfer.platforms import get_platform
    return get_platform(name)


class _Caches:
    """One device's KV cache on the host emulation: a shared-memory buffer viewed as ``(BLOCKS, BT, 8)`` bytes."""

    def __init__(self, plat, device: int, seed: int):
        self.buf = plat.alloc(1 << 14, device)
        self.t = plat.as_tensor(self.buf)[:BLOCKS * BT * 8].view(BLOCKS, BT, 8)
        g = torch.Generator().manual_seed(seed)
        self.t.copy_(torch.randint(0, 256, self.t.shape, dtype=torch.uint8, generator=g).to(self.t.device))
        if self.t.device.type != "cpu":
            torch.cuda.synchronize(self.t.device)


def _pair(plat, engine: str = "triton", timeout_s: float = 30.0):
    """Two agents of one process, each with one registered group, peered both ways: (pre, dec, caches of each,
    dec's peer pre, pre's peer dec)."""
    kw = {"slot_bytes": 512} if engine == "pack" else {}
    d1 = 1 if plat.host_memory else 0           # on a GPU both agents on device 0 (one GPU is enough)
    c0, c1 = _Caches(plat, 0, 1), _Caches(plat, d1, 2)
    pre = KVAgent("prefill", platform=plat, device=0, engine=engine, timeout_s=timeout_s, **kw)
    dec = KVAgent("decode", platform=plat, device=d1, engine=engine, timeout_s=timeout_s, **kw)
    pre.register_group("g", BT, [c0.t])
    dec.register_group("g", BT, [c1.t])
    p_of_dec = dec.add_peer(pre.metadata())
    p_of_pre = pre.add_peer(dec.metadata())
    return pre, dec, c0, c1, p_of_dec, p_of_pre


def _run_child(spawner, fn, *args, timeout: float = 240.0):
    """``fn(*args)`` in a spawned child: its result; the child must exit with code 0 (a signal fails here)."""
    child = spawner.start(fn, *args, name=fn.__name__)
    out = child.result(timeout)
    child.join(60)
    return out


# ----------------------------------------------------------------------------- timeouts (bounds of waits)


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, -math.inf, 1e12, MAX_TIMEOUT_S * 2, "soon", None, True,
                                 "1", b"1", np.bool_(True), [5]])
def test_agent_timeout_is_checked_at_construction(bad):
    plat = _host()
    try:
        with pytest.raises(BadInput, match="timeout_s"):
            KVAgent("a", platform=plat, device=0, timeout_s=bad)
    finally:
        plat.close()


@pytest.mark.parametrize("bad", ["1", "nan", b"1", True, False, np.bool_(True), None, [5], complex(1, 0),
                                 math.nan, math.inf, -math.inf, 0, -0.5, MAX_TIMEOUT_S * 2])
def test_check_timeout_takes_only_real_numbers_of_seconds(bad):
    """The one check of a caller-given bound: a string (even of digits), a flag, None, a list, a complex number,
    NaN, an infinity or a bound out of (0, MAX_TIMEOUT_S]: BadInput naming it; real numbers (numpy's too) pass."""
    with pytest.raises(BadInput, match="the bound"):
        check_timeout(bad, "the bound")
    for good in (1, 2.5, np.float32(0.5), np.int64(3), MAX_TIMEOUT_S):
        assert check_timeout(good) == float(good)


def _bad_wait_timeouts():
    """The waits of an agent given bounds no wait can take: each a BadInput, and the agent stays usable."""
    plat = _host()
    pre, dec, c0, c1, p_of_dec, _ = _pair(plat)
    x = dec.prepare(p_of_dec, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}, notify_slot=0)
    h = x.post()
    for bad in (0, -1, math.nan, math.inf, 1e12, "x", "1", " 2.5 ", True, False, np.bool_(True)):
        try:
            h.wait(bad)
        except BadInput:
            pass
        else:
            raise AssertionError(f"handle.wait({bad!r}) did not raise BadInput")
        try:
            pre.wait_notification(0, 1, timeout_s=bad)
        except BadInput:
            pass
        else:
            raise AssertionError(f"wait_notification(timeout_s={bad!r}) did not raise BadInput")
    h.wait(30)
    assert pre.wait_notification(0, 1, timeout_s=30) == 1
    assert dec.failed is None and pre.failed is None
    assert torch.equal(c1.t[0], c0.t[1])
    dec.close()
    pre.close()
    plat.close()
    return True


def test_wait_timeouts_are_checked(spawner):
    assert _run_child(spawner, _bad_wait_timeouts)


def _zeroing_times_out():
    """Flag words whose zeroing is still queued when the bound passes are kept, not freed under the fill."""
    import time

    from gpuxfer import flaglink
    plat = _host()
    real = plat.memset_async

    def slow(s, ptr, byte, n):          # the fill runs late: after the construction gave up on it
        plat.launch(s, lambda: time.sleep(0.5))
        real(s, ptr, byte, n)
    plat.memset_async = slow
    before = len(flaglink._KEPT)
    try:
        KVAgent("a", platform=plat, device=0, timeout_s=0.05)
    except TransferTimeout:
        pass
    else:
        raise AssertionError("the construction did not time out")
    assert len(flaglink._KEPT) == before + 1
    time.sleep(1.0)                      # the fill lands in the kept words
    plat.close()
    return True


def test_construction_timing_out_keeps_the_flag_words_under_the_fill(spawner):
    assert _run_child(spawner, _zeroing_times_out)


def test_a_wait_that_raises_is_not_completed():
    """_completed: an event wait that fails (not the stream's own error) is not a completion."""
    plat = _host()
    a = KVAgent("a", platform=plat, device=0, timeout_s=5)
    try:
        real = plat.event_wait

        def broken(e, t):
            raise OverflowError("timestamp out of range for platform time_t")
        plat.event_wait = broken
        assert a._lifetime.completed([plat.record_event(a.stream)]) is False
        plat.event_wait = real
        assert a._lifetime.completed([plat.record_event(a.stream)]) is True
    finally:
        plat.event_wait = real
        a.close()
        plat.close()


# ----------------------------------------------------------------------------- streams made to wait on a slot


def test_stream_wait_notification_refuses_values_the_release_cannot_pass():
    plat = _host()
    a = KVAgent("a", platform=plat, device=0, timeout_s=5)
    s = plat.create_stream(0)
    try:
        for bad in (RELEASE_VALUE, RELEASE_VALUE + 1, 1 << 63, -1, 1.5, "3", True, None):
            with pytest.raises(BadInput, match="notification value"):
                a.stream_wait_notification(s, 0, bad)
            with pytest.raises(BadInput, match="notification value"):
                a.wait_notification(0, bad, timeout_s=1)
        with pytest.raises(BadInput, match="Stream"):
            a.stream_wait_notification("stream", 0, 1)
        a.stream_wait_notification(s, 0, RELEASE_VALUE - 1)     # released by the close below
        a.close()
        assert plat.synchronize(s, 30)
    finally:
        a.close()
        s.close()
        plat.close()


def _dropped_waited_stream():
    """A stream made to wait on a slot, then dropped by the caller; new streams (one may take its id) wait
    too; close must drain the dropped one's wait (releasing it), not free the words under its poll."""
    plat = _host()
    a = KVAgent("a", platform=plat, device=0, timeout_s=2)
    s = plat.create_stream(0)
    a.stream_wait_notification(s, 0, 1)
    old = id(s)
    del s
    gc.collect()
    reused = False
    keep = []
    for _ in range(200):                 # CPython usually gives the next stream the freed object's address
        t = plat.create_stream(0)
        keep.append(t)
        if id(t) == old:
            reused = True
            break
    a.stream_wait_notification(keep[-1], 1, 0)         # passes at once
    a.close()                            # waits (2 s), releases the waits, drains: nothing freed under a poll
    for t in keep:
        t.close()
    plat.close()
    return reused


def test_a_dropped_waited_stream_is_drained_at_close(spawner):
    _run_child(spawner, _dropped_waited_stream)


def test_a_dropped_waited_stream_is_held_until_its_wait_passed():
    """The agent holds a stream it made wait (so no later stream takes its place in the agent's books) until
    the wait passed and a later stream_wait_notification looked."""
    import weakref
    plat = _host()
    a = KVAgent("a", platform=plat, device=0, timeout_s=5)
    s, other = plat.create_stream(0), plat.create_stream(0)
    try:
        a.stream_wait_notification(s, 0, 1)
        held = weakref.ref(s)
        del s
        gc.collect()
        assert held() is not None
        plat.host_write_flag(a.flags.word(NOTIFY), 1, 0)
        assert plat.synchronize(held(), 30)
        a.stream_wait_notification(other, 1, 0)
        gc.collect()
        assert held() is None
    finally:
        a.close()
        other.close()
        plat.close()


def test_stream_waits_that_passed_are_let_go():
    plat = _host()
    a = KVAgent("a", platform=plat, device=0, timeout_s=5)
    streams = [plat.create_stream(0) for _ in range(3)]
    try:
        for s in streams:
            a.stream_wait_notification(s, 0, 0)
            assert plat.synchronize(s, 30)
        a.stream_wait_notification(streams[0], 0, 0)
        assert len(a._lifetime.stream_waits) <= 2 and streams[0] in a._lifetime.stream_waits
    finally:
        a.close()
        for s in streams:
            s.close()
        plat.close()


# ----------------------------------------------------------------------------- two agents of one process


def _close_one_of_two(engine: str, platform_name: str = "host"):
    """Close one agent while the other still holds it as a peer: the other's posts to it raise PeerLost
    (typed, nothing queued); the closed agent's flag words and staging stay allocated until the survivor lets
    go of the peer, and its earlier transfers' bytes are right."""
    plat = _platform(platform_name)
    pre, dec, c0, c1, p_of_dec, p_of_pre = _pair(plat, engine)
    kw = dict(local_blocks={"g": [2]}, remote_blocks={"g": [5]}, notify_slot=3)
    xd = dec.prepare(p_of_dec, "pull", **kw)
    if engine == "pack":
        xs = pre.prepare(p_of_pre, "push", local_blocks={"g": [5]}, remote_blocks={"g": [2]}, notify_slot=3)
        hd, hs = xd.post(), xs.post()
        hd.wait(60)
        hs.wait(60)
    else:
        xd.post().wait(60)
    assert torch.equal(c1.t[2], c0.t[5])
    flags, staging = pre.flags, pre.staging
    pre.close()
    assert not flags.closed and (staging is None or not staging.closed)    # held by dec's link to it
    for _ in range(3):
        try:
            xd.post()
        except PeerLost as exc:
            assert "'prefill'" in str(exc)
        else:
            raise AssertionError("a post to a closed agent of this process did not raise PeerLost")
    try:
        dec.prepare(p_of_dec, "pull", **kw)
    except GpuxferError:
        pass
    dec.remove_peer("prefill")
    assert flags.closed and (staging is None or staging.closed)
    assert dec.failed is None
    dec.close()
    plat.close()
    return True


@pytest.mark.parametrize("engine", ["triton", "pack"])
def test_closing_one_agent_of_a_process_keeps_what_the_other_uses(spawner, engine):
    assert _run_child(spawner, _close_one_of_two, engine)


def _close_under_posts(engine: str):
    """One agent of the process closes while another thread posts to it (notifications into its words)."""
    import threading
    plat = _host()
    pre, dec, c0, c1, p_of_dec, _ = _pair(plat, engine)
    x = dec.prepare(p_of_dec, "pull", local_blocks={"g": [1]}, remote_blocks={"g": [6]}, notify_slot=0)
    errors: list = []
    started = threading.Event()

    def poster():
        s = plat.create_stream(1)
        try:
            for i in range(40):
                try:
                    h = x.post(s if i % 2 else None)
                    started.set()
                    h.wait(60)
                except GpuxferError as exc:
                    started.set()
                    errors.append(exc)
        finally:
            s.close()
    t = threading.Thread(target=poster, daemon=True)
    t.start()
    started.wait(60)
    pre.close()
    t.join(240)
    assert not t.is_alive()
    assert errors and all(isinstance(e, PeerLost) for e in errors), errors[:3]
    dec.close()
    plat.close()
    return len(errors)


@pytest.mark.parametrize("engine", ["triton", "copy_engine"])
def test_closing_an_agent_while_the_other_posts_to_it(spawner, engine):
    assert _run_child(spawner, _close_under_posts, engine) >= 1


# ----------------------------------------------------------------------------- posts against remove_peer and close


def _post_against(what: str):
    """Posts from one thread while another removes the peer (then adds it again) or closes the agent: every
    post either ran (its bytes landed) or raised a typed error having queued nothing."""
    import threading
    plat = _host()
    pre, dec, c0, c1, p_of_dec, _ = _pair(plat)
    stop = threading.Event()
    seen: dict = {"ok": 0, "errors": []}

    def poster():
        s = plat.create_stream(1)
        try:
            i = 0
            while not stop.is_set() and i < 60:
                i += 1
                try:
                    peer = dec.peer("prefill")
                    x = dec.prepare(peer, "pull", local_blocks={"g": [i % BLOCKS]},
                                    remote_blocks={"g": [(i * 3) % BLOCKS]}, notify_slot=i % 4)
                    x.post(s if i % 2 else None).wait(60)
                    assert torch.equal(c1.t[i % BLOCKS], c0.t[(i * 3) % BLOCKS])
                    seen["ok"] += 1
                except GpuxferError as exc:
                    seen["errors"].append(exc)
        finally:
            s.close()
    t = threading.Thread(target=poster, daemon=True)
    t.start()
    try:
        if what == "remove_peer":
            for _ in range(6):
                try:
                    dec.remove_peer("prefill")
                except NotRegistered:
                    pass
                dec.add_peer(pre.metadata())
        else:
            import time
            time.sleep(0.5)
            dec.close()
    finally:
        stop.set()
        t.join(240)
    assert not t.is_alive()
    assert all(isinstance(e, (NotRegistered, BadInput)) for e in seen["errors"]), seen["errors"][:3]
    assert dec.failed is None and pre.failed is None
    dec.close()
    pre.close()
    plat.close()
    return seen["ok"], len(seen["errors"])


@pytest.mark.parametrize("what", ["remove_peer", "close"])
def test_posts_racing_remove_peer_and_close(spawner, what):
    _run_child(spawner, _post_against, what)


def test_a_post_after_remove_peer_queues_nothing():
    """The check runs under the post lock: a post to a removed peer raises NotRegistered before it takes a slot
    or touches a stream."""
    plat = _host()
    pre, dec, c0, c1, p_of_dec, _ = _pair(plat)
    try:
        x = dec.prepare(p_of_dec, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}, notify_slot=0)
        dec.remove_peer("prefill")
        taken = []
        real = dec._poster.take_slot
        dec._poster.take_slot = lambda *a: taken.append(a) or real(*a)
        with pytest.raises(NotRegistered, match="removed"):
            x.post()
        assert not taken
        with pytest.raises(NotRegistered):
            p_of_dec.anchor((0, 0), 0)
    finally:
        dec.close()
        pre.close()
        plat.close()


def _removal_during_a_post(what: str, platform_name: str = "host"):
    """remove_peer (or close) called while a post is between its check and its enqueue: it waits for that
    post (which completes, its notification included) before it closes the peer's flag link."""
    import threading
    plat = _platform(platform_name)
    pre, dec, c0, c1, p_of_dec, _ = _pair(plat)
    x = dec.prepare(p_of_dec, "pull", local_blocks={"g": [4]}, remote_blocks={"g": [7]}, notify_slot=1)
    in_post, done = threading.Event(), threading.Event()
    real = dec._poster.take_slot

    def slow(*a):
        in_post.set()
        done.wait(2)                     # a removal that does not wait for this post is over by then
        return real(*a)
    dec._poster.take_slot = slow

    def remover():
        in_post.wait(60)
        if what == "remove_peer":
            dec.remove_peer("prefill")
        else:
            dec.close()
        done.set()
    t = threading.Thread(target=remover, daemon=True)
    t.start()
    s = plat.create_stream(dec.device)
    h = x.post(s)
    assert plat.event_wait(h.event, 60)
    t.join(120)
    assert done.is_set() and p_of_dec.closed and p_of_dec.flags.closed
    assert torch.equal(c1.t[4], c0.t[7]) and pre.notification(1) == 1
    s.close()
    dec.close()
    pre.close()
    plat.close()
    return True


@pytest.mark.parametrize("what", ["remove_peer", "close"])
def test_removal_waits_for_a_post_in_progress(spawner, what):
    assert _run_child(spawner, _removal_during_a_post, what)


# ----------------------------------------------------------------------------- many threads at once


def _stress(seed: int, rounds: int, platform_name: str = "host"):
    """Threads on two agents of one process: pulls and pushes (each thread its own destination blocks, bytes
    checked after every completed transfer), notification reads and stream waits, remove_peer / add_peer on
    both sides, and one agent closed part way. Every error is a GpuxferError; the counts come back."""
    import random
    import threading
    plat = _platform(platform_name)
    pre, dec, c0, c1, _, _ = _pair(plat, timeout_s=60)
    src0 = c0.t.clone()                  # pre's blocks 0..3 are sources only (pulls read them, pushes write 4..7)
    stop = threading.Event()
    counts = {"ok": 0, "typed": 0}
    other: list = []
    lock = threading.Lock()

    def note(ok: bool = False, exc: BaseException | None = None):
        with lock:
            if ok:
                counts["ok"] += 1
            elif isinstance(exc, GpuxferError):
                counts["typed"] += 1
            else:
                other.append(repr(exc))

    def mover(me: int, agent, op: str):
        rng = random.Random(seed * 31 + me)
        peer_name = "prefill" if agent is dec else "decode"
        s = plat.create_stream(agent.device)
        try:
            for _ in range(rounds):
                if stop.is_set():
                    break
                src = rng.randrange(4)
                dst = me                             # each mover its own destination block
                try:
                    peer = agent.peer(peer_name)
                    if op == "pull":                 # dec's block `dst` <- pre's block `src`
                        x = agent.prepare(peer, "pull", local_blocks={"g": [dst]}, remote_blocks={"g": [src]},
                                          notify_slot=me)
                    else:                            # pre's source block `src` -> dec's block `dst`
                        x = agent.prepare(peer, "push", local_blocks={"g": [src]}, remote_blocks={"g": [dst]},
                                          notify_slot=me)
                    h = x.post(s if rng.random() < 0.5 else None)
                    h.wait(60)
                    assert torch.equal(c1.t[dst], src0[src]), f"mover {me}: wrong bytes in block {dst}"
                    note(ok=True)
                except AssertionError:
                    raise
                except BaseException as exc:  # noqa: BLE001 - sorted by note
                    note(exc=exc)
        finally:
            s.close()

    def notes():
        rng = random.Random(seed)
        s0, s1 = plat.create_stream(pre.device), plat.create_stream(dec.device)
        try:
            for _ in range(rounds * 4):
                if stop.is_set():
                    break
                try:
                    a = rng.choice((pre, dec))
                    a.notification(rng.randrange(4))
                    a.stream_wait_notification(s0 if a is pre else s1, rng.randrange(4), 0)
                    note(ok=True)
                except BaseException as exc:  # noqa: BLE001
                    note(exc=exc)
        finally:
            s0.close()
            s1.close()

    def churn():
        rng = random.Random(seed + 7)
        for i in range(rounds):
            if stop.is_set():
                break
            a, b, name = (dec, pre, "prefill") if rng.random() < 0.5 else (pre, dec, "decode")
            try:
                a.remove_peer(name)
            except BaseException as exc:  # noqa: BLE001
                note(exc=exc)
            try:
                a.add_peer(b.metadata())
            except BaseException as exc:  # noqa: BLE001
                note(exc=exc)
            if i == rounds // 2:
                pre.close()                          # one agent of the pair goes part way
    fns = [lambda: mover(0, dec, "pull"), lambda: mover(1, dec, "pull"), lambda: mover(2, pre, "push"),
           notes, churn]

    def run(f):
        try:
            f()
        except BaseException as exc:  # noqa: BLE001 - a wrong byte or an escaped error: reported below
            with lock:
                other.append(repr(exc))
    threads = [threading.Thread(target=run, args=(f,), daemon=True) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    stop.set()
    alive = [t for t in threads if t.is_alive()]
    assert not alive, f"{len(alive)} threads still running"
    assert not other, other[:5]
    dec.close()
    pre.close()
    plat.close()
    return counts


@pytest.mark.parametrize("seed", [1, 2])
def test_threads_on_two_agents_raise_only_typed_errors(spawner, seed):
    counts = _run_child(spawner, _stress, seed, 12, timeout=900)
    assert counts["ok"] > 0


# ----------------------------------------------------------------------------- the same on CUDA (-m gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["close-triton", "close-pack", "remove_peer", "close", "stress"])
def test_cuda_lifetime(spawner, case):
    """Two agents of one process on CUDA device 0: a closed peer agent, removal during a post, the threads
    stress -- each in a spawned child (a signal or a device fault is its exit code)."""
    from _skips import platform_reason
    why = platform_reason("cuda")
    if why is not None:
        pytest.skip(f"CUDA unavailable: {why}")
    if case.startswith("close-"):
        assert _run_child(spawner, _close_one_of_two, case[len("close-"):], "cuda")
    elif case == "stress":
        assert _run_child(spawner, _stress, 3, 20, "cuda", timeout=900)["ok"] > 0
    else:
        assert _run_child(spawner, _removal_during_a_post, case, "cuda")
