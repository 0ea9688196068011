#!/usr/bin/env python3
"""Host time of GpuxferConnector's decode-side calls under vLLM 0.33's real Scheduler: a prefill and a
decode instance in two processes (tests/integrations/vllm_instance.py), ``--requests`` requests of
``--tokens`` prompt tokens per run, ``--runs`` runs. Reports, per run and as p50/p90 over all runs:
``start_load_kv`` host time per step with loads (and per request in it), ``get_transfer_results`` host
time per step while loads are in flight, post host time per request, time from post to seen-complete,
and the first handshake. Every loaded byte is checked.

    python scripts/vllm_connector_bench.py --device cuda --tokens 32768 --requests 1 --runs 3
    python scripts/vllm_connector_bench.py --device host --tokens 2048 --requests 4     # CPU emulation

Needs vLLM importable (see docs/VLLM.md). Writes the JSON to ``--out`` (default
gpuxfer-out/vllm/latest/vllm_bench.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integrations"))
sys.path.insert(0, os.path.join(HERE, ".."))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "host"), default="cuda")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--requests", type=int, default=1, help="requests per run (loaded in one step)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--out", default="gpuxfer-out/vllm/latest/vllm_bench.json")
    a = ap.parse_args(argv)
    from vllm_instance import Instance, write_model

    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    dev = "cuda" if a.device == "cuda" else "cpu"
    if a.device == "host":
        env.update(GPUXFER_PLATFORM="host", VLLM_TARGET_DEVICE="cpu")
    blocks = max(4096, 2 * a.requests * (a.tokens // a.block_size + 2) + 16)
    model = write_model(tempfile.mkdtemp(prefix="gpuxfer-vllm-model-"))
    P = Instance("benchP", model, a.block_size, extra={"token_major": True}, env=env, device=dev, num_blocks=blocks)
    D = Instance("benchD", model, a.block_size, extra={"token_major": True}, env=env, device=dev, num_blocks=blocks)
    rows = []
    try:
        P.ready(timeout=600)
        D.ready(timeout=600)
        for run in range(a.runs):
            reqs = [(f"r{run}-{i}", a.tokens, 100 * run + i) for i in range(a.requests)]
            res = P.run("prefill", [(r, n, s, None) for r, n, s in reqs], timeout=600)
            t0 = time.perf_counter()
            out = D.run("decode", [(f"d-{r}", n, s, res[r]["params"]) for r, n, s in reqs], timeout=600)
            wall = time.perf_counter() - t0
            bad = sum(v.get("bad", 0) for v in out.values())
            failed = [r for r, v in out.items() if v.get("load") != "ok"]
            st = D.call("stats")["stats"]
            P.call("idle", 60, timeout=120)
            rows.append({"run": run, "wall_s": wall, "wrong_bytes": bad, "failed": failed, "stats": st})
    finally:
        P.close()
        D.close()
    st = rows[-1]["stats"]
    sl = st.get("start_load_kv_s", [])
    summary = {
        "device": a.device, "tokens": a.tokens, "requests_per_run": a.requests, "runs": a.runs,
        "start_load_kv_us_p50": 1e6 * pct([t for _, t in sl], 0.5) if sl else None,
        "start_load_kv_us_p90": 1e6 * pct([t for _, t in sl], 0.9) if sl else None,
        "start_load_kv_us_per_request_p90": 1e6 * pct([t / n for n, t in sl], 0.9) if sl else None,
        "get_finished_us_p50": 1e6 * pct(st.get("get_finished_s", []), 0.5) if st.get("get_finished_s") else None,
        "get_finished_us_p90": 1e6 * pct(st.get("get_finished_s", []), 0.9) if st.get("get_finished_s") else None,
        "post_host_us_p90": 1e6 * pct(st.get("post_host_s", []), 0.9) if st.get("post_host_s") else None,
        "post_to_done_ms_p90": 1e3 * pct(st.get("xfer_s", []), 0.9) if st.get("xfer_s") else None,
        "first_handshake_s": (st.get("handshake_s") or [None])[0],
        "wrong_bytes": sum(r["wrong_bytes"] for r in rows), "failed": sum(len(r["failed"]) for r in rows),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"summary": summary, "runs": rows}, f, indent=1)
    for k, v in summary.items():
        print(f"{k:36s} {v if not isinstance(v, float) else round(v, 3)}")
    return 0 if summary["wrong_bytes"] == 0 and summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
