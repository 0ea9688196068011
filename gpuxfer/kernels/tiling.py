"""The copy kernel's tiling: :class:`CopyConfig` (checked when made), the measured table
:func:`choose_config` picks from (and the block copy's own for rows up to 4 KB, :func:`blocks_config`), and
the grids the launchers of :mod:`gpuxfer.kernels.launch` use by default (SM counts; a few programs in the CPU
interpreter)."""
from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import torch

from ..errors import BadInput

CPU_PROGRAMS = 3            # interpreter: a few programs, to exercise the persistent loop
LOAD_CACHE_MODIFIERS = ("", ".ca", ".cg", ".cv")
STORE_CACHE_MODIFIERS = ("", ".wb", ".cg", ".cs", ".wt")
MAX_TILE_UNITS = 1 << 18    # rows x 16-byte units of one step's block: 4 int32 lanes each, 2**20 in all


@dataclass(frozen=True)
class CopyConfig:
    """How the copy kernel tiles its work (all compile-time constants but ``programs_per_sm``).

    Each program step loads ``unroll`` chunks of ``width`` 16-byte units from each of
    ``rows`` descriptors -- :attr:`step_bytes` in all -- before storing any of them; two
    steps are in flight at a time.
    """

    rows: int                 # descriptors per work item (power of 2)
    width: int                # 16-byte units per row chunk (power of 2)
    unroll: int               # row chunks in flight per step
    num_warps: int
    programs_per_sm: int      # default grid = programs_per_sm x SM count
    load_cache: str = ""      # Triton cache_modifier for loads ("", ".cg", ".cv", ...)
    store_cache: str = ""     # ... and stores ("", ".cg", ".cs", ".wt")

    def __post_init__(self):
        for name in ("rows", "width", "unroll", "num_warps", "programs_per_sm"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise BadInput(f"CopyConfig.{name} must be an int, got {v!r}")
        for name, v, known in (("load_cache", self.load_cache, LOAD_CACHE_MODIFIERS),
                               ("store_cache", self.store_cache, STORE_CACHE_MODIFIERS)):
            if not isinstance(v, str) or v not in known:
                raise BadInput(f"CopyConfig.{name} must be one of {known} (Triton's), got {v!r}")
        for name in ("rows", "width"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise BadInput(f"CopyConfig.{name} must be a power of two, got {v}")
        if self.rows * self.width > MAX_TILE_UNITS:
            raise BadInput(f"CopyConfig.rows x width must be at most {MAX_TILE_UNITS} (a Triton block of at most "
                           f"2**20 int32 lanes), got {self.rows} x {self.width}")
        if not 1 <= self.unroll <= 16:
            raise BadInput(f"CopyConfig.unroll must be in 1..16, got {self.unroll}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise BadInput(f"CopyConfig.num_warps must be a power of two <= 32, got {self.num_warps}")
        if self.programs_per_sm < 1:
            raise BadInput(f"CopyConfig.programs_per_sm must be >= 1, got {self.programs_per_sm}")

    @property
    def row_step_bytes(self) -> int:
        return self.width * 16 * self.unroll

    @property
    def step_bytes(self) -> int:
        return self.rows * self.row_step_bytes


def _cfg(rows, width, unroll, warps, pps) -> "CopyConfig":
    return CopyConfig(rows=rows, width=width, unroll=unroll, num_warps=warps, programs_per_sm=pps)


# (largest typical descriptor size, default config, config for a bounded grid of <= 1 program per SM,
#  config when both pools are in this GPU's memory: pack, unpack, local copies).
# Measured on 2x H200 (NV18), every page of a 2 GiB pool in random order, pull and push over
# NVLink: wide row chunks (512 B - 1 KiB contiguous per warp instruction) beat tight padding,
# and a bounded grid needs big steps (32-74 KB per program) because each program is latency
# bound. Local HBM traffic preferred tighter rows and one bigger program per SM; at 528-576 B,
# 128-byte row chunks (width 8) packed 2-5 points faster than 64-byte ones (over five runs).
CONFIG_TABLE = (
    (1024, _cfg(16, 32, 2, 8, 2), _cfg(32, 32, 2, 8, 1), _cfg(64, 8, 5, 8, 1)),
    (4096, _cfg(16, 32, 2, 8, 2), _cfg(32, 16, 9, 8, 1), _cfg(16, 16, 9, 8, 1)),
    (12288, _cfg(2, 64, 9, 4, 2), _cfg(8, 64, 9, 8, 1), _cfg(2, 64, 9, 4, 2)),
    (None, _cfg(4, 64, 4, 4, 2), _cfg(16, 64, 4, 8, 1), _cfg(4, 64, 4, 4, 2)),
)


# The block copy (mode 5, :func:`~gpuxfer.kernels.launch.copy_blocks_launcher`) derives each row from the request and
# the plane table: a chain of dependent loads per work item, which more rows and more chunks in flight per step
# hide. On 1x H100 (the peer pool a second process's on the same GPU; `bench kernels --ops blocks --tilings`, 2 GiB
# pools) 32 rows of 8 units with 8 chunks in flight and 8 warps moved 1.16-1.23x the expansion + descriptor copy at
# 528-576 B rows and 1.18x at 2,304 B, where mode 5 at the descriptor copy's tiling moved 0.92-0.94x; above 4 KB a
# row that tiling is as fast as any tried (0.99-1.01x).
BLOCKS_SMALL_ROWS = (4096, _cfg(32, 8, 8, 8, 2))


def blocks_config(nbytes_hint: int | None = None, *, local: bool = False,
                  num_programs: int | None = None) -> CopyConfig | None:
    """Mode 5's own tiling where it has one (:data:`BLOCKS_SMALL_ROWS`), else None (:func:`choose_config`'s)."""
    small = nbytes_hint is None or (isinstance(nbytes_hint, numbers.Integral) and not isinstance(nbytes_hint, bool)
                                    and nbytes_hint <= BLOCKS_SMALL_ROWS[0])
    return BLOCKS_SMALL_ROWS[1] if small and not local and num_programs is None else None


def choose_config(nbytes_hint: int | None = None, *, few_programs: bool = False, local: bool = False) -> CopyConfig:
    """The tiling for descriptors of about ``nbytes_hint`` bytes (2,304 if unknown).

    ``few_programs``: the grid is bounded to at most one program per SM (an SM budget),
    so each program gets a bigger step (more bytes in flight) instead of company.
    ``local``: both pools are in this GPU's memory (pack, unpack, a local copy).
    """
    hint = 2304 if nbytes_hint is None else max(int(nbytes_hint), 1)
    for limit, normal, few, near in CONFIG_TABLE:
        if limit is None or hint <= limit:
            return few if few_programs else near if local else normal
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (the interpreter's few programs on the CPU)."""
    device = torch.device(device)
    if device.type == "cpu":
        return CPU_PROGRAMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def default_programs(device: torch.device, config: CopyConfig) -> int:
    """The grid a launcher uses when ``num_programs`` is not given."""
    device = torch.device(device)
    if device.type == "cpu":
        return CPU_PROGRAMS
    return config.programs_per_sm * sm_count(device)
