"""Faults at the stage hand-off: dead, late and hostile peers never hang a process, break its group or
read past a buffer.

Unit checks run in-process; the multi-process scenarios spawn every stage (host emulation in CI, and
marked ``gpu`` on CUDA: two processes on one device are enough). Timeouts are short; times are only
asserted as hang bounds (timeout_s + 5 s).
"""
from __future__ import annotations


import numpy as np
import pytest

from gpuxfer.errors import BadInput, GpuxferError, PeerLost, ProtocolError, TransferTimeout
from gpuxfer.pp.spec import MAX_NDIM, SpecTable
from gpuxfer.pp.transport import resolve_on_timeout, resolve_timeout
from test_pp_chain import specs


# --------------------------------------------------------------------------- unit


@pytest.mark.parametrize("bad", ["inf", "-inf", "nan", "1e400"])
def test_timeout_must_be_finite(monkeypatch, bad):
    monkeypatch.setenv("GPUXFER_PP_TIMEOUT_S", bad)
    with pytest.raises(BadInput, match="finite"):
        resolve_timeout(None)
    with pytest.raises(BadInput, match="finite"):
        resolve_timeout(float(bad))


def test_on_timeout_policy(monkeypatch):
    monkeypatch.delenv("GPUXFER_PP_ON_TIMEOUT", raising=False)
    assert resolve_on_timeout(None) == "raise"
    assert resolve_on_timeout("EXIT") == "exit" and resolve_on_timeout("raise") == "raise"
    monkeypatch.setenv("GPUXFER_PP_ON_TIMEOUT", "exit")
    assert resolve_on_timeout(None) == "exit" and resolve_on_timeout("raise") == "raise"
    monkeypatch.setenv("GPUXFER_PP_ON_TIMEOUT", "abort")
    with pytest.raises(BadInput, match="GPUXFER_PP_ON_TIMEOUT"):
        resolve_on_timeout(None)
    with pytest.raises(BadInput, match="on_timeout"):
        resolve_on_timeout("crash")


def _forged(t: SpecTable, step: int, shapes: list[tuple[int, tuple]]) -> np.ndarray:
    """A metadata message as a hostile sender writes it: (ndim, dims) per tensor, unchecked."""
    buf = np.zeros(t.meta_len, dtype=np.int64)
    row = [0x67787070, step, 0, 0]
    for nd, dims in shapes:
        row += [nd] + list(dims) + [0] * (MAX_NDIM - len(dims))
    buf[:] = row
    return buf


@pytest.mark.parametrize("label, hidden", [
    ("larger than the slot", (1, (5000,))),
    ("SIGBUS-sized", (1, (10 ** 8,))),
    ("overflows int64", (2, (2 ** 62, 2 ** 62))),
    ("negative dim", (2, (-1, 40))),
    ("too many dims", (MAX_NDIM + 1, ())),
    ("negative ndim", (-3, ())),
    ("dims past ndim", (1, (4, 40))),
])
def test_forged_metadata_is_refused_before_any_view(label, hidden):
    t = SpecTable(specs())      # sorted: hidden (48, 40) bf16, pos (48,) int64, residual (48, 40) f32
    ok = _forged(t, 3, [(2, (7, 40)), (1, (7,)), (2, (7, 40))])
    assert t.decode(ok, step=3, peer=0, rank=1) == ((7, 40), (7,), (7, 40))
    bad = _forged(t, 3, [hidden, (1, (7,)), (2, (7, 40))])
    with pytest.raises(ProtocolError, match="rank 1: .*rank 0") as ei:
        t.decode(bad, step=3, peer=0, rank=1)
    assert "'hidden'" in str(ei.value)


def test_forged_metadata_out_of_order_is_a_protocol_error():
    t = SpecTable(specs())
    with pytest.raises(ProtocolError, match="out of order"):
        t.decode(_forged(t, 4, [(2, (7, 40)), (1, (7,)), (2, (7, 40))]), step=3, peer=0, rank=1)


