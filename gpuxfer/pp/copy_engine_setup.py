"""The ``copy_engine`` pair's setup: the settings a transport reads when built (inline step size, copy
graphs, batched flag operations, the sender's empty words in host memory) and the phases
:func:`gpuxfer.pp.selection.connect` drives on every rank in lock step (allocate and export, open the
peer's, probe the flag link, finish), mixed into :class:`~gpuxfer.pp.copy_engine.CopyEngineTransport`,
with its teardown and what a released sender leaves its receiver (the marked slot words and their check).
"""
from __future__ import annotations

import logging
import operator

from .. import config
from ..errors import BadInput, GpuxferError, PeerLost
from ..flaglink import FIRST_WORD, FLAG_STRIDE, FlagLink
from ..platforms.base import FLAG_OP_VALUE, FLAG_OP_WAIT, FLAG_OP_WORDS, FLAG_OP_WRITE, RELEASE_VALUE, flag_ops_array
from ..hostwords import HostWords

log = logging.getLogger("gpuxfer.pp")

W_IN = FIRST_WORD          # the first of this end's flag words (in[0..R-1], then stage[0..R-1])
PROBE_TIMEOUT_S = 10.0
ENV_INLINE_BYTES = "GPUXFER_PP_INLINE_BYTES"
DEFAULT_INLINE_BYTES = config.VARS[ENV_INLINE_BYTES].default
ENV_STEP_GRAPHS = "GPUXFER_PP_STEP_GRAPHS"
ENV_FLAG_BATCH = "GPUXFER_PP_FLAG_BATCH"
ENV_HOST_GIVE_BACK = "GPUXFER_PP_HOST_GIVE_BACK"
STEP_GRAPHS = 64            # copy graphs a sender keeps (one per slot and set of source addresses seen twice
                            # within this many steps)



def _words(ops):
    """A flag_ops array's words as a flat uint64 memoryview (a word set in place costs less than through numpy):
    the value of its first row at :data:`FIRST_VALUE`, of its second at :data:`SECOND_VALUE`."""
    return memoryview(ops).cast("B").cast("Q")


FIRST_VALUE, SECOND_VALUE = FLAG_OP_VALUE, FLAG_OP_WORDS + FLAG_OP_VALUE   # in a two-row flag_ops array's words

def flag_batch_from_env() -> bool:
    """Whether a receiver queues its two flag operations of a step (give back the slot held since the last
    step, wait for the next) as one ``platform.flag_ops`` call (``$GPUXFER_PP_FLAG_BATCH``: 1, the default, or 0;
    remote flag writes only)."""
    return config.get(ENV_FLAG_BATCH)


def host_give_back_from_env() -> bool:
    """Whether a sender keeps its ``empty`` words in host memory shared with its receiver, so it sees a
    free slot on the host and queues no GPU wait for it (``$GPUXFER_PP_HOST_GIVE_BACK``: 1, the default,
    or 0)."""
    return config.get(ENV_HOST_GIVE_BACK)


def step_graphs_from_env() -> bool:
    """Whether a sender launches a small step's peer copies as one cached graph (``$GPUXFER_PP_STEP_GRAPHS``:
    1, the default, or 0)."""
    return config.get(ENV_STEP_GRAPHS)


def inline_bytes_from_env(value: "int | str | None" = None, option: str = "inline_bytes") -> int:
    """The largest step sent on the caller's stream (no staging, no side stream): ``value`` (named
    ``option`` in errors), else ``$GPUXFER_PP_INLINE_BYTES`` (``1M``, ``65536``...), else 1 MiB; 0 sends
    every step through staging."""
    if value is None or isinstance(value, str):
        return config.resolve(ENV_INLINE_BYTES, value, option=option)
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise BadInput(f"{option} must be a number of bytes (an integer >= 0, or a size like '1M'), "
                       f"got {value!r}") from None
    if n < 0:
        raise BadInput(f"{option} must be >= 0, got {n}")
    return n


