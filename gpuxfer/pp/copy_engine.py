"""The ``copy_engine`` backend: peer copies on copy engines, GPU-side flags, no SM kernel, no CPU wait.

Memory (one pair S -> R; R = number of receive slots, >= 2)::

    receiver R owns  data  = R slots x slot_bytes        (exported over IPC; S opens it)
                     flags = [probe words | full[0..R-1]  | stage_empty[0..R-1]]   (exported; S opens it)
    sender   S owns  staging = 2 slots x slot_bytes      (local only)
                     flags = [probe words | empty[0..R-1] | stage_full[0..R-1]]    (exported; R opens it)
                     give-back = [empty[0..R-1] | value[0..R-1]]  (shared host memory, R maps it; where
                                 it is, these empty words replace the ones in flags, see below)

The flags are a peer-flag link (:mod:`gpuxfer.flaglink`): every flag word is
64-bit, on its own 64-byte line, in a buffer of its own (never next to data,
never in a copy batch with data). Flags hold step numbers (step k = 1, 2, ...;
slot j = (k - 1) % R) and are waited with GEQ on LOCAL memory only: R waits its
own ``full[j]``, S waits its own ``empty[j]``. A flag reaches the peer either by a
remote stream write into the peer's word, where the link's setup probe showed it
works across the pair, or else by a local stream write into ``stage_*[j]`` plus
an 8-byte copy to the peer's word (CUDA 13.1+ refuses remote stream writes).
``GPUXFER_FLAG_PATH=remote|copy`` forces one path.

Timeline of step k (slot j, staging slot s = k % 2)::

    S current stream      S side stream                    R current stream (first .tensors access)
    ----------------      -------------                    -----------------------------------------
    wait ev copied[s]
      (step k-2's copy
       left staging[s])
    pack tensors ->
      staging[s]  (copy
      engine, one local
      copy per tensor)
    record ev packed ---> wait ev packed
                          wait empty[j] >= k-R  (local;
                            only when k > R)
                          copy_async staging[s] ->
                            R.data[j]     (copy engine)
                          publish full[j] = k:
                            remote write R.full[j], or
                            write stage_full[j] = k;
                            copy_async 8 B -> R.full[j] -----> wait full[j] >= k  (local)
                          record ev copied[s]                copy-out R.data[j] -> one new buffer
                                                               (copy engine, one local copy of the
                                                                step's bytes; its tensors are views
                                                                of that buffer, the caller's own)
                                                             ... the caller's work on them ...
                                                             at .tensors of step k+1 (before its wait):
                                                             publish empty[j] = k:
                       empty[j] >= k  <---------------------   remote write S.empty[j], or
                       (lets step k+R reuse slot j)            write stage_empty[j] = k;
                                                               copy_async 8 B -> S.empty[j]

Small steps (``layout.total <= inline_bytes``; default 1 MiB, ``$GPUXFER_PP_INLINE_BYTES``,
0 turns it off) skip the staging ring and the side stream::

    S current stream                                       R current stream (first .tensors access)
    ----------------                                       -----------------------------------------
    wait empty[j] >= k-R  (local; only when k > R)
    copy_async tensor -> R.data[j] + offset, one peer
      copy per tensor (copy engine)
    publish full[j] = k  ----------------------------->  wait full[j] >= k ... (as above)

The caller's next work on its stream then waits for these copies (a few us of
copy-engine time at 1 MiB) where it would wait for the pack, and the host queues
2 + (tensors) calls where the staging path queues 7 + (tensors): a small step is
bound by those calls (scripts/host_costs.py). A sender more than R steps ahead
of its receiver stalls its current stream on a small step. Steps of either kind
mix freely: each slot's flags still only grow, and a slot is written only after
its ``empty`` wait (or once the host saw ``empty`` high enough, below).

A sender launches a small step's peer copies as one graph (``platform.capture_graph``,
the same copy-engine copies) once it has seen the same slot, source addresses and
sizes within the last :data:`STEP_GRAPHS` steps (``$GPUXFER_PP_STEP_GRAPHS=0`` turns it
off): one host call where there were one per tensor. Source tensors at recurring
addresses (a model's persistent outputs, the caching allocator's reused blocks) hit
the cache. Copy sets that recur less often than that (more of them in turn than the
cache holds) keep plain copies: capturing them would evict a graph every step and
capture one per step.

A sender keeps its ``empty[j]`` words in host memory shared with its receiver where both
processes can map it (:class:`~gpuxfer.hostwords.HostWords`; ``$GPUXFER_PP_HOST_GIVE_BACK=0``
keeps them in device memory). ``send()`` then reads ``empty[j]`` with a load: a slot seen free
needs no GPU wait (a value only grows, and R writes it after its work on the slot is done). Each
slot also has a value word there, and a sender's cached copy graph ends with an 8-byte copy of it
into the peer's ``full[j]`` (the publish): for a slot seen free the host stores k and one launch
moves the step (step k-R's publish from the same word has landed: R saw it before it gave the slot
back); otherwise a stream write sets the word after the wait::

    S host, step k (slot j), small steps                 S current stream
    -------------------------------------                ----------------
    load empty[j] >= k-R ?
      yes: store value[j] = k; launch graph[j] --------> copy tensors -> R.data[j]; copy 8 B value[j]
                                                            -> R.full[j]  (publish full[j] = k)
      no:  wait empty[j] >= k-R, write value[j] = k --> (one flag_ops call, in order: the write
           launch graph[j]                                lands after step k-R's publish read the word,
                                                          $GPUXFER_PP_FLAG_BATCH=0: two calls); the graph
    (R's publish empty[j] = k lands in host memory: remote write or 8-byte copy, as before)

A receiver gives slot j back (``publish empty[j] = k``) at the next ``.tensors`` access, queued
before that step's wait; by default ``.tensors`` are copied out of the slot, and the publish lands
after that copy (stream order); with ``recv_views=True`` nothing is copied out: ``.tensors`` are views
of slot j itself, lent to the caller, and the publish lands after the work the caller queued on them::

    R current stream, .tensors of step k (slot j)      of step k+1 (slot j')
    ---------------------------------------------      ---------------------
    publish empty[j_prev] = k-1 (the slot back)         publish empty[j] = k
    wait full[j] >= k                                   wait full[j'] >= k+1
    default: copy R.data[j] -> one new buffer           default: copy R.data[j'] -> one new buffer
      -> its views (one allocation, one copy)             -> its views
    recv_views: -> views of R.data[j]                   recv_views: -> views of R.data[j']
      (no copy, no allocation)

With remote flag writes the publish and the wait go (``$GPUXFER_PP_FLAG_BATCH=0`` keeps two calls)
as one ``platform.flag_ops`` call (CUDA: ``cuStreamBatchMemOp``, executed in order): a steady step is
that call (and the copy-out's one copy). A copied-out slot needs nothing of the caller's, so it goes
back earlier where waiting would cost: on the old stream before steps move to another, at
``synchronize()`` and close, and before a ``recv()`` that the sender could only reach with it
(``recv_slots`` receives not yet accessed): such a receiver may leave ``recv_slots + 1`` receives
unaccessed, a ``recv_views`` one ``recv_slots`` while a slot is lent. Holding the slot to the next
step lets a sender get ``recv_slots - 1`` steps ahead of the receiver's stream before a slot wait.
``recv(out=...)`` copies into the caller's tensors and gives the slot back at once.

Nothing on this path waits on the CPU and nothing runs on SMs: every copy,
the pack and the copy-out included, is a copy-engine copy; the sender's side
stream and the receiver's current stream wait on flags, the streams wait on
each other with events. The sender packs into its own staging ring (rather
than copying straight from the caller's tensors) so ``send()`` returns with the caller free
to overwrite its outputs in the next forward; the staging ring is counted in
``allocated_bytes``. Back-pressure: a sender more than R steps ahead of its
receiver stalls its side stream; more than R + 2 steps ahead, its current
stream (the pack waits for the staging slot).

Metadata (shapes) travels before the GPU work is queued -- through the pair's
shared-memory mailbox on one host (:mod:`gpuxfer.pp.mailbox`), else over the CPU
group -- unless the pair was set up with ``metadata=False``.

Setup (driven collectively by :mod:`gpuxfer.pp.selection`): the flag link's
phases (allocate and zero the flags, export, open the peer's, probe the pair:
the writer uses remote stream writes only where its peer saw one arrive) beside
the receive slots and the staging ring.

The pair's settings, local checks, setup phases and teardown are :mod:`gpuxfer.pp.copy_engine_setup` (mixed in);
this module holds the steps, the watchdog's reads and the drain.

An ``sdma`` backend (ROCm) can subclass :class:`CopyEngineTransport` and
override :meth:`~CopyEngineTransport.unavailable_reason`,
:meth:`~CopyEngineTransport._alloc_flags` (the flag link's memory),
:meth:`~CopyEngineTransport._ce_copy` and :meth:`~CopyEngineTransport._publish`.
"""
from __future__ import annotations

