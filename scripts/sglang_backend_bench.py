#!/usr/bin/env python3
"""gpuxfer's SGLang 0.5.23 transfer backend under SGLang's own prefill queue: host time per ``send()`` chunk,
and a whole request's transfer beside the same request moved by ``KVAgent`` directly; ``--backend mooncake``:
SGLang's built-in Mooncake backend in the same harness on the same buffers, the reference (no direct push).

One device, two processes (tests/integrations/sglang_instance.py): a prefill rank running SGLang's
``PrefillBootstrapQueue`` and its scheduler's ``send_kv_chunk`` with SGLang's real bootstrap server, a decode
rank replaying the decode queues' calls, the backend chosen by name through the plugin. The KV pool has
kv-dsv4-like geometry (``gpuxfer.bench.kv.model``'s ``kv-dsv4``: 30 compressed-attention layers at 576 B per
4 tokens, their 30 indexer layers at 132 B per 4 tokens, 31 heavily-compressed layers at one 576 B entry per
page), one buffer per layer as SGLang's MLA pool hands it over, every entry paged alike; the 128-token
sliding window is left out (SGLang keeps it as a state buffer, which the backend does not move yet).

Per request (``--repeats`` of them, after one warm-up request not counted):

* ``send_us``: host time of each ``KVSender.send`` call SGLang's ``send_kv_chunk`` makes (one per
  ``--chunk-tokens`` chunk of chunked prefill; the last carries the metadata row), and of ``send_kv_chunk``;
* ``request_ms``: from the first ``send_kv_chunk`` to the decode rank's ``KVPoll.Success`` (its receiver
  polled back to back; both clocks ``CLOCK_MONOTONIC``);
* ``direct_ms``: the same pages moved onto the same decode pages by the prefill's ``KVAgent`` itself, one
  ``prepare`` + ``post`` + ``wait`` of one push;
* ``tail_ms``: from the last ``send_kv_chunk`` to the decode's ``KVPoll.Success``: with ``--forward-ms``
  (the scheduler sleeping between chunks, standing in for their forward passes) the earlier chunks move while
  the next ones are computed, and the tail is what the request waits for once its prefill is done, against
  ``direct_ms``, what moving the whole request then costs;
* every byte of every decode page and of the metadata row checked after each (the decode pages zeroed
  before each).

Targets (issue #39, p90 over the repeats): ``send()`` <= 100 us; the request within 100 us of the direct push.
Mooncake runs over TCP (``MC_FORCE_TCP=1``: its wheel ``mooncake-transfer-engine-non-cuda``, where no system
libibverbs is found with NIXL's bundled copy on the ranks' library path), KV in host memory:
``--platform host`` only. ``--trace`` prints, per request, the clock at the backend's steps (chunks queued, posts, the metadata row,
the drain, the status) on both ranks.

    python scripts/sglang_backend_bench.py --platform cuda --json out.json                  # 32k tokens
    python scripts/sglang_backend_bench.py --platform host --tokens 512 --layers 2 --chunk-tokens 128 \\
        --repeats 2 --json o.json
    python scripts/sglang_backend_bench.py --platform host --backend mooncake --json m.json   # the reference

Needs SGLang 0.5.23 importable (docs/SGLANG.md; on a GPU machine with no network,
scripts/sglang_device_tree.py). Exit status 1 on a wrong byte or a failed request, 2 on bad options.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integrations"))
sys.path.insert(0, os.path.join(HERE, ".."))

TARGETS = {"send_us": 100.0, "request_minus_direct_us": 100.0, "request_minus_direct_minus_handover_us": 100.0}
REGIONS = ("csa", "csa-idx", "hca")         # kv-dsv4's paged regions (its window is a state buffer in SGLang)


from gpuxfer.bench.cpus import machine_line as cpus  # noqa: E402
from gpuxfer.bench.cliutil import json_path_option  # noqa: E402
from gpuxfer.bench.report import nearest_rank as pct  # noqa: E402
from gpuxfer.errors import BadInput  # noqa: E402


def geometry(page_size: int, layers: int):
    """kv-dsv4's paged regions at ``page_size``: ``[(region, layers, bytes per page)]``; ``layers`` > 0
    caps each region's layer count (small runs)."""
    from gpuxfer.bench.kv.model import get_workload
    w = get_workload("kv-dsv4")
    return [(r.name, min(r.layers, layers) if layers else r.layers, r.page_bytes(page_size))
            for r in w.regions if r.name in REGIONS]