class _CopyEngineSetup:
    """The local checks, setup phases and teardown of :class:`~gpuxfer.pp.copy_engine.CopyEngineTransport` (its
    state, set in its ``__init__``, and its hooks ``_ce_copy``, ``_own_publish``)."""

    # ---- local checks (doctor, and setup before allocating) ----
    @classmethod
    def platform_reason(cls, platform) -> str | None:
        """Why ``platform`` lacks what this backend rests on (a capability of the contract), or None: ``auto``
        takes the first zero-SM backend for which this is None."""
        if platform.copy_engine_peer_copies:
            return None
        return (f"platform {platform.name}'s copies to a peer do not run on copy engines "
                f"(Platform.copy_engine_peer_copies)"
                + (" (SDMA engines: the sdma backend)" if platform.sdma is not None else ""))

    @classmethod
    def unavailable_reason(cls, platform, device: int | None = None) -> str | None:
        """Why this backend cannot run on ``platform`` here (local checks only), or None."""
        why = cls.platform_reason(platform)
        if why is not None:
            return why
        try:
            n = platform.device_count()
            if n < 1:
                return "no device"
            info = platform.device_info(0 if device is None else device)
        except Exception as exc:  # noqa: BLE001 - a reason, not a crash
            return f"cannot query the device: {type(exc).__name__}: {exc}"
        if not info.stream_mem_ops_64:
            return (f"device {info.index} ({info.name}) cannot run 64-bit stream memory operations "
                    f"(stream flag write/wait)")
        return None

    # ---- setup phases (called by selection.connect, every rank in lock step) ----
    def _fptr(self, mem, word: int) -> int:
        return mem.ptr + word * FLAG_STRIDE

    @property
    def flag_words(self) -> int:
        """This end's flag words after the link's probe words: in[0..R-1], stage[0..R-1]."""
        return 2 * self.recv_slots

    def _alloc_flags(self, nbytes: int):
        """The flag buffer's memory (a platform with uncached flag memory overrides this)."""
        return self.platform.alloc(nbytes, self.device)

    def setup_prepare(self) -> dict:
        """Allocate and zero own memory, create the stream, export handles."""
        p, dev = self.platform, self.device
        p.set_device(dev)
        self._link = FlagLink(p, dev, self.flag_words, path=self.flag_path, rank=self.rank, peer=self.peer,
                              name=self.name, alloc=self._alloc_flags, copy=self._ce_copy)
        self._flags = self._link.local
        if self.role == "recv":
            self._data = p.alloc(self.recv_slots * self.specs.slot_bytes, dev)
        else:
            self._aux = p.create_stream(dev)
            self._prepare_send_side()
            if not p.synchronize(self._aux, PROBE_TIMEOUT_S):
                raise GpuxferError(f"initialising the sender's memory did not finish in {PROBE_TIMEOUT_S:g} s")
        payload = {"flags": self._link.export(), "slot_bytes": self.specs.slot_bytes, "slots": self.recv_slots}
        if self._data is not None:
            payload["data"] = self._data.export()
        if self.role == "send" and self.host_give_back and host_give_back_from_env():
            try:
                self._give_back = HostWords.create(p, dev, 2 * self.recv_slots)
            except Exception as exc:  # noqa: BLE001 - the empty words stay in device memory
                log.info("rank %d: %s empty words in device memory (host memory: %s)", self.rank, self.name, exc)
        payload["give_back"] = self._give_back.ref if self._give_back is not None else None
        return payload

    def _prepare_send_side(self) -> None:
        """The sender's own memory: the staging ring (and the stream its copy graphs are captured on)."""
        p, dev = self.platform, self.device
        self._staging = p.alloc(2 * self.specs.slot_bytes, dev)
        if self.inline_bytes and step_graphs_from_env():
            self._cap = p.create_stream(dev)

    def setup_open(self, peer_payload: dict) -> None:
        """Open the peer's handles."""
        p, dev = self.platform, self.device
        if peer_payload.get("slot_bytes") != self.specs.slot_bytes or peer_payload.get("slots") != self.recv_slots:
            raise BadInput(f"rank {self.peer} set up {peer_payload.get('slots')} slots of "
                           f"{peer_payload.get('slot_bytes')} B, this rank {self.recv_slots} of {self.specs.slot_bytes} B")
        self._link.open(peer_payload["flags"])
        self._peer_flags = self._link.peer_mem
        if self.role == "send":
            self._peer_data = p.open_handle(peer_payload["data"], dev)
            if self._peer_data.nbytes < self.recv_slots * self.specs.slot_bytes:
                raise BadInput(f"rank {self.peer}'s receive buffer holds {self._peer_data.nbytes} B, expected "
                               f"{self.recv_slots * self.specs.slot_bytes}")
        elif peer_payload.get("give_back"):
            self._open_give_back(peer_payload["give_back"])

    def _open_give_back(self, name: str) -> None:
        """Receiver: open the sender's empty words in host memory and check that this end's publishes (a
        stream write, or a stage write and an 8-byte copy) land there; else keep the device words."""
        p, dev = self.platform, self.device
        stage = self._fptr(self._flags, W_IN + self.recv_slots)

        def copy(stream, dst: int, value: int) -> None:
            p.write_flag(stream, stage, value)
            self._ce_copy(stream, dst, stage, 8)
        words = stream = None
        try:
            words = HostWords.open(p, dev, name, 2 * self.recv_slots)
            stream = p.create_stream(dev)
            words.check_peer_writes(stream, copy, PROBE_TIMEOUT_S)
            self._give_back, words = words, None
        except Exception as exc:  # noqa: BLE001 - the pair keeps the device words
            log.info("rank %d: %s: rank %d's empty words in host memory not usable (%s)", self.rank, self.name,
                     self.peer, exc)
        finally:
            if stream is not None:
                stream.close()
            if words is not None:
                words.close()

    def setup_probe_send(self, nonce: int) -> dict:
        """The flag link's probe: write ``nonce`` into the peer's probe words by an 8-byte copy and by a remote
        write.

        Every peer has opened this end's handles by now: a platform whose exports are names in a
        namespace (the host emulation's shared memory) drops the names here, so nothing outlives
        the processes even if they are all killed."""
        self._unpublish()
        return dict(self._link.probe_send(nonce), give_back=self.role == "recv" and self._give_back is not None)

    def _unpublish(self) -> None:
        """Drop the names of what this end exported (a namespace's names: the host emulation's shared memory;
        the mappings stay): at the probe, once the peer opened them, or after a failed setup."""
        unpublish = getattr(self.platform, "unpublish", None)
        failed = None
        if unpublish is not None:
            for buf in (self._flags, self._data, self._staging):    # (staging: never exported at all)
                if buf is not None and not buf.closed:
                    try:                # (each buffer's name dropped whatever happened to the one before)
                        unpublish(buf)
                    except Exception as exc:  # noqa: BLE001 - raised below, once every name was tried
                        failed = failed or exc
        if self._give_back is not None:
            self._give_back.unlink()
        if failed is not None:
            raise failed

    def setup_probe_check(self, peer_report: dict) -> dict:
        """Check the peer's probe writes arrived in local memory, and that a stream wait on it completes.
        A sender whose receiver could not use its empty words in host memory keeps the device words."""
        if self.role == "send" and self._give_back is not None and peer_report.get("give_back") is not True:
            self._give_back.close()
            self._give_back = None
        return self._link.probe_check(peer_report)

    def setup_finish(self, peer_check: dict) -> None:
        """Choose the flag path (remote writes only where the peer saw them) and pre-resolve the hot path."""
        self._link.finish(peer_check)
        self.remote_flags = self._link.remote
        R, slot = self.recv_slots, self.specs.slot_bytes
        self._in_ptr = [self._fptr(self._flags, W_IN + j) for j in range(R)]
        self._stage_ptr = [self._fptr(self._flags, W_IN + R + j) for j in range(R)]
        self._peer_in_ptr = [self._fptr(self._peer_flags, W_IN + j) for j in range(R)]
        if self._give_back is not None:     # the sender's empty words live in shared host memory
            if self.role == "send":
                self._in_ptr = [self._give_back.ptr(j) for j in range(R)]
                self._value_ptr = [self._give_back.ptr(R + j) for j in range(R)]
                self._free_loads = self._give_back.loads()
                if flag_batch_from_env():   # per slot: [wait empty[j] >= k-R, write value[j] = k] (flag_ops)
                    self._slot_arrays = [flag_ops_array([(FLAG_OP_WAIT, self._in_ptr[j], 0),
                                                         (FLAG_OP_WRITE, self._value_ptr[j], 0)]) for j in range(R)]
                    self._slot_ops = [_words(a) for a in self._slot_arrays]
            else:
                self._peer_in_ptr = [self._give_back.ptr(j) for j in range(R)]
        if self.role == "recv":
            self._slot_ptr = [self._data.ptr + j * slot for j in range(R)]
            if self.recv_views:
                self._data_bytes = self.platform.as_tensor(self._data, None, (R * slot,))
            if self.remote_flags and self._own_publish and flag_batch_from_env():
                self._lend_arrays = [flag_ops_array([(FLAG_OP_WRITE, self._peer_in_ptr[(j - 1) % R], 0),
                                                     (FLAG_OP_WAIT, self._in_ptr[j], 0)]) for j in range(R)]
                self._lend_ops = [_words(a) for a in self._lend_arrays]
        else:
            self._peer_slot_ptr = [self._peer_data.ptr + j * slot for j in range(R)]
            self._staging_ptr = [self._staging.ptr + s * slot for s in range(2)]
        self._state = "open"

    # ---- failure and teardown (after the drain) ----
    def _mark_peer_slots(self) -> None:
        """Sender, before its waits are released: the release value into the receiver's ``full`` word of each
        slot a queued step still waits for, so the copies the release lets into it (while the receiver may
        not have taken the slot's earlier step yet) never pass for that step (the receiver's
        ``_check_slot``; its waits on the word pass too). Under the lock ``_close_mappings`` takes: never
        into a closed mapping."""
        with self._peer_lock:
            ptrs = getattr(self, "_peer_in_ptr", None)
            if self._peer_flags is None or self._peer_flags.closed or ptrs is None:
                return
            if self._wd_lock.acquire(timeout=1.0):
                try:
                    waits = list(self._wd)
                finally:
                    self._wd_lock.release()
                slots = set()
                for _k, j, _t0, expected in waits:
                    v = self._seen(j)
                    if v is None or v < expected:
                        slots.add(j)
            else:               # the watchdog holds the waits: every slot
                slots = set(range(len(ptrs)))
            for j in sorted(slots):
                try:
                    self.platform.host_write_flag(ptrs[j], RELEASE_VALUE, self.device)
                except Exception as exc:  # noqa: BLE001 - best effort on the failure path
                    log.warning("rank %d: marking rank %d's receive slot words: %s", self.rank, self.peer, exc)
                    return

    def _check_slot(self, j: int, k: int) -> None:
        """Emulation, step k copied out of slot j, the slot not given back: ``full[j]`` still holds k (a sender
        publishes k + R only after it came back; any other value: the sender's waits were released, its
        released copies may have written the slot, :meth:`_mark_peer_slots`): else the step is not handed out."""
        v = self.platform.read_flag(self._in_ptr[j], self.device)
        if v != k and self._error is None:
            raise PeerLost(rank=self.rank, peer=self.peer, step=k, flag=f"full[{j}]", after_s=0.0,
                           why=f"rank {self.peer} released its waits: its copies may have written slot {j}",
                           detail=f"{self.name} receive: full[{j}] = {v}, expected {k}; step {k} not handed out")

    def _overwritten(self, j: int, k: int, v: int, after_s: float) -> PeerLost | None:
        """A receiver's watchdog: step k's wait on slot j passed and the slot's word reads ``v`` > k. A healthy
        sender writes past k only once this end gave the slot back; where it had not (``_back[j]`` < k, read after
        the word: it only grows), or ``v`` is the release mark, the sender's release let its copies into the slot
        (:meth:`_mark_peer_slots`, then their publish) and the step was handed out over them: ``PeerLost`` for a
        healthy receiver, so its next call raises (the emulation checks a slot before handing its step out:
        :meth:`_check_slot`). None otherwise."""
        if self._error is not None or (v < RELEASE_VALUE and self._back[j] >= k):
            return None
        return PeerLost(rank=self.rank, peer=self.peer, step=k, flag=f"full[{j}]", after_s=after_s,
                        why=f"rank {self.peer} released its waits: its copies may have written slot {j}",
                        detail=f"{self.name} receive: step {k} was handed out over slot {j}, full[{j}] = {v}")

    def _close_mappings(self) -> None:
        if self._peer_data is not None:
            self._peer_data.close()
        if self.role == "recv" and self._give_back is not None:
            self._give_back.close()
        if self._link is not None:
            with self._peer_lock:
                self._link.close_peer()

    def _free(self) -> None:
        self._calls = self._eager_stream = self._copy_out = None
        self._lent, self._lent_copied = None, False
        self._caller_streams.clear()
        self._free_loads = None
        self._copied = [None, None]
        self._packed = None
        self._graphs.clear()
        self._views.clear()
        self._slot_views = [(None, None)] * self.recv_slots
        self._lend_arrays = self._lend_ops = self._slot_arrays = self._slot_ops = None
        self._close_streams()
        if self._give_back is not None:     # after the graphs that copy from its value words
            self._give_back.close()
        self._data_bytes = None
        for b in (self._data, self._staging):
            if b is not None:
                b.close()
        if self._link is not None:
            self._link.close()

    def _free_local(self) -> None:
        """abort(): the staging ring and the streams are ours alone; flags and receive slots are mapped by the
        peer, kept; the give-back words' name dropped (the peer's mapping, if any, stays)."""
        if self._staging is not None:
            self._staging.close()
        if self._give_back is not None:
            self._give_back.unlink()
        self._close_streams()

    def _close_streams(self) -> None:
        for s in (self._cap, self._aux):
            if s is not None:
                s.close()
        self._cap = self._aux = None

    def _allocated(self) -> int:
        return sum(b.allocated_bytes for b in (self._data, self._staging, self._flags)
                   if b is not None and not b.closed)