def test_peer_lost_is_a_transfer_timeout():
    err = PeerLost(rank=1, peer=0, step=5, flag="metadata", after_s=0.02, detail="x")
    assert isinstance(err, TransferTimeout) and isinstance(err, GpuxferError)
    assert "lost rank 0 after 0.02 s" in str(err) and "connection closed" in str(err)
    assert "timed out" not in str(err)


def test_connection_names_a_missing_side():
    from gpuxfer.pp.selection import Connection
    send_only = Connection("copy_engine", {1: object()}, {}, {}, rank=0)
    with pytest.raises(BadInput, match="rank 0 has no receive side .*only sends to \\[1\\]"):
        send_only.receiver()
    recv_only = Connection("copy_engine", {}, {0: object()}, {}, rank=1)
    with pytest.raises(BadInput, match="rank 1 has no send side .*only receives from \\[0\\]"):
        recv_only.sender()
    with pytest.raises(BadInput, match="holds no transport"):
        Connection("nccl", {}, {}, {}, rank=2).sender()


# --------------------------------------------------------------------------- processes

TIMEOUT = 2.0          # the transports' timeout_s in these scenarios
BOUND = TIMEOUT + 5.0  # the hang bound: error and exit within this long after the fault
SEED = 6               # every step of this seed carries data
KILL_AT = 4            # the victim dies right after this step


def _setup(rank: int, world: int, init_method: str, platform_name: str):
    import os
    os.environ["GPUXFER_PLATFORM"] = platform_name
    import torch

    from gpuxfer.platforms import get_platform
    from gpuxfer.pp.launch import init_cpu_group
    init_cpu_group(rank, world, init_method)
    plat = get_platform(platform_name)
    device = 0 if not plat.is_emulation else rank % plat.device_count()   # CUDA: every stage on one GPU
    if plat.is_emulation:
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", device)
        torch.cuda.set_device(device)
    return plat, device, dev


def _sync_current_stream(plat, device) -> None:
    """Host work that waits for everything queued on the current stream, as a user's .item() does
    (unbounded on CUDA; the emulation's bound is far past every hang bound of these tests)."""
    if plat.is_emulation:
        assert plat.synchronize(plat.current_stream(device), 120.0), "the current stream stayed blocked"
    else:
        import torch
        torch.cuda.current_stream().synchronize()


def _die(mark_path: str) -> None:
    import os
    import signal
    import time
    with open(mark_path, "w") as f:
        f.write(repr(time.monotonic()))    # CLOCK_MONOTONIC: one clock for every process of the host
    os.kill(os.getpid(), signal.SIGKILL)


def _killed_at(mark_path: str) -> float:
    with open(mark_path) as f:
        return float(f.read())


def stage_session(rank: int, world: int, init_method: str, platform_name: str, sc: dict, mark_path: str) -> dict:
    """One stage of a chain of ``world`` stages; rank ``sc["victim"]`` SIGKILLs itself after step KILL_AT.
    A survivor runs until its transport fails, synchronises its current stream, closes (or aborts)."""
    import time

    import torch.distributed as dist

    from gpuxfer.pp import connect
    from test_pp_chain import check_equal, step_shapes, step_tensors
    plat, device, dev = _setup(rank, world, init_method, platform_name)
    metadata = sc["meta"] != "none"
    conn = connect(send_to=rank + 1 if rank < world - 1 else None, recv_from=rank - 1 if rank else None,
                   specs=specs(), backend=sc["backend"], platform=plat, device=device, timeout_s=TIMEOUT,
                   metadata=metadata, inline_bytes=sc.get("inline_bytes"),
                   meta_channel="group" if sc["meta"] == "group" else None)
    dist.barrier()      # every stage past connect() before the victim may die (else a survivor gets SetupFailed)
    out = {"steps": 0}
    err = None
    try:
        for k in range(1, 1000):
            if rank > 0:
                rcv = conn.receiver().recv(**({} if metadata else {"shapes": step_shapes(SEED, rank - 1, k)}))
                got = rcv.tensors
            if rank < world - 1:
                conn.sender().send(step_tensors(SEED, rank, k, dev))
            _sync_current_stream(plat, device)
            for t in conn.transports:        # on a GPU a step's data may land after .tensors returned
                t.check()
            if rank > 0:
                check_equal(got, step_tensors(SEED, rank - 1, k, "cpu"), f"rank {rank} step {k}")
            out["steps"] = k
            if rank == sc["victim"] and k == KILL_AT:
                _die(mark_path)
    except GpuxferError as exc:
        err = exc
    t_err = time.monotonic()
    assert err is not None
    out["error"] = f"{type(err).__name__}: {err}"
    out["timeout"] = isinstance(err, TransferTimeout)
    _sync_current_stream(plat, device)       # no GPU wait of the failed transport is left on it
    t_sync = time.monotonic()
    broken = [t for t in conn.transports if t.error is not None]
    assert broken, "the error broke no transport"
    for t in broken:                         # every later call raises the stored error
        with pytest.raises(GpuxferError):
            t.synchronize()
        with pytest.raises(GpuxferError):
            t.send({}) if t.role == "send" else t.recv()
    if sc.get("abort"):
        conn.abort()
    else:
        conn.close()
    t_closed = time.monotonic()
    killed = _killed_at(mark_path)
    dist.destroy_process_group()
    plat.close()
    out.update(error_s=t_err - killed, sync_s=t_sync - t_err, close_s=t_closed - t_sync,
               teardown_s=time.monotonic() - t_closed, done_s=time.monotonic() - killed)
    return out


