"""The engine side of the vLLM connector's loader process (gpuxfer.integrations.vllm.loader.LoaderClient) without
vLLM: a decode WorkerSide over host tensors whose loads go to a loader process, each load's handshake refused (no
prefill listens), so that every load ends failed soon. Every load is reported once, whatever the loader does
(fails, is killed, reported before it died, was idle long, gets a step larger than its ring) and whatever the
calls' order (a replayed request, calls after or during close), and no engine-thread call raises."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gpuxfer.integrations.vllm import loader as loader_mod  # noqa: E402
from gpuxfer.integrations.vllm.loads import Load  # noqa: E402
from gpuxfer.integrations.vllm.params import RemotePrefill  # noqa: E402
from gpuxfer.integrations.vllm.worker import Settings, WorkerSide  # noqa: E402

BLOCKS, BS, HEADS, CONTENT, LAYERS = 24, 16, 2, 32, 2
WAIT_S = 60.0


def _decode_worker() -> tuple[WorkerSide, dict]:
    """A decode WorkerSide whose loads go to a loader process, and host caches of vLLM's shape for it."""
    whole = torch.zeros(LAYERS, BLOCKS, HEADS, BS, CONTENT, dtype=torch.uint8)
    caches = {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(LAYERS)}
    w = WorkerSide(engine_id="d", model="m", dtype="auto/float16", layout="LBHNC",
                   groups=[("FullAttentionSpec", BS, list(caches))],
                   settings=Settings(lease_s=60, host="127.0.0.1", port=0, handshake_timeout_s=30,
                                     token_major=True, loader="process"))
    return w, caches


@pytest.fixture
def worker(monkeypatch):
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    made = []

    def make() -> WorkerSide:
        w, caches = _decode_worker()
        made.append(w)
        w.register(caches)
        w.caches = caches
        assert w.decode.proc.poll() is None
        return w
    yield make
    for w in made:
        w.close()
        assert w.decode.proc.poll() is not None


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


PORT = _closed_port()


def _load(req: str, blocks: int = 2) -> Load:
    ids = np.arange(1, blocks + 1, dtype=np.int64)
    rp = RemotePrefill("p", "127.0.0.1", PORT, f"p-{req}", (ids,), (BS,), time.monotonic() + 60, token="t" * 16)
    return Load(req, rp, (ids.copy(),), 0, BS * blocks - 1)


def _drive(w: WorkerSide, want: set, reports: list | None = None) -> tuple[set, set]:
    """Poll until every load of ``want`` was reported; every report appended to ``reports``."""
    got, failed = set(), set()
    end = time.monotonic() + WAIT_S
    while want - got:
        assert time.monotonic() < end, f"loads {sorted(want - got)} never reported"
        _, r, f = w.poll()
        if reports is not None:
            reports.extend(r)
        got |= r
        failed |= f
        time.sleep(0.005)
    return got, failed


def _zombie(pid: int) -> None:
    """Wait until ``pid`` (a child) exited, leaving it to be reaped by its owner."""
    end = time.monotonic() + WAIT_S
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        assert time.monotonic() < end
        time.sleep(0.01)


def test_a_load_after_an_idle_spell_is_not_taken_for_a_stalled_loader(worker):
    """An instance idle for longer than a load may last: its next load is not taken for one the loader left
    unreported (which kills the loader, failing every later load)."""
    w = worker()
    c = w.decode
    c._last_news -= c._stall_s + 1          # (what an idle spell of that long leaves)
    c.start([_load("a")])
    got, failed = _drive(w, {"a"})
    assert failed == {"a"} and c.dead is None and c.proc.poll() is None
    assert w.stats["failed"] == 1


