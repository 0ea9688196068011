"""The ``copy_engine_graph`` backend: a stage hand-off whose steps live inside the caller's CUDA graph.

``connect(..., graph=True)`` (or ``GPUXFER_PP_TRANSPORT=copy_engine_graph``)
sets the pair up like ``copy_engine`` (receive slots and flags exported over
IPC, the flag-path probe, the same teardown), but a step is *captured*:
``send()`` and ``recv().tensors`` called while the current stream captures a
graph record their flag operations and copy-engine copies into that graph, and
every replay of the graph moves one step with no host call::

    conn = connect(group, send_to=nxt, recv_from=prev, specs=specs, graph=True)
    snd, rcv = conn.sender(), conn.receiver()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x = rcv.recv(out=static_in).tensors["hidden"]    # views of static_in
        y = layer(x)                                     # static shapes
        snd.send({"hidden": y})                          # y's memory is read at every replay
    for _ in range(steps):
        g.replay()                                       # both ends replay their graphs in step
    conn.synchronize()                                   # raises TransferTimeout if a replay got stuck

What is fixed at capture: the tensors' addresses (the sender reads the tensors
it passed at capture, the receiver writes ``out``, or a buffer allocated from
the graph's memory pool when ``out`` is None), the shapes (metadata, if it
travels, travels once, at capture) and each step's slot: the c-th step captured
on a transport uses slot ``j = (c - 1) % R`` at every replay. Both ends must
replay their captured steps in the order they were captured (typically one
graph per decode step, replayed once per step on each end).

Mixing is refused with :class:`~gpuxfer.errors.GraphModeError`: ``send()`` or
``recv()`` outside capture, or a captured receive whose ``.tensors`` is first
read after the capture ended.

Flags hold constant values, so a replayed step means the same thing every
time: a flag word is a token, set (1) by the peer and consumed (reset to 0) by
the end that waited for it. Memory (pair S -> R, R slots)::

    R owns  data  = R slots x slot_bytes                               (S opens it)
            flags = [probe | full[j] | stage[j] | enter[j], done[j]]   (S opens it)
    S owns  flags = [probe | empty[j] | stage[j] | enter[j], done[j]]  (R opens it)

    initially empty[j] = 1 (every slot free), full[j] = 0, counters 0

One replayed step on slot j::

    S (replaying its graph)                          R (replaying its graph)
    -----------------------                          -----------------------
    enter[j] += 1          (one-element kernel)      enter[j] += 1
    wait empty[j] >= 1     (local)                   wait full[j] >= 1     (local)
    empty[j] = 0           (token consumed)            .
    copy tensors -> R.data[j]  (copy engine)           .
    publish full[j] = 1  -------------------------->  (wait passes)
    done[j] += 1                                     full[j] = 0           (token consumed)
                                                     copy R.data[j] -> out  (copy engine)
    empty[j] = 1  <---------------------------------  publish empty[j] = 1
    (the next replay on slot j may write it)         done[j] += 1

A publish goes by a remote stream write or by a local write of the constant
into ``stage[j]`` plus an 8-byte copy, as the setup probe chose (see
:mod:`gpuxfer.pp.copy_engine`). Each token is made by one peer step and
consumed by one local step, and a token for the next use of slot j is only
made after the previous one was consumed (R resets ``full[j]`` before its
copy-out, before it publishes ``empty[j]``, before S's next write into the
slot), so values stay 0/1 however many times the graphs replay.

Timeouts: ``enter[j]`` / ``done[j]`` are the device-side step counters (each
a one-element add kernel in the graph, off the hand-off path: ``enter`` runs
before the wait, ``done`` after the publish). The process watchdog reads them
from the host; a slot whose ``enter`` exceeds its ``done`` with neither moving
for ``timeout_s`` is a replay stuck in its wait: the watchdog records
:class:`~gpuxfer.errors.TransferTimeout` (raised by ``synchronize()`` and any
later call) and writes a release value into this end's flag words, so the
stuck replay runs through; from then on it releases every replay that waits
(their data is garbage; nothing hangs) until ``close()`` / ``abort()``.

Lifetime: the graphs holding captured steps are the caller's own objects
(``torch.cuda.CUDAGraph``, or the platform's graph on the host emulation);
gpuxfer hands out no graph and no replay call, so it cannot refuse a replay.
The captured operations hold the raw addresses of the transport's receive
slots, flag words and the peer's mappings, which ``close()`` / ``abort()`` /
:func:`~gpuxfer.pp.watchdog.close_all` free or unmap. The rule: finish every
replay (``conn.synchronize()``), then destroy the graphs or never replay them
again, on both ends, before closing the transport. A graph replayed after
``close()`` (or after the peer closed its end) reads and writes freed memory:
undefined behaviour on a GPU (a fault, or bytes of whatever reuses the memory),
not an error gpuxfer can raise. To keep stepping after a close, ``connect()``
again and capture new graphs.

Cost: no host call per step (the caller's one graph launch covers its whole
step); on the GPU, per step and end, two one-element kernels (the counters),
one flag wait, one or two flag writes, one 8-byte copy on the copy path, and
the data copies. Measured with both processes on one H200: a two-stage decode
loop of 10^4 steps bit-exact against the eager loop, ~430 us per round trip,
and a pipelined loop ~300 us per step, where eager copy_engine steps (no kernels)
took 19-29 us; the likely reason is that two processes' kernels on one GPU take
turns (time slices), so the counters' kernels cost a context switch per step
there. Two GPUs do not share that.
"""
from __future__ import annotations

