"""gpuxfer.spawn: ranks spawned and watched; every failure, exit code and hang named by rank."""
from __future__ import annotations

import time

import pytest

from gpuxfer.errors import GpuxferError
from gpuxfer.spawn import run_ranks, spawn


def _events_then(ctx, code_of_rank1: int):
    if ctx.rank == 1 and code_of_rank1:
        raise SystemExit(code_of_rank1)
    for i in range(3):
        ctx.emit("step", {"i": i})
    return {"rank": ctx.rank, "world": ctx.world, "rendezvous": ctx.init_method.startswith("file://")}


def _one_raises_one_hangs(ctx):
    if ctx.rank == 0:
        raise ValueError("a broken rank")
    time.sleep(600)


def _one_stays_silent(ctx):
    if ctx.rank == 1:
        time.sleep(600)
    return "done"


def _sum(rank, world, base):
    import torch.distributed as dist
    out = [None] * world
    dist.all_gather_object(out, base + rank)
    return sum(out)


@pytest.mark.timeout(120)
def test_results_events_and_exit_codes():
    seen = []
    out = spawn(_events_then, 2, (0,), idle_s=60, on_event=lambda r, k, p: seen.append((r, k, p["i"])))
    assert out.ok and out.results == [{"rank": r, "world": 2, "rendezvous": True} for r in (0, 1)]
    assert [i for r, k, i in seen if r == 0] == [0, 1, 2] and len(seen) == 6
    out = spawn(_events_then, 2, (3,), idle_s=60)
    assert out.results[0]["rank"] == 0 and out.results[1] is None
    assert out.errors == [out.errors[0]] and "rank 1" in out.errors[0] and "exited with code 3" in out.errors[0]


@pytest.mark.timeout(120)
def test_a_failed_rank_is_named_with_its_traceback_and_its_peer_is_killed():
    out = spawn(_one_raises_one_hangs, 2, idle_s=300, grace_s=0.5)
    assert len(out.errors) == 2 and not out.ok
    assert "rank 0" in out.errors[0] and "ValueError: a broken rank" in out.errors[0]
    assert "rank 1" in out.errors[1] and "killed 0.5 s after a peer failed" in out.errors[1]


@pytest.mark.timeout(120)
def test_a_silent_rank_is_killed_after_the_idle_limit():
    out = spawn(_one_stays_silent, 2, idle_s=3)
    assert any("rank 1" in e and "no word from any rank for 3 s" in e for e in out.errors)
    assert out.results[1] is None


@pytest.mark.timeout(120)
def test_run_ranks_joins_a_cpu_group_and_raises_on_failure():
    assert run_ranks(_sum, 2, (10,), timeout_s=60) == [21, 21]
    with pytest.raises(GpuxferError, match="(?s)rank 0 .*ValueError: a broken rank"):
        run_ranks(_bad, 2, timeout_s=60)


def _bad(rank, world):
    if rank == 0:
        raise ValueError("a broken rank")
    return rank


_CTRL_C_SCRIPT = '''
import os, signal, sys, time
from multiprocessing import shared_memory
from gpuxfer.spawn import spawn

# a shell's background job starts with SIGINT ignored, and Python keeps an inherited SIG_IGN: take Ctrl-C back
signal.signal(signal.SIGINT, signal.default_int_handler)

def holds_shared_memory(ctx, ready_dir):
    shm = shared_memory.SharedMemory(create=True, size=4096)
    try:
        open(os.path.join(ready_dir, f"ready{ctx.rank}"), "w").close()
        time.sleep(600)
    finally:            # runs only if the rank is let to unwind
        time.sleep(float(os.environ.get("UNWIND_S", "0")))    # a slow unwind, which a second SIGINT must not cut
        shm.close()
        shm.unlink()

if __name__ == "__main__":
    out = spawn(holds_shared_memory, 2, (sys.argv[1],), idle_s=600)
    print("ERRORS", out.errors, flush=True)
'''


@pytest.mark.timeout(240)
@pytest.mark.parametrize("to_group", [False, True], ids=["parent-only", "terminal"])
def test_ctrl_c_lets_the_ranks_unwind(tmp_path, to_group):
    """Ctrl-C on the parent alone (kill -INT), or at a terminal (SIGINT to the parent and the ranks, which
    then get the parent's too, during a slow unwind): the ranks get time to free what they hold, so nothing
    is reported leaked, and the outcome says 'interrupted'."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / "ctrl_c.py"
    script.write_text(_CTRL_C_SCRIPT)
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=root, UNWIND_S="1" if to_group else "0"))
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        if to_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, out + err
    assert "'interrupted'" in out and "leaked" not in err, out + err


def _log_level(ctx) -> int:
    import logging
    logging.getLogger("gpuxfer.test").info("rank %d says hello at INFO", ctx.rank)
    return logging.getLogger("gpuxfer.test").getEffectiveLevel()


@pytest.mark.timeout(120)
def test_ranks_log_at_the_level_the_command_asked(capfd):
    """GPUXFER_LOG_LEVEL (what ``gpuxfer -v`` sets) reaches the spawned ranks: INFO lines from a rank, prefixed
    with its rank; WARNING without it."""
    import logging
    out = spawn(_log_level, 1, (), idle_s=60, env={"GPUXFER_LOG_LEVEL": "info"})
    assert out.ok and out.results == [logging.INFO]
    assert "rank 0 INFO gpuxfer.test: rank 0 says hello at INFO" in capfd.readouterr().err
    out = spawn(_log_level, 1, (), idle_s=60, env={"GPUXFER_LOG_LEVEL": "warning"})
    assert out.ok and out.results == [logging.WARNING]
    assert "says hello" not in capfd.readouterr().err
