"""An SGLang 0.5.23 prefill or decode rank without a model, for the gpuxfer backend's tests: SGLang's own
bootstrap server (prefill), KV manager, sender and receiver classes, chosen by the backend name through the
``sglang.srt.plugins`` entry point (or SGLang's built-in Mooncake backend, the reference), over a KV pool laid out as SGLang's MHA or MLA pool hands it to a backend
(``KVArgs``: K layers then V layers, or one buffer per layer; ``page_size``-token pages, page 0 padding; aux
metadata rows). Every page and row is filled with bytes known from a seed, so the decode side checks each
byte it got.

Each rank runs SGLang's own queues over stand-ins for what they read of a scheduler
(tests/integrations/sglang_queues.py). The prefill: ``PrefillBootstrapQueue`` (which builds its ``KVArgs`` from
the pool and makes the KV manager and each request's ``KVSender``) and its scheduler's ``send_kv_chunk``:
``queue_add`` then ``queue_run``; ``senders``/``send`` call the ``KVSender`` directly instead. The decode:
``DecodePreallocQueue`` (its ``KVArgs``, KV manager and each request's ``KVReceiver``) and
``DecodeTransferQueue`` driven by the scheduler's ``process_decode_queue`` over SGLang's allocators and
req-to-token pool: ``requests`` then ``finish``; ``receivers`` makes the receiver calls by hand onto fixed pages
(the benchmark's). A full SGLang server cannot run on a CPU (no CPU build of ``sgl_kernel``).

The parent drives it over a pipe (:class:`Rank`); the child runs :func:`serve`.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from types import SimpleNamespace

import multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = os.path.join(HERE, "sglang_stubs")           # the torchvision stand-in SGLang's import chain needs

#: the pool's geometry: LAYERS layers, an MHA pool's K and V buffer per layer (2 * LAYERS entries) or an MLA
#: pool's one buffer per layer (MLA_DIM elements per token), ``pages`` pages of ``page_size`` tokens per entry
LAYERS, HEADS, HEAD_DIM, ITEMSIZE = 2, 2, 8, 2
#: the aux (metadata) buffers' bytes per row; the last is laid out as SGLang's ``bootstrap_room`` buffer (eight
#: 64-bit slots, zero until the prefill's ``set_buf`` writes the request's room into slot 0)
AUX_ITEM_LENS = (64, 128, 64)
AUX_ROWS = 128


def ctx():
    return mp.get_context("spawn")


#: SGLang's Mooncake backend (the reference beside gpuxfer's) over TCP: Mooncake's TCP transport, no RDMA device
MOONCAKE_ENV = {"MC_FORCE_TCP": "1", "MOONCAKE_PROTOCOL": "tcp", "MC_LOG_LEVEL": "WARNING"}
#: the shared libraries Mooncake's TCP wheel links beyond its own, and the names NIXL's wheel bundles them by
_MOONCAKE_LINKS = {"libibverbs.so.1": "libibverbs-*.so*", "libnl-3.so.200": "libnl-3-*.so*",
                   "libnl-route-3.so.200": "libnl-route-3-*.so*"}


def _mooncake_imports(env: dict) -> str | None:
    """None where a fresh interpreter with ``env`` imports Mooncake's engine, else its error's last line."""
    import subprocess
    r = subprocess.run([sys.executable, "-c", "import mooncake.engine"], env=env, capture_output=True, text=True,
                       timeout=120)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]


def mooncake_library_path(tmp: str) -> tuple[str | None, str | None]:
    """``(why Mooncake cannot run, or None; the LD_LIBRARY_PATH the ranks need, or None: the one they have)``.
    Mooncake's TCP wheel (``mooncake-transfer-engine-non-cuda``) links libibverbs and libnl; where the machine
    has none, ``tmp`` gets links naming NIXL's bundled copies as Mooncake asks for them, and NIXL's library
    directory (their own dependencies) follows it on the path. Set it in ``os.environ`` before the ranks spawn
    (the loader reads it at a process's start)."""
    import glob
    import importlib.util
    if importlib.util.find_spec("mooncake") is None:
        return "Mooncake is not installed (pip install --no-deps mooncake-transfer-engine-non-cuda)", None
    why = _mooncake_imports(dict(os.environ))
    if why is None:
        return None, None
    for name in ("nixl_cu12", "nixl_cu13"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        libs = os.path.join(os.path.dirname(list(spec.submodule_search_locations)[0]), f"{name}.libs")
        found = {want: sorted(glob.glob(os.path.join(libs, pat))) for want, pat in _MOONCAKE_LINKS.items()}
        if not all(found.values()):
            continue
        os.makedirs(tmp, exist_ok=True)
        for want, paths in found.items():
            link = os.path.join(tmp, want)
            if not os.path.lexists(link):
                os.symlink(paths[0], link)
        path = os.pathsep.join(p for p in (tmp, libs, os.environ.get("LD_LIBRARY_PATH")) if p)
        if _mooncake_imports({**os.environ, "LD_LIBRARY_PATH": path}) is None:
            return None, path
    return f"Mooncake's engine does not import: {why}", None


MLA_DIM = 576


def item_len(page_size: int, mla: bool = False, heads: int = HEADS) -> int:
    return page_size * (MLA_DIM if mla else heads * HEAD_DIM) * ITEMSIZE


_PATTERNS: dict = {}


def aux_rows(seed: int, j: int, room: int | None = None, row: int | None = None):
    """A rank of ``seed``'s aux buffer ``j`` (``AUX_ROWS`` rows): seeded bytes, the room buffer zero; with
    ``room``, row ``row`` as the prefill's ``set_buf`` left it for that request (a copy)."""
    import torch
    n = AUX_ITEM_LENS[j]
    if j == len(AUX_ITEM_LENS) - 1:
        rows = torch.zeros((AUX_ROWS, n), dtype=torch.uint8)
    else:
        rows = pattern(seed, 1000 + j, AUX_ROWS * n).view(AUX_ROWS, n)
    if room is None:
        return rows
    out = rows[row].clone()
    if j == len(AUX_ITEM_LENS) - 1:
        out.view(torch.int64)[0] = room
    return out


def pattern(seed: int, entry: int, nbytes: int):
    """The bytes a rank of ``seed`` holds in KV entry ``entry`` (``entry >= 1000``: aux buffer ``entry - 1000``),
    kept for the checks: read it, copy it to make a buffer."""
    import torch
    key = (seed, entry, nbytes)
    if key not in _PATTERNS:
        g = torch.Generator().manual_seed(seed * 100003 + entry)
        _PATTERNS[key] = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    return _PATTERNS[key]


def kv_bytes(seed: int, entry: int, nbytes: int, heads_at: tuple | None = None):
    """The bytes a rank of ``seed`` holds in KV entry ``entry`` (:func:`pattern`); with ``heads_at``, ``(first,
    count)``: the entry's rows (``(tokens, count, HEAD_DIM)`` elements, SGLang's MHA layout) hold the global KV
    heads ``first .. first + count - 1`` of a server of ``seed``, each head's bytes its own pattern, so every rank
    holding a head (at any TP size, a replica too) holds the same bytes of it."""
    import torch
    if heads_at is None:
        return pattern(seed, entry, nbytes)
    key = (seed, entry, nbytes, heads_at)
    if key not in _PATTERNS:
        first, count = heads_at
        hb = HEAD_DIM * ITEMSIZE
        tokens = nbytes // (count * hb)
        _PATTERNS[key] = torch.cat([pattern(seed, 10000 + 256 * entry + h, tokens * hb).view(tokens, 1, hb)
                                    for h in range(first, first + count)], dim=1).reshape(-1)
    return _PATTERNS[key]


class Rank:
    """The parent's handle on one rank process."""

    def __init__(self, role: str, *, port: int, page_size: int, pages: int, seed: int, env: dict | None = None,
                 mla: bool = False, heads: int = HEADS, **extra):
        """``extra``: ``layers`` (entries: one per layer for MLA, two for MHA), ``item_lens`` (each entry's
        bytes per page, else the MHA/MLA page of ``HEADS`` x ``HEAD_DIM``), ``device`` (``cuda``: the KV
        buffers on GPU 0), ``cpus`` (``(rank, world)``: pinned as a benchmark rank), ``cpu_mode`` (with
        ``cpus``: ``split``, the default: the rank's main thread on the fastest core of its part and every
        thread the rank starts on the rest of the part; ``one``: every thread on that one core), ``backend``
        (``gpuxfer``, the default, or ``mooncake``: SGLang's built-in Mooncake backend, the reference; with
        ``MOONCAKE_ENV`` in ``env``), ``tp`` (``(rank, size)``: this rank of a server of that TP size; the
        prefill's rank 0 runs the bootstrap server), ``heads_at`` (``(first, count)``: an MHA rank's global KV heads,
        its bytes :func:`kv_bytes`'s of them; ``heads`` is then ``count``), ``total_heads`` (the model's KV heads
        SGLang's ``KVArgs`` report; default ``heads`` times the TP size)."""
        self.role, self.port = role, port
        self.conn, child = ctx().Pipe()
        spec = dict(role=role, port=port, page_size=page_size, pages=pages, seed=seed, env=env or {}, mla=mla,
                    heads=heads, **extra)
        self.proc = ctx().Process(target=serve, args=(child, spec), name=f"sglang-{role}", daemon=True)
        self.proc.start()
        child.close()

    def ready(self, timeout: float = 300.0) -> dict:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.role}: not ready within {timeout} s")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"{self.role} failed to start:\n{payload}")
        return payload

    def call(self, cmd: str, *args, timeout: float = 120.0):
        self.conn.send((cmd, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.role}: no answer to {cmd!r} within {timeout} s")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"{self.role} failed in {cmd!r}:\n{payload}")
        return payload

    def close(self, timeout: float = 60.0) -> int | None:
        if self.proc.is_alive():
            try:
                self.conn.send(("close", ()))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        return self.proc.exitcode


# ---------------------------------------------------------------------- child


class _State:
    def __init__(self, spec: dict):
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
        from sglang.srt.runtime_context import get_context

        self.spec = spec
        self.role, self.port, self.seed = spec["role"], spec["port"], spec["seed"]
        self.page_size, self.pages = spec["page_size"], spec["pages"]
        self.addr = f"127.0.0.1:{self.port}"
        self.backend = name = spec.get("backend") or "gpuxfer"
        backend = TransferBackend(name)             # "gpuxfer" resolves only through the plugin
        self.tp_rank, tp_size = spec.get("tp") or (0, 1)
        self.server_args = get_context().override_server_args(
            disaggregation_mode=self.role, disaggregation_transfer_backend=name,
            disaggregation_bootstrap_port=self.port, host="127.0.0.1", tp_size=tp_size).install()
        # rank tp_rank of a server of TP size tp_size (DP/CP/PP size 1), as its scheduler publishes itself; its
        # polls are not all-reduced over the TP group (the gloo world of one): the test drives every rank alike
        from sglang.srt.runtime_context import get_parallel
        get_parallel().override_permanently(attn_tp_rank=self.tp_rank, attn_cp_rank=0, attn_dcp_rank=0,
                                            attn_dp_rank=0, dp_rank=0, tp_rank=self.tp_rank, pp_rank=0,
                                            pp_group=None, attn_tp_group=SimpleNamespace(cpu_group=None))
        self.server = None
        server_cls = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)     # (SGLang's fake backend has none)
        if self.role == "prefill" and self.tp_rank == 0 and server_cls is not None:
            self.server = server_cls(host="127.0.0.1", port=self.port)   # beside a server's rank 0
        self.mla = spec["mla"]
        heads = 1 if self.mla else spec["heads"]
        layers = spec.get("layers") or LAYERS
        n_entries = layers if self.mla else 2 * layers
        self.item_lens = list(spec.get("item_lens") or [item_len(self.page_size, self.mla, spec["heads"])] * n_entries)
        self.item_len = self.item_lens[0]
        device = spec.get("device") or "cpu"
        self.heads_at = None if self.mla or spec.get("heads_at") is None else tuple(spec["heads_at"])
        self.kv = [kv_bytes(self.seed, e, self.pages * il, self.heads_at).to(device, copy=True)
                   for e, il in enumerate(self.item_lens)]
        self.aux = [aux_rows(self.seed, j).clone().view(-1) for j in range(len(AUX_ITEM_LENS))]
        ptrs, lens = [t.data_ptr() for t in self.kv], [t.numel() for t in self.kv]
        self.driver = None
        # SGLang's own queues build the rank's KVArgs from the pool and make the KV manager: the prefill's
        # PrefillBootstrapQueue, the decode's DecodePreallocQueue
        from sglang_queues import (DecodeQueueDriver, MetadataRows, QueueDriver, decode_scheduler, init_world_of_one,
                                   make_pool, prefill_scheduler)
        init_world_of_one()
        pool = make_pool(self.mla, self.page_size, layers, heads, ptrs, lens, self.item_lens)
        self.meta = MetadataRows(self.aux, AUX_ITEM_LENS)
        if self.role == "prefill":
            sched = prefill_scheduler(pool=pool, meta=self.meta, page_size=self.page_size,
                                      layers=layers, heads=heads, port=self.port, server_args=self.server_args,
                                      total_heads=spec.get("total_heads") or heads * tp_size,
                                      max_reqs=AUX_ROWS, max_tokens=self.pages * self.page_size, aux_rows=AUX_ROWS,
                                      backend=backend)
            self.driver = QueueDriver(sched, "127.0.0.1")
            self.mgr = sched.disagg_prefill_bootstrap_queue.kv_manager
        else:
            sched = decode_scheduler(pool=pool, meta=self.meta, page_size=self.page_size, pages=self.pages,
                                     layers=layers, server_args=self.server_args, max_reqs=AUX_ROWS,
                                     aux_rows=AUX_ROWS, backend=backend, seed=self.seed)
            self.driver = DecodeQueueDriver(sched, "127.0.0.1", self.port)
            self.mgr = sched.disagg_decode_prealloc_queue.kv_manager
        self.kv_args = self.mgr.kv_args
        self.sender_cls = get_kv_class(backend, KVClassType.SENDER)
        if device == "cpu" and getattr(self.sender_cls, "supports_host_tensor_indices", False):
            # Mooncake's sender takes page indices as a pinned host tensor with a CUDA event (its D2H copy off
            # the scheduler's stream); on a CPU the scheduler hands it the plain index array instead
            self.sender_cls.supports_host_tensor_indices = False
        self.receiver_cls = get_kv_class(backend, KVClassType.RECEIVER)
        self.ends: dict[int, object] = {}           # room -> KVSender / KVReceiver
        self.plan: dict[int, tuple] = {}            # decode: room -> (prefill pages, decode pages, decode row)
        self.reasons: dict[int, str] = {}           # room -> the failure SGLang reported
        self.landed: set[int] = set()               # decode: rooms whose bytes were checked as the prefill's
        self.logged_errors: list[str] = []          # the backend's error log records (a failed control message)
        handler = logging.Handler(logging.ERROR)
        handler.emit = lambda record: self.logged_errors.append(record.getMessage())
        logging.getLogger("gpuxfer.sglang").addHandler(handler)

    # -- prefill

    def queue_add(self, plan):
        """``plan``: ``(room, prefill pages, tokens, chunk tokens)``: each request added to SGLang's
        ``PrefillBootstrapQueue``, which makes its ``KVSender``; their statuses."""
        out = {}
        for room, pages, tokens, chunk in plan:
            out[room] = _NAMES[self.driver.add(room, list(pages), tokens, chunk)]
            self.ends[room] = self.driver.reqs[room].disagg_kv_sender
        return out

    def queue_run(self, timeout):
        """``pop_bootstrapped`` and ``send_kv_chunk`` (per prefill chunk) until the queue is empty:
        ``{"left", "failed", "rows"}`` (:meth:`sglang_queues.QueueDriver.run`)."""
        return self.driver.run(timeout)

    def senders(self, rooms):
        for room in rooms:
            self.ends[room] = self.sender_cls(self.mgr, self.addr, room)
        return {room: self._poll_one(room)[0] for room in rooms}

    def send(self, plan, timeout):
        """``plan``: ``(room, prefill pages, aux row, chunk pages, action)``; action ``send``, ``abort`` (the
        prefill aborts it once the decode's pages arrived) or ``hold`` (nothing is sent)."""
        from sglang.srt.disaggregation.base.conn import KVPoll
        import numpy as np
        deadline = time.monotonic() + timeout
        todo = {p[0]: p for p in plan}
        while todo and time.monotonic() < deadline:
            for room, (_, pages, row, chunk, action) in list(todo.items()):
                s = self.ends[room]
                st = s.poll()
                if st == KVPoll.Failed:         # given up (the decode aborted it): the scheduler drops it
                    del todo[room]
                if st != KVPoll.WaitingForInput:
                    continue
                del todo[room]
                if action == "hold":
                    continue
                if action == "abort":
                    s.abort()
                    continue
                pages = np.asarray(pages, dtype=np.int32)
                self.meta.bootstrap_room[row, 0] = room     # what the scheduler's set_buf writes of the row
                s.init(len(pages), row)
                for i in range(0, len(pages), chunk):
                    s.send(pages[i:i + chunk])
            time.sleep(0.005)
        return sorted(todo)                 # rooms whose decode pages never arrived

    # -- decode

    def requests(self, plan, timeout):
        """``plan``: ``(room, prompt tokens)``: each request added to SGLang's ``DecodePreallocQueue`` (which
        makes its ``KVReceiver``), then the scheduler's ``process_decode_queue`` run until each request's pages
        and metadata row went to the prefill (``pop_preallocated``: the prefill's parallel info, the
        handshake, SGLang's allocators, ``send_metadata``) or the queue failed it. Returns room -> (decode
        pages, decode row, its receiver's status)."""
        rooms = [room for room, _ in plan]
        for room, tokens in plan:
            self.ends[room] = self.driver.add(room, tokens)
        d = self.driver
        if not d.until(lambda: all(r in d.sent or r in d.ended for r in rooms), timeout):
            raise TimeoutError(f"rooms {[r for r in rooms if r not in d.sent]} not preallocated in {timeout} s")
        for room in rooms:
            if room in d.sent:
                self.plan[room] = (None, *d.sent[room])
        return {room: (*d.sent.get(room, (None, None)), self._poll_one(room)[0]) for room in rooms}

    def finish(self, rooms, timeout):
        """``process_decode_queue`` until every room of ``rooms`` left SGLang's queues or ``timeout`` passed:
        room -> (``Success`` (``pop_transferred`` handed it to the decode batch) or ``Failed`` (its queue
        aborted it), seconds since it was added, SGLang's abort message), ``("Pending", None, None)`` where
        still queued."""
        d = self.driver
        d.until(lambda: all(r in d.ended for r in rooms), timeout)
        return {r: d.ended.get(r, ("Pending", None, None)) for r in rooms}

    def receivers(self, plan, timeout):
        """The benchmark's (scripts/sglang_backend_bench.py), which times the backend onto fixed pages: the
        decode queues' receiver calls made by hand. ``plan``: ``(room, prefill pages, decode pages, prefill
        aux row, decode aux row)``: each room's ``KVReceiver`` made, the prefill's parallel info fetched,
        ``init`` (the handshake), then ``send_metadata`` with the room's pages and row."""
        import numpy as np
        for room, src, dst, src_row, dst_row in plan:
            self.ends[room] = self.receiver_cls(self.mgr, self.addr, room)
            self.plan[room] = (src, dst, dst_row)
        deadline = time.monotonic() + timeout
        while not self.mgr.try_ensure_parallel_info(self.addr):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the prefill's bootstrap server at {self.addr} never answered")
            time.sleep(0.05)
        for room, *_ in plan:
            self.ends[room].init(0)
        for room, src, dst, src_row, dst_row in plan:
            self.ends[room].send_metadata(np.asarray(dst, dtype=np.int32), dst_row)
        return {room: self._poll_one(room)[0] for room, *_ in plan}

    def abort(self, rooms):
        """SGLang's ``Scheduler.abort_request`` for each room's request (its receiver aborted in the queue
        that holds it)."""
        for room in rooms:
            self.driver.sched.abort(f"req-{room}")

    def check(self, rooms, prefill_seed, unknown=(), src_rows=None, src_pages=None):
        """Every byte of each room of ``rooms`` (its decode pages and the metadata row the transfer queue read,
        or the row itself where no queue read it) against the prefill's; every other page and row against
        this rank's own bytes (nothing else was written), but those of the rooms in ``unknown`` (an outcome
        the test does not pin down) and of rooms an earlier call checked. ``src_rows`` / ``src_pages``: room
        -> the prefill's metadata row / pages (else those ``receivers`` was given)."""
        bad, checked = {}, 0
        skip_pages, skip_rows = set(), set()
        for room in rooms:
            src, dst, dst_row = self.plan[room]
            src = (src_pages or {}).get(room, src)
            src_row = (src_rows or {})[room]
            got = self.meta.got.get(room)
            if got is not None and got[0] != dst_row:
                raise AssertionError(f"room {room}: its row {got[0]} read, {dst_row} sent")
            wrong = 0
            for e, t in enumerate(self.kv):
                il = self.item_lens[e]
                want = kv_bytes(prefill_seed, e, self.pages * il, self.heads_at).view(self.pages, il)
                wrong += int((t.view(self.pages, il)[list(dst)].cpu() != want[list(src)]).sum())
                checked += len(dst) * il
            for j, (t, n) in enumerate(zip(self.aux, AUX_ITEM_LENS)):
                row = got[1][j] if got is not None else t.view(AUX_ROWS, n)[dst_row]
                wrong += int((row != aux_rows(prefill_seed, j, room, src_row)).sum())
                checked += n
            bad[room] = wrong
            skip_pages.update(dst)
            skip_rows.add(dst_row)
        self.landed.update(rooms)
        for room in {*unknown, *self.landed}:          # rooms checked by an earlier call hold the prefill's bytes
            skip_pages.update(self.plan[room][1])
            skip_rows.add(self.plan[room][2])
        keep = [p for p in range(self.pages) if p not in skip_pages]
        changed = 0
        for e, t in enumerate(self.kv):
            il = self.item_lens[e]
            own = kv_bytes(self.seed, e, self.pages * il, self.heads_at).view(self.pages, il)
            changed += int((t.view(self.pages, il)[keep].cpu() != own[keep]).sum())
        rows = [r for r in range(AUX_ROWS) if r not in skip_rows]
        for j, (t, n) in enumerate(zip(self.aux, AUX_ITEM_LENS)):
            changed += int((t.view(AUX_ROWS, n)[rows] != aux_rows(self.seed, j)[rows]).sum())
        return {"bad": bad, "checked": checked, "others_changed": changed}

    # -- the benchmark's (scripts/sglang_backend_bench.py)

    def scrub(self, pages):
        """Zero ``pages`` of every KV entry (a decode page that then holds the prefill's bytes was written)."""
        import torch
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.kv[0].device)
        for t, il in zip(self.kv, self.item_lens):
            t.view(self.pages, il).index_fill_(0, idx, 0)
        if self.kv[0].device.type == "cuda":
            torch.cuda.synchronize()

    def timings(self):
        """The host times of SGLang's ``KVSender.send`` and ``send_kv_chunk`` calls since the last call, and
        each room's first and last ``send_kv_chunk`` (``CLOCK_MONOTONIC``, comparable across processes)."""
        d = self.driver
        out = {"send_s": d.send_s, "chunk_s": d.chunk_s, "first_send": dict(d.first_send),
               "last_send": dict(d.last_send)}
        d.send_s, d.chunk_s = [], []
        d.first_send.clear()
        d.last_send.clear()
        return out

    def forward(self, seconds):
        """The prefill scheduler sleeps ``seconds`` before each chunk but the first (its forward pass)."""
        self.driver.forward_s = float(seconds)
        return self.driver.forward_s

    def watch_start(self, rooms):
        """A thread polling ``rooms``' receivers back to back, noting the clock when each is first Success
        or Failed (the decode scheduler polls once per iteration; this polls every ~20 us)."""
        import threading
        self._seen: dict[int, tuple] = {}
        left = set(rooms)

        def run():
            if getattr(self, "helper_cpus", None):
                os.sched_setaffinity(0, self.helper_cpus)
            deadline = time.monotonic() + 600
            while left and time.monotonic() < deadline:
                for room in list(left):
                    st = int(self.ends[room].poll())
                    if st in (0, 4):
                        self._seen[room] = (_NAMES[st], time.monotonic())
                        left.discard(room)
                time.sleep(20e-6)
        self._watch = threading.Thread(target=run, name="bench-watch", daemon=True)
        self._watch.start()

    def watch_result(self, timeout):
        self._watch.join(timeout)
        return dict(self._seen)

    def direct_push(self, src, dst, timeout):
        """``src`` pages pushed onto the decode's ``dst`` pages by this rank's ``KVAgent`` itself: one
        ``prepare`` + ``post`` + ``wait`` (the same agent, peer and pages the backend uses)."""
        import numpy as np
        from gpuxfer.integrations.sglang.layout import GROUP
        mgr = self.mgr
        with mgr._agent_lock:
            peer = next(iter(mgr.pushes._peers.values()))
            t0 = time.monotonic()
            x = mgr.agent.prepare(peer, "push", local_blocks={GROUP: np.asarray(src, dtype=np.int32)},
                                  remote_blocks={GROUP: np.asarray(dst, dtype=np.int32)}, name="direct")
            t1 = time.monotonic()
            h = x.post()
            t2 = time.monotonic()
            h.wait(timeout)
            t3 = time.monotonic()
        return {"prepare_s": t1 - t0, "post_s": t2 - t1, "total_s": t3 - t0}

    def drop_success(self, on):
        """Prefill: from now on drop (``on``) or send again the Success status messages to the decode, as if
        lost on the way (a decode then ends its rooms by their notification alone)."""
        mgr = self.mgr
        if not on:
            mgr.__dict__.pop("send_kv_status_message", None)
            return False
        from sglang.srt.disaggregation.base.conn import KVPoll
        send = type(mgr).send_kv_status_message.__get__(mgr)

        def dropping(**kw):
            if kw.get("status") != KVPoll.Success:
                send(**kw)
        mgr.send_kv_status_message = dropping
        return True

    def trace_on(self):
        """Note the clock (``CLOCK_MONOTONIC``) at the backend's steps of a request, for the benchmark's
        ``--trace``: the prefill's chunk queued, each post's start and end, the room's drain (its posts waited
        for) and its conclusion; the decode's metadata row and status arriving. :meth:`trace` returns them."""
        from gpuxfer.integrations.sglang import inbox
        self._marks: list[tuple] = []
        mgr, marks = self.mgr, self._marks

        def wrap(name, obj=mgr, room=lambda a, k: a[0], label=None):
            fn, label = getattr(obj, name), label or name

            def traced(*a, **k):
                r = room(a, k)
                marks.append((label, r, time.monotonic()))
                c0 = time.thread_time()
                try:
                    return fn(*a, **k)
                finally:
                    marks.append((label + ".end", r, time.monotonic()))
                    # the calling thread's own CPU time in it: the rest it waited (the GIL, the device)
                    marks.append((label + ".cpu", r, time.thread_time() - c0))
            setattr(obj, name, traced)
        if self.role == "prefill":
            wrap("add_transfer_request", room=lambda a, k: k.get("bootstrap_room", a[0] if a else None))
            wrap("_post", obj=mgr.pushes, room=lambda a, k: a[0].room)
            wrap("_drain", obj=mgr.pushes)
            wrap("_send_aux", obj=mgr.pushes, room=lambda a, k: a[0].room)
            if mgr.aux_rows is not None:    # the rows written into the decode's host memory before the last push
                wrap("write", obj=mgr.aux_rows, room=lambda a, k: None, label="row_write")
            wrap("conclude_transfer", room=lambda a, k: k.get("bootstrap_room"))
        else:
            wrap("write_aux_rows", obj=inbox, room=lambda a, k: None, label="row_from_message")
            if mgr.inbox.rows is not None:      # the row's stamp (and the row) read once the word grew, then taken
                wrap("take", obj=mgr.inbox.rows, room=lambda a, k: None, label="row_from_agent")
                wrap("stamp", obj=mgr.inbox.rows, room=lambda a, k: None, label="row_stamp_read")
                wrap("row", obj=mgr.inbox.rows, room=lambda a, k: None, label="row_read")
            wrap("end_by_word", obj=mgr.inbox)
            wrap("apply_prefill_status", room=lambda a, k: k.get("bootstrap_room"))
        return True

    def trace(self):
        """The marks since :meth:`trace_on` or the last call: ``[(step, room, clock)]``."""
        out, self._marks[:] = list(self._marks), []
        return out

    def routes(self):
        """Whether this rank's agent has a NIXL side, the route each decode rank was added on (prefill), and the
        backend's error log records so far."""
        return {"nixl": self.mgr.agent.nixl is not None,
                "peers": {s: p.route for s, p in getattr(getattr(self.mgr, "pushes", None), "_peers", {}).items()},
                "errors": list(self.logged_errors)}

    def control(self):
        """This rank's control socket (the KV manager's ZMQ PULL socket): its port, its ``MAXMSGSIZE`` and the
        port published for it (a prefill's: what its bootstrap server holds for the rank; a decode's: what its
        registration message names); from now on each message the manager's control thread receives is noted
        (:meth:`control_seen`)."""
        import zmq
        mgr = self.mgr
        if self.role == "prefill":
            published = self.server.prefill_port_table[0][0][self.tp_rank][0].rank_port
        else:
            published = int(mgr.build_receiver_registration_message()[2])
        sock = mgr.server_socket
        if not isinstance(sock, _SeenSocket):
            self._control_seen: list = []
            mgr.server_socket = sock = _SeenSocket(sock, self._control_seen)
        self._control_seen.clear()
        return {"port": mgr.rank_port, "max_msg_size": sock.getsockopt(zmq.MAXMSGSIZE), "published": published}

    def control_seen(self):
        """The messages the control thread received since :meth:`control`: ``(first frame, frame sizes)``."""
        return list(self._control_seen)

    def cpu(self):
        from gpuxfer.bench.cpus import current_cpu, python_speed_us
        return {"cpu": current_cpu(), "python_us": python_speed_us()}

    # -- both

    def _poll_one(self, room):
        st = int(self.ends[room].poll())
        return _NAMES[st], st

    def await_status(self, rooms, name, timeout):
        """Poll until every room of ``rooms`` is in status ``name``; the rooms that never got there."""
        deadline = time.monotonic() + timeout
        left = set(rooms)
        while left and time.monotonic() < deadline:
            left = {r for r in left if _NAMES[int(self.ends[r].poll())] != name}
            time.sleep(0.005)
        return sorted(left)

    def wait(self, rooms, timeout):
        """Poll ``rooms`` until each is Success or Failed or ``timeout`` passed: ``{room: (status, seconds)}``."""
        t0 = time.monotonic()
        out = {}
        while True:
            for room in rooms:
                if room in out:
                    continue
                st = int(self.ends[room].poll())
                if st in (0, 4):
                    out[room] = (_NAMES[st], round(time.monotonic() - t0, 3))
            if len(out) == len(rooms) or time.monotonic() - t0 > timeout:
                break
            time.sleep(0.005)
        for room in rooms:
            out.setdefault(room, (_NAMES[int(self.ends[room].poll())], None))
        return out

    def clear(self, rooms):
        for room in rooms:
            if self.role == "prefill":
                self.driver.release(room)
            end = self.ends.pop(room)
            if int(end.poll()) == 0:
                try:
                    end.failure_exception()
                except Exception as exc:            # SGLang's KVTransferError: the reason, reported
                    self.reasons[room] = str(exc)
            else:
                end.clear()
        return {room: self.reasons.get(room) for room in rooms}

    def close(self):
        if self.backend == "gpuxfer":
            self.mgr.teardown()
        # else the process's exit releases the reference backend's threads and sockets, as a server's shutdown
        # does (Mooncake's teardown, meant for a role switch, destroys its ZMQ context under a polling thread)
        if self.server is not None:
            self.server.close()


