#!/usr/bin/env python3
"""GpuxferConnector under vLLM 0.33's real Scheduler: what a decode instance's engine thread waits for.

Each run starts a prefill and a decode instance afresh (two processes, tests/integrations/vllm_instance.py:
the real ``Scheduler``, KV caches allocated by vLLM's own code, a config-only Llama of ``--layers`` layers,
fp16, 2 KV heads of 16), each with an empty Triton kernel cache, then loads on the decode side:

* the **first** request after startup (its handshake, the peer's mapping and the first read included);
* ``--warm`` more single requests, one after another (the warm case);
* ``--batch`` requests arriving in one scheduler step, ``--batch-steps`` times (the first such step grows the
  route's launch slots to the batch's size, a cost paid once; the later ones are the steady state).

Per run it reports, from the decode instance: ``start_load_kv`` host time per step with one load and per
extra request in a batched step; ``get_finished`` (``get_transfer_results``) host time per step while loads
are in flight; each request's time from ``start_load_kv`` to ``get_finished`` reporting it done (the
first vs the warm median); the handshake; and every loaded byte checked against what the prefill wrote.
After the loads (``--loop``), the decode process times the same read back to back (prepare, post, wait):
what the calls cost in that process without the scheduler's work between them; then again with 64 MiB of
memory written before each read (the CPU's caches then hold other data, as after a scheduler step).
Targets (issue #34, p90 over the runs): ``start_load_kv`` <= 100 us, <= 20 us per extra request,
``get_finished`` <= 20 us, first request within 50 ms of the warm case, 0 wrong bytes.

    python scripts/vllm_connector_bench.py --device cuda --tokens 32768 --runs 3 --out out.json
    python scripts/vllm_connector_bench.py --device host --tokens 2048 --layers 4 --runs 1 --out o.json
    python scripts/vllm_connector_bench.py --device host --engine triton --ids device ...   # on the host emulation

``--connector nixl`` runs vLLM's own NixlConnector on the same instances and caches instead (the baseline a
vLLM user has: NIXL 1.5.1 over UCX, its side channel on a free port), with the same loads, timings and byte
checks (no ``--loop``: it times gpuxfer's calls). ``--remote nixl`` runs gpuxfer's connector with every peer on
the agent's NIXL route (``remote``/``route`` nixl: how it reads from another host).

``--ids`` sets the connector's ``device_ids``: ``auto`` (its default: a step's several reads of one prefill
engine with their block IDs on the device, a lone read with host IDs), ``host`` (false) or ``device`` (true:
on the device wherever it can -- the triton engine, kernel blocks alike on both sides). Each run's ``path``
column says how its loads went (``dev``: every load with device IDs, ``host``: every load with host IDs,
``mixed``).

Needs vLLM importable (docs/VLLM.md). Exit status 1 on a wrong byte or a failed load, 2 on bad options.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integrations"))
sys.path.insert(0, os.path.join(HERE, ".."))

#: the memory the flushed read loop writes before each read: more than the CPU's caches hold
FLUSH_MB = 64
TARGETS = {"start_load_kv_us": 100.0, "extra_request_us": 20.0, "get_finished_us": 20.0, "first_minus_warm_ms": 50.0}


from gpuxfer.bench.cpus import machine_line as cpus  # noqa: E402
from gpuxfer.bench.cliutil import json_path_option  # noqa: E402
from gpuxfer.bench.report import nearest_rank as pct  # noqa: E402
from gpuxfer.errors import BadInput  # noqa: E402


def _inline(a, dev: str) -> bool:
    """Whether the decode instance's loads run on its engine thread (the connector's ``loader`` setting)."""
    return a.connector == "gpuxfer" and (a.loader == "inline" or (a.loader == "auto" and dev == "cpu"))


def _gpu_mib(pid) -> int | None:
    """The GPU memory process ``pid`` holds (its CUDA context and allocations), as nvidia-smi reports it."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        p, _, mib = line.partition(",")
        if p.strip() == str(pid) and mib.strip().isdigit():
            return int(mib)
    return None