def run_kill(spawner, platform_name: str, world: int, sc: dict, tmp_path) -> list[dict]:
    import os
    import tempfile
    import time
    mark = str(tmp_path / "killed")
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rdv')}"
        kids = [spawner.start(stage_session, r, world, init, platform_name, sc, mark, name=f"rank {r}")
                for r in range(world)]
        victim = kids[sc["victim"]]
        victim.proc.join(120)
        assert victim.proc.exitcode == -9, f"the victim exited with {victim.proc.exitcode}"
        survivors = {r: kid for r, kid in enumerate(kids) if r != sc["victim"]}
        exited: dict[int, float] = {}
        deadline = time.monotonic() + 90
        while len(exited) < len(survivors) and time.monotonic() < deadline:   # each exit as it happens
            for r, kid in survivors.items():
                if r not in exited and kid.proc.exitcode is not None:
                    exited[r] = time.monotonic() - _killed_at(mark)
            time.sleep(0.02)
        results = []
        for r, kid in survivors.items():
            res = kid.result(5)
            kid.join(5)                        # exit code 0
            res.update(rank=r, exit_s=exited[r])
            results.append(res)
    for res in results:
        assert res["timeout"], res                      # TransferTimeout (PeerLost is one)
        assert res["error_s"] < BOUND, res
        assert res["done_s"] < BOUND, res               # error, stream sync, close/abort, group destroyed
        assert res["exit_s"] < BOUND + 15.0, res        # + interpreter teardown (seconds on loaded cores)
        assert res["sync_s"] < 2.0, res
    return results


