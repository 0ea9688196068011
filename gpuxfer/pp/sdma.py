"""The ``sdma`` backend: the copy-engine stage hand-off on ROCm (gfx942 / gfx950), peer copies on SDMA engines.

**Not run on an AMD GPU yet**: built to the published facts of
:mod:`gpuxfer.platforms.hsa` and tested on the CPU against a fake ROCr
(tests/fake_hsa.py) and the host emulation. Until it has run on hardware,
``auto`` never picks it: select it with ``GPUXFER_PP_TRANSPORT=sdma``.

It is :class:`~gpuxfer.pp.copy_engine.CopyEngineTransport` -- same memory
layout, receive slots, flags, setup phases, probe, deferred receive, watchdog
and teardown -- with ROCm differences:

* every flag buffer is uncached memory (``alloc_flags``), so a word a peer's
  SDMA engine wrote is seen by a stream wait without cache maintenance;
* every stream gpuxfer creates on ROCm has its own hardware queue (the
  platform's ``create_stream``): a HIP flag wait blocks its whole queue;
* 8-byte flag copies (the receiver's ``empty``, the setup probe) are
  stream-ordered SDMA copies (``hipMemcpyAsync`` with ``hipMemcpyDeviceToDeviceNoCU``);
* the sender's data copy -- two paths, ``GPUXFER_SDMA_PATH``:

``hip``: the parent's protocol as is, the peer copy being
``hipMemcpyAsync(..., hipMemcpyDeviceToDeviceNoCU, side_stream)``: HIP picks
the engine and orders the SDMA copy after the side stream's earlier work
itself. Simple; HIP's engine choice for IPC-mapped destinations is poor in
ROCm releases without ROCm/rocm-systems PRs #9472 and #5655.

``hsa`` (default): the host queues the copies on the SDMA engine recommended
for the GPU pair with ``hsa_amd_memory_async_copy_on_engine``, the peer's
agent as destination. SDMA copies are not stream work, so the ordering is
carried by HSA signals from a ring of ``N`` entries (``GPUXFER_SDMA_RING``,
default 16); entry ``i = k % N`` of step ``k`` holds:

* ``open[i]``   -- a ``hipMallocSignalMemory`` word: a ROCr signal that the
  side stream may write. The host stores 1 (armed) *before* the side stream's
  write of 0 is queued, and before the copies that depend on it are queued:
  ROCr reads a dependency when the copy is queued and waits only if it is then
  non-zero;
* ``data[i]``   -- completion signal(s) of the data copies: one per copy, or
  one shared by all (armed to their count) only where the GPU-CPU link is
  known to have 64-bit PCIe atomics (otherwise each copy's completion *writes*
  ``value_at_submit - 1`` and decrements would be lost);
* ``full[i]``, ``sent[i]`` -- completion signals of the two 8-byte flag copies;
* ``stage[i]``  -- a local (uncached) word holding ``k``, the flag copies' source.

Timeline of step k (slot j = (k-1) % R, staging slot s = k % 2)::

    host                          S current stream       S side stream (own HW queue)   SDMA engines
    ----                          ----------------       ------------------------------ ------------
    (k > N) wait data/full/sent   wait sent[s] >= k-2
      of step k-N to reach 0        (step k-2's copy
    store data[i]=1.., full[i]=1,    read staging[s])
      sent[i]=1, open[i]=1        pack -> staging[s]
                                  record ev packed ----> wait ev packed
                                                         wait empty[j] >= k-R (k > R)
                                                         write stage[i] = k
                                                         write open[i] = 0  ---------->  (polls pass)
    queue data copy(ies) staging[s] -> R.data[j], deps [open[i]], completion data[i]    copy ...
    queue flag copy stage[i] -> R.full[j], deps [open[i], data[i]..], completion full[i] ... then 8 B
    queue flag copy stage[i] -> S.sent[s], deps [open[i], data[i]..], completion sent[i]   ... then 8 B

The flag copies depend on the data copies' completion signals, never on queue
order (SDMA packets may overlap). The receiver is the parent's: wait
``full[j] >= k`` on its current stream, copy out, publish ``empty[j] = k``.
The host blocks only when it is N steps ahead of the engines (the ring wait,
bounded: :class:`~gpuxfer.errors.TransferTimeout`).

The platform's SDMA engines come through the contract: :attr:`Platform.sdma
<gpuxfer.platforms.base.Platform.sdma>`, a :class:`~gpuxfer.platforms.base.SdmaEngines`
(ROCm's is :class:`~gpuxfer.platforms.rocm.RocmSdma`; tests use it over a fake ROCr).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .. import config
from ..errors import BadInput, GpuxferError, TransferTimeout
from ..platforms.base import RELEASE_VALUE
from ..sync import wait_event_or_raise
from .copy_engine import FLAG_STRIDE, PROBE_TIMEOUT_S, CopyEngineTransport
from .backends import register_backend
from .spec import ALIGN, Layout

log = logging.getLogger("gpuxfer.pp")

ENV_PATH = "GPUXFER_SDMA_PATH"
ENV_RING = "GPUXFER_SDMA_RING"
ENV_COPIES = "GPUXFER_SDMA_COPIES"

#: Flip to True (and add "sdma" to backends.ZERO_SM) once the backend has passed
#: docs/ROCM.md's validation on an MI355X; until then ``auto`` keeps NCCL on ROCm.
VALIDATED_ON_HARDWARE = False


def sdma_path_from_env(value: str | None = None) -> str:
    return config.resolve(ENV_PATH, value, option="sdma_path")


def _engine(onehot: int) -> int:
    """The index of a one-hot engine id (engine n is 1 << n)."""
    return onehot.bit_length() - 1


@dataclass
class _Entry:
    """One ring entry (see the module docstring)."""

    open_mem: object               # SdmaEngines.alloc_signal: .ptr (value word), .signal
    open: object                   # the runtime's signals (handles)
    data: list
    full: object
    sent: object
    step: int = 0                  # the step that last used it (0: never)
    used_data: list = field(default_factory=list)

    def signals(self) -> list:
        return self.used_data + [self.full, self.sent]


class SdmaTransport(CopyEngineTransport):
    """One end of an SDMA pair on ROCm (see the module docstring)."""

    name = "sdma"
    validated_on_hardware = VALIDATED_ON_HARDWARE
    host_give_back = False       # its own ring of SDMA signals; the slots' words stay in device memory

    @classmethod
    def platform_reason(cls, platform) -> str | None:
        if platform.sdma is None:
            return f"platform {platform.name} offers no SDMA engines (Platform.sdma is None)"
        return None

    @classmethod
    def unavailable_reason(cls, platform, device: int | None = None) -> str | None:
        why = super().unavailable_reason(platform, device)
        if why is not None:
            return why
        try:
            path = sdma_path_from_env()
        except BadInput as exc:
            return str(exc)
        return platform.sdma.unavailable_reason(0 if device is None else device, host_queued=path == "hsa")

    def __init__(self, *, sdma_path: str | None = None, ring: int | None = None, copies: int | None = None, **kw):
        super().__init__(**kw)
        self.inline_bytes = 0    # every step staged: the inline path was measured on CUDA only
        self.sdma_path = sdma_path_from_env(sdma_path)
        self.ring = int(ring) if ring is not None else config.get(ENV_RING)
        self.copies = int(copies) if copies is not None else config.get(ENV_COPIES)
        if self.ring < 1 or self.copies < 1:
            raise BadInput(f"sdma ring ({self.ring}) and copies ({self.copies}) must be >= 1")
        self._sd = self.platform.sdma
        if self._sd is None:
            raise BadInput(f"the sdma backend needs SDMA engines; platform {self.platform.name} offers none")
        self._hsa = None
        self._entries: list[_Entry] = []
        self._sdma_flags = None
        self._engines = None                 # the SdmaEngines.plan_engines of the pair (hsa sender)
        self._my_agent = self._peer_agent = None
        self.shared_completion = False
        self._last_cur = None
        self._stage: list[int] = []          # hsa sender: stage[i] words (source of the flag copies)
        self._sent: list[int] = []           # hsa sender: sent[s] words (staging slot s is free again)

    # ---- setup ----
    def _alloc_flags(self, nbytes: int):
        """Flag words in uncached memory."""
        return self._sd.alloc_flags(nbytes, self.device)

    def setup_prepare(self) -> dict:
        """The parent's (its flags uncached: :meth:`_alloc_flags`); the hsa sender also gets its stage/sent words."""
        payload = super().setup_prepare()
        p, dev = self.platform, self.device
        if self.role == "send" and self.sdma_path == "hsa":
            self._sdma_flags = self._sd.alloc_flags((self.ring + 2) * FLAG_STRIDE, dev)
            p.memset_async(self._aux, self._sdma_flags.ptr, 0, (self.ring + 2) * FLAG_STRIDE)
            self._stage = [self._sdma_flags.ptr + i * FLAG_STRIDE for i in range(self.ring)]
            self._sent = [self._sdma_flags.ptr + (self.ring + s) * FLAG_STRIDE for s in range(2)]
            if not p.synchronize(self._aux, PROBE_TIMEOUT_S):
                raise GpuxferError(f"zeroing the sdma flags did not finish in {PROBE_TIMEOUT_S:g} s")
        return payload

    def setup_open(self, peer_payload: dict) -> None:
        super().setup_open(peer_payload)
        if self.role == "send" and self.sdma_path == "hsa":
            self._setup_hsa()

    def _setup_hsa(self) -> None:
        sd, dev = self._sd, self.device
        hsa = self._hsa = sd.runtime()
        self._my_agent = sd.agent(dev)
        self._peer_agent = sd.owner_agent(self._peer_data.ptr, f"rank {self.peer}'s receive buffer")
        if self._peer_agent.handle == self._my_agent.handle:
            log.info("rank %d: rank %d's buffer lives on this GPU; SDMA forced for a same-device copy",
                     self.rank, self.peer)
        self._engines = sd.plan_engines(self._my_agent, self._peer_agent, self.copies)
        self.shared_completion = bool(sd.pcie_atomics_64(dev)) and self.copies > 1
        log.info("rank %d -> %d: sdma %s; completion signals: %s", self.rank, self.peer, self._engines.why,
                 "one shared (64-bit PCIe atomics)" if self.shared_completion else "one per copy")
        n_data = 1 if self.shared_completion else self.copies
        for _ in range(self.ring):
            mem = sd.alloc_signal(dev)
            e = _Entry(mem, mem.signal, [hsa.signal_create(0) for _ in range(n_data)],
                       hsa.signal_create(0), hsa.signal_create(0))
            self._entries.append(e)
        self._warm_up()

    def _warm_up(self) -> None:
        """One 8-byte copy per engine used (ROCr creates an engine's queue on first use), checked to finish."""
        hsa, me, peer = self._hsa, self._my_agent.handle, self._peer_agent.handle
        probe = hsa.signal_create(0)
        try:
            for eng in dict.fromkeys(self._engines.data):   # into the peer's slot 0: unused before step 1
                hsa.signal_store(probe, 1)
                hsa.copy_on_engine(self._peer_data.ptr, peer, self._staging.ptr, me, 8, [], probe, eng,
                                   doing=f"warming up SDMA engine {_engine(eng)} towards rank {self.peer}")
                hsa.signal_wait_at_most(probe, 0, PROBE_TIMEOUT_S, rank=self.rank, step=0, flag="sdma warm-up",
                                        what=f"warm-up copy on engine {_engine(eng)} to rank {self.peer}")
            hsa.signal_store(probe, 1)
            hsa.copy_on_engine(self._sent[0], me, self._stage[0], me, 8, [], probe, self._engines.local,
                               doing="warming up the local SDMA flag copy")
            hsa.signal_wait_at_most(probe, 0, PROBE_TIMEOUT_S, rank=self.rank, step=0, flag="sdma warm-up",
                                    what="local flag-copy warm-up")
        finally:
            if hsa.signal_load(probe) <= 0:
                hsa.signal_destroy(probe)

    # ---- the parent's hooks ----
    def _ce_copy(self, stream, dst: int, src: int, nbytes: int) -> None:
        """A stream-ordered SDMA copy (the pack, the copy-out, the ``hip`` path's data copy, every 8-byte flag copy)."""
        self._sd.copy_async(stream, dst, src, nbytes)

    # ---- send (hsa path) ----
    def _chunks(self, total: int) -> list[tuple[int, int]]:
        """(offset, nbytes) of each data copy: ``copies`` pieces aligned to 256 B (fewer if small)."""
        n = max(1, min(self.copies, -(-total // ALIGN)))
        step = -(-total // n)
        step = -(-step // ALIGN) * ALIGN
        out, off = [], 0
        while off < total:
            out.append((off, min(step, total - off)))
            off += step
        return out

    def _ring_wait(self, e: _Entry, i: int) -> None:
        """Block the host (bounded) until ring entry i's previous step is entirely done."""
        for name, sig in [("data", s) for s in e.used_data] + [("full", e.full), ("sent", e.sent)]:
            self._hsa.signal_wait_at_most(
                sig, 0, self.timeout_s, rank=self.rank, step=e.step, flag=f"sdma {name}[{i}]",
                what=f"{self.name} send to rank {self.peer}: the SDMA {name} copy of step {e.step} did not "
                     f"complete (ring of {self.ring} entries)")

    def _send_impl(self, k: int, tensors, layout: Layout) -> None:
        if self.sdma_path == "hip":
            return super()._send_impl(k, tensors, layout)
        p, hsa, R, N = self.platform, self._hsa, self.recv_slots, self.ring
        cur, side = p.current_stream(self.device), self._aux
        s, j, i = k & 1, (k - 1) % R, k % N
        if cur is not self._last_cur:
            self._note_stream(cur)
            self._last_cur = cur
        # staging slot s was last read by step k-2's data copy, whose sent copy wrote sent[s] = k-2
        if k > 2:
            p.wait_flag(cur, self._sent[s], k - 2)
        self._copy_tensors(cur, self._staging_ptr[s], tensors, layout)     # the pack
        packed = p.record_event(cur)
        if self._host_sync:
            wait_event_or_raise(p, packed, self.timeout_s, rank=self.rank, step=k - 2, flag=f"sent[{s}]",
                                expected=k - 2, flag_ptr=self._sent[s], device=self.device,
                                what=f"{self.name} send to rank {self.peer}: staging slot not free")
        e = self._entries[i]
        if e.step:
            self._ring_wait(e, i)
        chunks = self._chunks(layout.total) if layout.total else []
        if self.shared_completion:
            e.used_data = e.data[:1] if chunks else []
            if chunks:
                hsa.signal_store(e.data[0], len(chunks))
        else:
            e.used_data = e.data[:len(chunks)]
            for sig in e.used_data:
                hsa.signal_store(sig, 1)
        hsa.signal_store(e.full, 1)
        hsa.signal_store(e.sent, 1)
        hsa.signal_store(e.open, 1)          # armed BEFORE the side stream's opening write is queued
        e.step = k
        p.stream_wait_event(side, packed)
        if k > R:
            p.wait_flag(side, self._in_ptr[j], k - R)
            self._wd.append((k, j, time.monotonic(), k - R))
        p.write_flag(side, self._stage[i], k)
        p.write_flag(side, e.open_mem.ptr, 0)
        me, peer = self._my_agent.handle, self._peer_agent.handle
        engines = self._engines.data
        for n, (off, nbytes) in enumerate(chunks):
            comp = e.used_data[0] if self.shared_completion else e.used_data[n]
            hsa.copy_on_engine(self._peer_slot_ptr[j] + off, peer, self._staging_ptr[s] + off, me, nbytes, [e.open],
                               comp, engines[n % len(engines)],
                               doing=f"queueing step {k}'s data copy {n} ({nbytes} B) to rank {self.peer}")
        deps = [e.open] + list(e.used_data)
        hsa.copy_on_engine(self._peer_in_ptr[j], peer, self._stage[i], me, 8, deps, e.full, engines[0],
                           doing=f"queueing step {k}'s full[{j}] flag copy to rank {self.peer}")
        hsa.copy_on_engine(self._sent[s], me, self._stage[i], me, 8, deps, e.sent, self._engines.local,
                           doing=f"queueing step {k}'s local sent[{s}] flag copy")

    # ---- drain and teardown ----
    def _drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        if not super()._drain(timeout_s):       # the side stream and every caller stream
            return False
        for i, e in enumerate(self._entries):
            for sig in e.signals():
                try:
                    self._hsa.signal_wait_at_most(sig, 0, max(0.01, deadline - time.monotonic()), rank=self.rank,
                                                  step=e.step, flag=f"sdma ring[{i}]")
                except TransferTimeout:
                    return False
        return True

    def _release_waits(self) -> None:
        super()._release_waits()
        if self._sdma_flags is not None and not self._sdma_flags.closed:
            for ptr in self._sent:
                self.platform.host_write_flag(ptr, RELEASE_VALUE, self.device)
        for e in self._entries:          # let copies still polling an unopened entry drain
            try:
                self._hsa.signal_store(e.open, 0)
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.debug("releasing sdma entry: %s", exc)

    def _free(self) -> None:
        hsa, leaked = self._hsa, 0
        for e in self._entries:
            for sig in e.data + [e.full, e.sent]:
                if hsa.signal_load(sig) <= 0:
                    hsa.signal_destroy(sig)
                else:       # a copy may still decrement it: leaking beats a use-after-free on the engine
                    leaked += 1
            e.open_mem.close()
        if leaked:
            log.warning("rank %d: %d sdma completion signal(s) still pending at teardown were not destroyed",
                        self.rank, leaked)
        self._entries = []
        if self._sdma_flags is not None:
            self._sdma_flags.close()
        super()._free()

    def _allocated(self) -> int:
        extra = 0
        if self._sdma_flags is not None and not self._sdma_flags.closed:
            extra += self._sdma_flags.allocated_bytes
        extra += 8 * sum(1 for e in self._entries if not e.open_mem.closed)
        return super()._allocated() + extra


# Registered as a peer-memory backend, but NOT among auto's candidates (zero_sm=False) until
# VALIDATED_ON_HARDWARE: GPUXFER_PP_TRANSPORT=sdma selects it explicitly.
register_backend("sdma", "gpuxfer.pp.sdma", "SdmaTransport", zero_sm=VALIDATED_ON_HARDWARE)
