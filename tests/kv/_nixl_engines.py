"""Plain helpers of the NIXL / Mooncake engine tests: descriptor tables for hypothesis, two engines over
the fakes on two threads of one process, two engines in two processes, and the fake Mooncake library.

Both sides of an in-process pair run in this process, one thread each, each with its own host platform
and pool; Side.exchange is an all-gather over a barrier. The fake NIXL copies with memmove, so the
bytes really move; the pack kernel is the reference copy (torch on the CPU).
"""
from __future__ import annotations

import ctypes
import threading
import types

import numpy as np
from hypothesis import strategies as st

from _spawn import on_threads
from gpuxfer.bench.kv.engines import DescriptorBurst, Role, Side
from gpuxfer.bench.kv.engines import mooncake as me
from gpuxfer.bench.kv.engines import nixl as ne
from gpuxfer.kv import nixl_ffi as nf
from gpuxfer.platforms.base import Memory


def descriptor_tables(max_n=40):
    @st.composite
    def build(draw):
        n = draw(st.integers(0, max_n))
        sizes = draw(st.lists(st.integers(1, 1 << 20), min_size=n, max_size=n))
        src = draw(st.lists(st.integers(0, 1 << 40), min_size=n, max_size=n))
        dst = draw(st.lists(st.integers(0, 1 << 40), min_size=n, max_size=n))
        return np.array(list(zip(src, dst, sizes)), dtype=np.int64).reshape(-1, 3)
    return build()


class PeerAlias(Memory):
    """The peer's pool as seen from the other thread (same process: no IPC mapping needed)."""

    def __init__(self, buf):
        self.platform, self.device, self.ptr, self.nbytes = buf.platform, buf.device, buf.ptr, buf.nbytes

    def _release(self):
        pass


