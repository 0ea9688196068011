"""Every environment variable gpuxfer reads, declared once: its own ``GPUXFER_*`` ones and those other
tools set (torchrun's ``RANK``, ``CUDA_VISIBLE_DEVICES``, ...; :data:`EXTERNAL`).

Each :class:`Var` has a name, a default, a parser and a one-line meaning. Nothing is read at import:
:func:`get` reads the environment when it is called (when an object is built), so a test or a
launcher can set a variable any time before. An unset or blank variable takes its default; a bad
value raises :class:`~gpuxfer.errors.BadInput` naming the variable and the value.

    from gpuxfer import config
    config.get("GPUXFER_PP_TIMEOUT_S")              # 300.0, or the variable's value
    config.resolve("GPUXFER_PP_ON_TIMEOUT", value, option="on_timeout")   # an argument, else the variable

``python -m gpuxfer.config > docs/CONFIGURATION.md`` writes the documentation from the declarations
(a test keeps the two equal).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import BadInput

# ----------------------------------------------------------------------------- parsers
# A parser turns a stripped, non-empty string into a value, or raises ValueError with the rest of the
# sentence "<NAME> must be ..., got '<raw>'".


@dataclass(frozen=True)
class Parser:
    kind: str                               # how the docs table describes an accepted value
    parse: Callable[[str], Any]


def choice(*options: str) -> Parser:
    """One of ``options`` (case-insensitive)."""
    listed = ", ".join(options[:-1]) + f" or {options[-1]}" if len(options) > 1 else options[0]

    def parse(raw: str) -> str:
        v = raw.strip().lower()
        if v not in options:
            raise ValueError(f"must be {listed}, got {raw!r}")
        return v
    return Parser(" \\| ".join(options), parse)


def _flag(raw: str) -> bool:
    v = raw.strip().lower()
    if v not in ("0", "1", "on", "off", "true", "false"):
        raise ValueError(f"must be 1 or 0, got {raw!r}")
    return v in ("1", "on", "true")


FLAG = Parser("1 \\| 0", _flag)


def integer(low: int = 1, high: int | None = None) -> Parser:
    """An integer in ``[low, high]`` (no upper bound when ``high`` is None)."""
    def parse(raw: str) -> int:
        try:
            v = int(raw)
        except ValueError:
            raise ValueError(f"must be an integer, got {raw!r}") from None
        if v < low or (high is not None and v > high):
            raise ValueError(f"must be >= {low}, got {v}" if high is None else f"must be in [{low}, {high}], got {v}")
        return v
    return Parser(f"integer >= {low}" if high is None else f"integer in [{low}, {high}]", parse)


#: the longest wait any ``*_TIMEOUT_S`` may ask for (one week): a longer one is a mistake (every wait is
#: bounded), and past about 1e9 s the clocks and deadlines waits go through (``threading``'s, gloo's
#: ``timedelta``, ``time_t``) overflow instead of waiting
MAX_SECONDS = 7 * 24 * 3600.0


def _number_of_seconds(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"must be a number of seconds, got {raw!r}") from None


def _seconds(raw: str) -> float:
    v = _number_of_seconds(raw)
    if not (math.isfinite(v) and 0 < v <= MAX_SECONDS):
        raise ValueError(f"must be a finite number of seconds > 0 and <= {MAX_SECONDS:g}, got {raw!r}")
    return v


SECONDS = Parser(f"seconds in (0, {MAX_SECONDS:g}]", _seconds)


def _offset(raw: str) -> float:
    v = _number_of_seconds(raw)
    if not (math.isfinite(v) and abs(v) <= 1e9):
        raise ValueError(f"must be a finite number of seconds within +-1e9, got {raw!r}")
    return v


OFFSET = Parser("seconds in [-1e9, 1e9]", _offset)


def _bytes(raw: str) -> int:
    from .common import parse_size
    return 0 if raw.strip() == "0" else parse_size(raw.strip(), option="", kind="bytes")


BYTES = Parser("bytes (`1M`, `65536`; 0)", _bytes)
TEXT = Parser("text", lambda raw: raw)

# ----------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Var:
    name: str
    default: Any
    parser: Parser
    doc: str


VARS: dict[str, Var] = {v.name: v for v in (
    # platforms
    Var("GPUXFER_PLATFORM", None, TEXT, "the platform to use: cuda, rocm or host (unset: the first usable)"),
    Var("GPUXFER_HOST_DEVICES", 2, integer(1), "devices the host emulation offers"),
    Var("GPUXFER_WARN_LEAKS", True, FLAG, "warn (ResourceWarning) when a buffer, mapping or stream is "
                                          "garbage-collected without close()"),
    Var("GPUXFER_CUDA_BATCH", "auto", choice("auto", "ctypes", "ctypes12080", "bindings", "loop"),
        "how the CUDA platform reaches cuMemcpyBatchAsync (loop: one copy per call)"),
    Var("GPUXFER_ROCM_HOST_FLAG_TIMEOUT_S", 10.0, SECONDS, "longest a ROCm host read or write of a flag word may take"),
    Var("GPUXFER_ROCM_DEDICATED_QUEUES", True, FLAG, "give each new ROCm stream its own hardware queue"),
    Var("GPUXFER_HSA_LIBRARY", None, TEXT, "path of libhsa-runtime64 to load first"),
    Var("GPUXFER_DIRECT_LAUNCH", True, FLAG, "launch cached Triton kernels directly (0: through Triton every time)"),
    # peer flags (gpuxfer/flaglink.py)
    Var("GPUXFER_FLAG_PATH", "auto", choice("auto", "remote", "copy"),
        "how peer flags (copy_engine stage hand-off, pack KV engine) reach the peer: probed, remote stream "
        "writes, or 8-byte copies"),
    # pipeline-parallel transports
    Var("GPUXFER_PP_TRANSPORT", "auto", TEXT, "the PP transport connect() builds: auto or a registered backend "
        "(nccl, copy_engine, sdma, copy_engine_graph)"),
    Var("GPUXFER_PP_TIMEOUT_S", 300.0, SECONDS, "longest any PP wait may take"),
    Var("GPUXFER_PP_ON_TIMEOUT", "raise", choice("raise", "exit"),
        "what a failed PP transport does: raise on every later call, or also log and exit"),
    Var("GPUXFER_PP_META_CHANNEL", "auto", choice("auto", "group"),
        "where step metadata travels: a shared-memory mailbox on one host (auto) or the CPU group"),
    Var("GPUXFER_PP_INLINE_BYTES", 1 << 20, BYTES, "largest copy_engine step sent without staging (0: stage every step)"),
    Var("GPUXFER_PP_STEP_GRAPHS", True, FLAG, "launch a small copy_engine step's peer copies as one cached graph"),
    Var("GPUXFER_PP_FLAG_BATCH", True, FLAG, "queue a copy_engine receiver's two flag operations of a step (give back, wait) as one call"),
    Var("GPUXFER_PP_HOST_GIVE_BACK", True, FLAG, "keep a copy_engine sender's empty words in host memory shared "
        "with its receiver: a slot seen free on the host needs no GPU wait"),
    Var("GPUXFER_PP_INJECT_FAILURE", "", TEXT, "test hook: RANK:PHASE[,RANK:PHASE...] fails connect() setup there"),
    Var("GPUXFER_SDMA_PATH", "hsa", choice("hsa", "hip"), "how the sdma transport copies: HSA SDMA queues or hipMemcpy"),
    Var("GPUXFER_SDMA_RING", 16, integer(1, 1 << 16), "ring entries of the sdma transport"),
    Var("GPUXFER_SDMA_COPIES", 1, integer(1, 16), "SDMA engines one sdma step is split over"),
    Var("GPUXFER_LOG_LEVEL", "warning", choice("debug", "info", "warning", "error"),
        "log level of the gpuxfer command and of the ranks a benchmark spawns (gpuxfer -v: INFO)"),
    # KV engines
    Var("GPUXFER_KV_ON_TIMEOUT", "raise", choice("raise", "exit"),
        "what a failed KV side or agent does: raise on every later call, or also log and exit"),
    Var("GPUXFER_KV_COPY", "blocks", choice("descriptors", "blocks"),
        "how the triton engine's posts copy: blocks (each copy derives its rows from the block IDs on the device: "
        "no descriptor memory, one launch per tiling, less host time a post and a batch) or descriptors (an "
        "expansion kernel writes a request's descriptor table, 24 B a row, the copies read it): "
        "docs/PERFORMANCE.md, 'Mode 5's own tiling'"),
    Var("GPUXFER_KV_TRITON_ORDER", "peer", choice("peer", "local", "plan"),
        "how the triton engine orders each size class: by the peer pool's offsets, the local pool's, or as planned"),
    Var("GPUXFER_KV_REMOTE", "none", choice("none", "nixl"),
        "how KVAgent reaches peers on other hosts (KVAgent(remote=...)): none, or through NIXL (an agent of its own)"),
    Var("GPUXFER_KV_ROUTE", "auto", choice("auto", "ipc", "nixl"),
        "the route KVAgent.add_peer takes when not given one: auto (IPC on this host, NIXL to another), ipc, or "
        "nixl (every peer through NIXL, one on this host included)"),
    # a descriptor is a 24-byte row here and NIXL keeps its own copy: 4M of them are ~100 MiB of rows a list
    Var("GPUXFER_KV_NIXL_MAX_DESCRIPTORS", 1 << 22, integer(1, (1 << 31) - 1),
        "most NIXL descriptors in either prepped list of a KVAgent's NIXL peer, when more than 4x the blocks x "
        "pieces of this agent's shared groups; a peer needing more is refused at add_peer"),
    Var("GPUXFER_NIXL_PROGRESS_THREAD", False, FLAG,
        "run NIXL's progress thread in the KV agent's NIXL agent (off: the agent's poller progresses it)"),
    Var("GPUXFER_TEST_REQUIRE_NIXL", False, FLAG,
        "tests: a missing NIXL fails the NIXL route's tests (CI's NIXL step) instead of skipping them"),
    Var("GPUXFER_TEST_REQUIRE_MOONCAKE", False, FLAG,
        "tests: a missing Mooncake fails the SGLang Mooncake reference tests (CI's SGLang step) instead of "
        "skipping them"),
    Var("GPUXFER_NIXL_MODULE", None, TEXT, "the NIXL Python module to import (unset: the wheel matching CUDA)"),
    # at ~8 us per descriptor (UCX cuda_ipc on H200) the default cap is ~17 s per burst; nixl+pack moves a few
    # bulk descriptors and has no cap
    Var("GPUXFER_NIXL_MAX_DESCS", 2_200_000, integer(1), "bursts with more descriptors are shed by the per-descriptor NIXL engines (nixl, nixl-oneshot)"),
    Var("GPUXFER_NIXL_PACK_STAGE_BYTES", 2 << 30, integer(1), "staging buffer bytes of nixl+pack on each side (at most the pool)"),
    Var("GPUXFER_MOONCAKE_HOST", "127.0.0.1", TEXT, "the address Mooncake's transfer engine binds"),
    Var("GPUXFER_MOONCAKE_NIC", "", TEXT, "Mooncake's NIC filter ({gpu} expands to the device index)"),
    Var("GPUXFER_MORI_MODULE", "mori.io", TEXT, "the MoRI-IO Python module to import"),
    Var("GPUXFER_MORI_BACKEND", "rdma", choice("rdma", "xgmi"), "MoRI-IO backend: RDMA, or XGMI within one node"),
    Var("GPUXFER_MORI_HOST", "127.0.0.1", TEXT, "the address MoRI-IO's control plane binds"),
    # vLLM connector (gpuxfer.integrations.vllm; kv_connector_extra_config keys override each)
    Var("GPUXFER_VLLM_LEASE_S", 120.0, SECONDS, "vLLM prefill: longest it holds a finished request's blocks for a "
        "decode instance to read (extra config lease_s)"),
    Var("GPUXFER_VLLM_HOST", "127.0.0.1", TEXT, "vLLM prefill: the address its side channel binds and announces "
        "(extra config host)"),
    Var("GPUXFER_VLLM_PORT", 0, integer(0, 65535), "vLLM prefill: the side channel's TCP port (0: any free port; "
        "tensor parallel rank r listens on port + r; extra config port)"),
    Var("GPUXFER_VLLM_ENGINE", "auto", choice("auto", "triton", "copy_engine"), "vLLM: the KV engine the decode "
        "side pulls with (auto: triton on GPUs, copy_engine on the host emulation; extra config engine)"),
    Var("GPUXFER_VLLM_HANDSHAKE_TIMEOUT_S", 10.0, SECONDS, "vLLM decode: longest a handshake with a prefill "
        "instance may take before its requests' loads fail (extra config handshake_timeout_s)"),
    Var("GPUXFER_VLLM_LOADER", "auto", choice("auto", "inline", "process"), "vLLM decode: where its loads run: on "
        "the engine's thread (inline), or in a loader process of the worker's own, the engine thread only handing the "
        "loads over and reading completions (process); auto: process for caches in GPU memory (inline where it "
        "cannot start, logged), inline for host memory (extra config loader)"),
    Var("GPUXFER_VLLM_LOADER_START_S", 300.0, SECONDS, "vLLM decode: longest the loader process may take to "
        "start (import, register the caches, load its kernels) before registration fails"),
    Var("GPUXFER_VLLM_TEST_CLOCK_SHIFT_S", 0.0, OFFSET, "test hook: seconds added to this process's lease clock "
        "(stands in for another host's clock)"),
    Var("GPUXFER_REQUIRE_VLLM", False, FLAG, "test hook: the vLLM connector's tests fail instead of skipping where "
        "vLLM is not installed (CI's vLLM step)"),
    # SGLang transfer backend (gpuxfer.integrations.sglang; --disaggregation-transfer-backend gpuxfer)
    Var("GPUXFER_SGLANG_ENGINE", "auto", choice("auto", "triton", "copy_engine"), "SGLang: the KV engine the "
        "prefill side pushes with (auto: triton on GPUs, copy_engine on the host emulation)"),
    Var("GPUXFER_SGLANG_UNREQUESTED_ROOMS", 8192, integer(1), "SGLang: how many rooms one decode rank may have "
        "named pages for that no request of the prefill rank holds yet (its oldest past this are dropped; each is "
        "dropped anyway after SGLANG_DISAGGREGATION_WAITING_TIMEOUT)"),
    Var("GPUXFER_SGLANG_DECODE_RANKS", 1024, integer(1), "SGLang: how many decode ranks a prefill rank keeps "
        "registered at once (each a peer mapping its KV pool); a new rank past this takes the place of one a push "
        "found gone, else its registration is refused (logged, counted) and its rooms fail"),
    # the largest frame a real peer sends: a decode's registration payload, its agent's metadata (at most
    # kv.metadata.MAX_METADATA_BYTES, ~13.2 MiB) and geometry, at most 16 MiB
    # (integrations.sglang.layout.MAX_PAYLOAD_BYTES);
    # a metadata message's page list, int32 page indices (4 MiB for 1M tokens at page size 1; 8 MiB were they
    # int64); a row message's rows (KiB). 64 MiB is four times the largest.
    Var("GPUXFER_SGLANG_MAX_FRAME_MB", 64, integer(1, 1 << 20), "SGLang: the largest frame (MiB) of a control "
        "message a KV manager's socket takes; a larger one drops its connection, nothing of its message delivered "
        "(ZMQ's MAXMSGSIZE: it bounds each frame, not their number)"),
    Var("GPUXFER_REQUIRE_SGLANG", False, FLAG, "test hook: the SGLang backend's tests fail instead of skipping "
        "where SGLang is not installed (CI's SGLang step)"),
    # KV benchmark
    Var("GPUXFER_INJECT_FAULT", None, TEXT, "test hook of bench kv: ENGINE[:DIRECTION][:stray] or all flips a byte"),
    Var("GPUXFER_KV_TRACE", None, TEXT, "bench kv on GPUs: a directory for a torch.profiler timeline of each row"),
)}

#: variables other tools set that gpuxfer reads (torchrun, CUDA, ROCm): read through :func:`get` as well
EXTERNAL: dict[str, Var] = {v.name: v for v in (
    Var("RANK", None, integer(0), "torchrun: this process's rank (with WORLD_SIZE: the benchmarks run under torchrun)"),
    Var("WORLD_SIZE", None, integer(1), "torchrun: the number of ranks"),
    Var("LOCAL_RANK", None, integer(0), "torchrun: this process's rank on its host (the device it takes)"),
    Var("CUDA_VISIBLE_DEVICES", None, TEXT, "CUDA: the devices a process sees (named in detection's reasons)"),
    Var("HSA_ENABLE_SDMA", None, TEXT, "ROCr: 0 turns SDMA copies into blit kernels (the sdma transport refuses it)"),
    Var("HSA_ENABLE_PEER_SDMA", None, TEXT, "ROCr: 0 turns peer SDMA copies into blit kernels (likewise)"),
    Var("ROCM_PATH", None, TEXT, "ROCm: the installation whose lib/ is searched for libhsa-runtime64"),
    Var("ROCM_HOME", None, TEXT, "ROCm: the same, where ROCM_PATH is unset"),
)}

# ----------------------------------------------------------------------------- API


def _var(name: str) -> Var:
    try:
        return VARS[name] if name in VARS else EXTERNAL[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared gpuxfer variable (see gpuxfer/config.py)") from None


def parse(name: str, raw: str, option: str | None = None) -> Any:
    """``raw`` parsed as variable ``name``'s type; a bad value raises BadInput naming ``option`` (default: ``name``)."""
    label = option or name
    try:
        return _var(name).parser.parse(raw)
    except BadInput as exc:                     # parse_size's own message, which names no option
        raise BadInput(f"{label}{exc}") from None
    except ValueError as exc:
        raise BadInput(f"{label} {exc}") from None


