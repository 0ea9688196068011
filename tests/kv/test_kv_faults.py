"""KV engines under hostile input and faults: descriptors out of bounds, stray writes, a stuck peer.

Most cases run both sides of an engine in one process (two threads, each with its own
host platform, standing for the two processes); a case that could crash the process on a
regression runs in a spawned child whose exit code is asserted.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from _spawn import on_threads
from gpuxfer.errors import BadInput
from gpuxfer.bench.kv import engines as E
from gpuxfer.bench.kv.model.plan import DIRECTIONS
from gpuxfer.bench.kv.model.plan import check_bounds
from gpuxfer.platforms import host_memory
from gpuxfer.platforms.base import PeerMapping
from gpuxfer.platforms.host import HostPlatform

POOL = 1 << 20
#: the built-in engines over descriptor tables; ``triton`` and ``copy_engine`` (KVAgent) run such bursts on
#: their descriptor-table twins (``pack``'s twin is built collectively, so it needs both sides at once)
BUILT_IN = ("bulk", "triton-table", "pack-table", "copy_engine-table", "triton", "copy_engine")


# ----------------------------------------------------------------------------- both sides in one process


class SameProcessHost(HostPlatform):
    """The host emulation with both sides in one process: a handle this process exported may be opened
    (each side has its own platform object, as two processes would)."""

    def open_handle(self, handle, device):
        if handle.owner_pid != os.getpid():
            return super().open_handle(handle, device)
        shm = host_memory._Shm(handle.payload.decode(), handle.nbytes, create=False)
        return PeerMapping(self, device, shm.ptr, handle, impl=shm)


class Exchange:
    """The all-gather of :class:`gpuxfer.bench.kv.engines.Side` between two threads."""

    def __init__(self, n: int = 2, timeout_s: float = 30.0):
        self.slots = [None] * n
        self.barrier = threading.Barrier(n, timeout=timeout_s)

    def __call__(self, rank: int):
        def exchange(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return exchange


class Pair:
    """Two sides (source: rank 0, destination: rank 1) and their pools; a context manager."""

    def __init__(self, pool_bytes: int = POOL, timeout_s: float = 20.0, **side_kw):
        self.plats = [SameProcessHost(devices=2) for _ in range(2)]
        self.pools = [self.plats[r].alloc(pool_bytes, r) for r in range(2)]
        self.peers = [self.plats[r].open_handle(self.pools[1 - r].export(), r) for r in range(2)]
        ex = Exchange()
        opts = E.EngineOptions(pack_chunk_bytes=64 << 10, pack_first_chunk_bytes=16 << 10)
        self.sides = [E.Side(self.plats[r], r, r, E.Role.SOURCE if r == 0 else E.Role.DESTINATION, self.pools[r],
                             self.peers[r], ex(r), timeout_s=timeout_s, options=opts, **side_kw) for r in range(2)]
        for s in self.sides:
            s.open_streams()
        self.engines: list[E.Engine] = []

    def array(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s pool as a writable uint8 array."""
        p = self.pools[rank]
        return np.frombuffer((ctypes.c_uint8 * p.nbytes).from_address(p.ptr), dtype=np.uint8)

    def build(self, name: str) -> list[E.Engine]:
        cls = E.engine_class(name)
        engines = on_threads([lambda r=r: cls(self.sides[r]) for r in range(2)])
        self.engines += engines
        return engines

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for e in self.engines:
            e.close()
        for s in self.sides:
            s.close()
        for m in (*self.peers, *self.pools):
            m.close()
        for p in self.plats:
            p.close()


def transfer(pair: Pair, engines, burst: E.DescriptorBurst, direction: str) -> None:
    """One unarmed burst of ``engines`` over ``pair`` (the passive side posts first)."""
    ps = [engines[r].prepare(burst, direction) for r in range(2)]
    passive = 0 if direction == "pull" else 1
    engines[passive].post(ps[passive])
    engines[1 - passive].post(ps[1 - passive])
    on_threads([lambda r=r: engines[r].wait(ps[r]) for r in range(2)])
    for r in range(2):
        engines[r].release(ps[r])


# ----------------------------------------------------------------------------- descriptor bounds


