"""The benchmarks' one clock and the statistics of its samples.

* :func:`now` -- the host clock every bench reads (``time.perf_counter``, seconds);
* :class:`DeviceClock` -- times work on a device stream: CUDA events where torch has
  them, else the host clock around the work and a synchronize of the stream; every
  wait bounded;
* :func:`sample_stats` -- p50 / p10 / p90 / min / max / mean of samples in seconds,
  returned in ms; :func:`gbps` -- decimal GB/s.

Timing code returns samples (seconds); statistics are computed here, once.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from ..errors import TransferTimeout

now = time.perf_counter


def sample_stats(samples_s: Sequence[float]) -> dict[str, float | int | None]:
    """p50, p10, p90, min, max and mean of times given in seconds, returned in ms (None without samples)."""
    if len(samples_s) == 0:
        return {"n": 0, "p50_ms": None, "p10_ms": None, "p90_ms": None, "min_ms": None, "max_ms": None,
                "mean_ms": None}
    a = np.asarray(samples_s, dtype=np.float64) * 1e3
    p10, p50, p90 = np.percentile(a, [10, 50, 90])
    return {"n": int(a.size), "p50_ms": float(p50), "p10_ms": float(p10), "p90_ms": float(p90),
            "min_ms": float(a.min()), "max_ms": float(a.max()), "mean_ms": float(a.mean())}


def gbps(nbytes: int, ms: float | None) -> float | None:
    """Decimal GB/s for ``nbytes`` moved in ``ms`` milliseconds (None if the time is unknown or zero)."""
    if ms is None or not ms > 0:
        return None
    return nbytes / (ms * 1e-3) / 1e9


class DeviceClock:
    """Times ``fn`` on ``device``: CUDA events on torch's current stream, or the host clock + synchronize.

    ``tdev`` is the torch device the work runs on; every wait gives up after ``timeout_s`` with
    :class:`TransferTimeout`.
    """

    def __init__(self, plat, device: int, tdev, timeout_s: float):
        self.plat, self.device, self.tdev, self.timeout_s = plat, device, tdev, timeout_s
        self.cuda = tdev.type == "cuda"

    def sync(self, what: str) -> None:
        import torch
        stream = self.plat.current_stream(self.device)
        if not self.plat.synchronize(stream, self.timeout_s):
            raise TransferTimeout(rank=self.device, step=0, flag=f"end of {what}", expected=1, seen=None,
                                  timeout_s=self.timeout_s, what="stream did not drain")
        if self.cuda:
            torch.cuda.synchronize(self.tdev)

    def _wait(self, ev, what: str, trial: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        delay = 1e-5
        while not ev.query():
            if time.monotonic() > deadline:
                raise TransferTimeout(rank=self.device, step=trial, flag=f"end-of-trial event of {what}",
                                      expected=1, seen=0, timeout_s=self.timeout_s)
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def time(self, fn: Callable[[], object], what: str, warmup: int, trials: int) -> list[float]:
        """``warmup`` untimed runs, then ``trials`` timed ones: their times in seconds."""
        import torch
        for _ in range(warmup):
            fn()
        self.sync(what)
        out = []
        for t in range(trials):
            if self.cuda:
                stream = torch.cuda.current_stream(self.tdev)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(stream)
                fn()
                e1.record(stream)
                self._wait(e1, what, t)
                out.append(e0.elapsed_time(e1) * 1e-3)
            else:
                t0 = now()
                fn()
                self.sync(what)
                out.append(now() - t0)
        return out
