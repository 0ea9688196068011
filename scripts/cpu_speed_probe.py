"""How fast each CPU of this machine runs one busy Python thread, and what slows it (no GPU; a diagnosis aid).

    PYTHONPATH=. python scripts/cpu_speed_probe.py [--json PATH] [--quick]

A host time per step is the time of one busy Python thread, so a step measures the CPU it runs on as much
as the code. This probe times a fixed pure-Python loop (:func:`gpuxfer.bench.cpus.python_speed_us`):

* ``alone``: on each CPU in turn (the process pinned there), three times over the run;
* ``beside``: on each CPU while another process spins on each other CPU: a CPU that runs much slower
  beside one spinning neighbour shares a physical core with it (SMT siblings the VM does not show);
* ``over time``: on one CPU, many short windows: two clusters mean the CPU itself changes speed
  (the hypervisor's scheduling, steal, clock);
* ``threads``: a loop of ctypes calls that release the GIL (as the driver calls of a step do), alone and
  beside a second Python thread that wakes every 20 ms (as the pp watchdog does while a transport has
  steps in flight) or spins: what a GIL hand-off per call costs;
* the steal time of each CPU over the run (``/proc/stat``).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import threading
import time

from gpuxfer.bench.cpus import python_speed_us
from gpuxfer.bench.report import nearest_rank


def _pin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    time.sleep(0.002)       # let the scheduler move us


def _spin(cpu: int, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    x = 0
    while not stop.is_set():
        for i in range(10000):
            x += i


def _steal() -> dict[int, int]:
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                parts = line.split()
                out[int(parts[0][3:])] = int(parts[8])      # steal, in USER_HZ ticks
    return out


def _speed(rounds: int) -> float:
    return python_speed_us(rounds=rounds, loops=1000)


def alone(cpus, rounds: int) -> dict:
    out = {c: [] for c in cpus}
    for _ in range(3):
        for c in cpus:
            _pin(c)
            out[c].append(_speed(rounds))
    return {c: statistics.median(v) for c, v in out.items()}, out


def beside(cpus, rounds: int, base: dict) -> dict:
    """slowdown[a][b]: speed on b with a spinner on a, over b alone."""
    ctx = mp.get_context("fork")       # no threads run yet here: a fork is cheap and safe
    slow = {}
    for a in cpus:
        stop = ctx.Event()
        p = ctx.Process(target=_spin, args=(a, stop), daemon=True)
        p.start()
        time.sleep(0.05)
        row = {}
        for b in cpus:
            if b != a:
                _pin(b)
                row[b] = _speed(rounds) / base[b]
        stop.set()
        p.join(5)
        if p.is_alive():
            p.kill()
        slow[a] = row
    return slow


def over_time(cpu: int, windows: int) -> list[float]:
    _pin(cpu)
    out = []
    for _ in range(windows):
        out.append(_speed(3))
        time.sleep(0.005)
    return out


def threads(calls: int = 20000) -> dict:
    """us per ctypes call that releases the GIL: alone, beside a thread waking every 20 ms, beside a spinner."""
    libc = ctypes.CDLL(None)
    fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.cast(libc.getpid, ctypes.c_void_p).value)

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6

    out = {"alone_us": statistics.median(loop() for _ in range(3))}
    stop = threading.Event()

    def waker():
        while not stop.wait(0.02):
            sum(range(2000))        # ~50 us of Python, as a watchdog poll

    def spinner():
        while not stop.is_set():
            sum(range(2000))
    for name, target in (("beside_20ms_waker_us", waker), ("beside_spinning_thread_us", spinner)):
        stop.clear()
        th = threading.Thread(target=target, daemon=True)
        th.start()
        out[name] = statistics.median(loop() for _ in range(3))
        stop.set()
        th.join(5)
    return out


def clusters(values: list[float]) -> str:
    v = sorted(values)
    lo, hi = nearest_rank(v, 0.1), nearest_rank(v, 0.9)
    return f"p10 {lo:.1f}, median {statistics.median(v):.1f}, p90 {hi:.1f}, max/min {v[-1] / v[0]:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a CPU-starved machine)")
    args = ap.parse_args()
    rounds = 5 if args.quick else 20
    cpus = sorted(os.sched_getaffinity(0))
    steal0 = _steal()
    t0 = time.monotonic()
    res = {"cpus": cpus}
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        res["model"] = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
                            None)
        res["mhz"] = [float(ln.split(":", 1)[1]) for ln in info.splitlines() if ln.startswith("cpu MHz")]
    except OSError:
        pass
    base, tries = alone(cpus, rounds)
    res["alone_us"], res["alone_tries_us"] = base, tries
    print(f"# {len(cpus)} CPUs, {res.get('model')}; MHz now {sorted(set(round(m) for m in res.get('mhz', [])))}")
    print("# alone (us per yardstick, median of 3 tries; each try the median of "
          f"{rounds}): " + ", ".join(f"cpu{c} {base[c]:.1f}" for c in cpus))
    spread = [max(v) / min(v) for v in tries.values()]
    print(f"# alone: slowest/fastest CPU {max(base.values()) / min(base.values()):.2f}; "
          f"worst try-to-try spread on one CPU {max(spread):.2f}")
    res["over_time_us"] = ot = over_time(cpus[len(cpus) // 2], 100 if args.quick else 300)
    print(f"# over time, cpu{cpus[len(cpus) // 2]}, windows 5 ms apart: {clusters(ot)}")
    if len(cpus) > 1:
        sl = beside(cpus, rounds, base)
        res["beside_slowdown"] = {str(a): {str(b): r for b, r in row.items()} for a, row in sl.items()}
        pairs = sorted(((r, a, b) for a, row in sl.items() for b, r in row.items()), reverse=True)
        print("# beside a spinner on another CPU, the 8 worst (slowdown, spinner cpu -> timed cpu): "
              + ", ".join(f"{r:.2f} cpu{a}->cpu{b}" for r, a, b in pairs[:8]))
        allr = [r for r, _, _ in pairs]
        print(f"# beside a spinner, all pairs: {clusters(allr)}; pairs slowed > 1.3x: "
              f"{sum(r > 1.3 for r in allr)} of {len(allr)}")
    os.sched_setaffinity(0, set(cpus))
    res["threads"] = th = threads()
    print("# ctypes call releasing the GIL (us per call): " + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in th.items()))
    steal1 = _steal()
    el = time.monotonic() - t0
    res["steal_pct"] = {c: (steal1.get(c, 0) - steal0.get(c, 0)) / os.sysconf("SC_CLK_TCK") / el * 100 for c in cpus}
    print(f"# steal over {el:.1f} s (% of each CPU): "
          + ", ".join(f"cpu{c} {v:.1f}" for c, v in res["steal_pct"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