#: (name, descriptor rows): each must be refused by every engine on both sides, before anything moves
HOSTILE = {
    "size wraps int64": [[16, 16, 2 ** 63 - 1]],
    "source offset wraps": [[2 ** 63 - 8, 0, 16]],
    "destination offset wraps": [[0, 2 ** 63 - 8, 16]],
    "both near 2**62": [[2 ** 62, 2 ** 62, 2 ** 62]],
    "negative source": [[-16, 0, 16]],
    "negative destination": [[0, -16, 16]],
    "negative size": [[0, 0, -16]],
    "zero size": [[0, 0, 0]],
    "past the end": [[0, POOL - 8, 16]],
    "one byte past": [[POOL - 15, 0, 16]],
    "uint64 max": np.array([[0, 0, 2 ** 64 - 1]], dtype=np.uint64),
    "second request": "second",
}


def _hostile_burst(rows) -> E.DescriptorBurst:
    good = np.array([[0, 0, 64], [64, 4096, 64]], dtype=np.int64)
    if isinstance(rows, str):                  # a good request, then one whose last row reaches past the pool
        return E.DescriptorBurst([good, np.array([[128, 8192, 64], [0, POOL - 32, 64]], dtype=np.int64)])
    return E.DescriptorBurst([good, np.asarray(rows)])


def hostile_descriptors_child() -> dict:
    """Every built-in engine, both directions, both sides: what prepare says for each hostile burst;
    then a good burst still moves every byte (a refused burst leaves nothing behind)."""
    out = {}
    with Pair() as pair:
        src = pair.array(0)
        src[:] = np.random.default_rng(0).integers(0, 256, POOL, dtype=np.uint8)
        for name in BUILT_IN:
            engines = pair.build(name)
            for direction in DIRECTIONS:
                for case, rows in HOSTILE.items():
                    for r in range(2):
                        try:
                            p = engines[r].prepare(_hostile_burst(rows), direction)
                            engines[r].release(p)
                            got = "accepted"
                        except BadInput as exc:
                            got = f"BadInput: {exc}"
                        except Exception as exc:  # noqa: BLE001 - reported to the test
                            got = f"{type(exc).__name__}: {exc}"
                        out[(name, direction, case, r)] = got
                good = E.DescriptorBurst([np.array([[0, 0, 4096], [8192, 65536, 100]], dtype=np.int64)])
                pair.array(1)[:] = 0
                transfer(pair, engines, good, direction)
                dst = pair.array(1)
                moved = bool((dst[:4096] == src[:4096]).all() and (dst[65536:65636] == src[8192:8292]).all())
                if name == "bulk":
                    moved = bool((dst[:4196] == src[:4196]).all())
                out[(name, direction, "good burst moved")] = moved
    return out


def test_hostile_descriptors_are_refused_by_every_engine_on_both_sides(spawner):
    """Overflowing, negative, zero-size and out-of-range descriptors: BadInput from every engine's prepare
    on both sides, naming the descriptor; no signal (the child exits 0); good bursts still move."""
    child = spawner.start(hostile_descriptors_child, name="hostile descriptors")
    res = child.result(240)
    child.join(30)
    for key, got in res.items():
        if key[2] == "good burst moved":
            assert got is True, key
            continue
        assert got.startswith("BadInput: descriptor "), (key, got)
        if key[2] == "second request":
            assert "descriptor 3 (request 1, row 1 of the request)" in got, got
        elif key[2] in ("zero size", "negative size", "size wraps int64", "uint64 max"):
            assert "(request 1, row 0 of the request)" in got
    assert len(res) == len(BUILT_IN) * 2 * (2 * len(HOSTILE) + 1)


@pytest.mark.parametrize("rows, limits, match", [
    ([[16, 16, 2 ** 63 - 1]], (POOL, POOL), r"source range \[16, 9223372036854775823\) lies outside"),
    ([[0, 2 ** 63 - 1, 1]], (POOL, POOL), "destination range"),
    ([[0, 0, 0]], (None, None), "moves 0 bytes"),
    ([[0, -1, 4]], (None, None), r"destination range \[-1, 3\) lies outside the destination pool$"),
    ([[4, 0, 4]], (7, 8), "source pool of 7 bytes"),
])
def test_check_bounds_is_overflow_safe_and_names_the_row(rows, limits, match):
    with pytest.raises(BadInput, match=match):
        check_bounds(np.array(rows, dtype=np.int64), *limits)


