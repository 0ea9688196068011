"""Which CPUs each rank of a two-process benchmark runs on (``--cpus``).

Host time per step is the time of one busy Python thread. Two ranks that spin
on the two hardware threads of one physical core (SMT siblings) each run
slower than on cores of their own, and where the scheduler puts them changes
from run to run, so the same step can measure two different host times.
A virtual machine's CPUs also differ among themselves and over time (on the
lent H200 machine half of them ran one busy Python thread about 2x slower
than the others, alone: ``scripts/cpu_speed_probe.py``). ``auto`` gives each
rank physical cores of its own (every hardware thread of them), never one the
other rank also runs on: of the cores local to the rank's GPU where sysfs says
which (a driver call from a far NUMA node costs more), rank r of n takes the
r-th n-th part; then it runs a pure-Python yardstick on each of them
(:func:`fastest_cpu`) and pins itself to the fastest one (``bench pp`` picks
again before each paced host-time loop: a vCPU's speed changes within seconds); ``none`` leaves
placement to the scheduler; a list names each rank's CPUs (``2,3``: rank 0 on
CPU 2, rank 1 on CPU 3; ``2+10,3+11``: two CPUs each).

A rank pins itself (:func:`pin`, or :func:`pin_auto` once it knows its GPU)
before its timed work: threads it starts later (the watchdog, torch's) inherit
the set.
"""
from __future__ import annotations

import logging
import os

from ..errors import BadInput

SYSFS_CPUS = "/sys/devices/system/cpu"
SYSFS_PCI = "/sys/bus/pci/devices"
log = logging.getLogger("gpuxfer.bench")

AUTO = "auto"       # resolved by each rank (:func:`auto_cpus`), which knows its GPU
#: ``--cpus``'s help, one text for every benchmark that has the option
HELP = ("each rank's CPUs: auto (the fastest, by a Python yardstick, of physical cores of its own near its GPU: "
        "two spinning ranks never share one), none (the scheduler places them), or one set per rank: 2,3 or "
        "2+10,3+11")


def _parse_list(text: str) -> list[int]:
    """A sysfs CPU list (``0-3,8,10-11``) as CPU numbers."""
    out = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def physical_cores(cpus, sysfs: str = SYSFS_CPUS) -> list[tuple[int, ...]]:
    """``cpus`` grouped by physical core (the SMT siblings of each, from sysfs), ordered by their first
    CPU; a CPU whose siblings sysfs does not give is a core of its own."""
    cpus = set(cpus)
    cores: dict[tuple[int, ...], None] = {}
    for c in sorted(cpus):
        try:
            with open(os.path.join(sysfs, f"cpu{c}", "topology", "thread_siblings_list")) as f:
                sib = tuple(x for x in _parse_list(f.read()) if x in cpus) or (c,)
        except (OSError, ValueError):
            sib = (c,)
        cores.setdefault(sib if c in sib else (c,), None)
    return sorted(cores, key=lambda t: t[0])


def rank_cpus(spec: str | None, world: int, available=None, sysfs: str = SYSFS_CPUS,
              option: str = "--cpus") -> list[tuple[int, ...]] | None:
    """Each rank's CPUs for ``spec`` (a list, see the module docstring), :data:`AUTO` (each rank picks,
    :func:`auto_cpus`), or None where the ranks are not pinned (``none``; ``auto`` with fewer physical
    cores than ranks)."""
    spec = "auto" if spec is None else str(spec).strip()
    if available is None:
        available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    available = set(available)
    if spec == "none":
        return None
    if spec == "auto":
        return AUTO if len(physical_cores(available, sysfs)) >= world else None
    ranks = []
    for part in spec.split(","):
        try:
            cpus = tuple(int(x) for x in part.split("+"))
        except ValueError:
            raise BadInput(f"{option}: auto, none, or one CPU set per rank (CPU numbers joined by '+', the sets "
                           f"by ','), got {spec!r}") from None
        bad = [c for c in cpus if c not in available]
        if bad:
            raise BadInput(f"{option}: CPU(s) {bad} are not among this process's CPUs "
                           f"{_fmt(sorted(available))}")
        ranks.append(cpus)
    if len(ranks) != world:
        raise BadInput(f"{option}: {world} ranks need {world} CPU sets, got {len(ranks)} in {spec!r}")
    return ranks


def gpu_local_cpus(pci_bus_id: str | None, sysfs_pci: str = SYSFS_PCI) -> set[int] | None:
    """The CPUs sysfs calls local to the PCI device ``pci_bus_id`` (``0000:1a:00.0``), or None."""
    try:
        dom, bus, devfn = str(pci_bus_id).split(":")
        name = f"{int(dom, 16):04x}:{bus.lower()}:{devfn.lower()}"
        with open(os.path.join(sysfs_pci, name, "local_cpulist")) as f:
            return set(_parse_list(f.read())) or None
    except (OSError, ValueError):
        return None


