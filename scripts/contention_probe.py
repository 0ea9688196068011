"""What slows a matmul down: each kind of transfer work alone, next to a bf16 matmul loop on GPU 0.

    PYTHONPATH=. python3 scripts/contention_probe.py [--json PATH]

A tuning aid for the stage hand-off's SM-contention target (not a test). The
matmul loop runs on one stream; another stream of the same process runs, back to
back for the loop's length, one kind of work at a time: local device-to-device
copies on copy engines, peer copies to GPU 1, stream flag writes and waits, an
SM copy kernel. Prints the matmul's TFLOP/s next to each, against alone, and what
NVML saw on GPU 0 meanwhile (median SM clock, mean power, the clock-event reasons
seen), to tell a loss to shared SMs from a loss to a lower clock under the power cap.
"""
from __future__ import annotations

import argparse
import json
import threading
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192, help="matmul size")
    ap.add_argument("--ms", type=float, default=400.0, help="length of the matmul loop alone")
    ap.add_argument("--size", type=int, default=16 << 20, help="bytes per copy")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from gpuxfer.platforms import get_platform
    plat = get_platform("cuda")
    torch.cuda.set_device(0)
    n, size = args.n, args.size
    a = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda:0", dtype=torch.bfloat16)
    comp, other = plat.create_stream(0), plat.create_stream(0)
    src = plat.alloc(size, 0)
    dst = plat.alloc(size, 0)
    peer = plat.alloc(size, 1) if plat.device_count() > 1 else None
    flags = plat.alloc(4096, 0)
    plat.memset_async(other, flags.ptr, 0, 4096)
    xs = torch.empty(size, dtype=torch.uint8, device="cuda:0")
    xd = torch.empty(size, dtype=torch.uint8, device="cuda:0")
    plat.synchronize(other, 30)

    def matmuls(k: int):
        with torch.cuda.stream(comp.torch):
            for _ in range(k):
                torch.mm(a, b, out=c)
        return plat.record_event(comp)

    sampler = _Sampler(0)

    def run(k: int, work=None) -> float:
        torch.cuda.synchronize()
        sampler.start()
        t0 = time.perf_counter()
        ev = matmuls(k)
        i = 0
        while work is not None and not plat.event_query(ev):
            for _ in range(8):
                i += 1
                work(i)
            if i % 64 == 0:          # keep the queue of copies short
                plat.synchronize(other, 60)
        plat.event_wait(ev, 300)
        el = time.perf_counter() - t0
        sampler.stop()
        torch.cuda.synchronize()
        return el

    run(4)
    probe = run(8)
    k = max(8, int(args.ms / 1e3 / (probe / 8)))
    flops = 2.0 * n ** 3 * k

    def local_ce(i):
        plat.copy_async(other, dst.ptr, src.ptr, size)

    def peer_ce(i):
        plat.copy_async(other, peer.ptr, src.ptr, size)

    def flags_only(i):
        plat.write_flag(other, flags.ptr, i)
        plat.wait_flag(other, flags.ptr, i)

    def sm_copy(i):
        with torch.cuda.stream(other.torch):
            xd.copy_(xs)

    cases = {"alone": None, "local ce copy": local_ce, "flag write+wait": flags_only, "sm copy kernel": sm_copy}
    if peer is not None:
        cases["peer ce copy"] = peer_ce
    out = {"matmul_n": n, "matmuls": k, "copy_bytes": size}
    alone = []
    nvml = {}
    for name, work in cases.items():
        el = run(k, work)
        if work is None:
            alone.append(el)
        out[name] = flops / el / 1e12
        nvml[name] = sampler.summary()
    alone.append(run(k))
    out["alone"] = flops / min(alone) / 1e12
    out["nvml"] = nvml
    for name in cases:
        loss = (1 - out[name] / out["alone"]) * 100
        print(f"{name:18s} {out[name]:8.1f} TFLOP/s  loss {loss:6.1f}%   {nvml[name]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    for m in (src, dst, peer, flags):
        if m is not None:
            m.close()
    plat.close()
    return 0


class _Sampler:
    """NVML on one GPU every 5 ms while a case runs: SM clock, power, clock-event reasons."""

    def __init__(self, index: int):
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nv, self._h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # noqa: BLE001 - the probe runs without it
            print(f"NVML unavailable: {exc}")
            self._nv = None
        self._samples: list = []
        self._stop = None

    def _reasons(self) -> int:
        nv = self._nv
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(self._h))

    def start(self) -> None:
        self._samples = []
        if self._nv is None:
            return
        self._stop = threading.Event()

        def loop():
            nv, h = self._nv, self._h
            while not self._stop.is_set():
                self._samples.append((nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                      nv.nvmlDeviceGetPowerUsage(h) / 1e3, self._reasons()))
                self._stop.wait(0.005)
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join(5)

    def summary(self) -> dict:
        if not self._samples:
            return {}
        clocks = sorted(c for c, _, _ in self._samples)
        reasons = 0
        for _, _, r in self._samples:
            reasons |= r
        return {"sm_mhz_median": clocks[len(clocks) // 2], "power_w_mean": round(
            sum(p for _, p, _ in self._samples) / len(self._samples), 1), "clock_event_reasons": hex(reasons),
            "samples": len(self._samples)}


if __name__ == "__main__":
    raise SystemExit(main())