def test_check_bounds_accepts_ranges_that_end_at_the_pool_end():
    check_bounds(np.array([[0, 0, 8], [2 ** 63 - 9, 2 ** 63 - 2, 1]], dtype=np.int64), 2 ** 63 - 1, 2 ** 63 - 1)
    check_bounds(np.zeros((0, 3), dtype=np.int64), 0, 0)
    with pytest.raises(BadInput, match="pool size"):
        check_bounds(np.array([[0, 0, 8]], dtype=np.int64), -1, 8)


# ----------------------------------------------------------------------------- guard bytes (stray writes)


def _guarded_transfer(pool_bytes: int, rows, *, src_seed: int = 11, dst_seed: int = 22):
    """A source pool of ``src_seed``'s pattern, a destination of ``dst_seed``'s, ``rows`` copied (reference)."""
    from gpuxfer.kernels import reference as ref
    src = ref.pattern(src_seed, 0, pool_bytes)
    dst = ref.pattern(dst_seed, 0, pool_bytes)
    d = np.array(rows, dtype=np.int64).reshape(-1, 3)
    ref.copy(src, dst, d)
    return dst, d


def _covered(d: np.ndarray, pool_bytes: int) -> np.ndarray:
    mask = np.zeros(pool_bytes, dtype=bool)
    for _, o, n in d.tolist():
        mask[o:o + n] = True
    return mask


@pytest.mark.parametrize("seed", range(6))
def test_guard_descriptors_are_exactly_the_bytes_no_destination_covers(seed):
    import torch

    from gpuxfer.kernels import launch as L
    rng = np.random.default_rng(seed)
    pool = int(rng.integers(1, 5000))
    n = int(rng.integers(0, 12))
    dst = rng.integers(0, pool, n)
    size = np.minimum(rng.integers(0, 300, n), pool - dst)       # zero sizes and overlaps included
    d = np.stack([np.zeros(n, np.int64), dst, size], axis=1).astype(np.int64)
    g = L.guard_descriptors(torch.from_numpy(d), pool, piece=int(rng.integers(1, 700))).numpy()
    assert (g[:, 0] == g[:, 1]).all() and (g[:, 2] > 0).all()
    mask = np.zeros(pool, dtype=np.int64)
    for _, o, k in g.tolist():
        mask[o:o + k] += 1
    assert (mask == (~_covered(d, pool)).astype(np.int64)).all()


def test_verify_with_guard_counts_stray_writes_and_names_the_first():
    """The kernel path (``kernels.verify(guard_seed=...)``) and the NumPy reference agree on a clean
    transfer, a stray write outside every descriptor, and a wrong byte inside one."""
    import torch

    from gpuxfer import kernels as K
    from gpuxfer.errors import VerificationFailed
    from gpuxfer.kernels import reference as ref
    pool = 48 << 10
    rows = [[0, 1000, 700], [5000, 3000, 64], [9000, 40000, 2048]]
    dst, d = _guarded_transfer(pool, rows)
    desc_t = torch.from_numpy(d)

    clean = K.verify(torch.from_numpy(dst.copy()), desc_t, 11, guard_seed=22)
    assert clean.ok and clean.wrong_bytes == 0 and clean.guard_wrong_bytes == 0
    assert clean.guard_bytes == pool - 700 - 64 - 2048
    assert ref.verify_guard(dst, d, 22) == (0, -1, pool - 700 - 64 - 2048)
    assert K.verify(torch.from_numpy(dst.copy()), desc_t, 11).guard_bytes == 0     # off by default

    stray = dst.copy()
    for o in (999, 1700, 30000, pool - 1):          # just before/after a destination, between, the last byte
        stray[o] ^= 0x5A
    r = K.verify(torch.from_numpy(stray.copy()), desc_t, 11, guard_seed=22)
    assert not r.ok and r.wrong_bytes == 0 and r.guard_wrong_bytes == 4 and r.guard_first_bad == 999
    assert ref.verify_guard(stray, d, 22) == (4, 999, pool - 700 - 64 - 2048)
    assert K.verify(torch.from_numpy(stray.copy()), desc_t, 11).ok          # unguarded, the stray writes go unseen
    with pytest.raises(VerificationFailed, match="4 of the .* bytes outside every descriptor changed") as ei:
        r.raise_if_failed()
    assert ei.value.wrong_bytes == 4

    inside = dst.copy()
    inside[3010] ^= 1                                # inside descriptor 1: the descriptor check, not the guard
    r = K.verify(torch.from_numpy(inside), desc_t, 11, guard_seed=22)
    assert (r.wrong_bytes, r.first_bad, r.guard_wrong_bytes) == (1, 1, 0)
    assert ref.verify_guard(inside, d, 22)[0] == 0