def get(name: str) -> Any:
    """The value of ``name`` now: its default when unset or blank, else its parsed value."""
    var = _var(name)
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return var.default
    return parse(name, raw)


def resolve(name: str, value: Any = None, option: str | None = None) -> Any:
    """``value`` when given (parsed as ``name``'s type, errors naming ``option``), else :func:`get`."""
    if value is None or not str(value).strip():
        return get(name)
    return parse(name, str(value), option)


def is_set(name: str) -> bool:
    """Whether the environment gives ``name`` a value (not unset, not blank)."""
    _var(name)
    return bool(os.environ.get(name, "").strip())


def torchrun() -> tuple[int, int, int] | None:
    """``(rank, world size, local rank)`` when the process runs under torchrun (``RANK`` and ``WORLD_SIZE``
    set), else None; the local rank defaults to the rank."""
    if not (is_set("RANK") and is_set("WORLD_SIZE")):
        return None
    rank = get("RANK")
    local = get("LOCAL_RANK")
    return rank, get("WORLD_SIZE"), rank if local is None else local


def effective() -> dict[str, Any]:
    """Every variable's value now, by name (raises BadInput on the first bad one)."""
    return {name: get(name) for name in VARS}


def report() -> dict[str, dict]:
    """Every variable's value now, whether the environment set it, and the error of a bad value (doctor)."""
    out = {}
    for name in VARS:
        try:
            out[name] = {"value": get(name), "set": is_set(name), "error": None}
        except BadInput as exc:
            out[name] = {"value": None, "set": True, "error": str(exc)}
    return out