def auto_cpus(rank: int, world: int, local: set[int] | None = None, available=None,
              sysfs: str = SYSFS_CPUS) -> tuple[int, ...] | None:
    """``rank``'s CPUs for ``auto``: of the physical cores of ``available`` (the process's CPUs), those
    whose CPUs are all in ``local`` (the rank's GPU's, where there are ``world`` of them), the
    ``rank``-th of ``world`` equal parts. Every rank computes this alone: ranks whose GPUs share the
    local cores get disjoint parts, ranks on different NUMA nodes parts of disjoint sets."""
    if available is None:
        available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    cores = physical_cores(available, sysfs)
    near = [c for c in cores if local and set(c) <= local]
    cores = near if len(near) >= world else cores
    if len(cores) < world:
        return None
    part = cores[len(cores) * rank // world:len(cores) * (rank + 1) // world]
    return tuple(sorted(c for core in part for c in core))


def _fmt(cpus) -> str:
    return "+".join(str(c) for c in cpus)


def describe(by_rank, spec=None) -> str:
    """``rank 0 on CPUs 6+14, rank 1 on CPUs 7+15 (--cpus auto)``: each rank's CPUs as it ran, and how
    they were chosen (``spec``: :data:`AUTO`, a list of sets, or None for the scheduler)."""
    how = ("auto: the fastest, by a Python yardstick, of physical cores of its own near its GPU" if spec == AUTO else
           "not pinned: the scheduler places them" if spec is None else "as named")
    return ", ".join(f"rank {r} on CPU{'s' if c is None or len(c) > 1 else ''} {_fmt(c) if c else '?'}"
                     for r, c in enumerate(by_rank)) + f" ({how})"


def machine_line() -> str:
    """``"N usable cores of M, <CPU model>"``: the CPUs a benchmark's preamble names."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"{len(os.sched_getaffinity(0))} usable cores of {os.cpu_count()}, {model}"


def current_cpu() -> int | None:
    """The CPU the calling thread runs on now (``sched_getcpu``), or None where unknown."""
    global _getcpu
    if _getcpu is None:
        try:
            import ctypes
            fn = ctypes.CDLL(None, use_errno=True).sched_getcpu
            fn.restype = ctypes.c_int
            _getcpu = fn
        except (OSError, AttributeError):
            _getcpu = False
    if not _getcpu:
        return None
    cpu = _getcpu()
    return cpu if cpu >= 0 else None


_getcpu = None


def python_speed_us(rounds: int = 5, loops: int = 1000) -> float:
    """A yardstick of this thread's CPU speed: the median time (us) of a fixed pure-Python loop of
    ``loops`` iterations over ``rounds`` tries. Beside a host time it tells a slow step from a slow CPU
    (the same loop takes longer on a core shared with another busy hardware thread, or a slower clock)."""
    import statistics
    import time
    clock, per = time.perf_counter, []
    for _ in range(rounds):
        t0 = clock()
        x = 0
        for i in range(loops):
            x += i & 7
        per.append(clock() - t0)
    return statistics.median(per) * 1e6


def fastest_cpu(cpus, passes: int = 3) -> tuple[int | None, float, dict[int, float]]:
    """Of ``cpus``, the CPU :func:`python_speed_us` runs fastest on now, each measured ``passes`` times (the
    median kept) with the calling thread pinned there, in turns: ``(cpu, its us, {cpu: us})``. The thread is
    left on the last CPU measured: pin it after. A CPU the OS refuses (a restricted or changed CPU set) is left
    out; where none is left, or the OS has no CPU affinity (macOS), ``(None, us where the thread runs, {})``
    and the thread keeps its CPUs: a run never fails for its placement."""
    import statistics
    cpus = sorted(cpus)
    if not cpus:
        raise BadInput("fastest_cpu needs at least one CPU")
    setaffinity = getattr(os, "sched_setaffinity", None)
    before = os.sched_getaffinity(0) if setaffinity is not None else None
    times: dict[int, list[float]] = {}
    refused: set[int] = set() if setaffinity is not None else set(cpus)
    for _ in range(max(1, passes)):
        for c in cpus:
            if c in refused:
                continue
            try:
                setaffinity(0, {c})
            except OSError:
                refused.add(c)
                continue
            python_speed_us(rounds=1, loops=200)        # settle on the CPU
            times.setdefault(c, []).append(python_speed_us(rounds=3))
    if not times:
        pin(before)
        return None, python_speed_us(), {}
    each = {c: statistics.median(v) for c, v in times.items()}
    best = min(each, key=each.__getitem__)
    return best, each[best], each


def pin(cpus) -> bool:
    """Pin the calling thread (and the threads it starts later) to ``cpus`` (None, or no CPU: leave it); False
    where it stays where it was (no CPU affinity on this OS, or the OS refused the set: logged)."""
    cpus = set() if cpus is None else {c for c in cpus if c is not None}
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        log.warning("cannot pin to CPU(s) %s (%s): placement left to the scheduler", _fmt(sorted(cpus)), exc)
        return False
    return True


def pin_auto(rank: int, world: int, pci_bus_id: str | None) -> tuple[tuple[int, ...] | None, dict | None]:
    """``auto``, the rank's GPU known (``pci_bus_id``; None: no locality): its part of the physical cores
    (:func:`auto_cpus`), the thread pinned to the fastest of them by a Python yardstick (:func:`fastest_cpu`).
    Returns ``(the part, {"cpu", "python_us", "candidates_python_us"})``, or ``(None, None)`` where the rank
    stays where it was (too few cores, no CPU affinity, or the OS refused every CPU of the part)."""
    part = auto_cpus(rank, world, gpu_local_cpus(pci_bus_id))
    pick = pin_fastest(part)
    return (None, None) if pick is None else (part, pick)


def pin_fastest(part) -> dict | None:
    """The calling thread pinned to the fastest of ``part`` (:func:`fastest_cpu`): ``{"cpu", "python_us",
    "candidates_python_us"}``, or None where it stays where it was (no part, no CPU affinity, or the OS refused)."""
    if part is None or not hasattr(os, "sched_setaffinity"):
        return None
    cpu, us, each = fastest_cpu(part)
    if not pin((cpu,)):
        return None
    return {"cpu": cpu, "python_us": us, "candidates_python_us": {str(c): v for c, v in each.items()}}