KILL_2 = [  # victim role x step kind x metadata channel
    pytest.param({"victim": 1, "backend": "copy_engine", "meta": "mailbox"}, id="recv-inline-mailbox"),
    pytest.param({"victim": 0, "backend": "copy_engine", "meta": "mailbox", "inline_bytes": 0},
                 id="send-staged-mailbox",
                 marks=pytest.mark.slow),
    pytest.param({"victim": 1, "backend": "copy_engine", "meta": "none", "inline_bytes": 0, "abort": True},
                 id="recv-staged-none-abort",
                 marks=pytest.mark.slow),
    pytest.param({"victim": 0, "backend": "copy_engine", "meta": "group"}, id="send-inline-group"),
    pytest.param({"victim": 0, "backend": "nccl", "meta": "group"}, id="send-nccl-group"),
    pytest.param({"victim": 1, "backend": "copy_engine", "meta": "group", "inline_bytes": 0},
                 id="recv-staged-group", marks=pytest.mark.slow),
    pytest.param({"victim": 1, "backend": "copy_engine", "meta": "none"}, id="recv-inline-none",
                 marks=pytest.mark.slow),
    pytest.param({"victim": 0, "backend": "copy_engine", "meta": "none"}, id="send-inline-none",
                 marks=pytest.mark.slow),
    pytest.param({"victim": 0, "backend": "copy_engine", "meta": "none", "inline_bytes": 0},
                 id="send-staged-none", marks=pytest.mark.slow),
    pytest.param({"victim": 1, "backend": "copy_engine", "meta": "mailbox", "inline_bytes": 0},
                 id="recv-staged-mailbox", marks=pytest.mark.slow),
    pytest.param({"victim": 0, "backend": "copy_engine", "meta": "mailbox"}, id="send-inline-mailbox",
                 marks=pytest.mark.slow),
    pytest.param({"victim": 1, "backend": "copy_engine", "meta": "group"}, id="recv-inline-group",
                 marks=pytest.mark.slow),
    pytest.param({"victim": 0, "backend": "copy_engine", "meta": "group", "inline_bytes": 0},
                 id="send-staged-group", marks=pytest.mark.slow),
    pytest.param({"victim": 1, "backend": "nccl", "meta": "mailbox"}, id="recv-nccl-mailbox",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("sc", KILL_2)
def test_peer_killed_mid_run(spawner, platform_name, sc, tmp_path):
    if sc["backend"] == "nccl" and platform_name != "host":
        pytest.skip("these scenarios put every stage on one GPU, where NCCL refuses two ranks")
    (res,) = run_kill(spawner, platform_name, 2, sc, tmp_path)
    if sc["backend"] == "nccl" and sc["meta"] == "group" and platform_name == "host":
        assert "PeerLost" in res["error"] and "connection closed" in res["error"], res    # not "timed out"
    print(f"\n{sc}: {res}")


@pytest.mark.parametrize("victim", [
    pytest.param(3, id="last"),
    pytest.param(1, id="middle", marks=pytest.mark.slow),
])
def test_four_stage_chain_with_a_stage_killed(spawner, platform_name, victim, tmp_path):
    res = run_kill(spawner, platform_name, 4, {"victim": victim, "backend": "copy_engine", "meta": "mailbox"},
                   tmp_path)
    assert sorted(r["rank"] for r in res) == sorted(set(range(4)) - {victim})
    print(f"\nvictim {victim}: {res}")


def _conn(plat, device, rank, **kw):
    from gpuxfer.pp import connect
    kw.setdefault("timeout_s", TIMEOUT)
    return connect(send_to=1 if rank == 0 else None, recv_from=0 if rank == 1 else None, specs=specs(),
                   backend=kw.pop("backend", "copy_engine"), platform=plat, device=device, **kw)


def misc_session(rank: int, world: int, init_method: str, platform_name: str) -> dict:
    import torch.distributed as dist

    from gpuxfer.pp.spec import MAX_NDIM, META_MAGIC
    from test_pp_chain import check_equal, step_tensors
    plat, device, dev = _setup(rank, world, init_method, platform_name)
    out = {}
    # A. more deferred receives than recv_slots + 1: a typed error at the call, nothing consumed
    with _conn(plat, device, rank) as conn:
        if rank == 0:
            for k in range(1, 7):
                conn.sender().send(step_tensors(SEED, 0, k, dev))
            conn.synchronize()
        else:
            r = conn.receiver()
            pending = [r.recv() for _ in range(3)]
            with pytest.raises(BadInput, match="3 earlier receives not yet accessed .*access .tensors of step 1"):
                r.recv()
            got = [p.tensors for p in pending] + [r.recv().tensors for _ in range(3)]
            _sync_current_stream(plat, device)
            for k, g in enumerate(got, 1):
                check_equal(g, step_tensors(SEED, 0, k, "cpu"), f"step {k}")
            out["A"] = r.step
    # A2. the same with recv_views: the slot lent with the last step's views counts against the limit
    with _conn(plat, device, rank, recv_views=True) as conn:
        if rank == 0:
            for k in range(1, 7):
                conn.sender().send(step_tensors(SEED, 0, k, dev))
            conn.synchronize()
        else:
            r = conn.receiver()
            got = r.recv().tensors                 # step 1's views: its slot is lent until the next access
            _sync_current_stream(plat, device)
            check_equal(got, step_tensors(SEED, 0, 1, "cpu"), "step 1")
            pending = [r.recv() for _ in range(2)]
            with pytest.raises(BadInput, match="2 earlier receives not yet accessed"):
                r.recv()
            for k in range(2, 7):
                got = (pending.pop(0) if pending else r.recv()).tensors
                _sync_current_stream(plat, device)
                check_equal(got, step_tensors(SEED, 0, k, "cpu"), f"step {k} (views)")
            out["A2"] = r.step
    # B. a sender's forged metadata: the receiver refuses it before any view or copy (ProtocolError),
    # and the sender learns why instead of timing out
    with _conn(plat, device, rank) as conn:
        if rank == 0:
            s = conn.sender()
            real = s.specs.encode

            def forged(buf, step, shapes):
                real(buf, step, shapes)
                if step == 2:    # 'hidden' claims 10**8 elements: a read far past the 12 KiB slot
                    buf[4:5 + MAX_NDIM] = [1, 10 ** 8] + [0] * (MAX_NDIM - 1)

            s.specs.encode = forged
            with pytest.raises(GpuxferError) as ei:
                for k in range(1, 7):
                    s.send(step_tensors(SEED, 0, k, dev))
                s.synchronize()
            out["B"] = f"{type(ei.value).__name__}: {ei.value}"
        else:
            r = conn.receiver()
            check_equal(r.recv().tensors, step_tensors(SEED, 0, 1, "cpu"), "step 1")
            with pytest.raises(ProtocolError, match="claims shape \\(100000000,\\) for 'hidden'"):
                r.recv()
            with pytest.raises(ProtocolError):
                r.recv()
            assert META_MAGIC
    dist.barrier()
    dist.destroy_process_group()
    plat.close()
    return out


def test_deferred_overflow_and_forged_metadata(spawner, platform_name):
    sender, receiver = spawner.run_ranks(misc_session, 2, platform_name, timeout=120)
    assert receiver["A"] == receiver["A2"] == 6
    # the sender's error names the receiver's refusal (its "gone" note), not a bare timeout
    assert "PeerLost" in sender["B"] and "ProtocolError" in sender["B"] and "claims shape" in sender["B"]


LATE = 1.5     # the late-close scenarios' timeout: the peer comes 2x this late


def late_session(rank: int, world: int, init_method: str, platform_name: str) -> dict:
    import time

    import torch.distributed as dist

    from test_pp_chain import check_equal, step_tensors
    plat, device, dev = _setup(rank, world, init_method, platform_name)
    out = {}
    for case in ("healthy", "after a timeout"):
        conn = _conn(plat, device, rank, timeout_s=LATE)
        if rank == 0:
            s = conn.sender()
            try:
                for k in range(1, 4 if case == "healthy" else 6):
                    s.send(step_tensors(SEED, 0, k, dev))
                s.synchronize()
            except TransferTimeout:
                out[f"{case}: timeout"] = True
            t0 = time.monotonic()
            conn.close()                   # the peer comes 2x the timeout late
            out[f"{case}: close_s"] = time.monotonic() - t0
        else:
            if case == "healthy":
                for k in range(1, 4):
                    check_equal(conn.receiver().recv().tensors, step_tensors(SEED, 0, k, "cpu"), f"step {k}")
                _sync_current_stream(plat, device)
            time.sleep(2 * LATE)
            conn.close()
        dist.barrier()                     # the caller's group still works
    # metadata over the CPU group (its own two-rank group): a receive that times out closes that group's
    # pair, not the caller's
    with _conn(plat, device, rank, timeout_s=LATE, meta_channel="group") as conn:
        if rank == 1:
            with pytest.raises(TransferTimeout, match="metadata"):
                conn.receiver().recv()
            out["group metadata: timeout"] = True
    dist.barrier()
    if plat.is_emulation:    # the nccl backend's data on the emulation: the same, in a group of the pair's own
        with _conn(plat, device, rank, timeout_s=LATE, backend="nccl", metadata=False) as conn:
            if rank == 1:
                from test_pp_chain import step_shapes
                with pytest.raises(TransferTimeout, match="nccl recv"):
                    conn.receiver().recv(shapes=step_shapes(SEED, 0, 1)).tensors
                out["nccl data: timeout"] = True
        dist.barrier()
    conn = _conn(plat, device, rank)       # and so does a new connection over it
    with conn:
        if rank == 0:
            conn.sender().send(step_tensors(SEED, 0, 1, dev))
            conn.synchronize()
        else:
            check_equal(conn.receiver().recv().tensors, step_tensors(SEED, 0, 1, "cpu"), "new connection")
    dist.barrier()
    dist.destroy_process_group()
    plat.close()
    return out


def test_late_close_leaves_the_group_usable(spawner, platform_name):
    sender, receiver = spawner.run_ranks(late_session, 2, platform_name, timeout=120)
    assert sender["after a timeout: timeout"] and receiver["group metadata: timeout"]
    assert receiver.get("nccl data: timeout") or platform_name != "host"
    for case in ("healthy", "after a timeout"):
        assert sender[f"{case}: close_s"] < LATE + 5.0, sender
    print(f"\nlate close: {sender}")


def exit_session(rank: int, world: int, init_method: str, platform_name: str, log_path: str) -> dict:
    """on_timeout="exit": rank 0's send times out (rank 1 never receives) and its process ends."""
    import logging

    import torch.distributed as dist

    from test_pp_chain import step_tensors
    plat, device, dev = _setup(rank, world, init_method, platform_name)
    if rank == 0:
        logging.basicConfig(filename=log_path, level=logging.INFO)
    conn = _conn(plat, device, rank, on_timeout="exit")
    if rank == 0:
        for k in range(1, 50):
            conn.sender().send(step_tensors(SEED, 0, k, dev))
            _sync_current_stream(plat, device)
        raise AssertionError("the process should have ended")
    with pytest.raises(RuntimeError):
        dist.barrier()          # ends when rank 0's process does
    conn.abort()
    dist.destroy_process_group()
    plat.close()
    return {}


def test_on_timeout_exit_ends_the_process(spawner, platform_name, tmp_path):
    import os
    import tempfile
    import time

    from gpuxfer.pp.watchdog import EXIT_CODE
    log_path = str(tmp_path / "rank0.log")
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rdv')}"
        kids = [spawner.start(exit_session, r, 2, init, platform_name, log_path, name=f"rank {r}") for r in range(2)]
        t0 = time.monotonic()
        kids[0].proc.join(60)
        assert kids[0].proc.exitcode == EXIT_CODE, kids[0].proc.exitcode
        assert time.monotonic() - t0 < 60
        kids[1].result(60)
        kids[1].join(30)
    text = open(log_path).read()
    assert "on_timeout='exit'" in text and f"code {EXIT_CODE}" in text
    assert "rank 0: copy_engine send with rank 1: step" in text and "empty[" in text, text


def setup_death_session(rank: int, world: int, init_method: str, platform_name: str, mark_path: str) -> dict:
    """Rank 1 dies in connect() right after creating its metadata mailbox."""
    import os
    import signal

    import torch.distributed as dist

    from gpuxfer.errors import SetupFailed
    from gpuxfer.pp import mailbox
    plat, device, dev = _setup(rank, world, init_method, platform_name)
    if rank == 1:
        real = mailbox.Mailbox.create.__func__

        def create_then_die(cls, name, meta_len, magic):
            box = real(cls, name, meta_len, magic)
            with open(mark_path, "w") as f:
                f.write(name)
            os.kill(os.getpid(), signal.SIGKILL)
            return box

        mailbox.Mailbox.create = classmethod(create_then_die)
    with pytest.raises(SetupFailed, match="rank 0: pp connect: exchange .* died or left"):
        _conn(plat, device, rank)
    dist.destroy_process_group()
    plat.close()
    return {}


def test_a_rank_dying_in_setup(spawner, platform_name, tmp_path):
    import os
    import tempfile
    import time
    mark = str(tmp_path / "mailbox")
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rdv')}"
        kids = [spawner.start(setup_death_session, r, 2, init, platform_name, mark, name=f"rank {r}")
                for r in range(2)]
        kids[1].proc.join(60)
        assert kids[1].proc.exitcode == -9
        kids[0].result(60)
        kids[0].join(30)
    name = open(mark).read()
    deadline = time.monotonic() + 10    # the survivor unlinked it (or the victim's resource tracker did)
    while os.path.exists("/dev/shm/" + name.lstrip("/")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists("/dev/shm/" + name.lstrip("/")), f"{name} leaked"


def idle_session(rank: int, world: int, init_method: str, platform_name: str, q) -> None:
    """Connects, runs a step, reports its pid and its resource tracker's, then waits to be killed."""
    import os
    import time
    from multiprocessing import resource_tracker

    from test_pp_chain import step_tensors
    plat, device, dev = _setup(rank, world, init_method, platform_name)
    conn = _conn(plat, device, rank, timeout_s=60)
    if rank == 0:
        conn.sender().send(step_tensors(SEED, 0, 1, dev))
    else:
        conn.receiver().recv().tensors
    _sync_current_stream(plat, device)
    q.put((rank, os.getpid(), resource_tracker._resource_tracker._pid))
    time.sleep(120)


def test_killing_every_process_leaks_no_shared_memory(spawner, tmp_path):
    """Both ranks and their resource trackers SIGKILLed (a whole process group killed): nothing of
    theirs stays in /dev/shm (the host emulation's buffers and the mailbox drop their names once opened)."""
    import os
    import signal
    import tempfile
    import time
    q = spawner.queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rdv')}"
        kids = [spawner.start(idle_session, r, 2, init, "host", q, name=f"rank {r}") for r in range(2)]
        got = [q.get(timeout=90) for _ in kids]
        pids = []
        for _rank, pid, tracker in got:
            pids.append(pid)
            for p in (pid, tracker):
                if p:
                    os.kill(p, signal.SIGKILL)
        for k in kids:
            k.proc.join(10)
    time.sleep(0.5)
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"gx{p:x}_") for p in pids)]
    assert not left, left