def test_verify_guard_needs_validation_and_int_seeds():
    import torch

    from gpuxfer import kernels as K
    t = torch.zeros(64, dtype=torch.uint8)
    d = torch.tensor([[0, 0, 8]], dtype=torch.int64)
    with pytest.raises(BadInput, match="validate"):
        K.verify(t, d, 1, guard_seed=2, validate=False)
    with pytest.raises(BadInput, match="guard_seed must be an int"):
        K.verify(t, d, 1, guard_seed="2")
    r = K.verify(t, torch.zeros((0, 3), dtype=torch.int64), 1, guard_seed=2)      # no descriptor: all guard
    assert r.guard_bytes == 64 and r.guard_wrong_bytes > 0


def test_runner_verification_counts_a_stray_write(host):
    """The benchmark's verifier (what each row runs on the destination) on the host emulation: a byte
    flipped where no descriptor points, at the offset the ``:stray`` injection picks, is counted."""
    from gpuxfer.kernels import reference as ref
    from gpuxfer.bench.kv import checks as RN
    pool = host.alloc(64 << 10, 0)
    stream = host.create_stream(0)
    try:
        a = np.frombuffer((ctypes.c_uint8 * pool.nbytes).from_address(pool.ptr), dtype=np.uint8)
        src = ref.pattern(11, 0, pool.nbytes)
        a[:] = ref.pattern(22, 0, pool.nbytes)
        d = np.array([[100, 0, 512], [9000, 512, 64], [0, 4096, 1000]], dtype=np.int64)
        ref.copy(src, a, d)
        assert RN._pool_verify(host, stream, pool, d, 11, 30.0, 1, guard_seed=22) == (0, -1, 0, -1)
        at = RN.stray_offset(d, pool.nbytes)
        assert at == 576                                  # just past descriptor 0's neighbour run [0, 576)
        RN._flip_byte(host, stream, pool, at)
        assert host.synchronize(stream, 30.0)
        assert RN._pool_verify(host, stream, pool, d, 11, 30.0, 1, guard_seed=22) == (0, -1, 1, 576)
        assert RN._pool_verify(host, stream, pool, d, 11, 30.0, 1)[:2] == (0, -1)     # descriptors alone: unseen
    finally:
        pool.close()


@pytest.mark.parametrize("rows, pool, want", [
    ([[0, 10, 5]], 100, 15),                  # right past descriptor 0
    ([[0, 10, 5], [0, 15, 85]], 100, 0),      # covered to the end: the first uncovered byte
    ([[0, 0, 100]], 100, None),               # nothing uncovered
    ([], 8, 0),
])
def test_stray_offset(rows, pool, want):
    from gpuxfer.bench.kv import checks as RN
    assert RN.stray_offset(np.array(rows, dtype=np.int64).reshape(-1, 3), pool) == want