def table(variables: dict[str, Var] | None = None) -> str:
    """The declarations as a Markdown table (docs/CONFIGURATION.md)."""
    rows = ["| Variable | Values | Default | Meaning |", "|---|---|---|---|"]
    for v in (VARS if variables is None else variables).values():
        default = ("unset" if v.default is None else "empty" if v.default == "" else
                   "`1`" if v.default is True else "`0`" if v.default is False else f"`{v.default}`")
        rows.append(f"| `{v.name}` | {v.parser.kind} | {default} | {v.doc} |")
    return "\n".join(rows) + "\n"


def document() -> str:
    """docs/CONFIGURATION.md."""
    return ("# Configuration\n\n"
            "Every `GPUXFER_*` environment variable gpuxfer reads, as declared in `gpuxfer/config.py` (this file is\n"
            "`python -m gpuxfer.config`; `tests/test_config.py` keeps the two equal). A variable is read when the object\n"
            "that uses it is built, never at import. Unset or blank takes the default; a bad value raises `BadInput`\n"
            "naming the variable and the value. Flags take `1`/`0` (also `on`/`off`, `true`/`false`). `gpuxfer doctor`\n"
            "shows the variables set in the environment; `gpuxfer doctor --json` lists every effective value.\n\n"
            + table()
            + "\nVariables of other tools that gpuxfer reads (set by them, declared here too):\n\n" + table(EXTERNAL))


if __name__ == "__main__":
    print(document(), end="")