import functools
import threading
import time

from ..errors import BadInput, GraphModeError, PeerLost, TransferTimeout
from ..flaglink import FlagLink, flag_path_from_env
from ..platforms.base import RELEASE_VALUE
from ..sync import wait_event_or_raise
from .copy_engine_setup import (DEFAULT_INLINE_BYTES, ENV_FLAG_BATCH, ENV_HOST_GIVE_BACK, ENV_INLINE_BYTES,
                                ENV_STEP_GRAPHS, FIRST_VALUE, FLAG_STRIDE, PROBE_TIMEOUT_S, SECOND_VALUE, STEP_GRAPHS, W_IN, _CopyEngineSetup,
                                flag_batch_from_env, host_give_back_from_env, inline_bytes_from_env,
                                step_graphs_from_env)
from ..hostwords import WORD_STRIDE, HostWords
from .spec import Layout
from .transport import Received, Transport

__all__ = ["CopyEngineTransport", "W_IN", "FLAG_STRIDE", "PROBE_TIMEOUT_S", "STEP_GRAPHS", "ENV_INLINE_BYTES",
           "DEFAULT_INLINE_BYTES", "ENV_STEP_GRAPHS", "ENV_FLAG_BATCH", "ENV_HOST_GIVE_BACK", "flag_batch_from_env",
           "host_give_back_from_env", "step_graphs_from_env", "inline_bytes_from_env", "CALLER_STREAMS"]