@pytest.mark.slow
def test_bench_catches_a_stray_write_outside_every_descriptor(capsys, tmp_path):
    """``--inject-fault ENGINE:DIRECTION:stray`` flips a destination byte no descriptor covers (just past
    the first descriptor): the row is invalid and the command exits non-zero (clean rows pass the same
    check in test_kv_bench's end-to-end test)."""
    import json

    from gpuxfer.cli import main
    out_dir = tmp_path / "out"
    rc = main(["bench", "kv", "--platform", "host", "--workload", "kv-mla", "--isl", "16", "--page", "16",
               "--batch", "1", "--warmup", "0", "--trials", "1", "--timeout", "60", "--engine", "copy_engine",
               "--direction", "push", "--inject-fault", "copy_engine:push:stray", "--out", str(out_dir)])
    out = capsys.readouterr().out
    assert rc == 1, out
    doc = json.loads((out_dir / "kv_bench.json").read_text())
    (bad,) = doc["rows"]
    assert bad["fault_injected"] and not bad["valid"]
    assert bad["stray_bytes"] == 1 and bad["wrong_bytes"] == 1 and bad["first_wrong_descriptor"] is None
    assert "outside every descriptor" in bad["first_wrong"]
    assert doc["outcome"]["status"] == "fail"


# ----------------------------------------------------------------------------- a stuck peer


def stuck_peer_session(engine: str = "pack-table", direction: str = "pull", on_timeout: str | None = None,
                       waiting: str = "initiator") -> dict:
    """One side (``waiting``: the initiator or the passive side) arms and posts a burst; its peer never
    does (stuck or dead). What the waiting side sees."""
    out: dict = {}
    with Pair(on_timeout=on_timeout) as pair:
        engines = pair.build(engine)
        bulk = pair.build("bulk")
        ini = 1 if direction == "pull" else 0
        if waiting == "passive":
            ini = 1 - ini
        eng, side = engines[ini], pair.sides[ini]
        side.timeout_s = 1.0             # set-up at the default; the burst's wait is the one to time out
        burst = E.DescriptorBurst([np.array([[0, 0, 40 << 10], [65536, 131072, 4096]], dtype=np.int64)])
        p = eng.prepare(burst, direction)
        eng.arm(p)                       # armed: the whole transfer waits behind the gate
        eng.post(p)
        try:
            eng.wait(p)
            out["wait"] = "returned"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["wait"] = exc
        # every stream of the failed side drains: nothing of ours waits on the peer any more
        out["drained"] = {name: pair.plats[ini].synchronize(s, 10.0) for name, s in side._streams.items()}
        later = {}
        for what, call in (("prepare", lambda: eng.prepare(burst, direction)), ("arm", lambda: eng.arm(p)),
                           ("post", lambda: eng.post(p)), ("wait", lambda: eng.wait(p)),
                           ("other engine", lambda: bulk[ini].prepare(burst, direction))):
            try:
                call()
                later[what] = None
            except Exception as exc:  # noqa: BLE001
                later[what] = exc
        out["later"] = later
        eng.release(p)                   # release and close still work on a failed side
    return out