_EXIT_PROBE = """
import os, sys, tempfile, threading, time
import torch.distributed as dist
from gpuxfer.pp.watchdog import WATCHDOG

store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
store.set("k", b"1")
polled = threading.Event()

class Busy:                       # what the watchdog polls: every poll is a C++ call that releases the GIL
    _state, _error, _waiting_since, _wd, signals, name, rank, peer = "open", None, None, [None], None, "t", 0, 1
    watch_after_error = False
    _wd_lock = threading.Lock()

    def _watch(self, now, force=False):
        end = time.monotonic() + 0.2
        polled.set()              # the main thread exits while this thread is in the loop below
        while time.monotonic() < end:
            store.check(["k"])

busy = Busy()
WATCHDOG.register(busy)
polled.wait(30)
sys.exit(0)
"""


def test_the_watchdog_never_aborts_interpreter_exit(tmp_path):
    """A daemon thread inside a C++ call when the interpreter finalizes is unwound through C++ frames and
    the process aborts (exit -6, "terminate called without an active exception"); the watchdog stops at exit."""
    import os
    import subprocess
    import sys
    script = tmp_path / "probe.py"
    script.write_text(_EXIT_PROBE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    for _ in range(1):
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])


def test_pair_signals_in_a_store(tmp_path):
    """Barriers and "gone" notes between the two ends of a pair, in one store: a barrier nobody meets
    ends at its deadline and breaks nothing; a note is read without waiting."""
    import time

    import torch.distributed as dist

    from gpuxfer.pp.channel import PairSignals
    store = dist.FileStore(str(tmp_path / "store"), 1)
    a, b = PairSignals(store, "p/1", 0, 1), PairSignals(store, "p/1", 1, 0)
    other = PairSignals(store, "p/2", 0, 1)          # another pair: keys never mix
    t0 = time.monotonic()
    assert a.post("x") and not a.finish("x", time.monotonic() + 0.3)
    assert 0.25 < time.monotonic() - t0 < 10
    assert b.post("x") and a.finish("x", time.monotonic() + 5) and b.finish("x", time.monotonic() + 5)
    assert not other.finish("x", time.monotonic() + 0.05)
    assert a.peer_gone() is None
    b.leave("failed with ProtocolError: bad shape")
    assert a.peer_gone() == "failed with ProtocolError: bad shape" and b.peer_gone() is None
    assert other.peer_gone() is None
