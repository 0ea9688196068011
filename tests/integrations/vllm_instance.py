"""A vLLM 0.33 instance without a model, for the connector's tests: the real ``Scheduler`` and the
connector's worker side in one spawned process, in EngineCore's order (worker connector, caches
registered, scheduler, the worker's handshake metadata to the scheduler side, the startup heap frozen
out of the garbage collector's scans as vLLM's ``freeze_gc_heap``), with KV caches in
vLLM's shapes laid out by vLLM's own planning and view code. A "model" writes known bytes into a
request's blocks whenever it is scheduled; a finished load is checked byte by byte.

With ``tp`` N > 1 the process runs N worker-side connectors, one per tensor parallel rank, each made while
vLLM's tensor parallel group says that rank (:func:`_as_rank`) and each with caches of its own holding its
shard of the KV heads (the "model" writes each head's own bytes). Every step runs each rank's connector; their
outputs go to the scheduler through vLLM's own ``KVOutputAggregator``, and the ranks' handshake metadata
through ``set_xfer_handshake_metadata_pp_aware`` keyed ``(0, rank)``, as EngineCore gathers them.

The parent drives it over a pipe (:class:`Instance`); the child runs :func:`serve`.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import sys
import time
import traceback

import multiprocessing as mp


def ctx():
    return mp.get_context("spawn")

MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_hidden_layers": 4, "vocab_size": 1000, "max_position_embeddings": 8192,
                "torch_dtype": "float16"}


def write_model(path: str, **overrides) -> str:
    """The model's config.json (no weights); ``overrides`` change its keys (``num_hidden_layers=32``)."""
    import json
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**MODEL_CONFIG, **overrides}, f)
    return path


class Instance:
    """The parent's handle on one instance process."""

    def __init__(self, name: str, model_dir: str, block_size: int, *, hybrid: bool = False,
                 extra: dict | None = None, num_blocks: int = 4096, env: dict | None = None, device: str = "cpu",
                 max_model_len: int = 8192, cpus: tuple[int, int] | None = None, profile: bool = False,
                 shm_caches: bool = False, connector: str = "gpuxfer", tp: int = 1, count_calls: bool = False):
        """``cpus``: ``(rank, world)`` to place the instance as a benchmark rank with ``--cpus auto`` does
        (:func:`gpuxfer.bench.cpus.auto_cpus`: physical cores of its own; the engine thread pinned to the fastest,
        the threads the engine starts on all of them); None: the scheduler places it. ``profile``: time the calls a
        load makes inside the engine (:func:`_profile`, under ``stats["calls_s"]``). ``shm_caches``: on the host
        emulation, the caches in the platform's shared memory (the triton engine reaches a peer's caches only
        there). ``connector``: ``"gpuxfer"``, or ``"nixl"``
        for vLLM's own NixlConnector on the same caches (a baseline; its side channel on a free port). ``tp``: the
        tensor parallel size (one worker-side connector per rank in the process). ``count_calls``: count the Python
        and C calls the engine thread makes inside ``start_load_kv`` and ``get_transfer_results`` (``sys.setprofile``,
        under ``stats["calls_n"]``; their timings are then the profiler's, not the product's)."""
        self.name = name
        self.conn, child = ctx().Pipe()
        spec = dict(name=name, model_dir=model_dir, block_size=block_size, hybrid=hybrid, extra=extra or {},
                    num_blocks=num_blocks, env=env or {}, device=device, max_model_len=max_model_len, cpus=cpus,
                    profile=profile, shm_caches=shm_caches, connector=connector, tp=tp, count_calls=count_calls)
        self.proc = ctx().Process(target=serve, args=(child, spec), name=f"vllm-{name}", daemon=True)
        self.proc.start()
        child.close()

    def ready(self, timeout: float = 300.0) -> dict:
        return self._reply("ready", timeout)

    def _reply(self, want: str, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"instance {self.name}: no {want!r} within {timeout} s")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"instance {self.name} failed:\n{payload}")
        assert kind == want, (kind, payload)
        return payload

    def call(self, op: str, *args, timeout: float = 120.0):
        self.conn.send((op, args))
        return self._reply(op, timeout)

    def run(self, op: str, *args, timeout: float = 120.0) -> dict:
        """Add requests (``prefill`` / ``decode``) and wait until every one of them finished."""
        self.conn.send((op, args))
        return self._reply(op, timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=30)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit", ()))
            except OSError:
                pass
            self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=30)