def test_a_loader_that_fails_fails_its_loads_and_nothing_raises(worker):
    """A loader whose run raises (here: a load record it cannot read) reports its error: the engine thread logs it
    and fails the loads, raising nothing."""
    w = worker()
    bad = _load("bad")
    bad.wire = b"not a load record"
    w.decode.start([_load("a"), bad])
    got, failed = _drive(w, {"a", "bad"})
    assert failed == {"a", "bad"} and w.decode.dead is not None
    w.decode.start([_load("later")])
    assert _drive(w, {"later"}) == ({"later"}, {"later"})


def test_what_the_loader_reported_before_it_died_is_counted_once(worker):
    w = worker()
    c = w.decode
    c.start([_load("a")])
    end = time.monotonic() + WAIT_S
    while not c._evt.pending():             # (its report in the ring, not read yet)
        assert time.monotonic() < end
        time.sleep(0.005)
    os.kill(c.proc.pid, signal.SIGKILL)
    _zombie(c.proc.pid)
    reports: list = []
    assert _drive(w, {"a"}, reports) == ({"a"}, {"a"})
    c.start([_load("b")])
    _drive(w, {"b"}, reports)
    assert sorted(reports) == ["a", "b"] and w.stats["failed"] == 2


def test_steps_larger_than_the_ring_go_in_parts_and_a_load_larger_fails(worker, monkeypatch):
    monkeypatch.setattr(loader_mod, "RING_BYTES", 4096)
    w = worker()
    c = w.decode
    assert c._cmd.size == 4096
    loads = [_load(f"a{i}", 100) for i in range(8)]        # (each ~2 KB of block IDs)
    c.start(loads + [_load("huge", 1000)])
    got, failed = _drive(w, {ld.req_id for ld in loads} | {"huge"})
    assert failed == got and c.dead is None and c.proc.poll() is None


def test_calls_after_close_fail_their_loads_and_raise_nothing(worker):
    w = worker()
    c = w.decode
    c.start([_load("a")])
    c.close()
    c.start([_load("b")])
    c.release([_load("r").remote])
    got, failed = _drive(w, {"a", "b"})
    assert failed == {"a", "b"}


def test_close_from_another_thread_while_the_engine_thread_steps(worker):
    w = worker()
    c = w.decode
    t = threading.Thread(target=c.close)
    errors = []
    for i in range(400):
        if i == 50:
            t.start()
        try:
            c.start([_load(f"s{i}")])
            w.poll()
        except Exception as exc:    # noqa: BLE001  (what the engine thread would raise)
            errors.append(exc)
            break
    t.join(WAIT_S)
    assert not t.is_alive() and not errors, errors
    _drive(w, set(c.pending))


def test_a_replayed_load_is_reported_once(worker):
    """A request named again (replayed metadata) after the loader reported its load but before the engine thread
    read that report: as on the engine's thread (DecodeLoads.start), the second is dropped, not loaded again."""
    w = worker()
    c = w.decode
    c.start([_load("a")])
    end = time.monotonic() + WAIT_S
    while not c._evt.pending():
        assert time.monotonic() < end
        time.sleep(0.005)
    c.start([_load("a")])
    c.start([_load("b")])
    reports: list = []
    _drive(w, {"a", "b"}, reports)
    c.start([_load("c")])
    _drive(w, {"c"}, reports)
    assert sorted(reports) == ["a", "b", "c"]


def test_a_stalled_loader_is_killed_and_its_loads_fail_once_it_was_waited_for(worker):
    """A loader that takes nothing and reports nothing for longer than a load may last is killed; its loads are
    reported failed only once it was waited for (nothing it queued can write their blocks after), and no poll
    waits for it meanwhile."""
    w = worker()
    c = w.decode
    os.kill(c.proc.pid, signal.SIGSTOP)
    c.start([_load("a")])
    c._last_news -= c._stall_s + 1          # (what a stall of that long leaves)
    _, r, _ = w.poll()
    assert c.dead is not None and "reported nothing" in c.dead
    reports: list = []
    end = time.monotonic() + WAIT_S
    while not reports:
        assert time.monotonic() < end
        _, r, f = w.poll()
        if r:
            assert c.proc.returncode is not None and r == f == {"a"}
        reports.extend(r)
        time.sleep(0.005)
    c.start([_load("b")])
    assert _drive(w, {"b"}, reports) == ({"b"}, {"b"}) and reports == ["a", "b"]


