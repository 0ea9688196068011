"""How long a decode worker waits for a prefill's answer to its claim (the vLLM connector's side channel), on
the CPU: a prefill worker's side channel server with its claim book, an engine thread that pumps it once a step
and spends the step either off the GIL (``sleep``: a forward pass the GPU runs) or in Python (``busy``: the worst
case for the server's thread, which then waits for GIL hand-overs), and a decode client that claims one request at
a time over loopback and polls for the answer.

    PYTHONPATH=. python scripts/vllm_claim_latency.py [--step-ms 50] [--claims 60] [--idle-s S] [--json PATH]

``--idle-s`` sets how long after the engine thread's last pump the server's thread serves (the code's
``SideChannelServer.IDLE_S`` when not given). A tuning aid, not a number of record: a GPU machine's engine thread
spends its steps differently.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

from gpuxfer.integrations.vllm.channel import SideChannelClient, SideChannelServer
from gpuxfer.integrations.vllm.holds import ClaimBook, make_key

SECRET = b"s" * 16


def run(mode: str, claims: int, step_s: float) -> dict:
    book = ClaimBook()
    book.secret = SECRET
    srv = SideChannelServer("127.0.0.1", 0, lambda: (b"{}", b"m"), 5.0, claim=book.claim)
    stop = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            srv.pump()
            end = time.monotonic() + step_s
            if mode == "busy":
                while time.monotonic() < end:
                    sum(range(200))
            else:
                stop.wait(step_s)
    th = threading.Thread(target=engine, name="engine")
    th.start()
    c = SideChannelClient("127.0.0.1", srv.port, 5.0)
    lat = []
    try:
        c.handshake()
        for i in range(claims):
            req = f"r{i}"
            t0 = time.perf_counter()
            c.claim([req], [make_key(SECRET, req)], ["t"])
            while not c.answers:
                if time.perf_counter() - t0 > 10:
                    raise SystemExit(f"no answer to claim {i} within 10 s")
                c.read_answers()
                time.sleep(0.0002)
            lat.append((time.perf_counter() - t0) * 1e3)
            c.answers.clear()
            time.sleep(0.013)           # (claims land at different points of the engine's step)
    finally:
        stop.set()
        th.join(10)
        c.close()
        srv.close()
    lat.sort()
    return {"mode": mode, "step_ms": step_s * 1e3, "claims": claims, "p50_ms": statistics.median(lat),
            "p90_ms": lat[max(0, -(-9 * len(lat) // 10) - 1)], "max_ms": lat[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-ms", type=float, default=50.0, help="the prefill engine's step (ms)")
    ap.add_argument("--claims", type=int, default=60, help="claims timed per mode")
    ap.add_argument("--idle-s", type=float, default=None, help="SideChannelServer.IDLE_S to run with")
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args()
    if a.claims < 1 or a.step_ms <= 0:
        ap.error("--claims must be >= 1 and --step-ms > 0")
    where = os.path.dirname(os.path.abspath(a.json)) if a.json else None
    if where is not None and not (os.path.isdir(where) and os.access(where, os.W_OK)):
        ap.error(f"--json: cannot write in {where}")
    if a.idle_s is not None:
        SideChannelServer.IDLE_S = a.idle_s
    rows = []
    print(f"# claim -> answer over loopback, engine step {a.step_ms:g} ms, IDLE_S {SideChannelServer.IDLE_S:g} s")
    for mode in ("sleep", "busy"):
        r = run(mode, a.claims, a.step_ms / 1e3)
        rows.append(r)
        print(f"{mode:>5}: p50 {r['p50_ms']:.2f} ms  p90 {r['p90_ms']:.2f} ms  max {r['max_ms']:.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"idle_s": SideChannelServer.IDLE_S, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