def trace_steps(prefill_marks, decode_marks, room, first, t_done) -> dict | None:
    """The clock at each traced step of ``room`` (first and last occurrence where it repeats), in us after its
    first ``send_kv_chunk``: both ranks' ``CLOCK_MONOTONIC``; a ``<step>.cpu`` entry is the calling thread's own CPU
    time in that step (us), the rest of the step's time it waited."""
    if first is None:
        return None
    out: dict = {}
    for step, r, t in list(prefill_marks) + list(decode_marks):
        if r not in (room, None):
            continue
        us = 1e6 * (t if step.endswith(".cpu") else t - first)     # (".cpu": the thread's CPU time in the call)
        if step not in out:
            out[step] = us
        elif step + ".last" not in out or us > out[step + ".last"]:
            out[step + ".last"] = us
    if t_done is not None:
        out["decode_success"] = 1e6 * (t_done - first)
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mooncake_ready() -> str | None:
    """None where the ranks can import Mooncake (``LD_LIBRARY_PATH`` set for them where needed), else why not."""
    import tempfile
    from sglang_instance import mooncake_library_path
    why, path = mooncake_library_path(tempfile.mkdtemp(prefix="gpuxfer-mooncake-libs-"))
    if path is not None:
        os.environ["LD_LIBRARY_PATH"] = path
    return why