@contextlib.contextmanager
def running(specs: dict[str, dict]):
    """Instances started together (``{name: Instance's keyword arguments}``, ``model_dir`` and ``block_size`` among
    them), each ready (its ``info``), closed whatever happened; each process must have exited."""
    out: dict[str, Instance] = {}
    try:
        for name, kw in specs.items():
            out[name] = Instance(name, **kw)
        for i in out.values():
            i.info = i.ready(timeout=600)
        yield out
    finally:
        for i in out.values():
            i.close()
    for i in out.values():
        assert i.proc.exitcode is not None, f"instance {i.name} did not exit"


def free_port() -> int:
    """A TCP port of 127.0.0.1 nobody listens on (free when this returns)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def prefill(P: Instance, reqs, timeout: float = 300) -> dict:
    """Prefill ``reqs`` (id, prompt tokens, seed) on ``P`` for remote decode; returns {id: kv_transfer_params}."""
    res = P.run("prefill", [(r, n, s, None) for r, n, s in reqs], timeout=timeout)
    for r, v in res.items():
        assert v.get("finished") == "length", (r, v)
        assert v["params"] and v["params"]["do_remote_prefill"], (r, v)
    return {r: v["params"] for r, v in res.items()}


def decode(D: Instance, reqs, params: dict, timeout: float = 300) -> dict:
    """Decode requests reading the prefill requests of the same seed; returns the instance's results."""
    return D.run("decode", [(f"d-{r}", n, s, params[r]) for r, n, s in reqs], timeout=timeout)


def prompt_tokens(n_tokens: int, seed: int) -> list[int]:
    """The prompt of a request of ``n_tokens`` and ``seed`` (the instances' requests are made of it)."""
    return [(seed + i) % 900 + 1 for i in range(n_tokens)]


def resealed(P: Instance, params: dict) -> dict:
    """``params`` a test altered, sealed again with ``P``'s seal key, as ``P`` would have made them (a stand-in for
    genuine params naming what the test wants: a rank that went away)."""
    from gpuxfer.integrations.vllm.params import parse_remote_prefill, seal_of
    key = bytes.fromhex(P.call("seal_key"))
    rp = parse_remote_prefill(params, params["remote_block_sizes"])
    return dict(params, remote_seal=seal_of(rp, key).hex())


def assert_loaded(res: dict) -> None:
    for r, v in res.items():
        assert v.get("load") == "ok", (r, v)
        assert v["bad"] == 0 and v["checked"] > 0, (r, v)
        assert v.get("finished") == "length", (r, v)


def assert_idle(I: Instance, timeout: float = 60) -> dict:
    """Step ``I`` until it holds nothing; its free blocks are those it started with."""
    s = I.call("idle", timeout, timeout=timeout + 30)
    assert s["requests"] == 0, s
    assert s["free"] == I.info["free"], s
    return s


def assert_failed(D: Instance, res: dict) -> None:
    """Every load of ``res`` failed and vLLM computed the prompt itself; ``D`` holds no block for them."""
    for r, v in res.items():
        assert v.get("load") == "failed" and v.get("finished") == "length", (r, v)
    assert D.call("stats")["free"] == D.info["free"]


def lease_runs_out(P: Instance, D: Instance, reqs, ranks: int = 1) -> None:
    """Prefill ``reqs`` under a 1 s lease nobody reads within: the prefill frees their blocks (its counter, of
    each of its ``ranks`` tensor parallel ranks, says so); loading them on ``D`` then fails, and vLLM computes
    the prompts."""
    before = P.call("stats")["stats"].get("leases_expired", 0)
    P.call("set_lease", 1.0)
    try:
        params = prefill(P, reqs)
        time.sleep(1.5)
        s = assert_idle(P, timeout=30)
        assert s["stats"]["leases_expired"] == before + ranks * len(reqs)
        res = decode(D, reqs, params)
    finally:
        P.call("set_lease", 120.0)
    assert_failed(D, res)


def prefill_dies(P: Instance, D: Instance, reqs) -> None:
    """Prefill ``reqs``, kill ``P``, then load them on ``D``: every load fails well within a minute, no hang."""
    params = prefill(P, reqs)
    P.kill()
    time.sleep(1.0)             # the kill reaches the decode side as a closed side channel
    t0 = time.monotonic()
    res = decode(D, reqs, params, timeout=120)
    assert time.monotonic() - t0 < 60
    assert_failed(D, res)


