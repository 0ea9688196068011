"""What connect() swaps over the CPU group, forged or from another version: every rank ends in a typed error
(the same verdict everywhere, since every rank reads the same objects), nothing hangs, and the group still
sets up a working connection afterwards. Before, a peer's malformed object gave untyped TypeError / KeyError
(on every rank, or on some while the others waited in the next exchange)."""
from __future__ import annotations

import os

from test_pp_chain import check_equal, specs, step_tensors

# (label, exchange round the forged object goes out in, how rank 1 forges its object): round 1 carries each
# rank's setup facts, 2-6 the copy-engine setup phases, 7-8 the mailbox phases
CASES = [
    ("facts not a dict", 1, lambda o: [o]),
    ("facts: sends None", 1, lambda o: {**o, "sends": None}),
    ("facts: sends strings", 1, lambda o: {**o, "sends": ("0",)}),
    ("facts: counter a string", 1, lambda o: {**o, "counter": "x"}),
    ("facts: nonce missing", 1, lambda o: {k: v for k, v in o.items() if k != "nonce"}),
    ("facts: a rank out of the group", 1, lambda o: {**o, "rank": 7}),
    ("facts: slots a float", 1, lambda o: {**o, "slots": 2.0}),
    ("facts: timeout nan", 1, lambda o: {**o, "timeout": float("nan")}),
    ("phase: err an int", 2, lambda o: {**o, "err": 5}),
    ("phase: no obj", 3, lambda o: {k: v for k, v in o.items() if k != "obj"}),
    ("phase: obj a list", 4, lambda o: {**o, "obj": []}),
    ("mailbox: made None", 7, lambda o: {**o, "made": None}),
    ("mailbox: opened a string", 8, lambda o: {**o, "opened": "x"}),
]


def forged_session(rank: int, world: int, init_method: str, platform_name: str) -> dict:
    os.environ["GPUXFER_PLATFORM"] = platform_name
    import torch
    import torch.distributed as dist

    from gpuxfer.errors import GpuxferError
    from gpuxfer.platforms import get_platform
    from gpuxfer.pp import connect, selection
    from gpuxfer.pp.launch import init_cpu_group
    init_cpu_group(rank, world, init_method)
    plat = get_platform(platform_name)
    device = rank % plat.device_count()
    dev = torch.device("cpu") if plat.is_emulation else torch.device("cuda", device)
    real = selection._Exchange.__call__
    out = {}

    def conn():
        return connect(send_to=1 if rank == 0 else None, recv_from=0 if rank else None, specs=specs(),
                       backend="copy_engine", platform=plat, device=device, timeout_s=20)
    try:
        for label, at, forge in CASES:
            def call(self, obj, keys=(), at=at, forge=forge):
                return real(self, forge(obj) if rank == 1 and self.round + 1 == at else obj, keys)
            selection._Exchange.__call__ = call
            try:
                c = conn()
                c.close()
                out[label] = "connected"
            except GpuxferError as exc:
                out[label] = type(exc).__name__
            except Exception as exc:  # noqa: BLE001 - what the test reports
                out[label] = f"untyped {type(exc).__name__}: {exc}"
            finally:
                selection._Exchange.__call__ = real
            dist.barrier()
        with conn() as c:         # the group still sets up a working pair
            if rank == 0:
                c.sender().send(step_tensors(3, 0, 1, dev))
            else:
                check_equal(c.receiver().recv().tensors, step_tensors(3, 0, 1, "cpu"), "after the forgeries")
            c.synchronize(30)
    finally:
        dist.destroy_process_group()
        plat.close()
    return out


def test_forged_exchange_objects_end_in_typed_errors(spawner, platform_name):
    results = spawner.run_ranks(forged_session, 2, platform_name, timeout=400)
    for rank, got in enumerate(results):
        for label, _at, _forge in CASES:
            assert got[label] in ("SetupFailed", "BadInput", "BackendUnavailable"), (rank, label, got[label])
    assert results[0] == results[1]
