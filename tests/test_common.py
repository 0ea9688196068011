"""The helpers the three benchmarks share: size parsing and the versions a run reports."""
from __future__ import annotations

import os
import time

import pytest
from _orphans import backdate, gone_pid

from gpuxfer.common import SHM_ORPHAN_AGE_S, parse_size, run_versions
from gpuxfer.errors import BadInput


@pytest.mark.parametrize("text,value", [("16K", 16384), ("16KiB", 16384), ("256M", 256 << 20), ("1GB", 10 ** 9),
                                        ("2GiB", 2 << 30), ("1.5K", 1536), ("4096", 4096), ("64b", 64)])
def test_parse_size_bytes(text, value):
    assert parse_size(text, option="--pool", kind="bytes") == value


@pytest.mark.parametrize("text", ["0", "-5", "foo", "1.0001K", "16Q", ""])
def test_parse_size_bad_input_names_the_option(text):
    with pytest.raises(BadInput, match="--pool"):
        parse_size(text, option="--pool", kind="bytes")


def test_pp_bench_sizes_use_the_shared_parser():
    from gpuxfer.cli import build_parser
    from gpuxfer.errors import BadInput
    from gpuxfer.bench.pp.cli import _options

    def opts(*argv):
        return _options(build_parser().parse_args(["bench", "pp", "--platform", "host", *argv]))
    assert opts("--min-size", "16KiB", "--max-size", "32K")["sizes"] == [16384, 32768]
    for bad in ("0", "-5", "lots"):
        with pytest.raises(BadInput, match="--min-size"):
            opts("--min-size", bad)


class _Plat:
    def __init__(self, versions):
        self._v = versions

    def versions(self):
        if isinstance(self._v, Exception):
            raise self._v
        return self._v


def test_run_versions_lists_libraries_and_platform():
    v = run_versions(_Plat({"driver": 13000}))
    assert {"gpuxfer", "python", "numpy", "torch", "triton"} <= set(v)
    assert v["driver"] == "13000"


def test_run_versions_says_when_the_platform_cannot_tell():
    v = run_versions(_Plat(RuntimeError("no driver")))
    assert "no driver" in v["platform versions"] and v["torch"]


def test_package_version_reads_metadata():
    from importlib import metadata

    from gpuxfer.common import package_version
    assert package_version("numpy") == metadata.version("numpy")
    assert package_version("no-such-dist-gpuxfer", "numpy") == metadata.version("numpy")   # the first installed
    assert package_version("no-such-dist-gpuxfer") is None


def test_sweep_skips_a_name_whose_pid_no_process_can_have(tmp_path):
    """A name of a swept pattern whose pid is past any pid (8 hex digits, >= 2**31: any user can make one) is
    left alone, and the sweep still removes the names of creators gone."""
    from gpuxfer.common import sweep_shm_orphans
    from gpuxfer.hostwords import _NAME, PREFIX

    huge = tmp_path / f"{PREFIX}ffffffff-{'0' * 12}"
    dead = tmp_path / f"{PREFIX}{gone_pid():x}-{'1' * 12}"
    for f in (huge, dead):
        f.touch()
        backdate(f)
    removed = sweep_shm_orphans(_NAME, "give-back", str(tmp_path))
    assert huge.exists() and huge.name not in removed
    assert dead.name in removed


def test_sweep_leaves_a_fresh_segment_whose_pid_is_not_seen_here(tmp_path):
    """A segment made moments ago whose pid names no process here may be a live process's of another PID
    namespace sharing /dev/shm (containers sharing IPC, not PIDs): left alone until SHM_ORPHAN_AGE_S old."""
    from gpuxfer.common import sweep_shm_orphans
    from gpuxfer.hostwords import _NAME, PREFIX

    seg = tmp_path / f"{PREFIX}{gone_pid():x}-{'2' * 12}"
    seg.touch()
    assert sweep_shm_orphans(_NAME, "give-back", str(tmp_path)) == []
    backdate(seg)
    assert sweep_shm_orphans(_NAME, "give-back", str(tmp_path)) == [seg.name]


def test_sweep_never_follows_nor_removes_a_link(tmp_path):
    """A name of a swept pattern that is a symbolic link (any local user can plant one in /dev/shm) is judged as
    the link itself: never followed to an old file of ours, never removed."""
    from gpuxfer.common import sweep_shm_orphans
    from gpuxfer.hostwords import _NAME, PREFIX

    target = tmp_path / "target"
    target.touch()
    backdate(target)
    link = tmp_path / f"{PREFIX}{gone_pid():x}-{'3' * 12}"
    link.symlink_to(target)
    old = time.time() - SHM_ORPHAN_AGE_S - 60
    os.utime(link, (old, old), follow_symlinks=False)
    assert sweep_shm_orphans(_NAME, "give-back", str(tmp_path)) == []
    assert link.is_symlink() and target.exists()


def test_sweep_skips_a_name_it_may_not_unlink(tmp_path, monkeypatch):
    """A segment the sweep may not unlink (another user's in the sticky /dev/shm) is skipped, never raised."""
    import gpuxfer.common as common
    from gpuxfer.hostwords import _NAME, PREFIX

    refused = tmp_path / f"{PREFIX}{gone_pid():x}-{'4' * 12}"
    refused.touch()
    backdate(refused)

    def unlink(name):
        raise PermissionError(13, "Permission denied", name)
    monkeypatch.setattr(common, "unlink_shm", unlink)
    assert common.sweep_shm_orphans(_NAME, "give-back", str(tmp_path)) == []


def test_sweep_leaves_a_segment_its_owner_holds(tmp_path):
    """A segment whose owner lives (holds a lock on it) however old it is and whatever its pid names here: a KV
    agent's notification words stay named for the agent's life, its creator may be of another PID namespace sharing
    /dev/shm (a pid no process here has), and its peers open it by name at any time."""
    import fcntl

    from gpuxfer.common import sweep_shm_orphans
    from gpuxfer.hostwords import _NAMES, KV_PREFIX

    held = tmp_path / f"{KV_PREFIX}{gone_pid():x}-{'4' * 12}"
    dead = tmp_path / f"{KV_PREFIX}{gone_pid():x}-{'5' * 12}"
    for f in (held, dead):
        f.touch()
        backdate(f)
    fd = os.open(held, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        assert sweep_shm_orphans(_NAMES[KV_PREFIX], "notification", str(tmp_path)) == [dead.name]
    finally:
        os.close(fd)
    assert held.name in sweep_shm_orphans(_NAMES[KV_PREFIX], "notification", str(tmp_path))   # once let go


def test_kv_host_words_are_held_by_their_owner(host, monkeypatch):
    """A KV agent's host words as a named segment (where no sealed memory file can be made: kept named for its
    life) are locked by their owner until closed: a sweep of another PID namespace leaves them."""
    import fcntl

    import gpuxfer.hostwords as hostwords
    from gpuxfer.hostwords import KV_PREFIX, HostWords

    monkeypatch.setattr(hostwords, "_sealed_memfd", lambda name, nbytes: None)
    words = HostWords.create(host, 0, 4, KV_PREFIX)
    path = "/dev/shm" + words.name
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        words.close()
    assert not os.path.exists(path)