def test_the_loaders_path_puts_no_site_folder_before_the_standard_library(monkeypatch):
    import site
    root = os.path.abspath(loader_mod.__file__).rsplit(os.sep, 4)[0]
    assert loader_mod.child_path("/x") == os.pathsep.join([root, "/x"])      # (a source tree: it goes first)
    monkeypatch.setattr(site, "getsitepackages", lambda: [root])
    assert loader_mod.child_path("/x") == "/x" and loader_mod.child_path("") == ""


def test_a_loader_started_by_a_thread_that_ends_lives_on(worker):
    """The kernel's parent-death signal is sent when the *thread* that started a process ends: a worker registered
    by a thread that then ends keeps its loader."""
    made = []
    t = threading.Thread(target=lambda: made.append(worker()))
    t.start()
    t.join(WAIT_S)
    assert made and not t.is_alive()
    w = made[0]
    time.sleep(0.5)             # (a signal sent at the thread's end has landed by now)
    assert w.decode.proc.poll() is None
    w.decode.start([_load("a")])
    assert _drive(w, {"a"}) == ({"a"}, {"a"}) and w.decode.dead is None


def test_a_load_started_while_a_close_is_under_way_is_not_written_beside_it(worker):
    """The command ring has one writer: while close (another thread) writes to it, a step's loads are not written
    (they fail), and the engine thread does not wait for the close."""
    w = worker()
    c = w.decode
    written = c._cmd._pos[0]
    with c._lock:                           # (what a close under way holds)
        c.start([_load("a")])
        c.release([_load("r").remote])
        assert c._cmd._pos[0] == written and not c._out
    assert _drive(w, {"a"}) == ({"a"}, {"a"})


def test_a_loader_whose_warm_up_fails_starts_as_the_worker_would(worker):
    """The loader's warm-up (kernels loaded by reading the worker's null block) failing only moves that cost to
    the first request, as the worker's own warm-up does: it is no reason to fail the worker's registration."""
    from gpuxfer.kv import KVAgent
    from gpuxfer.platforms import current
    w = worker()
    other = KVAgent("gone", platform=current(), device=0)
    other.register_group("g0", BS, {"x": torch.zeros(4, HEADS, BS, CONTENT, dtype=torch.uint8)})
    meta = other.metadata()
    other.close()
    real = w.agent.metadata
    w.agent.metadata = lambda: meta     # (metadata the loader's warm-up cannot map)
    try:
        c = loader_mod.LoaderClient(w, w.caches)
    finally:
        w.agent.metadata = real
    try:
        assert c.proc.poll() is None
    finally:
        c.close()


def test_caches_the_loader_cannot_be_given_fail_registration_with_the_typed_error(monkeypatch):
    """Caches torch cannot share with another process (its pickle raising, as for memory of a platform without
    IPC): ``loader: "process"`` fails registration with GpuxferError naming it, the loader is not left running."""
    from gpuxfer.errors import GpuxferError
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    started = []
    real = loader_mod.subprocess.Popen

    def popen(*a, **k):
        p = real(*a, **k)
        started.append(p)
        return p

    def refuse(obj, *a, **k):
        raise RuntimeError("sharing this memory is not supported")
    monkeypatch.setattr(loader_mod.subprocess, "Popen", popen)
    monkeypatch.setattr(loader_mod.ForkingPickler, "dumps", refuse)
    w, caches = _decode_worker()
    with pytest.raises(GpuxferError, match="could not be given the caches .*RuntimeError"):
        w.register(caches)
    assert started and all(p.poll() is not None for p in started)
    w.close()
