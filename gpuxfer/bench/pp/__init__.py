"""``gpuxfer bench pp``: the stage hand-off, copy engines against NCCL in one run.

Two ranks (rank 0 sends, rank 1 receives), spawned here (or run under
``torchrun`` with ``RANK``/``WORLD_SIZE`` set). For every size from 16 KiB to
256 MiB (two bf16 tensors, ``hidden`` and ``residual``, half the bytes each) and
every configuration (copy_engine and nccl, with and without per-step metadata,
which goes through the pair's shared-memory mailbox, or over the CPU group with
``GPUXFER_PP_META_CHANNEL=group``) it times a pipelined loop of steps (the sender never waits
for the receiver; per-step time = the receiver's wall clock over the timed steps,
ended by a device synchronize) ``--repeats`` times, reporting the median loop
(the JSON keeps the fastest and slowest too), and checks every byte of
verification steps and of each loop's last step against the source (``wrong``
column, bytes).

Then, in the same run: the bulk peer-copy rate (back-to-back ``copy_async``
from the sender's staging buffer into the receiver's slot: the copy-engine
ceiling), and SM contention: a matmul loop's throughput alone, next to NCCL
transfers, next to copy-engine transfers, and next to copy-engine transfers
paced to the rate NCCL moved (equal traffic). Both ranks compute; the report is
of the rank where copy_engine cost more, with both ranks' losses beside it.

On the host emulation it runs at tiny sizes and says so everywhere: its
numbers measure Python and memmove, not a GPU. Speed targets (2x H200) are
reported as met or missed; ``--check-targets`` turns a miss into exit code 1.
Any wrong byte or error is exit code 1.

Modules: :mod:`.cli` (the options and the run: two ranks spawned, their results gathered),
:mod:`.ranks` (one rank: the timed step loops), :mod:`.measures` (what a rank measures beside them:
graph rows, ping-pong, the bulk ceiling, SM contention; the byte check), :mod:`.plain` (the plain
``torch.distributed`` baseline), :mod:`.report` (targets, the nccl-tests table, the
JSON document); the names they share are here.
"""
from __future__ import annotations

KiB, MiB = 1 << 10, 1 << 20
GRAPH = "copy_engine_graph"     # steps captured once, moved by graph replays (connect(graph=True))
PLAIN = "nccl_plain"            # plain torch.distributed isend / irecv: the NCCL baseline
NO_META = (GRAPH, PLAIN)        # measured without per-step metadata only
PING_SIZES = [1, 64, KiB, 4 * KiB, 16 * KiB, 64 * KiB]
BULK_REPEATS = 5                # timed loops of the bulk peer-copy ceiling, the median reported
TARGET_SMALL_RATIO = 1 / 3      # copy-engine step time vs NCCL's at <= 1 MiB
TARGET_BULK_FRACTION = 0.97     # of the bulk peer-copy rate at >= 64 MiB
TARGET_COMPUTE_LOSS = 0.01      # matmul throughput lost next to copy-engine transfers
TARGET_LATENCY_US = 10.0        # one-way step latency at <= 64 KiB
TARGET_HOST_US = 10.0           # copy_engine eager host time per side and step at 16 KiB - 1 MiB (paced)
HOST_TARGET = (f"copy_engine eager host time <= {TARGET_HOST_US:g} us per side and step at 16 KiB-1 MiB "
               f"(paced, without metadata; the p90 step)")
PACED_STEPS = 200               # most steps of the paced host-time loop
#: the paced loops' shortest interval between steps. The receiver gives a slot back (a stream write into the sender's
#: host word, after its work on the slot) half an interval after the sender's step; at this interval that write can
#: land after the sender's next step on the slot (the sender then queues a GPU wait, which the p90 counts). A longer
#: floor makes such waits rarer but each step's host time longer (docs/PERFORMANCE.md): the floor stays short
PACE_FLOOR_S = 20e-6


def _fmt_size(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


BACKENDS = ("copy_engine", GRAPH, "nccl", PLAIN)
#: the file a run leaves in its directory
ARTIFACT = "pp_bench.json"
