"""A peer killed (SIGKILL) at each step of connect()'s setup: the survivor raises SetupFailed (typed, not a hang)
and leaves no shared-memory name behind (it drops the names of what it exported: no peer opens
them now; before, they stayed until its resource tracker ended, which for spawned processes is their parent's).
The victim's own names go with its resource tracker.

Rounds of the exchange over the CPU group (copy_engine, metadata by mailbox): 1 the setup facts, 2 local checks
and allocation, 3 opening the peer's handles, 4 the probe writes, 5 the probe check, 6 the flag path, 7 the
mailbox made, 8 the mailbox opened. The victim dies just before it sends its object of round N.
"""
from __future__ import annotations

import glob
import os
import tempfile

import pytest

from test_pp_chain import specs


def death_session(rank: int, world: int, init_method: str, platform_name: str, at: int) -> str:
    os.environ["GPUXFER_PLATFORM"] = platform_name
    import signal

    import torch.distributed as dist

    from gpuxfer.errors import SetupFailed
    from gpuxfer.platforms import get_platform
    from gpuxfer.pp import connect, selection
    from gpuxfer.pp.launch import init_cpu_group
    init_cpu_group(rank, world, init_method, timeout_s=60)
    plat = get_platform(platform_name)
    device = rank % plat.device_count()
    if rank == 1:
        real = selection._Exchange.__call__

        def call(self, obj, keys=()):
            if self.round + 1 == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, obj, keys)
        selection._Exchange.__call__ = call
    try:
        connect(send_to=1 if rank == 0 else None, recv_from=0 if rank else None, specs=specs(),
                backend="copy_engine", platform=plat, device=device, timeout_s=20)
    except SetupFailed as exc:
        return f"SetupFailed: {exc}"
    finally:
        plat.close()
    raise AssertionError("connect() returned with the peer dead")


@pytest.mark.parametrize("at", [1, 2, 3, 4, 6, 7, 8])
def test_a_peer_killed_at_each_setup_step(spawner, at):
    before = set(glob.glob("/dev/shm/gpuxfer*")) | set(glob.glob("/dev/shm/gx*"))
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rdv')}"
        # the survivor leaves without the interpreter's teardown once its result is in: torch's gloo group, after
        # a collective the dead peer broke, can abort in its C++ destructor at exit ("terminate called without an
        # active exception", about 1 run in 10 on two busy cores) -- torch's, not what this test checks
        kids = [spawner.start(death_session, r, 2, init, "host", at, name=f"rank {r}", hard_exit=r == 0)
                for r in range(2)]
        kids[1].proc.join(90)
        assert kids[1].proc.exitcode == -9
        got = kids[0].result(120)
        kids[0].join(60)
    assert got.startswith("SetupFailed") and "died or left" in got, got
    left = (set(glob.glob("/dev/shm/gpuxfer*")) | set(glob.glob("/dev/shm/gx*"))) - before
    mine = {n for n in left if f"{kids[0].pid:x}" in n}
    assert not mine, f"the survivor left shared memory behind: {sorted(mine)}"