def loader_dies(P: Instance, D: Instance, reqs, later, timeout: float = 120) -> None:
    """``D``'s loader process killed right after the loads of ``reqs`` (prefilled on ``P``) were handed to it: each
    load is reported within ``timeout``, loaded with every byte right or failed; the loads of ``later`` fail at once;
    both instances free their blocks (``P``'s by a short lease: no decode lets go of them)."""
    import signal
    P.call("set_lease", 3.0)
    params = prefill(P, reqs + later)
    D.call("submit", "decode", [(f"d-{r}", n, s, params[r]) for r, n, s in reqs])
    os.kill(D.call("loader_pid"), signal.SIGKILL)
    names = [f"d-{r}" for r, _, _ in reqs]
    end = time.monotonic() + timeout
    out = D.call("results", names)
    while any("load" not in v for v in out.values()) and time.monotonic() < end:
        time.sleep(0.2)
        out = D.call("results", names)
    for r, v in out.items():
        assert v.get("load") == "failed" or (v.get("load") == "ok" and v["bad"] == 0), (r, v)
    res = decode(D, later, params, timeout=timeout)
    assert all(v.get("load") == "failed" for v in res.values()), res
    logs = "\n".join(D.call("logs"))
    assert "loader process" in logs and "is lost" in logs
    assert_idle(D, timeout=60)
    assert_idle(P, timeout=60)
    P.call("set_lease", 120.0)


# ---------------------------------------------------------------------------------------------- child


