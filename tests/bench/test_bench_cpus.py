"""``--cpus`` of the two-rank benchmarks: physical cores read from a (fake) sysfs, one per rank for ``auto``,
explicit sets checked against the process's CPUs with named errors."""
from __future__ import annotations

import os

import pytest

from gpuxfer.bench.cpus import AUTO, auto_cpus, describe, gpu_local_cpus, physical_cores, rank_cpus
from gpuxfer.errors import BadInput


def _sysfs(tmp_path, siblings: dict[int, str]) -> str:
    for cpu, text in siblings.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    return str(tmp_path)


def test_smt_siblings_group_into_cores_and_auto_gives_each_rank_its_own(tmp_path):
    # 4 cores x 2 threads, Linux numbering: CPU c and c + 4 share a core
    sysfs = _sysfs(tmp_path, {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})
    assert physical_cores(range(8), sysfs) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert rank_cpus("auto", 2, available=range(8), sysfs=sysfs) == AUTO     # each rank picks
    ranks = [auto_cpus(r, 2, available=range(8), sysfs=sysfs) for r in (0, 1)]
    assert ranks == [(0, 1, 4, 5), (2, 3, 6, 7)]      # two cores each, no core shared
    assert describe(ranks, AUTO) == ("rank 0 on CPUs 0+1+4+5, rank 1 on CPUs 2+3+6+7 "
                                     "(auto: the fastest, by a Python yardstick, of physical cores of its own "
                                     "near its GPU)")
    # only the CPUs the process may use count; a lone sibling is its core
    assert physical_cores({1, 5, 2}, sysfs) == [(1, 5), (2,)]
    # a range list, and a CPU sysfs says nothing about: a core of its own
    sysfs2 = _sysfs(tmp_path / "b", {0: "0-1", 1: "0-1"})
    assert physical_cores({0, 1, 2}, sysfs2) == [(0, 1), (2,)]


def test_auto_prefers_the_cores_local_to_each_ranks_gpu(tmp_path):
    sysfs = _sysfs(tmp_path, {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})
    pci = tmp_path / "pci" / "0000:1a:00.0"
    pci.mkdir(parents=True)
    (pci / "local_cpulist").write_text("0-1,4-5\n")
    local = gpu_local_cpus("00000000:1A:00.0", str(tmp_path / "pci"))      # NVML's 8-digit domain, upper case
    assert local == {0, 1, 4, 5}
    assert gpu_local_cpus("0000:1b:00.0", str(tmp_path / "pci")) is None
    assert gpu_local_cpus(None, str(tmp_path / "pci")) is None
    # one GPU (both ranks local to cores 0 and 1): distinct cores, both near it
    assert [auto_cpus(r, 2, local, range(8), sysfs) for r in (0, 1)] == [(0, 4), (1, 5)]
    # two GPUs on two nodes: each rank near its own, the picks disjoint
    other = {2, 3, 6, 7}
    assert (auto_cpus(0, 2, local, range(8), sysfs), auto_cpus(1, 2, other, range(8), sysfs)) == ((0, 4), (3, 7))
    # an odd number of cores: parts of 1 and 2, disjoint
    assert [auto_cpus(r, 2, None, {0, 1, 2, 4, 5, 6}, sysfs) for r in (0, 1)] == [(0, 4), (1, 2, 5, 6)]
    # a local set with fewer cores than ranks, or unknown: any cores
    assert auto_cpus(1, 2, {0, 4}, range(8), sysfs) == (2, 3, 6, 7)
    assert auto_cpus(0, 2, None, range(8), sysfs) == (0, 1, 4, 5)


def test_auto_with_fewer_cores_than_ranks_and_none_leave_placement_alone(tmp_path):
    sysfs = _sysfs(tmp_path, {0: "0,1", 1: "0,1"})
    assert rank_cpus("auto", 2, available={0, 1}, sysfs=sysfs) is None
    assert auto_cpus(0, 2, None, {0, 1}, sysfs) is None
    assert rank_cpus("none", 2, available={0, 1}, sysfs=sysfs) is None
    assert describe([[0, 1], [0, 1]], None) == ("rank 0 on CPUs 0+1, rank 1 on CPUs 0+1 "
                                                "(not pinned: the scheduler places them)")