import functools
import time

from ..errors import GraphModeError, TransferTimeout
from ..platforms.base import RELEASE_VALUE
from .copy_engine import W_IN, CopyEngineTransport
from .spec import Layout
from .transport import Received



class GraphTransport(CopyEngineTransport):
    """One end of a graph-mode copy-engine pair (see the module docstring for the protocol)."""

    name = "copy_engine_graph"
    watch_after_error = True         # keep releasing replays that wait once the pair is broken
    host_give_back = False           # tokens, not step numbers: the slots' words stay in device memory
    mark_peer_slots = False          # (tokens: a receiver's replays have no step to check a slot word against)

    def __init__(self, *, inline_bytes=None, **kw):
        super().__init__(inline_bytes=0, **kw)   # every step goes straight into the peer's slot
        self._static: list = []      # what captured steps read or write (kept alive with the graphs)
        self._stamp: dict[int, tuple[int, int, float]] = {}   # slot -> (done, enter, since) of a step in flight
        self._bump: list = []        # per slot: (enter += 1, done += 1) callables

    def close(self) -> None:
        """Drain, barrier with the peer, close mappings, barrier, free. Idempotent. The caller's graphs that
        captured this transport's steps must not be replayed afterwards (they hold its freed addresses: see
        the module docstring's Lifetime): synchronize, then drop or stop replaying them, on both ends, first."""
        super().close()

    # ---- flag words ----
    @property
    def flag_words(self) -> int:
        """in[0..R-1], stage[0..R-1], then per slot its enter and done counters."""
        return 4 * self.recv_slots

    def _word(self, j: int, which: int) -> int:
        """Word index of slot j's ``enter`` (0) or ``done`` (1) counter."""
        return W_IN + 2 * self.recv_slots + 2 * j + which

    # ---- setup (the phases of CopyEngineTransport, without a staging ring) ----
    def _prepare_send_side(self) -> None:
        for j in range(self.recv_slots):     # every slot starts free: the sender holds its tokens
            self.platform.write_flag(self._aux, self._fptr(self._flags, W_IN + j), 1)

    def setup_finish(self, peer_check: dict) -> None:
        import torch
        self._link.finish(peer_check)
        self.remote_flags = self._link.remote
        p, R, slot = self.platform, self.recv_slots, self.specs.slot_bytes
        self._in_ptr = [self._fptr(self._flags, W_IN + j) for j in range(R)]
        self._stage_ptr = [self._fptr(self._flags, W_IN + R + j) for j in range(R)]
        self._peer_in_ptr = [self._fptr(self._peer_flags, W_IN + j) for j in range(R)]
        self._count_ptr = [(self._fptr(self._flags, self._word(j, 0)), self._fptr(self._flags, self._word(j, 1)))
                           for j in range(R)]
        if self.role == "recv":
            self._slot_ptr = [self._data.ptr + j * slot for j in range(R)]
        else:
            self._peer_slot_ptr = [self._peer_data.ptr + j * slot for j in range(R)]
        for j in range(R):
            counters = [p.as_tensor(self._flags, torch.int64, (1,), self._word(j, w) * 64) for w in (0, 1)]
            self._bump.append(tuple(functools.partial(torch.Tensor.add_, c, 1) for c in counters))
        p.read_flag(self._in_ptr[0], self.device)   # the host-read helper exists before any capture starts
        self._state = "open"

    # ---- mode ----
    def _capturing_stream(self, what: str):
        p = self.platform
        cur = p.current_stream(self.device)
        if not p.is_capturing(cur):
            raise GraphModeError(
                f"rank {self.rank}: {what} on the {self.name} transport with rank {self.peer} outside graph "
                f"capture: its steps are captured (call it inside torch.cuda.graph) and moved by replays; "
                f"eager steps need a copy_engine transport (connect without graph=True)")
        return cur

    def send(self, tensors) -> None:
        """Capture one step: the tensors' memory is read at every replay (keep them as static inputs)."""
        self._check_usable("send")
        self._capturing_stream("send()")
        super().send(tensors)

    def recv(self, shapes=None, out=None) -> Received:
        """Capture one receive (its ``.tensors`` must be read during the same capture): every replay writes
        ``out`` (or a buffer from the graph's memory pool) and returns nothing new on the host."""
        self._check_usable("recv")
        self._capturing_stream("recv()")
        return super().recv(shapes=shapes, out=out)

    # ---- the captured step ----
    def _step_begin(self, stream, j: int) -> None:
        p = self.platform
        p.launch(stream, self._bump[j][0])          # enter[j] += 1
        p.wait_flag(stream, self._in_ptr[j], 1)     # the peer's token
        p.write_flag(stream, self._in_ptr[j], 0)    # consumed
        if not self._wd:
            self._wd.append(None)                   # the watchdog polls this end's counters from now on

    def _step_end(self, stream, j: int) -> None:
        self._publish(stream, j, 1)
        self.platform.launch(stream, self._bump[j][1])   # done[j] += 1

    def _send_impl(self, k: int, tensors, layout: Layout) -> None:
        cur = self._capturing_stream("send()")
        j = (k - 1) % self.recv_slots
        self._step_begin(cur, j)
        self._copy_tensors(cur, self._peer_slot_ptr[j], tensors, layout)
        self._step_end(cur, j)
        self._static.append(dict(tensors))

    def _recv_impl(self, rcv: Received) -> None:
        pass   # recorded at the first .tensors access (in the same capture)

    def _materialize_impl(self, rcv: Received) -> None:
        import torch
        cur = self._capturing_stream(f"the first .tensors of captured receive {rcv.step}")
        lay, specs = rcv.layout, self.specs
        j = (rcv.step - 1) % self.recv_slots
        slot = self._slot_ptr[j]
        self._step_begin(cur, j)
        if rcv.out is None:        # a static buffer of the graph's memory pool
            buf = torch.empty(lay.buffer_bytes, dtype=torch.uint8, device=self.torch_device)
            if lay.total:
                self._ce_copy(cur, buf.data_ptr(), slot, lay.total)
            views, keep = specs.views(buf, lay), buf
        else:
            views, keep = {}, dict(rcv.out)
            for name, o, n, shape, item in zip(specs.names, lay.offsets, lay.nbytes, lay.shapes, specs.itemsizes):
                flat = rcv.out[name].view(-1)[:n // item]
                views[name] = flat.view(shape)
                if n:
                    self._ce_copy(cur, flat.data_ptr(), slot + o, n)
        self._step_end(cur, j)
        self._static.append(keep)
        rcv._tensors = views

    # ---- device-side progress ----
    def device_steps(self) -> int:
        """Steps this end finished on the device (every replay of every captured step), read from its counters."""
        self._check_usable("read the step counters of")
        return sum(self.platform.read_flag(done, self.device) for _, done in self._count_ptr)

    def _watch(self, now: float, force: bool = False):
        """Read each used slot's counters (``done`` first: both only grow, so done <= enter as read); a slot
        in flight with neither counter moving for ``timeout_s`` is a stuck replay."""
        p, dev = self.platform, self.device
        stuck, entered = None, 0
        for j in range(min(self.step, self.recv_slots)):
            done, enter = p.read_flag(self._count_ptr[j][1], dev), p.read_flag(self._count_ptr[j][0], dev)
            entered += enter
            if enter == done:
                self._stamp.pop(j, None)
                continue
            if self._error is not None:          # broken: let the waiting replay run through
                p.host_write_flag(self._in_ptr[j], RELEASE_VALUE, dev)
                continue
            st = self._stamp.get(j)
            if st is None or st[:2] != (done, enter):
                st = self._stamp[j] = (done, enter, now)
            if stuck is None and (force or now - st[2] > self.timeout_s):
                stuck = (j, now - st[2])
        if stuck is None:
            return None
        j, waited = stuck
        seen = self._seen(j)
        # no release here: _fail stores the error first and then releases, so a caller whose stream runs
        # through once released finds the error already set
        flag = "full" if self.role == "recv" else "empty"
        return TransferTimeout(rank=self.rank, step=entered, flag=f"{flag}[{j}]", expected=1, seen=seen,
                               timeout_s=self.timeout_s,
                               what=f"{self.name} {'receive from' if self.role == 'recv' else 'send to'} rank "
                                    f"{self.peer}: a replayed step waited {waited:.1f} s; this end's waits are "
                                    f"released from now on")

    def _drain(self, timeout_s: float) -> bool:
        p = self.platform
        deadline = time.monotonic() + timeout_s
        for s in (self._aux, p.current_stream(self.device)):    # replays run on the caller's stream
            if s is not None and not p.is_capturing(s) and \
                    not p.synchronize(s, max(0.01, deadline - time.monotonic())):
                return False
        return True

    def _free(self) -> None:
        self._static.clear()
        self._bump.clear()
        super()._free()
