"""The CollectiveX kv-transfer suite's facts, one constant each (their sources: the table of
:mod:`gpuxfer.bench.kv.collectivex`), and :func:`facts`, the same as a JSON-ready dict."""
from __future__ import annotations

from typing import Any

from ..engines import mooncake as mooncake_engine
from ..engines import mori as mori_engine
from ..model.workloads import Workload, _pos_int, get_workload

SUITE = "collectivex"
SOURCE = ("SemiAnalysisAI/InferenceX PR #2510 @ dc95b1fc0ce7, experimental/CollectiveX/ "
          "(configs/kv_sweep.json, bench/run_kv.py, bench/kv_workload.py, bench/kv_backend.py)")

# --- the workload (configs/kv_sweep.json: workloads {"kv-dsv4": ["fp8"]})
WORKLOAD = "kv-dsv4"
PRESET = "dsv4"
PRECISION = "fp8"
MODEL_CLASS = "deepseek-v4-pro"

# --- the grid (configs/kv_sweep.json)
ISL_LADDER = (8192, 32768, 131072, 524288)
PAGES = (16, 64)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
OPS = ("pull", "push")

# --- timing (configs/kv_sweep.json "timing"; kv_backend.time_bursts drops each trial's warm-ups)
WARMUP_PER_TRIAL = 2
REPS_PER_TRIAL = 8
TRIALS = 3

# --- pool sizing (kv_workload.plan_config): pool pages per region = int(pages_req * slack) + 8,
#     slack = max(2.0, 1.25 * batch_max); kept in quarters so the arithmetic is exact
POOL_SLACK_QUARTERS = 8          # 2.0
BATCH_SLACK_QUARTERS = 5         # 1.25 per request of the point's largest batch
SPARE_PAGES = 8

# --- seeds (configs/kv_sweep.json "seed"; kv_workload.table_seed)
RUN_SEED = 67
SEED_ISL_FACTOR = 31
SEED_PRESET_FACTOR = 7
SEED_INITIATOR_OFFSET = 1000
#: gpuxfer's name for the suite's two table sides: the suite's "local" is the initiator, "remote" the target
SIDES = ("initiator", "target")

# --- budgets (run_kv.DESC_BUDGET, run_kv.POOL_BUDGET, run_kv._grid)
DESC_BUDGET = 2_250_000
POOL_BUDGET_BYTES = 64 << 30
FLOOR_BATCHES = 2

# --- the bulk row (run_kv.BULK_CAP; plan_config at page 64, batch_max 1)
BULK_CAP_BYTES = 8 << 30
BULK_PAGE_TOKENS = 64

# --- verification (kv_workload._chunk_byte, verify_transfer; run_kv exit code)
PATTERN_CHUNK_BYTES = 256
PATTERN_MULT = 131
PATTERN_ADD = 7
#: 131 is odd, so the chunk value repeats every 256 chunks: 64 KiB
PATTERN_PERIOD_BYTES = 256 * PATTERN_CHUNK_BYTES
VERIFY_SAMPLES = 16
VERIFY_SAMPLE_BYTES = 8
VERIFY_RNG_SEED = 7
EXIT_VERIFY_FAILED = 3

# --- engines (bench/kv_mooncake.py, bench/kv_mori_io.py): the engines carry these settings
MOONCAKE_PROTOCOL = "rdma"
MOONCAKE_ENV = mooncake_engine.SUITE_ENV
MOONCAKE_BATCH_CAP = mooncake_engine.BATCH_CAP
MORI_BATCH_CAP = mori_engine.BATCH_CAP
MORI_BULK_WR_CAP = mori_engine.WR_CAP_BYTES
MORI_RDMA_CONFIG = mori_engine.RDMA_CONFIG

# --- the document (run_kv.main)
DOC_VERSION = 1
SUITE_NAME = "kv-transfer"
RECORD_TYPE = "case-attempt"
PAYLOAD_UNIT = "request-kv-bytes"
OUTCOME_REASON = "transfer verification failed"


def _workload() -> Workload:
    return get_workload(WORKLOAD)


def _check_isl_page(isl: int, page: int) -> None:
    _pos_int(isl, "input length (tokens)")
    _pos_int(page, "page size (tokens)")
    _workload().check_page(page)


def facts() -> dict[str, Any]:
    """The suite's facts as a JSON-ready dict (for ``--plan-only`` and the artifacts)."""
    return {
        "suite": SUITE, "source": SOURCE, "workload": WORKLOAD, "precision": PRECISION,
        "isl_ladder_tokens": list(ISL_LADDER), "pages_tokens": list(PAGES), "batches": list(BATCHES),
        "ops": list(OPS),
        "timing": {"warmup_per_trial": WARMUP_PER_TRIAL, "reps_per_trial": REPS_PER_TRIAL, "trials": TRIALS,
                   "contract": "host wall clock from posting every request's prepped transfer to the last "
                               "completion; prep excluded; warm-ups dropped"},
        "statistics": "p50 = s[n//2], p95 = s[min(n-1, int(0.95 n))], min, max, n; "
                      "gbps_p50 = req_bytes * batch / p50_ms / 1e6",
        "pool_pages": "int(pages_req * max(2.0, 1.25 * batch_max)) + 8 per region; region bases unaligned",
        "desc_budget_descriptors": DESC_BUDGET, "pool_budget_bytes": POOL_BUDGET_BYTES,
        "floor_batches": FLOOR_BATCHES,
        "run_seed": RUN_SEED,
        "table_seed": "isl*31 + page + 7*len('dsv4'), +1000 on the initiator (the run seed is not read)",
        "bulk": {"bytes": "min(request bytes at page 64, 8 GiB, largest paged request)", "batch": 1,
                 "descriptors": 1, "cap_bytes": BULK_CAP_BYTES},
        "verification": {"samples_per_request": VERIFY_SAMPLES, "bytes_per_sample": VERIFY_SAMPLE_BYTES,
                         "rng_seed": VERIFY_RNG_SEED, "pattern": "((o >> 8) * 131 + 7) & 0xFF",
                         "pattern_period_bytes": PATTERN_PERIOD_BYTES, "exit_code_on_failure": EXIT_VERIFY_FAILED},
        "mooncake": {"protocol": MOONCAKE_PROTOCOL, "env": dict(MOONCAKE_ENV), "batch_cap": MOONCAKE_BATCH_CAP},
        "mori_io": {"backend": "RDMA", "config": dict(MORI_RDMA_CONFIG), "batch_cap": MORI_BATCH_CAP,
                    "bulk_wr_cap_bytes": MORI_BULK_WR_CAP},
    }