def one_run(a, run: int, model: str, env: dict, dev: str, per_req_blocks: int) -> dict:
    from vllm_instance import Instance, free_port
    env = dict(env, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="gpuxfer-triton-"))    # a fresh kernel cache
    total = 1 + a.warm + a.batch * a.batch_steps
    blocks = max(4096, 2 * total * per_req_blocks + 16)
    t0 = time.perf_counter()
    nixl = a.connector == "nixl"
    extra = {} if nixl else {"token_major": True, "device_ids": {"host": False, "device": True, "auto": "auto"}[a.ids]}
    if a.engine != "auto" and not nixl:
        extra["engine"] = a.engine
    if a.loader != "auto" and not nixl:
        extra["loader"] = a.loader
    inline = _inline(a, dev)
    if a.remote == "nixl":
        extra.update(remote="nixl", route="nixl")
    kw = dict(extra=extra, device=dev, num_blocks=blocks, max_model_len=a.tokens + 64,
              shm_caches=a.engine == "triton" and dev == "cpu", connector=a.connector)
    envs = [dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())) if nixl else env for _ in range(2)]
    auto = a.cpus == "auto"
    P = Instance(f"bP{run}", model, a.block_size, cpus=(0, 2) if auto else None, env=envs[0], **kw)
    D = Instance(f"bD{run}", model, a.block_size, cpus=(1, 2) if auto else None, profile=a.profile and not nixl,
                 env=envs[1], count_calls=a.calls and not nixl, **kw)
    yardstick = []
    try:
        P.ready(timeout=600)
        D.ready(timeout=600)
        startup = time.perf_counter() - t0
        loader_mib = _gpu_mib(D.call("loader_pid")) if not inline and dev == "cuda" else None
        reqs = [(f"r{run}-{i}", a.tokens, 1000 * run + i) for i in range(total)]
        res = P.run("prefill", [(r, n, s, None) for r, n, s in reqs], timeout=600)
        D.call("stats", True)
        loads: dict[str, dict] = {}
        b0 = 1 + a.warm
        phases = [reqs[:1]] + [[r] for r in reqs[1:b0]] + [reqs[b0 + i * a.batch:b0 + (i + 1) * a.batch]
                                                           for i in range(a.batch_steps if a.batch else 0)]
        for phase in phases:
            yardstick.append(D.call("cpu"))         # (pinned: onto the fastest of its cores now)
            out = D.run("decode", [(f"d-{r}", n, s, res[r]["params"]) for r, n, s in phase], timeout=600)
            loads.update(out)
        yardstick.append(D.call("cpu"))
        st = D.call("stats", True)["stats"]
        loops = a.loop if a.connector == "gpuxfer" and inline else 0
        loop = D.call("read_loop", a.tokens // a.block_size, loops, timeout=600) if loops else None
        cold = D.call("read_loop", a.tokens // a.block_size, loops, FLUSH_MB, timeout=600) if loops else None
        P.call("idle", 60, timeout=120)
    finally:
        P.close()
        D.close()
    first = loads.get(f"d-{reqs[0][0]}", {})
    warm = [loads.get(f"d-{r}", {}).get("load_s") for r, _, _ in reqs[1:1 + a.warm]]
    warm = [w for w in warm if w is not None]
    slk = st.get("start_load_kv_s", [])
    single = [x[1] for x in slk if x[0] == 1]
    batched = [(x[0], x[1]) for x in slk if x[0] > 1]
    # the single loads timed while the CPU ran at its fast speed (yardstick within 1.25x of the run's fastest)
    ys = [x[2] for x in slk if len(x) > 2]
    fast = [x[1] for x in slk[1:] if x[0] == 1 and len(x) > 2 and x[2] <= 1.25 * min(ys)] if ys else []
    s_med = statistics.median(single[1:] or single) if single else None
    # per extra request of each batched step: the first grows the route's launch slots to the batch's size
    # (once), the later ones are the steady state
    extra = [(t - s_med) / (n - 1) for n, t in batched] if s_med is not None else []
    steady = extra[1:] or extra
    us = lambda x: None if x is None else 1e6 * x          # noqa: E731
    return {
        "run": run, "startup_s": startup, "python_us": statistics.median(y["python_us"] for y in yardstick),
        "decode_cpus": sorted({y["cpu"] for y in yardstick if y["cpu"] is not None}),
        "start_load_kv_us_p50": us(pct(single[1:], 0.5)), "start_load_kv_us_p90": us(pct(single[1:], 0.9)),
        "start_load_kv_first_us": us(single[0]) if single else None,
        "start_load_kv_fast_cpu_us_p50": us(pct(fast, 0.5)), "start_load_kv_fast_cpu_n": len(fast),
        "step_python_us": [round(y, 1) for y in ys],
        # the garbage collector's time inside the timed calls (the heap frozen at startup, as vLLM does)
        "start_load_kv_gc_us": [round(1e6 * x[3], 1) for x in slk if len(x) > 3 and x[3] > 0],
        "get_finished_gc_us": [round(1e6 * x, 1) for x in st.get("get_finished_gc_s", []) if x > 0],
        "extra_request_us": us(max(steady)) if steady else None,
        "extra_request_first_us": us(extra[0]) if extra else None,
        # the engine thread's own CPU time inside the same calls (time.thread_time): the rest of a call's time it
        # waited (for the GIL another thread of the process held, or for a CPU)
        "start_load_kv_cpu_us_p50": us(pct([x[4] for x in slk[1:] if x[0] == 1 and len(x) > 4], 0.5)),
        "start_load_kv_cpu_us_p90": us(pct([x[4] for x in slk[1:] if x[0] == 1 and len(x) > 4], 0.9)),
        "get_finished_cpu_us_p50": us(pct(st.get("get_finished_cpu_s", []), 0.5)),
        "get_finished_cpu_us_p90": us(pct(st.get("get_finished_cpu_s", []), 0.9)),
        "get_finished_us_p50": us(pct(st.get("get_finished_s", []), 0.5)),
        "get_finished_us_p90": us(pct(st.get("get_finished_s", []), 0.9)),
        "loader_gpu_mib": loader_mib,
        "sched_load_us_p50": us(pct(st.get("sched_load_s", []), 0.5)),
        "sched_load_us_p90": us(pct(st.get("sched_load_s", []), 0.9)),
        "post_host_us_p50": us(pct(st.get("post_host_s", []), 0.5)),
        "post_host_us_p90": us(pct(st.get("post_host_s", []), 0.9)),
        "first_load_ms": 1e3 * first["load_s"] if "load_s" in first else None,
        "warm_load_ms": 1e3 * statistics.median(warm) if warm else None,
        "handshake_ms": 1e3 * st["handshake_s"][0] if st.get("handshake_s") else None,
        "calls_us": {k: {"n": len(v), "p50": us(pct(v, 0.5)), "p90": us(pct(v, 0.9))}
                     for k, v in st.get("calls_s", {}).items()},
        "calls_n": _calls_row(st.get("calls_n", [])),
        "device_id_loads": st.get("device_id_loads", 0), "host_id_loads": st.get("host_id_loads", 0),
        "path": _path(st.get("device_id_loads", 0), st.get("host_id_loads", 0)),
        "wrong_bytes": sum(v.get("bad", 0) for v in loads.values()),
        "checked_bytes": sum(v.get("checked", 0) for v in loads.values()),
        "failed": sorted(r for r, v in loads.items() if v.get("load") != "ok"),
        "read_loop": _loop_row(loop), "read_loop_flushed": _loop_row(cold),
        "samples": {"start_load_kv_s": st.get("start_load_kv_s", []), "get_finished_s": st.get("get_finished_s", []),
                    "load_s": {r: v.get("load_s") for r, v in loads.items()}},
    }


def _calls_row(counts: list) -> dict | None:
    """``--calls``: the median Python calls (and C calls) of ``start_load_kv`` with one load (after the first) and
    per extra request of a batched step, and of ``get_finished`` where it reported loads done and where not."""
    if not counts:
        return None
    med = lambda xs: statistics.median(xs) if xs else None          # noqa: E731
    slk = [c for c in counts if c[0] == "start_load_kv" and c[1]]
    one = [c for c in slk if c[1] == 1][1:]
    py1, c1 = med([c[2] for c in one]), med([c[3] for c in one])
    extra = [(c[2] - py1) / (c[1] - 1) for c in slk if c[1] > 1] if py1 is not None else []
    gf = [c for c in counts if c[0] == "get_finished"]
    done = [c for c in gf if c[1]]
    return {"start_load_kv_py": py1, "start_load_kv_c": c1, "extra_request_py": extra[1:] or extra,
            "get_finished_done_py": med([c[2] for c in done]), "get_finished_done_c": med([c[3] for c in done]),
            "get_finished_done_per_load_py": med([c[2] / c[1] for c in done]),
            "get_finished_idle_py": med([c[2] for c in gf if not c[1]]),
            "get_finished_idle_c": med([c[3] for c in gf if not c[1]])}


def _loop_row(loop: dict | None) -> dict | None:
    """A ``read_loop``'s p50 and p90 of each call (us) and the yardstick before and after it."""
    if loop is None:
        return None
    us = lambda x: 1e6 * x          # noqa: E731
    return {"prepare_us_p50": us(pct(loop["prepare_s"], 0.5)), "prepare_us_p90": us(pct(loop["prepare_s"], 0.9)),
            "post_us_p50": us(pct(loop["post_s"], 0.5)), "post_us_p90": us(pct(loop["post_s"], 0.9)),
            "python_us": [round(loop["python_us"], 1), round(loop["python_us_end"], 1)]}


def _path(device: int, host: int) -> str:
    """How a run's loads went: ``dev`` (block IDs on the device), ``host`` or ``mixed``."""
    return "mixed" if device and host else "dev" if device else "host" if host else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "host"), default="cuda")
    ap.add_argument("--tokens", type=int, default=32768, help="prompt tokens per request (default 32768)")
    ap.add_argument("--layers", type=int, default=32, help="model layers (default 32)")
    ap.add_argument("--block-size", type=int, default=64, help="vLLM block size on both instances (default 64)")
    ap.add_argument("--warm", type=int, default=5, help="single requests after the first (default 5)")
    ap.add_argument("--batch", type=int, default=8, help="requests loaded in one step (default 8; 0: none)")
    ap.add_argument("--batch-steps", type=int, default=2,
                    help="steps of --batch requests each (default 2: the first grows the route's launch slots to "
                         "the batch's size, once; extra/rq is the later steps', x_1st the first's)")
    ap.add_argument("--runs", type=int, default=3, help="runs, each with fresh instances (default 3)")
    ap.add_argument("--engine", choices=("auto", "triton", "copy_engine"), default="auto",
                    help="the decode side's engine (default auto: triton on GPUs, copy_engine on the host emulation; "
                         "triton there puts the caches in the platform's shared memory and runs Triton interpreted)")
    ap.add_argument("--ids", choices=("auto", "host", "device"), default="auto",
                    help="the connector's device_ids: auto (default, the connector's): a step's several reads of "
                         "one engine with their block IDs on the device, a lone read with host IDs; host: every "
                         "read with host IDs (false); device: on the device wherever the engine allows (true)")
    ap.add_argument("--loader", choices=("auto", "inline", "process"), default="auto",
                    help="where the decode side's loads run: on the engine thread (inline) or in the connector's "
                         "loader process (process); auto (the connector's default): process on a GPU, inline on the "
                         "host emulation (kv_connector_extra_config loader)")
    ap.add_argument("--connector", choices=("gpuxfer", "nixl"), default="gpuxfer",
                    help="gpuxfer (default): GpuxferConnector; nixl: vLLM's own NixlConnector on the same instances and "
                         "caches (needs the nixl wheel), the baseline")
    ap.add_argument("--remote", choices=("none", "nixl"), default="none",
                    help="gpuxfer's connector: none (default: the IPC route on one host), or nixl: every peer on the "
                         "agent's NIXL route, as for a prefill on another host")
    ap.add_argument("--cpus", choices=("auto", "none"), default="auto",
                    help="auto (default): each instance's engine thread pinned to the fastest, by a Python yardstick, "
                         "of physical cores of its own, the decode side picked again before each phase; none: the "
                         "scheduler places them")
    ap.add_argument("--loop", type=int, default=20,
                    help="after the loads, time this many reads of a request's blocks back to back in the decode "
                         "engine's process (prepare, then post_many of one; 0: none): the same calls as a load's "
                         "without the scheduler's work between them (default 20)")
    ap.add_argument("--calls", action="store_true",
                    help="count the Python and C calls of the decode engine thread inside start_load_kv and "
                         "get_finished (sys.setprofile; the times are then the profiler's): medians per lone load, "
                         "per extra request, per get_finished that reported loads and per idle one")
    ap.add_argument("--profile", action="store_true",
                    help="time each call a load makes inside the decode engine (the connector, the agent, the ID "
                         "checks, the driver calls): their medians are printed and kept in the JSON (calls_us)")
    ap.add_argument("--out", required=True, help="JSON file to write (must not exist)")
    a = ap.parse_args(argv)
    for k in ("tokens", "layers", "block_size", "runs"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if a.warm < 1 or a.batch < 0 or a.batch == 1 or a.batch_steps < 1:
        ap.error("--warm must be >= 1, --batch 0 or >= 2 and --batch-steps >= 1")
    if a.connector == "nixl" and (a.remote != "none" or a.ids != "auto" or a.engine != "auto" or a.profile
                                  or a.loader != "auto"):
        ap.error("--remote, --ids, --engine, --loader and --profile are options of gpuxfer's connector, not of "
                 "--connector nixl")
    try:        # checked before the runs, which take minutes: a new file in an existing, writable directory
        json_path_option(a.out, option="--out")
    except BadInput as exc:
        ap.error(str(exc))
    from vllm_instance import write_model

    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    dev = "cuda" if a.device == "cuda" else "cpu"
    if a.device == "host":
        env.update(GPUXFER_PLATFORM="host", VLLM_TARGET_DEVICE="cpu", UCX_NET_DEVICES="lo")
    model = write_model(tempfile.mkdtemp(prefix="gpuxfer-vllm-model-"), num_hidden_layers=a.layers,
                        max_position_embeddings=a.tokens + 64)
    kv_bytes = a.tokens * a.layers * 2 * 2 * 16 * 2
    name = "vLLM's NixlConnector (baseline)" if a.connector == "nixl" else (
        "GpuxferConnector" + (" over the agent's NIXL route" if a.remote == "nixl" else ""))
    print(f"# vllm connector bench: {name}; vLLM 0.33 Scheduler, {a.device}, python {platform.python_version()}")
    print(f"# CPUs: {cpus()}")
    print(f"# request: {a.tokens} tokens x {a.layers} layers, fp16, 2 KV heads x 16, block {a.block_size} "
          f"({kv_bytes / 2**20:.1f} MiB of KV); per run: 1 first + {a.warm} warm + {a.batch_steps} steps of {a.batch}; "
          f"{a.runs} runs, fresh instances and Triton cache each")
    print(f"# decode engine {a.engine}, block IDs {a.ids} (path per run: dev = on the device, host = on the host); "
          f"loads {'on the engine thread' if _inline(a, dev) else 'in the loader process'} (--loader {a.loader})")
    print(f"# CPU placement: {'each engine thread pinned (auto)' if a.cpus == 'auto' else 'the scheduler (none)'}; "
          "py_us: the Python yardstick (gpuxfer.bench.cpus.python_speed_us) on the decode thread's CPU, median")
    print("# times: host time of the decode engine thread's connector calls (us); load = start_load_kv -> "
          "reported done (ms)")
    hdr = (f"{'run':>3} {'start_s':>8} {'slk_p50':>8} {'slk_p90':>8} {'slk_1st':>9} {'extra/rq':>8} {'x_1st':>7} {'gf_p50':>7} "
           f"{'gf_p90':>7} {'1st_ms':>8} {'warm_ms':>8} {'hs_ms':>7} {'py_us':>6} {'wrong':>6} {'path':>5}")
    print(hdr)
    rows = []
    for run in range(a.runs):
        r = one_run(a, run, model, env, dev, a.tokens // a.block_size + 2)
        rows.append(r)
        f = lambda v, w, p=1: f"{v:>{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"  # noqa: E731
        print(f"{run:>3} {f(r['startup_s'], 8)} {f(r['start_load_kv_us_p50'], 8)} {f(r['start_load_kv_us_p90'], 8)} "
              f"{f(r['start_load_kv_first_us'], 9)} {f(r['extra_request_us'], 8)} {f(r['extra_request_first_us'], 7)} {f(r['get_finished_us_p50'], 7)} "
              f"{f(r['get_finished_us_p90'], 7)} {f(r['first_load_ms'], 8, 2)} {f(r['warm_load_ms'], 8, 2)} "
              f"{f(r['handshake_ms'], 7)} {f(r['python_us'], 6)} {r['wrong_bytes']:>6} {r['path']:>5}", flush=True)
    pool = lambda key: [x for r in rows for x in r["samples"][key]]      # noqa: E731
    single = [x[1] for r in rows for x in r["samples"]["start_load_kv_s"][1:] if x[0] == 1]
    summary = {
        "start_load_kv_us": 1e6 * pct(single, 0.9) if single else None,
        "extra_request_us": pct([r["extra_request_us"] for r in rows if r["extra_request_us"] is not None], 0.9),
        "get_finished_us": 1e6 * pct(pool("get_finished_s"), 0.9) if pool("get_finished_s") else None,
        "first_minus_warm_ms": pct([r["first_load_ms"] - r["warm_load_ms"] for r in rows
                                    if r["first_load_ms"] is not None and r["warm_load_ms"] is not None], 0.9),
    }
    wrong = sum(r["wrong_bytes"] for r in rows)
    failed = [x for r in rows for x in r["failed"]]
    print("# start_load_kv (one load) on steps whose yardstick was within 1.25x of the run's fastest, p50: "
          + ", ".join(f"run {r['run']}: " + ("-" if r["start_load_kv_fast_cpu_us_p50"] is None else
                      f"{r['start_load_kv_fast_cpu_us_p50']:.0f} us of {r['start_load_kv_fast_cpu_n']}")
                      for r in rows)
          + "; step yardsticks (us): " + " | ".join(f"{min(r['step_python_us'], default=0):.0f}-"
                                                   f"{max(r['step_python_us'], default=0):.0f}" for r in rows))
    print("# the garbage collector inside the timed calls (heap frozen at startup, as vLLM does), per run: "
          + " | ".join(f"start_load_kv {len(r['start_load_kv_gc_us'])} of {len(r['samples']['start_load_kv_s'])} "
                       f"calls (max {max(r['start_load_kv_gc_us'], default=0):.0f} us), get_finished "
                       f"{len(r['get_finished_gc_us'])} of {len(r['samples']['get_finished_s'])} "
                       f"(max {max(r['get_finished_gc_us'], default=0):.0f} us)" for r in rows))
    print("# the engine thread's own CPU time inside the calls (time.thread_time; the rest it waited: for the GIL or "
          "a CPU), p50 / p90 per run (us): start_load_kv (one load) "
          + " | ".join(f"{r['start_load_kv_cpu_us_p50'] or 0:.0f} / {r['start_load_kv_cpu_us_p90'] or 0:.0f} "
                       f"of {r['start_load_kv_us_p50'] or 0:.0f} / {r['start_load_kv_us_p90'] or 0:.0f}" for r in rows)
          + "; get_finished " + " | ".join(f"{r['get_finished_cpu_us_p50'] or 0:.0f} / "
                                           f"{r['get_finished_cpu_us_p90'] or 0:.0f} of {r['get_finished_us_p50'] or 0:.0f}"
                                           f" / {r['get_finished_us_p90'] or 0:.0f}" for r in rows))
    where = "inside start_load_kv" if _inline(a, dev) else "in the loader process"
    print(f"# a read's pairing, prepare and post per load ({where}), p50 / p90 per run (us): "
          + " | ".join(f"{r['post_host_us_p50'] or 0:.0f} / {r['post_host_us_p90'] or 0:.0f}" for r in rows))
    if not _inline(a, dev):
        print("# the loader process's GPU memory (nvidia-smi; its CUDA context, beside vLLM's budget), per run (MiB): "
              + " | ".join(str(r["loader_gpu_mib"]) for r in rows))
    print("# the decode scheduler side's update_state_after_alloc per request loaded (the params checked, the load "
          "made" + ("" if _inline(a, dev) else ", its loader record") + "), p50 / p90 per run (us): "
          + " | ".join(f"{r['sched_load_us_p50'] or 0:.0f} / {r['sched_load_us_p90'] or 0:.0f}" for r in rows))
    for key, what in (("read_loop", "back to back"), ("read_loop_flushed", f"with {FLUSH_MB} MiB written before each")):
        loops = [r[key] for r in rows if r[key]]
        if loops:
            print(f"# the same read in the decode engine's process, {what} (--loop), p50 / p90 per run (us): prepare "
                  + " | ".join(f"{x['prepare_us_p50']:.0f} / {x['prepare_us_p90']:.0f}" for x in loops)
                  + "; post_many " + " | ".join(f"{x['post_us_p50']:.0f} / {x['post_us_p90']:.0f}" for x in loops)
                  + "; yardstick before / after " + " | ".join(f"{x['python_us'][0]:.0f} / {x['python_us'][1]:.0f}"
                                                               for x in loops))
    for r in rows:
        if r["calls_n"]:
            print(f"# calls (--calls; Python / C) run {r['run']}: " + ", ".join(
                f"{k} {v if not isinstance(v, list) else [round(x, 1) for x in v]}" for k, v in r["calls_n"].items()))
    if a.profile:
        print("# inside the decode engine, per call (us, p50 / p90 over the runs' calls; nested calls included "
              "in their callers):")
        names = sorted({k for r in rows for k in r["calls_us"]})
        for k in names:
            cells = [r["calls_us"][k] for r in rows if k in r["calls_us"]]
            print(f"#   {k:<32} " + " | ".join(f"{c['p50']:8.1f} / {c['p90']:8.1f} ({c['n']})" for c in cells))
    print("# targets, p90 over the runs:")
    verdicts = {}
    for k, target in TARGETS.items():
        v = summary[k]
        verdicts[k] = "n/a" if v is None else ("met" if v <= target else "MISSED")
        print(f"#   {k:22s} {'-' if v is None else f'{v:.1f}':>9} (target <= {target:g}) {verdicts[k]}")
    ok = wrong == 0 and not failed
    print(f"# block IDs: on the device for {sum(r['device_id_loads'] for r in rows)} loads, on the host for "
          f"{sum(r['host_id_loads'] for r in rows)}")
    print(f"# wrong bytes: {wrong} of {sum(r['checked_bytes'] for r in rows)} checked; failed loads: {len(failed)}")
    print(f"# {'PASS' if ok else 'FAIL'}")
    with open(a.out, "x") as fh:
        json.dump({"params": vars(a), "cpus": cpus(), "summary": summary,
                   "path": _path(sum(r["device_id_loads"] for r in rows), sum(r["host_id_loads"] for r in rows)), "verdicts": verdicts, "wrong_bytes": wrong,
                   "failed": failed, "runs": rows}, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