def run(a) -> dict:
    from sglang_instance import MOONCAKE_ENV, Rank
    regions = geometry(a.page_size, a.layers)
    item_lens = [pb for _, n, pb in regions for _ in range(n)]
    n_pages = -(-a.tokens // a.page_size)
    pool_pages = n_pages + 1                    # page 0: SGLang's padding page, never handed out
    env = {"SGLANG_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GPUXFER_PLATFORM": a.platform, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(a.timeout)}
    if a.backend == "mooncake":
        env.update(MOONCAKE_ENV)
    port = free_port()
    kw = dict(port=port, page_size=a.page_size, pages=pool_pages, env=env, mla=True, layers=len(item_lens),
              item_lens=item_lens, device="cuda" if a.platform == "cuda" else "cpu", backend=a.backend)
    auto = a.cpus != "none"
    t0 = time.perf_counter()
    mode = "one" if a.cpus == "one" else "split"
    P = Rank("prefill", seed=1, cpus=(0, 2) if auto else None, cpu_mode=mode, **kw)
    D = Rank("decode", seed=2, cpus=(1, 2) if auto else None, cpu_mode=mode, **kw)
    rng = random.Random(0)
    src, dst = list(range(1, pool_pages)), list(range(1, pool_pages))
    rng.shuffle(src)
    rng.shuffle(dst)
    rows = []
    try:
        P.ready(timeout=600)
        D.ready(timeout=600)
        startup = time.perf_counter() - t0
        if a.trace:
            P.call("trace_on")
            D.call("trace_on")
        P.call("forward", a.forward_ms / 1e3)
        for i in range(1 + a.repeats):
            room = 7000 + i
            py = P.call("cpu")
            D.call("scrub", dst, timeout=600)
            assert P.call("queue_add", [(room, src, a.tokens, a.chunk_tokens)]) == {room: "Bootstrapping"}
            st = D.call("receivers", [(room, src, dst, 0, i % 128)], 60, timeout=120)
            P.call("await_status", [room], "WaitingForInput", 60, timeout=120)
            D.call("watch_start", [room])
            ran = P.call("queue_run", a.timeout, timeout=a.timeout + 60)
            seen = D.call("watch_result", a.timeout, timeout=a.timeout + 60)
            prefill = P.call("wait", [room], a.timeout, timeout=a.timeout + 60)
            tm = P.call("timings")
            steps = trace_steps(P.call("trace"), D.call("trace"), room, tm["first_send"].get(room), t_done=
                                seen.get(room, (None, None))[1]) if a.trace else None
            chk = D.call("check", [room], 1, (), ran["rows"], timeout=600)
            status, t_done = seen.get(room, ("Timeout", None))
            ok = status == "Success" and prefill[room][0] == "Success" and not ran["left"] and not ran["failed"]
            request_s = t_done - tm["first_send"][room] if ok else None
            tail_s = t_done - tm["last_send"][room] if ok else None
            P.call("clear", [room])
            D.call("clear", [room])
            D.call("scrub", dst, timeout=600)
            direct, dchk = None, {"bad": {}, "others_changed": 0, "checked": 0}
            if a.backend == "gpuxfer":
                direct = P.call("direct_push", src, dst, a.timeout, timeout=a.timeout + 60)
                dchk = D.call("check", [room], 1, (), ran["rows"], timeout=600)
            rows.append({
                "request": i, "warm_up": i == 0, "status": status, "prefill_status": prefill[room][0],
                "decode_receiver": st.get(room), "python_us": py["python_us"], "cpu": py["cpu"],
                "send_s": tm["send_s"], "send_kv_chunk_s": tm["chunk_s"], "request_s": request_s, "tail_s": tail_s,
                "direct": direct, "wrong_bytes": sum(chk["bad"].values()) + chk["others_changed"],
                "direct_wrong_bytes": sum(dchk["bad"].values()) + dchk["others_changed"],
                "checked_bytes": chk["checked"] + dchk["checked"], "ok": ok, "trace_us": steps})
            f = lambda v, w, p=1: f"{v:>{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"  # noqa: E731
            r = rows[-1]
            sends = [1e6 * x for x in r["send_s"]]
            print(f"{'warm' if i == 0 else i:>4} {len(sends):>6} {f(pct(sends, 0.5), 8)} {f(max(sends, default=None), 8)} "
                  f"{f(1e6 * max(r['send_kv_chunk_s'], default=0), 9)} "
                  f"{f(None if request_s is None else 1e3 * request_s, 10, 3)} "
                  f"{f(None if direct is None else 1e3 * direct['total_s'], 10, 3)} "
                  f"{f(None if request_s is None or direct is None else 1e6 * (request_s - direct['total_s']), 10)} "
                  f"{f(None if tail_s is None else 1e3 * tail_s, 8, 3)} "
                  f"{f(r['python_us'], 6)} {r['wrong_bytes'] + r['direct_wrong_bytes']:>6} {status}", flush=True)
            if steps:
                print("#      trace (us after the first send_kv_chunk): "
                      + ", ".join(f"{k} {v:.0f}" for k, v in steps.items()), flush=True)
    finally:
        codes = [P.close(), D.close()]
    return {"startup_s": startup, "exit_codes": codes, "requests": rows, "regions": regions, "pages": n_pages,
            "kv_bytes": n_pages * sum(item_lens)}


def run_fake(a) -> dict:
    """SGLang's built-in ``fake`` transfer backend (``sglang/srt/disaggregation/fake``: its sender is Success once a
    chunk was handed to it, nothing moved) on a prefill rank of the same pool, requests, chunking, forward passes and
    CPU placement, after gpuxfer's ranks closed: SGLang's own hand-over of a request's chunks with no backend work.
    No decode rank: the fake receiver ends Success once its metadata is sent, whatever the prefill does, so its time
    says nothing. Per request: ``request_s``, from the first ``send_kv_chunk`` to the end of the last; ``floor_s``,
    what of it is not SGLang's hand-over (the forward passes slept between chunks and the fake's own ``send()`` calls,
    which format the chunk's page array into a debug message); ``handover_s``, the difference."""
    from sglang_instance import Rank
    regions = geometry(a.page_size, a.layers)
    item_lens = [pb for _, n, pb in regions for _ in range(n)]
    pool_pages = -(-a.tokens // a.page_size) + 1
    env = {"SGLANG_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GPUXFER_PLATFORM": a.platform, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(a.timeout)}
    auto = a.cpus != "none"
    P = Rank("prefill", seed=1, cpus=(0, 2) if auto else None, cpu_mode="one" if a.cpus == "one" else "split",
             port=free_port(), page_size=a.page_size, pages=pool_pages, env=env, mla=True, layers=len(item_lens),
             item_lens=item_lens, device="cuda" if a.platform == "cuda" else "cpu", backend="fake")
    src = list(range(1, pool_pages))
    random.Random(0).shuffle(src)
    rows, code = [], None
    try:
        P.ready(timeout=600)
        P.call("forward", a.forward_ms / 1e3)
        for i in range(1 + a.repeats):
            room = 9000 + i
            P.call("queue_add", [(room, src, a.tokens, a.chunk_tokens)])
            ran = P.call("queue_run", a.timeout, timeout=a.timeout + 60)
            status = P.call("wait", [room], a.timeout, timeout=a.timeout + 60)[room][0]
            tm = P.call("timings")
            ok = status == "Success" and not ran["left"] and not ran["failed"] and room in tm["first_send"]
            span = tm["last_send"][room] + tm["chunk_s"][-1] - tm["first_send"][room] if ok else None
            floor = (len(tm["chunk_s"]) - 1) * a.forward_ms / 1e3 + sum(tm["send_s"])
            rows.append({"request": i, "warm_up": i == 0, "status": status, "ok": ok, "send_s": tm["send_s"],
                         "send_kv_chunk_s": tm["chunk_s"], "request_s": span, "floor_s": floor,
                         "handover_s": None if span is None else span - floor})
            P.call("clear", [room])
    finally:
        code = P.close()
    return {"requests": rows, "exit_code": code}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--platform", choices=("cuda", "host"), default="cuda",
                    help="cuda: KV on GPU 0 (both ranks); host: gpuxfer's host emulation (default cuda)")
    ap.add_argument("--tokens", type=int, default=32768, help="the request's tokens (default 32768)")
    ap.add_argument("--page-size", type=int, default=64, help="SGLang --page-size on both ranks (default 64)")
    ap.add_argument("--chunk-tokens", type=int, default=8192,
                    help="chunked-prefill size: one send_kv_chunk (and KVSender.send) per chunk (default 8192)")
    ap.add_argument("--layers", type=int, default=0, help="cap each region's layers (default 0: kv-dsv4's 30/30/31)")
    ap.add_argument("--repeats", type=int, default=3, help="requests measured after the warm-up one (default 3)")
    ap.add_argument("--timeout", type=int, default=60, help="SGLang's waiting timeout and every wait (s, default 60)")
    ap.add_argument("--cpus", choices=("auto", "one", "none"), default="auto",
                    help="auto (default): each rank gets physical cores of its own, its main (scheduler) thread "
                         "pinned to the fastest of them by a Python yardstick and the threads it starts (SGLang's and "
                         "the backend's) to the rest; one: every thread of a rank on that fastest core; none: the "
                         "scheduler places them")
    ap.add_argument("--forward-ms", type=float, default=0.0,
                    help="the prefill scheduler sleeps this long before each chunk but the first, standing in for "
                         "the chunk's forward pass (default 0: chunks sent back to back)")
    ap.add_argument("--trace", action="store_true",
                    help="note the clock at the backend's steps of each request (chunks queued, posts, the drain, "
                         "the decode's row and status) and print them after each request's row")
    ap.add_argument("--backend", choices=("gpuxfer", "mooncake"), default="gpuxfer",
                    help="the transfer backend SGLang is given: gpuxfer (default), or its built-in Mooncake backend "
                         "over TCP as the reference (--platform host; no direct push, no --trace)")
    ap.add_argument("--no-fake", action="store_true",
                    help="skip the same-run reference of SGLang's built-in fake backend (SGLang's own hand-over of "
                         "the chunks, no backend work; run after gpuxfer's requests, gpuxfer's backend only)")
    ap.add_argument("--json", required=True, help="JSON file to write (must not exist)")
    a = ap.parse_args(argv)
    if a.backend == "mooncake":
        if a.platform != "host":
            ap.error("--backend mooncake runs over TCP on host memory: use --platform host")
        if a.trace:
            ap.error("--trace notes gpuxfer's steps: not with --backend mooncake")
    for k in ("tokens", "page_size", "chunk_tokens", "repeats", "timeout"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if a.layers < 0:
        ap.error("--layers must be >= 0")
    if not 0 <= a.forward_ms <= 10_000:
        ap.error("--forward-ms must be in 0..10000")
    try:        # checked before the runs, which take minutes: a new file in an existing, writable directory
        json_path_option(a.json, option="--json")
    except BadInput as exc:
        ap.error(str(exc))
    regions = geometry(a.page_size, a.layers)
    n_pages = -(-a.tokens // a.page_size)
    kv_bytes = n_pages * sum(n * pb for _, n, pb in regions)
    print(f"# gpuxfer SGLang backend bench: SGLang 0.5.23 PrefillBootstrapQueue + send_kv_chunk, backend "
          f"{a.backend}{' (TCP)' if a.backend == 'mooncake' else ''}, {a.platform}, python {platform.python_version()}")
    if a.backend == "mooncake":
        why = mooncake_ready()
        if why is not None:
            print(f"# FAIL: {why}")
            return 1
    print(f"# CPUs: {cpus()}")
    print(f"# request: {a.tokens} tokens, {a.page_size}-token pages ({n_pages}), kv-dsv4-like entries "
          + ", ".join(f"{name} {n} x {pb} B/page" for name, n, pb in regions)
          + f" ({kv_bytes / 2**20:.1f} MiB of KV); chunked prefill {a.chunk_tokens} tokens; 1 warm-up + "
            f"{a.repeats} requests")
    print("# forward pass between chunks: "
          + (f"{a.forward_ms:g} ms (the scheduler thread sleeps, the GIL free)" if a.forward_ms else "none (back to back)"))
    placement = {"auto": "each rank on cores of its own: its main thread on the fastest, the threads it starts on "
                         "the rest (auto)",
                 "one": "every thread of a rank on one core of its own (one)", "none": "the scheduler (none)"}[a.cpus]
    print(f"# CPU placement: {placement}; "
          "py_us: the Python yardstick (gpuxfer.bench.cpus.python_speed_us) on the prefill rank before each request")
    print("# send: KVSender.send host time (us, p50 and max of the request's chunks); chunk: send_kv_chunk max (us); "
          "request: first send_kv_chunk -> decode KVPoll.Success (ms); direct: KVAgent prepare+post+wait (ms); "
          "tail: last send_kv_chunk -> decode KVPoll.Success (ms)")
    print(f"{'req':>4} {'sends':>6} {'send_p50':>8} {'send_max':>8} {'chunk_max':>9} {'request_ms':>10} "
          f"{'direct_ms':>10} {'req-dir_us':>10} {'tail_ms':>8} {'py_us':>6} {'wrong':>6} status")
    res = run(a)
    res["fake"] = None if a.no_fake or a.backend != "gpuxfer" else run_fake(a)
    measured = [r for r in res["requests"] if not r["warm_up"]]
    fake = [r for r in (res["fake"] or {"requests": []})["requests"] if not r["warm_up"] and r["ok"]]
    handover = pct([r["handover_s"] for r in fake], 0.5) if fake else None
    honest = [d - handover for d in [r["request_s"] - r["direct"]["total_s"] for r in measured
                                     if r["request_s"] is not None and r["direct"]]] if handover is not None else []
    sends = [x for r in measured for x in r["send_s"]]
    done = [r["request_s"] for r in measured if r["request_s"] is not None]
    diffs = [r["request_s"] - r["direct"]["total_s"] for r in measured if r["request_s"] is not None and r["direct"]]
    tails = [r["tail_s"] for r in measured if r["tail_s"] is not None]
    tail_diffs = [r["tail_s"] - r["direct"]["total_s"] for r in measured if r["tail_s"] is not None and r["direct"]]
    directs = [r["direct"]["total_s"] for r in measured if r["direct"]]
    summary = {
        "send_us": 1e6 * pct(sends, 0.9) if sends else None,
        "send_us_p50": 1e6 * pct(sends, 0.5) if sends else None,
        "send_kv_chunk_us": 1e6 * pct([x for r in measured for x in r["send_kv_chunk_s"]], 0.9) if measured else None,
        "request_ms_p50": 1e3 * pct(done, 0.5) if done else None,
        "request_ms_p90": 1e3 * pct(done, 0.9) if done else None,
        "direct_ms_p50": 1e3 * pct(directs, 0.5) if directs else None,
        "direct_ms_p90": 1e3 * pct(directs, 0.9) if directs else None,
        "request_minus_direct_us": 1e6 * pct(diffs, 0.9) if diffs else None,
        "tail_ms_p50": 1e3 * pct(tails, 0.5) if tails else None,
        "tail_ms_p90": 1e3 * pct(tails, 0.9) if tails else None,
        "tail_minus_direct_us": 1e6 * pct(tail_diffs, 0.9) if tail_diffs else None,
        "fake_request_us_p50": 1e6 * pct([r["request_s"] for r in fake], 0.5) if fake else None,
        "fake_floor_us_p50": 1e6 * pct([r["floor_s"] for r in fake], 0.5) if fake else None,
        "sglang_handover_us_p50": None if handover is None else 1e6 * handover,
        "sglang_handover_us_p90": 1e6 * pct([r["handover_s"] for r in fake], 0.9) if fake else None,
        "request_minus_direct_us_p50": 1e6 * pct(diffs, 0.5) if diffs else None,
        "request_minus_direct_minus_handover_us_p50": 1e6 * pct(honest, 0.5) if honest else None,
        "request_minus_direct_minus_handover_us": 1e6 * pct(honest, 0.9) if honest else None,
    }
    n = lambda k, p=3: "-" if summary[k] is None else f"{summary[k]:.{p}f}"  # noqa: E731
    print(f"# p50 / p90 over the {len(measured)} requests: send {n('send_us_p50', 1)} / {n('send_us', 1)} us; "
          f"request {n('request_ms_p50')} / {n('request_ms_p90')} ms; direct {n('direct_ms_p50')} / "
          f"{n('direct_ms_p90')} ms")
    print(f"# tail (last send_kv_chunk -> decode Success) p50 / p90 {n('tail_ms_p50')} / {n('tail_ms_p90')} ms; "
          f"tail minus direct (the whole request moved once prefill is done), p90: {n('tail_minus_direct_us', 1)} us")
    if res["fake"] is not None:
        print(f"# fake (SGLang's built-in fake backend, same run, {len(fake)} requests after a warm-up, no decode): "
              f"request (first send_kv_chunk -> end of the last: SGLang's hand-over, the fake's send() calls, the "
              f"forward sleeps) p50 {n('fake_request_us_p50', 1)} us; floor (the forward sleeps + the fake's own "
              f"send() calls) p50 {n('fake_floor_us_p50', 1)} us; SGLang's hand-over (request - floor) p50 / p90 "
              f"{n('sglang_handover_us_p50', 1)} / {n('sglang_handover_us_p90', 1)} us")
        print(f"# request - direct (all the backend path adds over a direct push, SGLang's hand-over included) "
              f"p50 / p90: {n('request_minus_direct_us_p50', 1)} / {n('request_minus_direct_us', 1)} us; "
              f"request - direct - SGLang's hand-over (the fake's p50; what gpuxfer's backend adds) p50 / p90: "
              f"{n('request_minus_direct_minus_handover_us_p50', 1)} / {n('request_minus_direct_minus_handover_us', 1)}"
              " us")
    print("# targets, p90 over the requests:")
    verdicts = {}
    for k, target in TARGETS.items():
        v = summary[k]
        verdicts[k] = "n/a" if v is None else ("met" if v <= target else "MISSED")
        print(f"#   {k:38s} {'-' if v is None else f'{v:.1f}':>10} (target <= {target:g}) {verdicts[k]}")
    wrong = sum(r["wrong_bytes"] + r["direct_wrong_bytes"] for r in res["requests"])
    failed = [r["request"] for r in res["requests"] if not r["ok"]]
    fake_bad = res["fake"] is not None and (res["fake"]["exit_code"] != 0 or len(fake) != a.repeats)
    ok = (wrong == 0 and not failed and len(res["requests"]) == 1 + a.repeats and res["exit_codes"] == [0, 0]
          and not fake_bad)
    print(f"# wrong bytes: {wrong} of {sum(r['checked_bytes'] for r in res['requests'])} checked; failed requests: "
          f"{len(failed)}; rank exit codes {res['exit_codes']}; startup {res['startup_s']:.1f} s"
          + ("" if res["fake"] is None else f"; fake rank exit code {res['fake']['exit_code']}, "
             f"{len(fake)} of {a.repeats} fake requests Success"))
    print(f"# {'PASS' if ok else 'FAIL'}")
    with open(a.json, "x") as fh:
        json.dump({"params": vars(a), "cpus": cpus(), "summary": summary, "verdicts": verdicts, "wrong_bytes": wrong,
                   "failed": failed, **res}, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
