"""The CollectiveX kv-transfer suite, as facts: ``gpuxfer bench kv --suite collectivex``.

Every number here is the suite's, read from SemiAnalysisAI/InferenceX PR #2510 at
``dc95b1fc0ce7`` (paths under ``experimental/CollectiveX/``; the PR page is
https://github.com/SemiAnalysisAI/InferenceX/pull/2510):

=========================  =====================================================================
fact                       source
=========================  =====================================================================
workload ``kv-dsv4`` fp8   ``configs/kv_sweep.json`` ``workloads``; ``bench/kv_workload.py`` ``PRESETS``
ISL ladder 8k..512k        ``configs/kv_sweep.json`` ``isl_ladder``
pages 16, 64               ``configs/kv_sweep.json`` ``page_tokens``
batches 1..64              ``configs/kv_sweep.json`` ``batch_sizes``
ops pull, push             ``configs/kv_sweep.json`` ``ops``
2 warm-up / 8 reps / 3     ``configs/kv_sweep.json`` ``timing``; ``bench/kv_backend.py`` ``time_bursts``
pool slack 2.0, 1.25/batch ``bench/kv_workload.py`` ``plan_config``: ``max(pool_slack, 1.25 * batch_max)``
pool pages ``int(..)+8``   ``plan_config``: ``int(pages_req * slack) + 8`` per region, bases unaligned
run seed 67                ``configs/kv_sweep.json`` ``seed`` (recorded; the block tables do not read it)
table seed                 ``kv_workload.table_seed``: ``isl*31 + page + 7*len(preset)``, +1000 "local"
block tables               ``kv_workload.block_table``: ``default_rng(seed)``, one permutation per
                           region in order, request r takes ``[r*pages_req, (r+1)*pages_req)``
descriptor budget          ``bench/run_kv.py`` ``DESC_BUDGET = 2_250_000`` per burst; the two smallest
                           requested batches ride over it (``_grid``)
pool budget                ``run_kv.POOL_BUDGET = 64 << 30`` per rank, pops the largest batches
bulk row                   ``run_kv.main``: per ISL and op, batch 1, one descriptor of
                           ``min(req_bytes at page 64, BULK_CAP = 8 << 30, largest paged req_bytes)``
pattern                    ``kv_workload._chunk_byte``: ``((o >> 8) * 131 + 7) & 0xFF`` (period 64 KiB)
sampled verification       ``kv_workload.verify_transfer``: per request a fresh ``default_rng(7)``,
                           16 samples of (region, layer, index) x 8 bytes; every request of a burst
statistics                 ``kv_workload.pcts``: p50 ``s[n//2]``, p95 ``s[min(n-1, int(0.95n))]``,
                           min, max, n; ``gbps_p50 = req_bytes * batch / p50_ms / 1e6``
exit code 3                ``run_kv.main``: 0 only if every row verified, else 3
row / document schema      ``run_kv.main`` (``measure``, ``doc``); read by ``summarize.render_kv``
Mooncake settings          ``bench/kv_mooncake.py``: protocol ``rdma``, ``MC_USE_NVLINK_IPC=0``,
                           ``MC_TRANSFER_TIMEOUT=120``, 8,192 descriptors per batch call
MoRI-IO settings           ``bench/kv_mori_io.py``: RDMA backend, qp 1, no chunking, 16,384 offsets
                           per batch call, bulk work requests of at most 1 GiB
=========================  =====================================================================

The suite's geometry is gpuxfer's ``kv-dsv4`` workload (same regions, same counts)
laid out the suite's way (:func:`layout`): its pool pages per region and its
unaligned region bases, so the pool per rank, the block tables and therefore
every descriptor offset equal the suite's. Side names: the suite's *initiator*
(rank 1, "local" seed) initiates both directions; in gpuxfer the initiator is the
decode (destination) side for pull and the prefill (source) side for push, so
pull takes its destination tables from the initiator seed and push its source
tables (:func:`burst`).

Everything here is pure Python + numpy; nothing touches a device.
The package's modules: :mod:`.suite` (the facts above as constants, and :func:`facts`),
:mod:`.geometry` (pool pages, layouts, table seeds, block tables, bursts, the grid and the bulk points,
the pattern and the sampled check) and :mod:`.rows` (statistics, the suite's rows, documents and exit
code); every name is re-exported here.
"""
from __future__ import annotations