_NAMES = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


class _SeenSocket:
    """A KV manager's control socket whose received messages are noted (first frame's first 32 bytes, the frames'
    sizes); anything else is the socket's."""

    def __init__(self, sock, seen: list):
        self._sock, self._seen = sock, seen

    def recv_multipart(self, *args, **kwargs):
        msg = self._sock.recv_multipart(*args, **kwargs)
        self._seen.append((bytes(msg[0][:32]) if msg else b"", [len(m) for m in msg]))
        return msg

    def __getattr__(self, name):
        return getattr(self._sock, name)


def serve(conn, spec: dict) -> None:
    os.environ.update(spec["env"])
    sys.path.insert(0, STUBS)
    state = None
    try:
        main_cpu = None
        if spec.get("cpus"):                # (rank, world): pinned as a benchmark rank with --cpus auto is
            from gpuxfer.bench.cpus import pin, pin_auto
            part, placed = pin_auto(*spec["cpus"], None)
            if part is not None and placed and spec.get("cpu_mode", "split") == "split" and len(part) > 1:
                # a server's scheduler thread has a core of its own; the threads the rank starts (SGLang's
                # and the backend's) inherit the rest of the part, never the scheduler's core
                main_cpu = placed["cpu"]
                pin(set(part) - {main_cpu})
        from sglang.srt.plugins import load_plugins
        load_plugins()                      # what every SGLang process does first: the entry point registers
        state = _State(spec)
        if main_cpu is not None:
            state.helper_cpus = os.sched_getaffinity(0)
            pin((main_cpu,))
        conn.send(("ready", {"session": getattr(state.mgr, "session_id", None), "pid": os.getpid()}))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        if not conn.poll(600):
            break                           # the parent is gone or stuck: never outlive it by much
        cmd, args = conn.recv()
        if cmd == "close":
            state.close()
            conn.send(("closed", None))
            break
        try:
            conn.send(("ok", getattr(state, cmd)(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