def test_explicit_sets_are_checked(tmp_path):
    avail = {0, 1, 2, 3}
    assert rank_cpus("2,3", 2, available=avail) == [(2,), (3,)]
    assert rank_cpus(" 0+2,1+3 ", 2, available=avail) == [(0, 2), (1, 3)]
    with pytest.raises(BadInput, match=r"--cpus: CPU\(s\) \[9\] are not among"):
        rank_cpus("2,9", 2, available=avail)
    with pytest.raises(BadInput, match="2 ranks need 2 CPU sets, got 1"):
        rank_cpus("2", 2, available=avail)
    with pytest.raises(BadInput, match="auto, none, or one CPU set per rank"):
        rank_cpus("2,x", 2, available=avail)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_this_machine_auto_pins_within_the_process_cpus():
    avail = os.sched_getaffinity(0)
    ranks = [auto_cpus(r, 2) for r in (0, 1)]
    if ranks[0] is not None:
        assert not set(ranks[0]) & set(ranks[1])
        assert set(ranks[0]) | set(ranks[1]) <= avail


def test_the_cpu_yardstick_and_the_current_cpu():
    from gpuxfer.bench.cpus import current_cpu, python_speed_us
    assert python_speed_us(rounds=3, loops=200) > 0
    cpu = current_cpu()
    assert cpu is None or cpu in os.sched_getaffinity(0)


def test_cpu_speed_probe_runs_its_parts():
    """scripts/cpu_speed_probe.py's parts on one CPU (not timed: each returns a positive time)."""
    import importlib.util
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("cpu_speed_probe", os.path.join(root, "scripts", "cpu_speed_probe.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cpus = sorted(os.sched_getaffinity(0))
    try:
        base, tries = mod.alone(cpus[:1], 1)
        assert base[cpus[0]] > 0 and len(tries[cpus[0]]) == 3
        assert all(v > 0 for v in mod.over_time(cpus[0], 2))
    finally:
        os.sched_setaffinity(0, set(cpus))
    assert all(v > 0 for v in mod.threads(calls=200).values())
    assert "median" in mod.clusters([1.0, 2.0, 3.0])
    # p10 and p90 by nearest rank: of ten samples the 1st and the 9th smallest
    assert mod.clusters([float(x) for x in range(10, 0, -1)]).startswith("p10 1.0, median 5.5, p90 9.0,")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_fastest_cpu_measures_each_candidate_and_picks_the_quickest():
    from gpuxfer.bench.cpus import fastest_cpu
    avail = os.sched_getaffinity(0)
    try:
        cpu, us, each = fastest_cpu(avail, passes=1)
        assert set(each) == avail and cpu in avail and us == each[cpu] == min(each.values()) > 0
        with pytest.raises(BadInput, match="at least one CPU"):
            fastest_cpu([])
    finally:
        os.sched_setaffinity(0, avail)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_fastest_cpu_and_pin_never_fail_on_a_refused_or_missing_affinity(monkeypatch):
    """A CPU set the OS refuses (a restricted or changed cpuset) or an OS without CPU affinity (macOS):
    the refused CPUs are left out, and where none is left the thread stays where it was; pin() then leaves it."""
    from gpuxfer.bench import cpus as C
    avail = os.sched_getaffinity(0)
    mine = min(avail)
    real = os.sched_setaffinity

    def refusing(pid, cpus):
        if set(cpus) - {mine}:
            raise OSError(22, "Invalid argument")
        real(pid, cpus)
    monkeypatch.setattr(os, "sched_setaffinity", refusing)
    try:
        cpu, us, each = C.fastest_cpu([mine, mine + 4096], passes=1)
        assert cpu == mine and set(each) == {mine} and us > 0
        cpu, us, each = C.fastest_cpu([mine + 4096], passes=1)
        assert cpu is None and each == {} and us > 0
        assert C.pin((cpu,)) is False and C.pin((mine + 4096,)) is False and C.pin(None) is False
        assert C.pin((mine,)) is True
        monkeypatch.delattr(os, "sched_setaffinity")
        cpu, us, each = C.fastest_cpu([mine], passes=1)
        assert cpu is None and each == {} and us > 0 and C.pin((mine,)) is False
    finally:
        real(0, avail)


def test_machine_line_names_the_usable_cores():
    from gpuxfer.bench.cpus import machine_line
    line = machine_line()
    assert line.startswith(f"{len(os.sched_getaffinity(0))} usable cores of {os.cpu_count()}, ")