from .geometry import (BulkPoint, Sample, SuitePoint, block_tables, build_grid, bulk_bytes, bulk_points, burst,
                       fill_pattern, layout, pattern_at, pool_pages, sample_positions, sampled_verify, table_seed)
from .rows import (LATENCY_FIELDS, ROW_FIELDS, bulk_row, document, documents_from_rows, exit_code, gbps_p50,
                   paged_row, pcts, suite_row_from, validate_document, validate_row)
from .suite import (BATCHES, BATCH_SLACK_QUARTERS, BULK_CAP_BYTES, BULK_PAGE_TOKENS, DESC_BUDGET, DOC_VERSION,
                    EXIT_VERIFY_FAILED, FLOOR_BATCHES, ISL_LADDER, MODEL_CLASS, MOONCAKE_BATCH_CAP, MOONCAKE_ENV,
                    MOONCAKE_PROTOCOL, MORI_BATCH_CAP, MORI_BULK_WR_CAP, MORI_RDMA_CONFIG, OPS, OUTCOME_REASON, PAGES,
                    PATTERN_ADD, PATTERN_CHUNK_BYTES, PATTERN_MULT, PATTERN_PERIOD_BYTES, PAYLOAD_UNIT,
                    POOL_BUDGET_BYTES, POOL_SLACK_QUARTERS, PRECISION, PRESET, RECORD_TYPE, REPS_PER_TRIAL, RUN_SEED,
                    SEED_INITIATOR_OFFSET, SEED_ISL_FACTOR, SEED_PRESET_FACTOR, SIDES, SOURCE, SPARE_PAGES, SUITE,
                    SUITE_NAME, TRIALS, VERIFY_RNG_SEED, VERIFY_SAMPLES, VERIFY_SAMPLE_BYTES, WARMUP_PER_TRIAL,
                    WORKLOAD, facts)

__all__ = [  # the suite's names, from its three modules
    "BulkPoint", "Sample", "SuitePoint", "block_tables", "build_grid", "bulk_bytes", "bulk_points", "burst",
    "fill_pattern", "layout", "pattern_at", "pool_pages", "sample_positions", "sampled_verify", "table_seed",
    "LATENCY_FIELDS", "ROW_FIELDS", "bulk_row", "document", "documents_from_rows", "exit_code", "gbps_p50",
    "paged_row", "pcts", "suite_row_from", "validate_document", "validate_row", "BATCHES", "BATCH_SLACK_QUARTERS",
    "BULK_CAP_BYTES", "BULK_PAGE_TOKENS", "DESC_BUDGET", "DOC_VERSION", "EXIT_VERIFY_FAILED", "FLOOR_BATCHES",
    "ISL_LADDER", "MODEL_CLASS", "MOONCAKE_BATCH_CAP", "MOONCAKE_ENV", "MOONCAKE_PROTOCOL", "MORI_BATCH_CAP",
    "MORI_BULK_WR_CAP", "MORI_RDMA_CONFIG", "OPS", "OUTCOME_REASON", "PAGES", "PATTERN_ADD", "PATTERN_CHUNK_BYTES",
    "PATTERN_MULT", "PATTERN_PERIOD_BYTES", "PAYLOAD_UNIT", "POOL_BUDGET_BYTES", "POOL_SLACK_QUARTERS", "PRECISION",
    "PRESET", "RECORD_TYPE", "REPS_PER_TRIAL", "RUN_SEED", "SEED_INITIATOR_OFFSET", "SEED_ISL_FACTOR",
    "SEED_PRESET_FACTOR", "SIDES", "SOURCE", "SPARE_PAGES", "SUITE", "SUITE_NAME", "TRIALS", "VERIFY_RNG_SEED",
    "VERIFY_SAMPLES", "VERIFY_SAMPLE_BYTES", "WARMUP_PER_TRIAL", "WORKLOAD", "facts",
]