@pytest.mark.parametrize("waiting", ["initiator", "passive"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_stuck_peer_fails_the_side_releases_its_waits_and_every_later_call_raises(direction, waiting):
    """A side of the pack engine waits on flags its peer never writes: TransferTimeout, every GPU wait
    of the side released (its streams drain), the same error from every later call on the side."""
    from gpuxfer.errors import TransferTimeout
    out = stuck_peer_session("pack-table", direction, waiting=waiting)
    err = out["wait"]
    assert isinstance(err, TransferTimeout), err
    assert "timed out after 1 s" in str(err) and f"pack-table {direction} burst" in str(err)
    assert out["drained"] and all(out["drained"].values()), out["drained"]
    for what, exc in out["later"].items():
        assert exc is err, (what, exc)


def test_on_timeout_exit_ends_the_process_with_the_exit_code_and_names_the_wait():
    code = "import test_kv_faults as t; t.stuck_peer_session('pack-table', 'pull'); print('NOT EXITED')"
    env = dict(os.environ, GPUXFER_KV_ON_TIMEOUT="exit", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == E.EXIT_CODE, (res.returncode, res.stdout, res.stderr)
    assert "NOT EXITED" not in res.stdout
    assert "rank 1 (decode, device 1) failed: TransferTimeout" in res.stderr and "pack-table pull burst" in res.stderr
    assert f"exiting with code {E.EXIT_CODE}" in res.stderr


@pytest.mark.parametrize("value", ["abort", "1", "Raise!"])
def test_bad_on_timeout_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv(E.ENV_KV_ON_TIMEOUT, value)
    with pytest.raises(BadInput, match=f"GPUXFER_KV_ON_TIMEOUT must be raise or exit, got '{value}'"):
        E.on_timeout_from_env(None)
    with pytest.raises(BadInput, match="on_timeout must be"):
        E.on_timeout_from_env("never")
    monkeypatch.setenv(E.ENV_KV_ON_TIMEOUT, " EXIT ")
    assert E.on_timeout_from_env(None) == "exit" and E.on_timeout_from_env("raise") == "raise"


# ----------------------------------------------------------------------------- two processes (host and CUDA)


def stuck_peer_rank(rank: int, world: int, init_method: str, platform_name: str, direction: str,
                    timeout_s: float) -> dict:
    """Rank ``rank`` of a two-process pack engine. Both move one good burst (loading every kernel with
    nothing armed); then the initiator arms and posts a second burst its peer never joins. The
    initiator reports its error, how long it took and whether every GPU wait of the process was
    released: ``synchronize`` of the whole device (host work that waits on every stream) returns."""
    import torch
    import torch.distributed as dist

    from gpuxfer.platforms import get_platform
    from gpuxfer.pp.launch import init_cpu_group
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    init_cpu_group(rank, world, init_method, timeout_s=300)

    def exchange(obj):
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out

    plat = get_platform(platform_name)
    dev = 0 if platform_name == "cuda" else rank
    plat.set_device(dev)
    if platform_name == "cuda":
        torch.cuda.set_device(dev)
    pool = plat.alloc(POOL, dev)
    peer = plat.open_handle(exchange(pool.export())[1 - rank], dev)
    opts = E.EngineOptions(pack_chunk_bytes=64 << 10, pack_first_chunk_bytes=16 << 10)
    side = E.Side(plat, dev, rank, E.Role.SOURCE if rank == 0 else E.Role.DESTINATION, pool, peer, exchange,
                  timeout_s=60.0, options=opts)
    side.open_streams()
    eng = E.PackEngine(side)
    out: dict = {"rank": rank}
    try:
        burst = E.DescriptorBurst([np.array([[0, 0, 40 << 10], [65536, 131072, 4096]], dtype=np.int64)])
        p = eng.prepare(burst, direction)
        exchange(None)
        eng.post(p)                       # the load burst: unarmed, both sides
        eng.wait(p)
        exchange(None)
        initiator = E.initiator_of(direction) is side.role
        if initiator:
            side.timeout_s = timeout_s
            eng.arm(p)
            t0 = time.monotonic()
            eng.post(p)
            try:
                eng.wait(p)
                out["error"] = None
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out["error"] = f"{type(exc).__name__}: {exc}"
            out["to_error_s"] = time.monotonic() - t0
            t1 = time.monotonic()
            out["device_synchronized"] = all(plat.synchronize(s, 30.0) for s in side._streams.values())
            if platform_name == "cuda":
                torch.cuda.synchronize()  # every stream of the device: returns only if nothing waits
            out["synchronize_s"] = time.monotonic() - t1
            later = []
            for call in (lambda: eng.prepare(burst, direction), lambda: eng.post(p), lambda: eng.wait(p)):
                try:
                    call()
                    later.append(None)
                except Exception as exc:  # noqa: BLE001
                    later.append(type(exc).__name__)
            out["later"] = later
        eng.release(p)
        exchange(None)                    # the stuck peer stays out of the burst until here
    finally:
        eng.close()
        side.close()
        peer.close()
        pool.close()
        plat.close()
    return out


def _stuck_peer_two_processes(spawner, platform_name: str, direction: str) -> dict:
    timeout_s = 3.0
    res = spawner.run_ranks(stuck_peer_rank, 2, platform_name, direction, timeout_s, timeout=300)
    ini = res[1 if direction == "pull" else 0]
    assert ini["error"] and ini["error"].startswith("TransferTimeout: ") and "timed out after 3 s" in ini["error"]
    assert ini["to_error_s"] < timeout_s + 5, ini
    assert ini["device_synchronized"] and ini["synchronize_s"] < 5, ini
    assert ini["later"] == ["TransferTimeout"] * 3, ini
    return ini


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_two_processes_stuck_peer_on_the_host(spawner, direction):
    _stuck_peer_two_processes(spawner, "host", direction)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_gpu_stuck_peer_releases_every_gpu_wait(spawner, direction):
    """Two processes on one GPU: after the timeout, torch.cuda.synchronize() returns (no stream of the
    process is left blocked on a flag), and the error is stored."""
    from gpuxfer.platforms import unavailable_reason
    why = unavailable_reason("cuda")
    if why is not None:
        pytest.skip(f"CUDA unavailable: {why}")
    ini = _stuck_peer_two_processes(spawner, "cuda", direction)
    print(f"stuck peer ({direction}): error after {ini['to_error_s']:.2f} s, synchronize {ini['synchronize_s']:.3f} s")


@pytest.mark.gpu
def test_gpu_verify_guard_matches_the_reference():
    """The guard check on the device finds stray writes exactly where the NumPy reference does."""
    import torch

    from gpuxfer import kernels as K
    from gpuxfer.kernels import reference as ref
    from gpuxfer.platforms import unavailable_reason
    if unavailable_reason("cuda") is not None:
        pytest.skip("CUDA unavailable")
    pool = 24 << 20                               # several guard pieces
    rng = np.random.default_rng(3)
    dsts = np.sort(rng.choice(pool // 4096 - 1, 300, replace=False)) * 4096
    rows = np.stack([rng.integers(0, pool - 4096, 300), dsts, rng.integers(1, 4096, 300)], axis=1)
    dst, d = _guarded_transfer(pool, rows)
    outside = np.flatnonzero(~_covered(d, pool))
    hits = np.sort(rng.choice(outside, 7, replace=False))
    dst[hits] ^= 0xFF
    r = K.verify(torch.from_numpy(dst).cuda(), torch.from_numpy(d).cuda(), 11, guard_seed=22)
    assert (r.wrong_bytes, r.guard_wrong_bytes, r.guard_first_bad) == (0, 7, int(hits[0]))
    assert ref.verify_guard(dst, d, 22)[:2] == (7, int(hits[0]))


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_bench_catches_a_stray_write(capsys, tmp_path):
    import json

    from gpuxfer.cli import main
    from gpuxfer.platforms import unavailable_reason
    if unavailable_reason("cuda") is not None:
        pytest.skip("CUDA unavailable")
    out_dir = tmp_path / "out"
    rc = main(["bench", "kv", "--platform", "cuda", "--isl", "8k", "--page", "64", "--batch", "1",
               "--engine", "triton,pack", "--trials", "1", "--warmup", "0", "--devices", "0,0",
               "--inject-fault", "pack:push:stray", "--out", str(out_dir)])
    out = capsys.readouterr().out
    assert rc == 1, out
    rows = {(r["engine"], r["direction"]): r for r in json.loads((out_dir / "kv_bench.json").read_text())["rows"]}
    assert all(r["stray_bytes"] == 0 and r["valid"] for k, r in rows.items() if k != ("pack", "push")), rows
    bad = rows[("pack", "push")]
    assert bad["stray_bytes"] == 1 and not bad["valid"] and "outside every descriptor" in bad["first_wrong"]


def test_a_burst_owns_read_only_descriptors():
    """What check_bounds checked is what the engines move: the caller's arrays changed afterwards do not
    reach the burst, and the burst's own tables cannot be written."""
    req = np.array([[0, 0, 64], [64, 128, 64]], dtype=np.int64)
    b = E.DescriptorBurst([req, req[:1]])
    b.check_bounds(POOL, POOL)
    req[0, 2] = 2 ** 63 - 1
    assert b.requests[0][0, 2] == 64 and b.concatenated()[2, 2] == 64
    with pytest.raises(ValueError, match="read-only"):
        b.requests[0][0, 0] = 5
    plan = np.concatenate([req, req[:1]])
    with pytest.raises(BadInput, match="request 1 differs"):
        E.DescriptorBurst([req, req[1:]], plan=plan)
    pb = E.DescriptorBurst([plan[:2], plan[2:]], plan=plan)
    assert [r.tolist() for r in pb.requests] == [plan[:2].tolist(), plan[2:].tolist()]