class Exchange:
    def __init__(self, n=2):
        self.slots = [None] * n
        self.barrier = threading.Barrier(n, timeout=30)

    def __call__(self, rank):
        def exchange(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return exchange


def reference_kernels():
    """The reference copy (torch on the CPU) in place of the Triton launchers, with their bounds check."""
    def check_copy(src_t, dst_t, desc_t):
        for s, d, n in desc_t.tolist():
            assert 0 <= s and s + n <= src_t.numel() and 0 <= d and d + n <= dst_t.numel(), (s, d, n)

    def copy_descriptors(src_t, dst_t, desc_t, *, validate=True, nbytes_hint=None):
        if validate:
            check_copy(src_t, dst_t, desc_t)
        for s, d, n in desc_t.tolist():
            dst_t[d:d + n] = src_t[s:s + n]
    return types.SimpleNamespace(copy_descriptors=copy_descriptors, check_copy=check_copy)


def fake_kernels(monkeypatch):
    monkeypatch.setattr(ne, "kernels", reference_kernels)
    monkeypatch.setattr(ne, "kernel_reason", lambda platform: None)


def random_requests(rng, pool_bytes, n_req, n_desc, max_len):
    reqs = []
    for _ in range(n_req):
        n = rng.integers(1, max_len, n_desc)
        s = rng.integers(0, pool_bytes - max_len, n_desc)
        d = rng.permutation(pool_bytes // max_len - 1)[:n_desc] * max_len   # disjoint destinations
        reqs.append(np.stack([s, d, n], axis=1).astype(np.int64))
    # destinations disjoint across requests too
    cat = np.concatenate(reqs)
    order = np.random.default_rng(1).permutation(pool_bytes // max_len - 1)[:len(cat)] * max_len
    cat[:, 1] = order
    out, i = [], 0
    for r in reqs:
        out.append(cat[i:i + len(r)])
        i += len(r)
    return out


def run_engine_pair(engine_name, direction, *, pool_bytes=1 << 18, bursts=2, n_req=3, stage_bytes=None,
                     timeout_s=20.0):
    from gpuxfer.bench.kv.engines import engine_class
    from gpuxfer.platforms.host import HostPlatform
    cls = engine_class(engine_name)
    plats = [HostPlatform(), HostPlatform()]
    pools = [plats[r].alloc(pool_bytes, r) for r in range(2)]
    ex = Exchange()
    rng = np.random.default_rng(7)
    src_np = np.frombuffer((ctypes.c_uint8 * pool_bytes).from_address(pools[0].ptr), dtype=np.uint8)
    dst_np = np.frombuffer((ctypes.c_uint8 * pool_bytes).from_address(pools[1].ptr), dtype=np.uint8)
    src_np[:] = rng.integers(0, 256, pool_bytes, dtype=np.uint8)
    sides = [Side(plats[r], r, r, Role.SOURCE if r == 0 else Role.DESTINATION, pools[r], PeerAlias(pools[1 - r]),
                  ex(r), timeout_s=timeout_s) for r in range(2)]
    try:
        engines = on_threads([lambda r=r: cls(sides[r]) for r in range(2)])
        try:
            if stage_bytes:
                assert all(e.round_bytes == stage_bytes for e in engines)
            stats = []
            for b in range(bursts):          # a row: prepare once, several bursts (as the runner does), release
                reqs = random_requests(rng, pool_bytes, n_req, 40, 2048)
                burst = DescriptorBurst(reqs)
                ps = on_threads([lambda r=r: engines[r].prepare(burst, direction) for r in range(2)])
                passive = 0 if direction == "pull" else 1
                for _ in range(3):
                    dst_np[:] = 0
                    engines[passive].post(ps[passive])
                    engines[1 - passive].post(ps[1 - passive])
                    on_threads([lambda r=r: engines[r].wait(ps[r]) for r in range(2)])
                    for s, d, n in engines[1].verify_descriptors(burst).tolist():
                        np.testing.assert_array_equal(dst_np[d:d + n], src_np[s:s + n])
                extra = [getattr(e, "row_extra", dict)() for e in engines]   # as the runner: before release
                for r in range(2):
                    engines[r].release(ps[r])
                stats.append(extra[1 - passive])
                assert extra[passive] == {}
            return engines, stats
        finally:
            for e in engines:
                e.close()
                e.close()
    finally:
        for p in pools:
            p.close()
        for p in plats:
            p.close()


def two_proc_child(rank, engine_name, direction, platform_name, q_out, q_in, seed, bursts, pool_bytes, patch_kernels):
    import os as _os
    if patch_kernels:
        _os.environ["GPUXFER_NIXL_PACK_STAGE_BYTES"] = str(64 << 10)
    from gpuxfer.bench.kv.engines import nixl as _ne
    from gpuxfer.bench.kv.engines import DescriptorBurst as _Burst, Role as _Role, Side as _Side, engine_class
    from gpuxfer.platforms import get_platform
    if patch_kernels:  # the reference copy in place of the Triton kernel (host emulation)
        _ne.kernels = reference_kernels
        _ne.kernel_reason = lambda platform: None

    def exchange(obj):
        q_out.put(obj)
        peer = q_in.get(timeout=60)
        return [obj, peer] if rank == 0 else [peer, obj]

    plat = get_platform(platform_name)
    dev = rank if plat.device_count() > 1 else 0
    plat.set_device(dev)
    pool = plat.alloc(pool_bytes, dev)
    peer_pool = None
    try:
        handles = exchange(pool.export())
        peer_pool = plat.open_handle(handles[1 - rank], dev)
        view = plat.as_tensor(pool)
        rng = np.random.default_rng(seed)
        content = rng.integers(0, 256, pool_bytes, dtype=np.uint8)
        import torch
        view.copy_(torch.from_numpy(content if rank == 0 else np.zeros(pool_bytes, np.uint8)).to(view.device))
        if not plat.is_emulation:
            torch.cuda.synchronize(dev)
        side = _Side(plat, dev, rank, _Role.SOURCE if rank == 0 else _Role.DESTINATION, pool, peer_pool,
                     exchange, timeout_s=60.0)
        eng = engine_class(engine_name)(side)
        results = []
        try:
            passive = 0 if direction == "pull" else 1
            for b in range(bursts):       # a row: prepare once, bursts, release (as the runner does)
                reqs = random_requests(np.random.default_rng(seed + 1 + b), pool_bytes, 2, 64, 4096)
                burst = _Burst(reqs)
                p = eng.prepare(burst, direction)
                wrong = 0
                for _ in range(3):
                    exchange("prepared")
                    if rank == passive:
                        eng.post(p)
                    exchange("passive posted")
                    if rank != passive:
                        eng.post(p)
                    eng.wait(p)
                    exchange("waited")
                    if rank == 1:
                        got = view.cpu().numpy()
                        wrong += sum(int((got[d:d + n] != content[s:s + n]).sum())
                                     for s, d, n in eng.verify_descriptors(burst).tolist())
                        view.zero_()
                        if not plat.is_emulation:
                            torch.cuda.synchronize(dev)
                    exchange("verified")
                eng.release(p)
                results.append(wrong)
            return {"wrong": results, "extra": eng.row_extra()}
        finally:
            eng.close()
    finally:
        if peer_pool is not None:
            peer_pool.close()
        pool.close()
        plat.close()


def run_two_processes(spawner, engine, direction, platform_name, *, patch_kernels, bursts=2, pool_bytes=1 << 20):
    q01, q10 = spawner.queue(), spawner.queue()
    kids = [spawner.start(two_proc_child, 0, engine, direction, platform_name, q01, q10, 11, bursts, pool_bytes,
                          patch_kernels, name="source"),
            spawner.start(two_proc_child, 1, engine, direction, platform_name, q10, q01, 11, bursts, pool_bytes,
                          patch_kernels, name="destination")]
    out = [k.result(timeout=240) for k in kids]
    for k in kids:
        k.join(timeout=30)
    return out


def two_gpus_reason() -> str | None:
    try:
        import torch
        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            return "needs 2 CUDA GPUs"
    except Exception as exc:  # noqa: BLE001
        return f"torch: {exc}"
    from gpuxfer.platforms import unavailable_reason
    why = unavailable_reason("cuda")
    return f"cuda platform: {why}" if why else nf.nixl_unavailable_reason()


class FakeMooncake:
    """``mooncake.engine.TransferEngine`` in one process: sessions find each other in a registry."""

    def __init__(self, *, init_rc=0, stuck=False, fail_rc=0):
        self.sessions: dict[str, "object"] = {}
        self.calls: list[tuple] = []
        fake = self

        class TransferEngine:
            def __init__(self):
                self.regions, self.port = [], None

            def initialize(self, hostname, metadata, protocol, device):
                fake.calls.append(("initialize", metadata, protocol, device))
                if init_rc == 0:
                    self.port = 5000 + len(fake.sessions)
                    fake.sessions[f"{hostname.split(':')[0]}:{self.port}"] = self
                return init_rc

            def get_rpc_port(self):
                return self.port

            def register_memory(self, ptr, n):
                fake.calls.append(("register_memory", n))
                self.regions.append((ptr, n))
                return 0

            def unregister_memory(self, ptr):
                fake.calls.append(("unregister_memory",))
                return 0

            def _move(self, session, local, remote, lengths, read):
                assert len(local) <= me.BATCH_CAP and len(local) == len(remote) == len(lengths)
                assert all(isinstance(x, int) for x in local + remote + lengths)
                peer = fake.sessions[session]
                for la, ra, n in zip(local, remote, lengths):
                    assert any(a <= la and la + n <= a + m for a, m in self.regions)
                    assert any(a <= ra and ra + n <= a + m for a, m in peer.regions)
                    ctypes.memmove(la, ra, n) if read else ctypes.memmove(ra, la, n)
                if stuck:
                    import time
                    time.sleep(2)
                return fail_rc

            def batch_transfer_sync_read(self, session, local, remote, lengths):
                fake.calls.append(("read", len(local)))
                return self._move(session, local, remote, lengths, True)

            def batch_transfer_sync_write(self, session, local, remote, lengths):
                fake.calls.append(("write", len(local)))
                return self._move(session, local, remote, lengths, False)

        self.TransferEngine = TransferEngine


def hostile_results(engine_name: str) -> dict:
    """What ``prepare`` says on each side of ``engine_name`` (over the fakes) for every hostile burst of
    test_kv_faults, both directions."""
    from test_kv_faults import HOSTILE, POOL, _hostile_burst

    from gpuxfer.bench.kv.engines import engine_class
    from gpuxfer.platforms.host import HostPlatform
    cls = engine_class(engine_name)
    plats = [HostPlatform(), HostPlatform()]
    pools = [plats[r].alloc(POOL, r) for r in range(2)]
    ex = Exchange()
    sides = [Side(plats[r], r, r, Role.SOURCE if r == 0 else Role.DESTINATION, pools[r], PeerAlias(pools[1 - r]),
                  ex(r), timeout_s=20.0) for r in range(2)]
    out = {}
    try:
        engines = on_threads([lambda r=r: cls(sides[r]) for r in range(2)])
        try:
            for direction in ("pull", "push"):
                for case, rows in HOSTILE.items():
                    for r in range(2):
                        try:
                            engines[r].release(engines[r].prepare(_hostile_burst(rows), direction))
                            out[(direction, case, r)] = "accepted"
                        except Exception as exc:  # noqa: BLE001 - reported to the test
                            out[(direction, case, r)] = f"{type(exc).__name__}: {exc}"
        finally:
            for e in engines:
                e.close()
    finally:
        for p in (*pools, *plats):
            p.close()
    return out