#: distinct caller streams a transport remembers before it forgets those seen idle (see ``_note_stream``)
CALLER_STREAMS = 16


class CopyEngineTransport(_CopyEngineSetup, Transport):
    """One end of a copy-engine pair (see the module docstring for the protocol)."""

    name = "copy_engine"
    min_slots = 2
    release_again = True
    mark_peer_slots = True             # a sender's release first marks its receiver's slot words (_mark_peer_slots)
    host_give_back = True              # the sender's empty words may live in shared host memory (HostWords)

    def __init__(self, *, recv_slots: int = 2, flag_path: str | None = None, inline_bytes: "int | str | None" = None,
                 recv_views: bool = False, **kw):
        super().__init__(**kw)
        if int(recv_slots) < self.min_slots:
            raise BadInput(f"the {self.name} backend needs >= {self.min_slots} receive slots, got {recv_slots}")
        self.recv_slots = int(recv_slots)
        self.flag_path = flag_path_from_env(flag_path)
        self.inline_bytes = inline_bytes_from_env(inline_bytes)
        self.remote_flags = False
        self._aux = None                    # sender: the side stream (the receiver has none)
        self._link: FlagLink | None = None  # the pair's flags (self._flags: its local words)
        self._flags = self._data = self._staging = None
        self._peer_flags = self._peer_data = None
        self._peer_lock = threading.Lock()  # a sender's _mark_peer_slots (any thread) never meets the unmap
        self._copied = [None, None]
        self._packed = None
        self._caller_streams: dict = {}     # every caller stream steps came on -> None, or an event recorded
                                            # on it since (_note_stream): _drain waits for each
        self._nonce = 0
        self._host_keep = None              # emulation: tensors a queued host-stream copy may still touch
        self.recv_views = bool(recv_views)  # receiver: .tensors are views of the slot, lent until the next
        self._lent = None                   # (slot, step) held since the last materialized step: lent to the
                                            # caller (recv_views) or copied out (_lent_copied), given back
                                            # with the next step's wait
        self._lent_copied = False           # whether the held slot's step was copied out (it may go back early)
        self._copy_out = None               # copy(dst, src, nbytes) on the steps' stream (stream_calls' own)
        self._views: dict = {}              # (slot, shapes) -> views of the slot (recv_views)
        self._slot_views = [(None, None)] * self.recv_slots   # per slot: (layout, views) of its last step
        self._back = [0] * self.recv_slots  # receiver: per slot, the last step its give-back was queued for
        self._data_bytes = None             # the receive slots as one uint8 tensor (recv_views)
        self._lend_arrays = self._lend_ops = None   # per slot j: [publish empty[j-1], wait full[j]] (flag_ops)
        self._cap = None                    # sender: the stream small steps' copy graphs are captured on
        self._graphs: dict = {}             # (slot, source pointers, sizes) -> graph of the step's peer copies
        self._sightings: dict = {}          # copy set -> the step it was last seen at without a graph
        self._eager_stream = None           # the last stream steps came on that was checked not to capture
        self._calls = None                  # its bound flag / graph calls (platform.stream_calls)
        self._remote_publish = False        # whether a publish is one remote flag write (this class's _publish)
        self._give_back: HostWords | None = None    # sender: its empty words in host memory; receiver: the peer's
        self._free_loads = None             # sender: host loads of those words (a[j * 8] is empty[j])
        self._value_ptr = None              # sender: per slot, the host word a copy graph publishes from
        self.slot_waits = 0                 # sender: steps that queued a GPU wait for their slot (not seen free)
        self._slot_arrays = self._slot_ops = None   # sender: per slot j: [wait empty[j], write value[j]] (flag_ops)

    @property
    def max_pending(self) -> int:
        """Most receives left deferred at once: the sender gets at most R steps past the last slot given
        back, and its next metadata is the one more receive that can arrive; a slot lent with the last
        step's views (``recv_views``) is not given back yet (one held after a copy-out goes back before the
        limit would count it: :meth:`_make_room`)."""
        return self.recv_slots + (0 if self._lent is not None else 1)

    @property
    def flags_via(self) -> str | None:
        """How this end's flags reach the peer (``gpuxfer.flaglink.REMOTE`` or ``COPY``), once set up."""
        return self._link.path if self._link is not None else None

    # ---- the per-step hooks an sdma-like backend may override ----
    @property
    def _own_publish(self) -> bool:
        """Whether ``_publish`` is this class's (with remote flags: one flag write), not a subclass's."""
        return type(self)._publish is CopyEngineTransport._publish

    def _ce_copy(self, stream, dst: int, src: int, nbytes: int) -> None:
        """A copy on copy engines (no SM): peer data and flags, the pack and the copy-out."""
        self.platform.copy_async(stream, dst, src, nbytes)

    def _publish(self, stream, j: int, k: int) -> None:
        """Make the peer's ``in`` word j hold k once earlier work on ``stream`` is done."""
        if self.remote_flags:
            self.platform.write_flag(stream, self._peer_in_ptr[j], k)
        else:
            stage = self._stage_ptr[j]
            self.platform.write_flag(stream, stage, k)
            self._ce_copy(stream, self._peer_in_ptr[j], stage, 8)

    # ---- send ----
    def _copy_tensors(self, stream, base: int, tensors, layout: Layout) -> None:
        """Copy the step's tensors to ``base`` (a staging slot, or the peer's receive slot) in the slot
        layout, on ``stream``: one copy-engine copy each, no SM."""
        for name, off, n in zip(self.specs.names, layout.offsets, layout.nbytes):
            if n:
                self._ce_copy(stream, base + off, tensors[name].data_ptr(), n)

    def _send_staged(self, k: int, tensors, layout: Layout) -> None:
        """A step larger than ``inline_bytes``: packed into the staging ring, sent from the side stream."""
        p, R = self.platform, self.recv_slots
        cur, side = p.current_stream(self.device), self._aux
        if cur is not self._eager_stream:
            self._check_eager(cur, "send()")
        s = k & 1
        copied = self._copied[s]
        if copied is not None:
            p.stream_wait_event(cur, copied)
        self._copy_tensors(cur, self._staging_ptr[s], tensors, layout)      # the pack
        packed = self._packed = p.record_event(cur, self._packed)   # re-recorded each step (CUDA: no new event)
        if self._host_sync:     # emulation: send() returns with the caller free to overwrite its tensors
            self._host_keep = tensors   # (kept past a timeout: the queued copy may still read them)
            if copied is None:  # steps 1-2: the pack waited for nothing but the stream itself
                wait_event_or_raise(p, packed, self.timeout_s, rank=self.rank, step=k, flag="stream", expected=k,
                                    device=self.device, what=f"{self.name} send to rank {self.peer}: packing")
            else:
                kk = k - 2      # the pack waited for step k-2's copy, which waited for empty >= k-2-R
                jj = (kk - 1) % R
                wait_event_or_raise(p, packed, self.timeout_s, rank=self.rank, step=kk, flag=f"empty[{jj}]",
                                    expected=kk - R, flag_ptr=self._in_ptr[jj], device=self.device,
                                    what=f"{self.name} send to rank {self.peer}: staging slot not free")
        p.stream_wait_event(side, packed)
        j = (k - 1) % R
        free = self._free_loads
        v = free[j * WORD_STRIDE] if free is not None else 0
        if v >= RELEASE_VALUE:          # released by a failure since this send began: raise it, touch no slot
            self._released(k, j)
        if k > R and (free is None or v < k - R):   # not seen free yet
            p.wait_flag(side, self._in_ptr[j], k - R)
            self._wd.append((k, j, time.monotonic(), k - R))
            self.slot_waits += 1
        if layout.total:
            self._ce_copy(side, self._peer_slot_ptr[j], self._staging_ptr[s], layout.total)
        self._publish(side, j, k)
        self._copied[s] = p.record_event(side, copied)   # cur waited for its last recording above

    def _send_impl(self, k: int, tensors, layout: Layout) -> None:
        """A small step (``layout.total <= inline_bytes``) on the caller's stream: straight into the peer's
        slot, no staging, no side stream; a larger one goes to :meth:`_send_staged`."""
        total, inline = layout.total, self.inline_bytes
        if not inline or total > inline:
            self._send_staged(k, tensors, layout)
            return
        p, R = self.platform, self.recv_slots
        cur = p.current_stream(self.device)
        if cur is not self._eager_stream:
            self._check_eager(cur, "send()")
        calls = self._calls
        j = (k - 1) % R
        free = self._free_loads
        g = None
        if total and self._cap is not None:     # the copy set's graph: cached, or captured at its second sight
            names = self.specs.names
            if len(names) == 2:     # (hidden states and residual, the usual pair: no list built)
                key = (j, layout.nbytes, tensors[names[0]].data_ptr(), tensors[names[1]].data_ptr())
            else:
                key = (j, layout.nbytes, *[tensors[n].data_ptr() for n in names])
            g = self._graphs.get(key)
            if g is None:
                g = self._copy_graph(key, tensors, layout, k)
        valued = g is not None and free is not None     # the graph publishes slot j's value word: make it k
        v = free[j * WORD_STRIDE] if free is not None else 0
        if v >= RELEASE_VALUE:          # released by a failure since this send began: raise it, touch no slot
            self._released(k, j)
        waited = k > R and (free is None or v < k - R)   # slot j not seen free on the host yet
        if waited:
            if valued and self._slot_ops is not None:   # wait, then set the word (step k-R's publish has
                ops = self._slot_ops[j]                 # read it once the wait passed): one call
                ops[FIRST_VALUE] = k - R
                ops[SECOND_VALUE] = k
                calls.flag_ops(self._slot_arrays[j])
            else:
                calls.wait_flag(self._in_ptr[j], k - R)
                if valued:
                    calls.write_flag(self._value_ptr[j], k)
            self._wd.append((k, j, time.monotonic(), k - R))
            self.slot_waits += 1
        elif valued:                    # seen free: step k-R's publish has landed already
            free[(R + j) * WORD_STRIDE] = k
        if g is None:
            self._copy_tensors(cur, self._peer_slot_ptr[j], tensors, layout)
        else:
            calls.launch_graph(g)
        if not valued:                  # no graph published the step
            if self._remote_publish:
                calls.write_flag(self._peer_in_ptr[j], k)
            else:
                self._publish(cur, j, k)
        if self._host_sync:     # emulation: return once the copies have read the caller's tensors
            self._host_keep = tensors
            wait_event_or_raise(p, p.record_event(cur), self.timeout_s, rank=self.rank, step=k,
                                flag=f"empty[{j}]" if waited else "stream", expected=k - R if waited else k,
                                flag_ptr=self._in_ptr[j] if waited else None, device=self.device,
                                what=f"{self.name} send to rank {self.peer}: "
                                     f"{'receive slot not free' if waited else 'copying'}")

    def _check_eager(self, stream, what: str) -> None:
        """Refuse a step queued on a stream that captures a graph: its step numbers would be baked into
        the graph and replays would move nothing (checked once per stream the steps come on)."""
        if self.platform.is_capturing(stream):
            raise GraphModeError(
                f"rank {self.rank}: {what} on the {self.name} transport with rank {self.peer} while the stream "
                f"captures a graph: eager steps carry host-supplied step numbers, which a replay cannot move; "
                f"capture steps on a graph-mode transport (connect(..., graph=True))")
        calls = self._calls = self.platform.stream_calls(stream)
        self._remote_publish = self.remote_flags and self._own_publish
        own_copy = type(self)._ce_copy is CopyEngineTransport._ce_copy
        self._copy_out = calls.copy if own_copy and calls.copy is not None else functools.partial(self._ce_copy,
                                                                                                  stream)
        self._eager_stream = stream
        self._note_stream(stream)

    def _note_stream(self, stream) -> None:
        """Remember a caller stream steps are queued on (called when the steps' stream changes, not per step):
        :meth:`_drain` waits for every one, since work queued on any of them may read this end's buffers.
        Past :data:`CALLER_STREAMS` of them (a caller making streams as it goes), each is given an event, and
        one whose event has completed since is forgotten: a step queued on it after the event would have
        noted it again, which drops its event."""
        streams = self._caller_streams
        if len(streams) >= CALLER_STREAMS and stream not in streams:
            p = self.platform
            for s, ev in list(streams.items()):
                if s.closed or (ev is not None and p.event_query(ev)):
                    del streams[s]
                elif not p.is_capturing(s):
                    streams[s] = p.record_event(s, ev)
        streams[stream] = None

    def _copy_graph(self, key: tuple, tensors, layout: Layout, k: int):
        """The graph of step k's peer copies (``key``: slot j, sizes, source addresses; not cached yet) where
        this copy set was seen before within :data:`STEP_GRAPHS` steps (captured now, on the capture stream,
        and kept; the oldest of :data:`STEP_GRAPHS` goes first), else None: the caller queues the copies one
        by one (a set that recurs less often: the cache could not hold the sets in between). Its nodes are the
        same copy-engine copies, and where the sender has value words in host memory, one more: the 8-byte
        copy of slot j's value word into the peer's ``full[j]`` (the publish; the caller sets the word)."""
        seen = self._sightings.get(key)
        if seen is None or k - seen > STEP_GRAPHS:
            if seen is None and len(self._sightings) >= 4 * STEP_GRAPHS:
                self._sightings.clear()
            self._sightings[key] = k
            return None
        del self._sightings[key]
        j = key[0]

        def record(s) -> None:
            self._copy_tensors(s, self._peer_slot_ptr[j], tensors, layout)
            if self._value_ptr is not None:
                self._ce_copy(s, self._peer_in_ptr[j], self._value_ptr[j], 8)
        g = self.platform.capture_graph(self._cap, record)
        if g is None:        # this platform cannot capture: plain copies from now on
            self._cap = None
            return None
        if len(self._graphs) >= STEP_GRAPHS:
            del self._graphs[next(iter(self._graphs))]
        self._graphs[key] = g
        return g

    # ---- receive ----
    def _make_room(self, queued: int) -> None:
        """A slot held after a copy-out goes back before a receive the sender could only reach with it (the
        ``queued`` receives not yet accessed fill the other slots): such a receiver keeps the limit of
        ``recv_slots + 1`` receives."""
        if self._lent_copied and self._lent is not None and queued >= self.recv_slots:
            self._return_copied()

    def _return_copied(self) -> None:
        """Give the slot held after a copy-out back now, on the stream that copy was queued on."""
        jj, kk = self._lent
        self._lent, self._lent_copied = None, False
        self._back[jj] = kk
        if self._remote_publish:
            self._calls.write_flag(self._peer_in_ptr[jj], kk)
        else:
            self._publish(self._eager_stream, jj, kk)

    def _recv_impl(self, rcv: Received) -> None:
        pass   # nothing to do before the first .tensors access

    def _materialize_impl(self, rcv: Received) -> None:
        p, R, k = self.platform, self.recv_slots, rcv.step
        j = (k - 1) % R
        lay = rcv.layout
        cur = p.current_stream(self.device)
        if cur is not self._eager_stream:
            if self._lent_copied and self._lent is not None and not self._eager_stream.closed:
                self._return_copied()       # after its copy, on that copy's stream
            self._check_eager(cur, ".tensors")
        calls = self._calls
        if self._lent is not None:      # the slot held since the last step goes back after the work queued on it
            jj, kk = self._lent
            self._lent = None
            self._back[jj] = kk
            ops = self._lend_ops[j] if self._lend_ops is not None and jj == (j - 1) % R else None
            if ops is None:
                if self._remote_publish:
                    calls.write_flag(self._peer_in_ptr[jj], kk)
                else:
                    self._publish(cur, jj, kk)
                calls.wait_flag(self._in_ptr[j], k)
            else:                       # publish empty[jj] = kk, wait full[j] >= k: one call
                ops[FIRST_VALUE] = kk
                ops[SECOND_VALUE] = k
                calls.flag_ops(self._lend_arrays[j])
        else:
            calls.wait_flag(self._in_ptr[j], k)
        self._wd.append((k, j, time.monotonic(), k))
        specs = self.specs
        if rcv.out is not None:         # the caller's persistent tensors: one copy each, the slot back at once
            views = {}
            slot = self._slot_ptr[j]
            for name, o, n, shape, item in zip(specs.names, lay.offsets, lay.nbytes, lay.shapes, specs.itemsizes):
                flat = rcv.out[name].view(-1)[:n // item]
                views[name] = flat.view(shape)
                if n:
                    self._ce_copy(cur, flat.data_ptr(), slot + o, n)
            if self._host_sync:         # the slot checked before it goes back (a healthy sender may reuse it)
                self._host_keep = rcv.out
                self._host_wait(cur, j, k)
                self._check_slot(j, k)
            self._back[j] = k
            if self._remote_publish:
                calls.write_flag(self._peer_in_ptr[j], k)
            else:
                self._publish(cur, j, k)
            keep = rcv.out
        elif self.recv_views:           # views of the slot itself, lent until the next step
            last = self._slot_views[j]              # (layout, views) of slot j's last step: the same layout
            if last[0] is not lay:                  # object has the same shapes
                views = self._views.get((j, lay.shapes))
                if views is None:
                    if len(self._views) > 4096:
                        self._views.clear()
                    views = self._views[(j, lay.shapes)] = specs.views(self._data_bytes, lay, j * specs.slot_bytes)
                last = self._slot_views[j] = (lay, views)
            views = dict(last[1])
            self._lent, self._lent_copied = (j, k), False
            keep = None
        else:                           # one copy of the step's bytes into one new buffer, the caller's; the
            views, keep = specs.fresh(lay, self.torch_device)     # slot goes back with the next wait
            if lay.total:
                self._copy_out(keep.data_ptr(), self._slot_ptr[j], lay.total)
            self._lent, self._lent_copied = (j, k), True
        if self._host_sync:
            if keep is not None:
                self._host_keep = keep      # (a timed-out copy may still write it)
            self._host_wait(cur, j, k)
            if rcv.out is None:         # the slot is still held
                self._check_slot(j, k)
        rcv._tensors = views

    def _host_wait(self, cur, j: int, k: int) -> None:
        """Emulation: wait (bounded) for the work queued on ``cur`` so far (step k's wait on slot j and copy)."""
        wait_event_or_raise(self.platform, self.platform.record_event(cur), self.timeout_s, rank=self.rank, step=k,
                            flag=f"full[{j}]", expected=k, flag_ptr=self._in_ptr[j], device=self.device,
                            what=f"{self.name} receive from rank {self.peer}")

    # ---- watchdog and teardown ----
    def _seen(self, j: int) -> int | None:
        if self._free_loads is not None:    # the sender's empty words in host memory: a load
            return self._free_loads[j * WORD_STRIDE]
        try:
            return self.platform.read_flag(self._in_ptr[j], self.device)
        except TransferTimeout:   # the platform's host read is itself stuck: report "unreadable" if it matters
            return None

    def _wait_label(self, entry) -> str:
        k, j, _t0, expected = entry
        return f"{'full' if self.role == 'recv' else 'empty'}[{j}] >= {expected}"

    def _watch(self, now: float, force: bool = False):
        """Pop the waits whose flag arrived; a wait older than the timeout becomes TransferTimeout.

        Each slot's flag is read (a device-to-host copy) at most once per poll:
        flags only grow, so one value per slot settles every wait queued on it.
        """
        wd = self._wd
        flag = "full" if self.role == "recv" else "empty"
        seen: dict[int, int | None] = {}
        while wd:
            k, j, t0, expected = wd[0]
            if j not in seen:
                seen[j] = self._seen(j)
            v = seen[j]
            if v is not None and v >= expected:
                if v > k and self.role == "recv" and (lost := self._overwritten(j, k, v, now - t0)):
                    return lost
                wd.popleft()
                continue
            if force or now - t0 > self.timeout_s:
                return TransferTimeout(rank=self.rank, step=k, flag=f"{flag}[{j}]", expected=expected, seen=v,
                                       timeout_s=self.timeout_s,
                                       what=f"{self.name} {'receive from' if self.role == 'recv' else 'send to'} "
                                            f"rank {self.peer}: waiting {now - t0:.1f} s")
            break
        return None

    def _drain(self, timeout_s: float) -> bool:
        """Wait for the side stream and every caller stream steps came on (a step on any of them may still
        read or write this end's buffers and host words), all within ``timeout_s``. A stream capturing a graph
        now cannot be waited on (steps are refused there); a closed one's work completes without us."""
        p = self.platform
        deadline = time.monotonic() + timeout_s
        if self._lent_copied and self._lent is not None and self._error is None and not self._eager_stream.closed:
            try:                # nothing waits for the next step's wait to give the copied-out slot back
                self._return_copied()
            except Exception as exc:
                raise self._fail(exc) from (None if exc is self._error else exc)
        for s in (self._aux, *self._caller_streams):
            if s is None or s.closed or p.is_capturing(s):
                continue
            if not p.synchronize(s, max(0.01, deadline - time.monotonic())):
                return False
        return True

    def _released(self, k: int, j: int) -> None:
        """Step ``k`` found slot ``j``'s empty word released: this end failed meanwhile (its error is raised),
        or the receiver did."""
        self._check_usable("send")
        raise PeerLost(rank=self.rank, peer=self.peer, step=k, flag=f"empty[{j}]", after_s=0.0,
                       why=f"rank {self.peer} released the slot words (its transport failed)",
                       detail=f"{self.name} send to rank {self.peer}")

    def _release_waits(self) -> None:
        if self.role == "send" and self.mark_peer_slots:
            self._mark_peer_slots()
        if self._link is not None:
            self._link.release_waits(range(W_IN, W_IN + self.recv_slots))
        loads = self._free_loads
        if loads is not None:
            for j in range(self.recv_slots):
                loads[j * WORD_STRIDE] = RELEASE_VALUE