class _Errors(logging.Handler):
    """The connector's warnings and errors in this process, for the parent's ``logs`` (the last 1000)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines = self.lines[-999:] + [record.getMessage()]


def serve(conn, spec: dict) -> None:
    os.environ.update(spec["env"])
    errors = _Errors()
    logging.getLogger("gpuxfer.vllm").addHandler(errors)
    try:
        part = None
        if spec.get("cpus"):
            from gpuxfer.bench.cpus import auto_cpus, pin
            # (pin_auto in two steps: the threads the engine starts -- the side channel's -- keep the instance's
            # part of the cores; the engine thread is then pinned to the fastest of them)
            part = auto_cpus(*spec["cpus"], None)
            pin(part)
        eng = _Engine(spec)
        pick = None
        if part is not None:
            from gpuxfer.bench.cpus import pin_fastest
            pick = pin_fastest(part)
        eng.cpus = None if pick is None else (part, pick)
        if pick is not None:
            eng.place_loader(pick["cpu"])
        eng.errors = errors
        conn.send(("ready", eng.describe()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        eng.loop(conn)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        eng.close()


def _pattern(torch, seed: int, layer: int, tokens, heads: int, cbytes: int, head0: int = 0):
    """The bytes of ``heads`` KV heads from ``head0`` on (a tensor parallel rank's shard) of ``tokens``."""
    t = tokens.view(-1, 1, 1)
    h = torch.arange(head0, head0 + heads, device=tokens.device).view(1, -1, 1)
    c = torch.arange(cbytes, device=tokens.device).view(1, 1, -1)
    return ((seed * 97 + layer * 31 + t * 7 + h * 13 + c) % 251).to(torch.uint8)


class _Engine:
    def __init__(self, spec: dict):
        import torch
        self.stats_calls: dict[str, list] = {}
        self.count_calls = bool(spec.get("count_calls"))
        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                                 SchedulerConfig, VllmConfig)
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager

        self.torch = torch
        self.name = spec["name"]
        bs = spec["block_size"]
        max_len = spec.get("max_model_len", 8192)
        mc = ModelConfig(model=spec["model_dir"], skip_tokenizer_init=True, dtype="float16", seed=0,
                         max_model_len=max_len)
        cache = CacheConfig(block_size=bs, cache_dtype="auto", enable_prefix_caching=False)
        cache.kv_cache_layout = "LBHNC"                 # what the CPU attention backend resolves to
        self.nixl = spec.get("connector") == "nixl"
        if self.nixl:
            ktc = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both", engine_id=spec["name"],
                                   kv_load_failure_policy="recompute", kv_buffer_device=spec["device"],
                                   kv_connector_extra_config=spec["extra"])
        else:
            ktc = KVTransferConfig(kv_connector="GpuxferConnector",
                                   kv_connector_module_path="gpuxfer.integrations.vllm", kv_role="kv_both",
                                   engine_id=spec["name"], kv_load_failure_policy="recompute",
                                   kv_connector_extra_config=spec["extra"])
        sc = SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=4096, max_model_len=max_len,
                             is_encoder_decoder=False, disable_hybrid_kv_cache_manager=not spec["hybrid"])
        self.tp = tp = spec.get("tp", 1)
        self.config = VllmConfig(model_config=mc, cache_config=cache, scheduler_config=sc, kv_transfer_config=ktc,
                                 device_config=DeviceConfig("cpu"),
                                 parallel_config=ParallelConfig(tensor_parallel_size=tp))
        import json
        with open(os.path.join(spec["model_dir"], "config.json")) as f:
            model = json.load(f)
        hd = model["hidden_size"] // model["num_attention_heads"]
        heads = mc.get_num_kv_heads(self.config.parallel_config)        # one rank's shard of the KV heads
        # rank r's first head: r * H // TP (vLLM's QKVParallelLinear; with more ranks than heads, replicas of one
        # head on neighbouring ranks)
        self.head0 = [r * mc.get_total_num_kv_heads() // tp for r in range(tp)]
        layer_specs = {}
        for i in range(model["num_hidden_layers"]):
            name = f"model.layers.{i}.self_attn.attn"
            if spec["hybrid"] and i % 2:
                layer_specs[name] = SlidingWindowSpec(block_size=bs, num_kv_heads=heads, head_size=hd,
                                                      dtype=torch.float16, sliding_window=2 * bs + 8)
            else:
                layer_specs[name] = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=hd,
                                                      dtype=torch.float16)
        groups = get_kv_cache_groups(self.config, layer_specs)
        page = sum(layer_specs[g.layer_names[0]].page_size_bytes for g in groups[:1]) * max(
            len(g.layer_names) for g in groups)
        self.kv_cache_config = get_kv_cache_config_from_groups(self.config, groups, page * spec["num_blocks"])
        self.kv_cache_config.kv_cache_layout = "LBHNC"
        self.config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.device = torch.device(spec["device"], 0) if spec["device"] == "cuda" else torch.device("cpu")
        if spec["device"] == "cuda":
            torch.cuda.set_device(0)
        self._bufs = []
        self.rank_caches = [self._allocate(KVCacheLayout.LBHNC, spec.get("shm_caches", False)) for _ in range(tp)]
        self.caches = self.rank_caches[0]
        if self.nixl:
            _single_rank_groups(self.config)
        self.workers = []
        for rank, caches in enumerate(self.rank_caches):
            with _as_rank(rank, tp):
                w = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
            w.register_kv_caches(caches)
            self.workers.append(w)
        self.worker = self.workers[0]
        if spec.get("profile"):
            _profile(self.worker, self.stats_calls)
        self.sched = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_cache_config, log_stats=True,
                               structured_output_manager=StructuredOutputManager(self.config),
                               block_size=bs)
        # EngineCore's gathering: each worker's metadata by (pipeline rank, tensor rank)
        self.sched.connector.set_xfer_handshake_metadata_pp_aware(
            {(0, r): w.get_handshake_metadata() for r, w in enumerate(self.workers)})
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        self.aggregator = KVOutputAggregator.from_connector(self.sched.connector,
                                                            self.config.parallel_config.world_size)
        # what EngineCore and the GPU worker do once made: the startup heap frozen, out of the collector's scans
        from vllm.utils.gc_utils import freeze_gc_heap
        freeze_gc_heap()
        self.gc_s = 0.0                                 # seconds in the collector since startup
        gc.callbacks.append(self._gc_timer)
        self.layer_groups = [list(g.layer_names) for g in self.kv_cache_config.kv_cache_groups]
        self.layer_index = {n: i for i, n in enumerate(layer_specs)}
        self.bs = bs
        self.seeds: dict[str, int] = {}
        self.prompt: dict[str, int] = {}
        self.results: dict[str, dict] = {}
        self.waiting: set[str] = set()
        self.stats: dict = {}
        _time_scheduler_loads(self.sched.connector, self.stats)
        self.load_t0: dict[str, float] = {}

    def _gc_timer(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t0

    def _allocate(self, layout, shm: bool):
        """vLLM's allocation: one int8 backing buffer viewed per layer by vLLM's own code. The buffer is the
        host platform's shared memory where asked or where the platform cannot reach a plain tensor of another
        process."""
        from vllm.v1.worker.utils import allocate_kv_cache
        from vllm.v1.kv_cache_interface import create_kv_cache_views
        torch = self.torch
        if self.device.type == "cuda" or (not shm and _plain_tensors_exportable()):
            return allocate_kv_cache(self.kv_cache_config, self.device, layout)
        from gpuxfer.platforms import current
        plat = current()
        size = self.kv_cache_config.kv_cache_tensors[0].size
        buf = plat.alloc(size, 0)
        self._bufs.append(buf)
        raw = plat.as_tensor(buf, torch.int8, (size,), 0)
        raw.zero_()
        caches = {}
        for tensor in self.kv_cache_config.kv_cache_tensors:
            gid = next(i for i, g in enumerate(self.kv_cache_config.kv_cache_groups) if tensor.layers[0] in g.layer_names)
            spec = self.kv_cache_config.kv_cache_groups[gid].kv_cache_spec
            views = create_kv_cache_views(raw, spec, self.kv_cache_config.num_blocks_of(tensor), layout, tensor)
            caches.update(zip(tensor.layers, views))
        return caches

    def describe(self) -> dict:
        return {"block_size": self.bs, "groups": [len(g) for g in self.layer_groups],
                "num_blocks": self.kv_cache_config.num_blocks, "free": self.free_blocks(),
                "heads": [int(c[self.layer_groups[0][0]].shape[1]) for c in self.rank_caches]}

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    # ------------------------------------------------------------------ model stand-in

    def _tokens(self, rid: str, g: int, upto: int):
        """(kernel block index, token in block, token) of tokens [0, upto) of request ``rid`` in group ``g``,
        skipping null blocks."""
        torch = self.torch
        ids = self.sched.kv_cache_manager.get_block_ids(rid)[g]
        t = torch.arange(min(upto, len(ids) * self.bs), device=self.device)     # a chunked prefill holds fewer
        man = torch.as_tensor(ids, dtype=torch.int64, device=self.device)[t // self.bs]
        keep = man != 0
        t, man = t[keep], man[keep]
        view = self.caches[self.layer_groups[g][0]]
        n = view.shape[2]
        r = self.bs // n
        return man * r + (t % self.bs) // n, t % n, t

    def _access(self, rid: str, upto: int, check: bool) -> tuple[int, int]:
        torch = self.torch
        bad = total = 0
        for g, names in enumerate(self.layer_groups):
            k, n, t = self._tokens(rid, g, upto)
            for name in names:
                for rank, caches in enumerate(self.rank_caches):
                    v = caches[name].view(self.torch.uint8)
                    heads = v.shape[1]
                    pat = _pattern(self.torch, self.seeds[rid], self.layer_index[name], t, heads, v.shape[3],
                                   head0=self.head0[rank])
                    if check:
                        got = v[k, :, n, :]
                        bad += int((got != pat).sum())
                        total += got.numel()
                    else:
                        v[k, :, n, :] = pat
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return bad, total

    def place_loader(self, cpu: int | None) -> None:
        """The decode worker's loader process (if any) on the instance's cores other than the engine thread's."""
        w = getattr(self.worker, "_worker", None)
        proc = getattr(w.decode, "proc", None) if w is not None else None
        part = self.cpus[0] if self.cpus else None
        rest = set(part or ()) - {cpu}
        if proc is not None and rest:
            try:
                os.sched_setaffinity(proc.pid, rest)
            except OSError:
                pass

    # ------------------------------------------------------------------ stepping

    def add(self, kind: str, reqs: list) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request
        for rid, n_tokens, seed, params in reqs:
            sp = SamplingParams(max_tokens=1)
            sp.update_from_generation_config({}, 999)
            req = Request(request_id=rid, prompt_token_ids=prompt_tokens(n_tokens, seed),
                          sampling_params=sp, pooling_params=None, mm_features=None)
            req.kv_transfer_params = dict(params) if params is not None else (
                {"do_remote_decode": True, "do_remote_prefill": False} if kind == "prefill" else None)
            self.seeds[rid], self.prompt[rid] = seed, n_tokens
            self.sched.add_request(req)
            self.waiting.add(rid)

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
        so = self.sched.schedule()
        for rid in so.num_scheduled_tokens:             # the "model": this request's KV, whole prompt
            self._access(rid, self.prompt[rid], check=False)
        meta = so.kv_connector_metadata
        loads = [ld.req_id for ld in getattr(meta, "loads", ())] or list(getattr(meta, "reqs_to_recv", ()))
        n_loads = len(loads)
        t0 = time.perf_counter()
        for rid in loads:
            self.load_t0.setdefault(rid, t0)
        reqs = list(so.num_scheduled_tokens)
        # a token is sampled only where the step reached the end of the prompt (not after a partial prefill)
        sampled = [[7] if self.sched.requests[r].num_computed_tokens >= self.sched.requests[r].num_tokens else []
                   for r in reqs]
        rank_outs, start_s, finished_s, gc_start, gc_finished = [], 0.0, 0.0, 0.0, 0.0
        start_cpu, finished_cpu = 0.0, 0.0      # the engine thread's CPU time in them (time.thread_time)
        counts = self.stats.setdefault("calls_n", []) if self.count_calls else None
        for w in self.workers:                          # each rank's worker, as each rank's process runs it
            w.bind_connector_metadata(meta)
            gc0 = self.gc_s
            c0 = time.thread_time()
            t0 = time.perf_counter()
            if counts is None:
                w.start_load_kv(None)
            else:
                _call(w.start_load_kv, (None,), counts, "start_load_kv", n_loads)
            t1 = time.perf_counter()
            c1 = time.thread_time()
            gc1 = self.gc_s
            w.wait_for_save()
            c2 = time.thread_time()
            t2 = time.perf_counter()
            gc2 = self.gc_s
            if counts is None:          # (no wrapper in the timed calls)
                res = w.get_transfer_results(so.finished_req_ids)
            else:
                res = _call(w.get_transfer_results, (so.finished_req_ids,), counts, "get_finished", None)
            t3 = time.perf_counter()
            c3 = time.thread_time()
            start_s, finished_s = start_s + t1 - t0, finished_s + t3 - t2
            start_cpu, finished_cpu = start_cpu + c1 - c0, finished_cpu + c3 - c2
            gc_start, gc_finished = gc_start + gc1 - gc0, gc_finished + self.gc_s - gc2
            kv_out = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                       finished_recving=res.finished_recving or None,
                                       failed_recving=res.failed_recving,
                                       invalid_block_ids=w.get_block_ids_with_load_errors(),
                                       kv_connector_stats=w.get_kv_connector_stats())
            w.clear_connector_metadata()
            rank_outs.append(ModelRunnerOutput(req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
                                          sampled_token_ids=sampled, kv_connector_output=kv_out))
        out = self.aggregator.aggregate(rank_outs)      # what the executor hands the scheduler
        kv = out.kv_connector_output
        recving, failed = kv.finished_recving or set(), kv.failed_recving or set()
        if n_loads:
            from gpuxfer.bench.cpus import python_speed_us
            # the CPU's speed right after the timed calls (a VM's vCPU changes speed within seconds); the
            # collector's seconds inside the call
            self.stats.setdefault("start_load_kv_s", []).append((n_loads, start_s, python_speed_us(rounds=1), gc_start,
                                                                 start_cpu))
        if self.load_t0 or recving:
            self.stats.setdefault("get_finished_s", []).append(finished_s)
            self.stats.setdefault("get_finished_cpu_s", []).append(finished_cpu)
            self.stats.setdefault("get_finished_gc_s", []).append(gc_finished)
        if self.stats_calls:
            calls = self.stats.setdefault("calls_s", {})
            for k, v in self.stats_calls.items():
                calls.setdefault(k, []).extend(v)
            self.stats_calls.clear()
        if kv.kv_connector_stats is not None:
            for k, v in kv.kv_connector_stats.data.items():
                if isinstance(v, list):
                    self.stats.setdefault(k, []).extend(v)
                else:
                    self.stats[k] = self.stats.get(k, 0) + v
        t3 = time.perf_counter()
        for rid in recving:
            if rid in failed:
                self.load_t0.pop(rid, None)
                self.results.setdefault(rid, {})["load"] = "failed"
            else:
                load_s = t3 - self.load_t0.pop(rid, t3)     # start_load_kv -> reported done
                bad, total = self._access(rid, self.prompt[rid] - 1, check=True)
                self.results.setdefault(rid, {}).update(load="ok", bad=bad, checked=total, load_s=load_s)
        outs = self.sched.update_from_output(so, out)
        for eco in outs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    r = self.results.setdefault(o.request_id, {})
                    r["finished"] = str(o.finish_reason)
                    r["params"] = o.kv_transfer_params
                    self.waiting.discard(o.request_id)

    def read_loop(self, blocks: int, iterations: int, flush_mb: int = 0) -> dict:
        """The read a load makes, back to back in this process: each prepared (block IDs in hand -> ready) and
        posted (``post_many`` of one) by the worker's agent, then waited for; the host seconds of each call.
        Blocks 1..``blocks`` of the first known prefill engine into ours (a measuring aid for after the run's
        loads were checked: it overwrites those blocks). ``flush_mb``: before each read (untimed), write that
        many MiB of memory of this process, so the read starts with the CPU's caches holding other data."""
        import numpy as np
        from gpuxfer.bench.cpus import python_speed_us
        worker = self.worker._worker
        peer = next(r.peer for r in worker.decode.remotes.values() if r.peer is not None)
        ids = {"g0": np.arange(1, blocks + 1, dtype=np.int64)}
        agent = worker.agent
        out = {"prepare_s": [], "post_s": [], "python_us": python_speed_us(rounds=1)}
        junk = np.zeros(flush_mb << 17, dtype=np.int64)
        for _ in range(iterations):
            if flush_mb:
                junk += 1
            t0 = time.perf_counter()
            x = agent.prepare(peer, "pull", local_blocks=ids, remote_blocks=ids, name="read-loop")
            t1 = time.perf_counter()
            [h] = agent.post_many([x])
            t2 = time.perf_counter()
            h.wait(60)
            out["prepare_s"].append(t1 - t0)
            out["post_s"].append(t2 - t1)
        out["python_us_end"] = python_speed_us(rounds=1)
        return out

    def loop(self, conn) -> None:
        pending: tuple | None = None         # (op, request ids) the parent waits on
        while True:
            if conn.poll(0 if self.sched.has_requests() else 0.02):
                op, args = conn.recv()
                if op == "exit":
                    return
                if op in ("prefill", "decode"):
                    self.add(op, args[0])
                    pending = (op, [r[0] for r in args[0]])
                elif op == "abort":
                    from vllm.v1.request import RequestStatus
                    self.sched.finish_requests(args[0], RequestStatus.FINISHED_ABORTED)
                    for rid in args[0]:
                        self.results.setdefault(rid, {})["finished"] = "abort"
                        self.waiting.discard(rid)
                    conn.send(("abort", None))
                elif op == "submit":                  # add without waiting for the requests
                    self.add(args[0], args[1])
                    conn.send(("submit", None))
                elif op == "submit_abort":            # add, run one step, abort them: mid-prefill or mid-load
                    from vllm.v1.request import RequestStatus
                    self.add(args[0], args[1])
                    self.step()
                    rids = [r[0] for r in args[1]]
                    states = {r: self.sched.requests[r].status.name for r in rids if r in self.sched.requests}
                    self.sched.finish_requests(rids, RequestStatus.FINISHED_ABORTED)
                    for rid in rids:
                        self.results.setdefault(rid, {})["finished"] = "abort"
                        self.waiting.discard(rid)
                    conn.send(("submit_abort", states))
                elif op == "idle":                    # step until nothing is held, then report
                    deadline = time.monotonic() + args[0]
                    while self.sched.has_requests() and time.monotonic() < deadline:
                        self.step()
                    conn.send(("idle", {"requests": len(self.sched.requests), "free": self.free_blocks(),
                                        "stats": self.stats}))
                elif op == "cpu":                     # pinned: move to the fastest of its cores now
                    from gpuxfer.bench.cpus import fastest_cpu, pin, python_speed_us
                    part = self.cpus[0] if self.cpus and self.cpus[0] else None
                    if part:
                        cpu, us, _ = fastest_cpu(part)
                        pin((cpu,))
                        self.place_loader(cpu)
                        conn.send(("cpu", {"cpu": cpu, "python_us": us}))
                    else:
                        conn.send(("cpu", {"cpu": None, "python_us": python_speed_us()}))
                elif op == "read_loop":               # args: (blocks, iterations[, MiB to flush])
                    conn.send(("read_loop", self.read_loop(*args)))
                elif op == "logs":                    # the connector's warnings and errors since the last call
                    conn.send(("logs", self.errors.lines))
                    self.errors.lines = []
                elif op == "results":                 # what requests added by ``submit`` came to
                    conn.send(("results", {r: self.results.get(r, {}) for r in args[0]}))
                elif op == "set_lease":
                    self.sched.connector._scheduler.lease_s = args[0]
                    conn.send(("set_lease", None))
                elif op == "loader_pid":              # the decode worker's loader process, if it has one
                    proc = getattr(self.worker._worker.decode, "proc", None)
                    conn.send(("loader_pid", None if proc is None else proc.pid))
                elif op == "seal_key":
                    conn.send(("seal_key", self.sched.connector._scheduler.seal_key.hex()))
                elif op == "stats":                   # args: (True,) to start counting anew
                    agent = None if self.nixl else self.worker._worker.agent
                    routes = {p.route for p in agent.peers.values()} if agent is not None else {"nixl"}
                    # per rank: requests decode ranks let go of that this rank does not hold (a word that came
                    # before the hold, or one too many)
                    unheld = [len(w._worker.prefill.early) for w in self.workers] if not self.nixl else []
                    conn.send(("stats", {"requests": len(self.sched.requests), "free": self.free_blocks(),
                                         "stats": self.stats, "routes": routes, "unheld": unheld}))
                    if args and args[0]:
                        self.stats.clear()
            if self.sched.has_requests():
                self.step()
            if pending is not None and not (set(pending[1]) & self.waiting):
                conn.send((pending[0], {r: self.results.get(r, {}) for r in pending[1]}))
                pending = None

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        if self._bufs:
            for caches in self.rank_caches:
                caches.clear()
            for buf in self._bufs:
                buf.close()


@contextlib.contextmanager
def _as_rank(rank: int, world: int):
    """vLLM's tensor parallel group as rank ``rank`` of ``world`` sees it, for the worker connector made inside
    (each rank of a real engine makes its connector in its own process, after the group exists; this process
    stands in for all of them). Only the group's rank and size: what a connector reads of it. An engine of one
    rank keeps vLLM's state as it is."""
    if world == 1:
        yield
        return
    import types
    from vllm.distributed import parallel_state as ps
    saved = ps._TP, ps._PP
    ps._TP = types.SimpleNamespace(rank_in_group=rank, world_size=world)
    ps._PP = types.SimpleNamespace(rank_in_group=0, world_size=1)
    try:
        yield
    finally:
        ps._TP, ps._PP = saved


def _single_rank_groups(config) -> None:
    """The one-rank tensor and pipeline parallel groups vLLM's NixlConnector asks for (a gloo world of one)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ensure_model_parallel_initialized(1, 1)


def _call(f, args: tuple, counts: list, name: str, n_loads: int | None):
    """``f(*args)``, and the Python and C calls the thread made inside it (``sys.setprofile``) appended to ``counts``
    as ``(name, n_loads, Python calls, C calls)``; ``n_loads`` None: the loads the result reports done. A measuring
    aid of the benchmark."""
    n = [0, 0]

    def prof(frame, event, arg):
        if event == "call":
            n[0] += 1
        elif event == "c_call":
            n[1] += 1
    sys.setprofile(prof)
    try:
        res = f(*args)
    finally:
        sys.setprofile(None)
    if n_loads is None:
        n_loads = len(res.finished_recving or ()) if res is not None else 0
    counts.append((name, n_loads, n[0] - 1, n[1]))       # (less the call of f itself)
    return res


def _time_scheduler_loads(connector, stats: dict) -> None:
    """The scheduler side's seconds in ``update_state_after_alloc`` for each request that loads (its share of a
    load's host time: the params checked, the load made, its loader record where loads go to a loader process),
    under ``sched_load_s`` in ``stats`` (taken when the stats are)."""
    f = connector.update_state_after_alloc

    def timed(request, blocks, num_external_tokens):
        t = time.perf_counter()
        try:
            return f(request, blocks, num_external_tokens)
        finally:
            if num_external_tokens > 0:
                stats.setdefault("sched_load_s", []).append(time.perf_counter() - t)
    connector.update_state_after_alloc = timed


def _profile(connector, acc: dict) -> None:
    """Time, inside this engine, each call a load makes on its way from ``start_load_kv`` to the driver (the
    connector's worker side, the agent, the ID checks, the slot and the driver calls the post makes): every
    call's seconds under its name in ``acc``. A measuring aid of the benchmark, not of the product."""
    import gpuxfer.integrations.vllm.channel as kc
    import gpuxfer.integrations.vllm.holds as kh
    import gpuxfer.integrations.vllm.loader as klo
    import gpuxfer.integrations.vllm.loads as kl
    import gpuxfer.integrations.vllm.ring as kr
    import gpuxfer.integrations.vllm.staging as kst
    import gpuxfer.integrations.vllm.worker as wk
    import gpuxfer.kv.agent as ka
    import gpuxfer.kv.batch as kb
    import gpuxfer.kv.device_ids as kd
    import gpuxfer.kv.ids as ki
    import gpuxfer.kv.request_arrays as ks

    def timed(name, f):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc.setdefault(name, []).append(time.perf_counter() - t)
        return wrapper

    for owner, attr in ((kst, "pair_group"), (kl.DecodeLoads, "start"), (kl.DecodeLoads, "_post"),
                        (kl, "pair_load"), (kl, "prepare_each_host"),
                        (kl, "prepare_on_device"), (kst.IdStaging, "take"), (kst.IdStaging, "send"),
                        (wk.WorkerSide, "poll"), (kh.PrefillHolds, "drain"), (kl.DecodeLoads, "finished"),
                        (kc.SideChannelClient, "notify"), (ka.KVAgent, "prepare"), (ka.KVAgent, "post_many"),
                        (ka, "prepare_device"), (kd._DeviceIdTransfer, "_post_locked"), (kb, "post_together"),
                        (ki._RouteIds, "check"), (ks.RequestStaging, "stage"), (kb, "run_in_slot"),
                        (kb, "_post_route"), (klo.LoaderClient, "start"), (klo, "encode_loads"),
                        (kr.ShmRing, "put"), (klo.LoaderClient, "finished")):
        setattr(owner, attr, timed(f"{getattr(owner, '__name__', owner)}.{attr}", getattr(owner, attr)))
    agent = connector._worker.agent
    calls = agent._poster.calls
    for attr in ("copy", "launch_graph"):
        if getattr(calls, attr, None) is not None:
            setattr(calls, attr, timed(f"driver.{attr}", getattr(calls, attr)))
    for attr in ("record_event", "event_query", "copy_async"):
        setattr(agent.platform, attr, timed(f"driver.{attr}", getattr(agent.platform, attr)))


def _plain_tensors_exportable() -> bool:
    """Whether the platform can hand another process a plain torch CPU tensor's memory."""
    from gpuxfer.errors import NotExportable
    from gpuxfer.platforms import current
    import torch
    t = torch.zeros(4096, dtype=torch.int8)
    try:
        current().export_range(t.data_ptr(), t.numel(), 0)
    except NotExportable:
        return False
    return True
