"""The ``pack`` engine's transfers (two-sided, staging to staging on a copy engine): what every
transfer of one shape shares (:class:`_PackShape`) and the transfer with its protocol
(:class:`_PackTransfer`), and what an agent keeps for them (:class:`PackState`). Its hand-offs are signals and
waits on the peer's flag link (:class:`~gpuxfer.flaglink.FlagLink`, a stream's operations in batches:
:class:`~gpuxfer.flaglink.FlagQueue`)."""
from __future__ import annotations

import collections
import logging
from typing import Any

import numpy as np

from ..errors import BadInput, TransferMismatch, TransferTimeout
from ..platforms.base import RELEASE_VALUE, Stream
from ..flaglink import FLAG_STRIDE
from .control import AVAIL, COPIED, FREE, GO, PACK_SLOTS, PACKED, REFUSED, STATUS
from .layers import _torch
from .triton_transfer import table_rows
from .transfer import KVTransfer, KVTransferHandle

log = logging.getLogger("gpuxfer.kv.agent")
_W = FLAG_STRIDE // 8               # int64 entries per flag word's line
#: shapes of pack transfers an agent keeps (buffers, kernels, graphs), the least recently posted going first
PACK_SHAPES = 8


class PackState:
    """What an agent keeps for its pack transfers: the one peer they go to (by uid), the shapes seen
    (:class:`_PackShape`, by shape key), the stream and event of the last post, the lane stream a source copies
    on, and -- a ``pack`` agent's -- the host words a refusal is copied into (:data:`~gpuxfer.kv.control.STATUS`:
    ``status``, at ``status_ptr``). ``agent``: its platform and device are read from it."""

    def __init__(self, agent):
        self.agent = agent
        self.peer_uid: str | None = None
        self.shapes: collections.OrderedDict = collections.OrderedDict()     # shape key -> _PackShape
        self.tail: tuple | None = None          # (stream, event) of the last pack post
        self.lane: Any = None                   # a pack source's copies (beside its packs)
        self.lane_event: Any = None
        self.status = self.status_ptr = self.status_mirror = None

    def make_status_words(self) -> None:
        """A ``pack`` agent's host words its posts copy :data:`~gpuxfer.kv.control.STATUS` into."""
        torch = _torch()
        self.status_mirror = torch.zeros(2, dtype=torch.int64, pin_memory=not self.agent.platform.host_memory)
        self.status, self.status_ptr = self.status_mirror.numpy(), self.status_mirror.data_ptr()

    def shape(self, poster, x: "_PackTransfer") -> "_PackShape":
        """The cached :class:`_PackShape` of ``x``'s shape (built on first use; the least recently used of
        more than :data:`PACK_SHAPES` goes: posts in flight keep theirs alive through :meth:`Poster.track
        <gpuxfer.kv.posting.Poster.track>`)."""
        shapes = self.shapes
        shape = shapes.get(x._shape_key)
        if shape is None:
            shape = shapes[x._shape_key] = _PackShape(poster, self, x)
            while len(shapes) > PACK_SHAPES:
                shapes.popitem(last=False)
        else:
            shapes.move_to_end(x._shape_key)
        return shape

    def lane_stream(self):
        if self.lane is None:
            self.lane = self.agent.platform.create_stream(self.agent.device)
        return self.lane

    def forget(self, peer) -> None:
        """Drop the shapes of ``peer`` (removed)."""
        for key in [k for k, v in self.shapes.items() if v.peer is peer]:
            del self.shapes[key]

    def mismatch_error(self, inflight, peers, mine: int, seen: int) -> TransferMismatch:
        """The error of a pack transfer refused on the device: ``mine`` the fingerprint of this side's request,
        ``seen`` what the verdict saw instead (:data:`~gpuxfer.kv.control.STATUS`); ``inflight``: the agent's
        posted transfers, ``peers``: its peers."""
        if mine >= RELEASE_VALUE:       # (the release's mark: this agent's own waits were released)
            return TransferMismatch(f"pack agent {self.agent.name!r}: its waits were released, so its pack transfers "
                                    "in flight no longer pair up with its peer's; their destination blocks may hold "
                                    "other bytes; the agent fails (close it and pair new agents)")
        names = [x.name for _, b, _ in inflight for x in b if getattr(x, "fingerprint", None) == mine]
        what = f"its request {names[0]!r}" if names else "one of its requests"
        written = "no byte of the destination's blocks was written"
        if seen >= RELEASE_VALUE:
            why = "was released (an agent of the pair failed)"
            written = "the destination's blocks of the request may hold other bytes"
        elif seen >= REFUSED:
            why = "refused it: the two sides' requests differ (block IDs, groups, layers or the order of posts)"
        else:
            why = f"posted another request (fingerprint 0x{seen:x}) in its place"
        peer = next((p.name for p in peers.values() if p.meta.uid == self.peer_uid), "?")
        return TransferMismatch(f"pack agent {self.agent.name!r}: {what} (fingerprint 0x{mine:x}) did not pair up "
                                f"with the transfer of peer {peer!r}: the peer {why}; {written}; the agent fails "
                                "(close it and pair new agents)")


class _PackShape:
    """What every pack transfer of one shape -- one route, one number of segments per group, hence the same
    descriptor rows and chunks -- shares: the device request and descriptor buffers, the kernels bound to
    them (one pack or unpack per chunk, its slot fixed), and per parity the captured graph of a post.

    Made at the first :meth:`KVAgent.prepare` of the shape, which on a GPU also loads the route's kernels
    (launches over an all-zero table, moving nothing): a kernel's first launch loads it, which waits for
    the device's queues, so it must not come while a stream of the process waits for the peer. A post
    uploads its request into :attr:`req` and enqueues :meth:`record`; once the shape was posted, its next
    prepare or post captures the graphs of both parities (where the platform captures), and posts replay
    them: one driver call per stream whatever the number of chunks."""

    def __init__(self, poster, pack: PackState, x: "_PackTransfer"):
        torch = _torch()
        from ..kernels.blocks import expand_launcher, request_header_len, verdict_launcher
        from ..kernels.launch import pack_launcher, unpack_launcher
        agent = poster.agent
        dev = poster.torch_device()
        self.agent, self.poster, self.pack = agent, poster, pack
        self.peer, self.route, self.source = x.peer, x.route, x.source
        self.req = torch.empty(x._req_bytes // 8, dtype=torch.int64, device=dev)
        self.req_ptr = self.req.data_ptr()
        self.out = torch.empty((max(x.descriptors, 1), 3), dtype=torch.int64, device=dev)
        r = self.route
        G = len(r.groups)
        self.expand = expand_launcher(r.planes, self.req, self.out, n_groups=G,
                                      max_segments=max(x.n_seg, default=0))
        stage = agent.platform.as_tensor(agent.staging)
        local = r.src_anchor if self.source else r.dst_anchor

        def launcher(out, a, b, at, c):
            if self.source:
                return pack_launcher(local, stage, out, start=a, end=b, staging_offset=at, row_bytes=c)
            return unpack_launcher(stage, local, out, start=a, end=b, staging_offset=at, row_bytes=c)

        # the verdicts (:mod:`gpuxfer.kernels.verdict_kernel`), one per parity: the source's on the go signal
        # (its stream) and on the last free signal (its lane), the destination's on the first chunk signal; the
        # values of this side's data-dependent signals land in ``sig``: one per chunk, then the closing reset, then
        # the destination's first two (the FREE reset: 0, and GO: its fingerprint, copied in at each post)
        nc = len(x._chunks)
        self.sig = torch.zeros(nc + 3, dtype=torch.int64, device=dev)
        self.sig_ptr = self.sig.data_ptr()
        self.fp_ptr = self.req_ptr + (x._req_bytes - 8)
        words = agent.platform.as_tensor(agent.flags.buf, torch.int64)
        status = words[STATUS * _W:STATUS * _W + 2]
        fp = self.req[-1:]

        def verdict(word: int, n_sig: int, out, n_rows: int, equal: bool):
            return [verdict_launcher(words[(word + p) * _W:(word + p) * _W + 1], fp, status, self.sig, n_sig, out,
                                     n_rows, equal=equal, refused=REFUSED) for p in (0, 1)]
        if self.source:
            self.verdicts = verdict(GO, nc + 1, None, 0, True)
            self.closing = verdict(FREE, 0, None, 0, False)
        else:
            self.verdicts = verdict(AVAIL, nc + 1, self.out, x.descriptors, False)
            self.closing = verdict(AVAIL, 0, None, 0, False)     # the source's last chunk signal
        # whether this side's own waits were released (STATUS holds the release value, written before the
        # words): a wait passed by the release may have let a copy, pack or unpack run ahead of the hand-offs, so
        # every signal this side sends after it carries the release value (the peer's last verdict then refuses
        # the transfer as released: its blocks may hold other bytes). Checked before the signals that follow a
        # wait or a verdict: the destination's first two, after each first verdict, before the last chunk
        # signal and the source's closing one -- a released side's later signals (its transfers queued behind
        # run on through released waits) never overwrite a release value the peer has yet to read with one
        # below the refusal. It writes every entry of ``sig``, the ones of signals already sent included, so its
        # arguments are of the kinds warmed below
        self.released = verdict_launcher(status[:1], fp, status, self.sig, nc + 3, None, 0,
                                         equal=False, refused=RELEASE_VALUE, only_refused=True)
        # the source's lane signals its last chunk and its closing reset from entries of its own (copied from
        # ``sig``, then checked): a released lane runs ahead of its stream, whose first verdict may write go-ahead
        # values into ``sig`` between the lane's check and its signal
        self.lane_sig = torch.zeros(2, dtype=torch.int64, device=dev) if self.source else None
        self.lane_released = None if self.lane_sig is None else verdict_launcher(
            status[:1], fp, status, self.lane_sig, 2, None, 0, equal=False, refused=RELEASE_VALUE, only_refused=True)
        self.spec = x._chunks                               # (first row, end row, bytes, segment bytes)
        self.chunks: list[tuple[int, Any]] = []             # (bytes, the launch of its pack or unpack)
        for i, (a, b, nbytes, c) in enumerate(x._chunks):
            self.chunks.append((nbytes, launcher(self.out, a, b, (i % PACK_SLOTS) * agent.slot_bytes, c)))
        # every kernel a post launches is loaded here (a first launch waits for the device's queues, so it must
        # not come inside a post while a stream waits for the peer): launches of the same kinds as the shape's
        # (Triton compiles per kind: None or a tensor, 16-byte aligned or not, constexprs) moving nothing
        fp_aligned = self.fp_ptr % 16 == 0
        if not agent.platform.kernels_interpreted and (self.source, fp_aligned) not in r.pack_warm:
            # on torch's current stream, after the zeros: every row copies 0 bytes, the request expands nothing
            zreq = torch.zeros(request_header_len(len(r.plane_group), G) + 2, dtype=torch.int64, device=dev)
            zout = torch.zeros((1, 3), dtype=torch.int64, device=dev)
            zfp = zreq[:1] if fp_aligned else zreq[1:2]
            fns = [expand_launcher(r.planes, zreq, zout, n_groups=G, max_segments=1)]
            fns += [launcher(zout, 0, 1, 0, c) for _, _, c in r.classes if c <= agent.slot_bytes]
            # the verdicts over zeros (their words and signals land in these buffers only),
            # as (equal, descriptors, refused, only_refused): the first verdicts, the closings, ``released``
            kinds = ((True, None, REFUSED, False), (False, zout, REFUSED, False), (False, None, REFUSED, False),
                     (False, None, RELEASE_VALUE, True))
            fns += [verdict_launcher(zreq[2:3], zfp, zout[0, :2], zreq[:2], 2, out, int(out is not None),
                                     equal=eq, refused=ref, only_refused=only) for eq, out, ref, only in kinds]
            for fn in fns:
                if fn is not None:
                    fn()
            cur = agent.platform.current_stream(agent.device)
            poster.track(agent.platform.record_event(cur), (zreq, zout), cur)
            r.pack_warm.add((self.source, fp_aligned))
        self.graphs: list[Any] = [None] * 2
        self.posts = 0
        self.capturable = True

    def graph(self, parity: int):
        """The graphs of a post of ``parity`` -- ``(stream part, the source's lane part or None)`` --: once the
        shape was posted (a shape posted once may never come again), both parities' graphs are captured, at
        its next prepare or post (a prepare, in one process, comes before either side waits on the other);
        None where the platform captures none (the post then enqueues the operations). Neighbouring flag
        operations go into a graph as one batch (fewer nodes to launch); a capture that fails so is tried
        again with one node per operation."""
        agent = self.agent
        if self.graphs[parity] is None and self.capturable and self.posts and self.poster.graphs:
            plat = agent.platform
            for batch in (True, False):
                try:
                    cs = self.poster.capture_stream()
                    for p in (0, 1):
                        g = plat.capture_graph(cs, lambda c, p=p: self.record(c, p, batch))
                        lane = (plat.capture_graph(cs, lambda c, p=p: self.record_copies(c, p, batch))
                                if self.source else None)
                        self.graphs[p] = None if g is None or (self.source and lane is None) else (g, lane)
                    break
                except Exception as exc:  # noqa: BLE001 - without batches, else one by one at each post
                    log.warning("agent %s: capturing a pack transfer%s failed (%s: %s)", agent.name,
                                " (flag operations in batches)" if batch else "", type(exc).__name__, exc)
                    self.graphs = [None] * 2
            self.capturable = all(g is not None for g in self.graphs)
        return self.graphs[parity]

    def record(self, s: Stream, parity: int, batch: bool = False) -> None:
        """Enqueue this side's stream part of one transfer (see :class:`_PackTransfer`) on ``s``, the request
        already in :attr:`req`: every value is a constant of the shape and the parity, so a graph replays it.
        The source's copies go on its lane (:meth:`record_copies`). Words are the peer link's
        (:attr:`KVPeer.flags`): ``wait`` / ``write`` this agent's own, ``signal`` the peer's."""
        q = self.peer.flags.queue(s, batch)
        avail, free, go = AVAIL + parity, FREE + parity, GO + parity
        if self.expand is not None:
            q.launch(self.expand)
        if self.source:
            packed, copied = PACKED + parity, COPIED + parity
            q.wait(go, 1)
            q.launch(self.verdicts[parity])         # the destination's fingerprint against ours
            q.launch(self.released)                 # were our waits released (a transfer queued behind one)?
            for i, (_, fn) in enumerate(self.chunks):
                if i:
                    q.write(packed, i)                  # chunk i - 1 is in its slot
                if i >= PACK_SLOTS:                     # the lane copied the slot's previous chunk out
                    q.wait(copied, i - PACK_SLOTS + 1)
                q.launch(fn)
            q.write(packed, len(self.chunks))
        else:
            sig, last = self.sig_ptr, len(self.chunks) - 1
            q.copy(sig + 8 * (last + 3), self.fp_ptr, 8)
            q.launch(self.released)             # were our waits released (a transfer queued behind one)?
            q.signal_from(free, sig + 8 * (last + 2))   # 0: the source is past every wait on it (its transfer
            #                                             before last)
            q.signal_from(go, sig + 8 * (last + 3))     # go, with our fingerprint
            for i, (_, fn) in enumerate(self.chunks):
                q.wait(avail, i + 1)
                if i == 0:
                    q.launch(self.verdicts[parity])     # the source's verdict: go ahead or refused
                    q.launch(self.released)
                    q.signal_from(go, sig + 8 * len(self.chunks))   # 0: the source is past its wait on it
                q.launch(fn)
                if i == last:
                    q.launch(self.closing[parity])      # the source's last signal: was it released meanwhile?
                    q.launch(self.released)             # were we?
                q.signal_from(free, sig + 8 * i)        # i + 1 (refused: REFUSED)
            q.copy(self.pack.status_ptr, self.agent.flags.word(STATUS), 16)
        q.flush()

    def record_copies(self, c: Stream, parity: int, batch: bool = False) -> None:
        """The source's lane of one transfer on ``c``: each packed chunk to the peer's slot, then the signal."""
        agent, peer = self.agent, self.peer
        q = peer.flags.queue(c, batch)
        slot = agent.slot_bytes
        avail, free = AVAIL + parity, FREE + parity
        packed, copied = PACKED + parity, COPIED + parity
        own = self.lane_sig.data_ptr()
        for i, (nbytes, _) in enumerate(self.chunks):
            k = i % PACK_SLOTS
            q.wait(packed, i + 1)
            if i >= PACK_SLOTS:                 # the destination unpacked the slot's previous chunk
                q.wait(free, i - PACK_SLOTS + 1)
            q.copy(peer.staging_ptr + k * slot, agent.staging.ptr + k * slot, nbytes)
            q.write(copied, i + 1)
            if i == len(self.chunks) - 1:
                q.copy(own, self.sig_ptr + 8 * i, 8)
                q.launch(self.lane_released)    # were our waits released meanwhile?
                q.signal_from(avail, own)       # i + 1 (refused: REFUSED; released: the release value)
            else:
                q.signal_from(avail, self.sig_ptr + 8 * i)    # i + 1 (refused: REFUSED)
        q.wait(free, len(self.chunks))
        q.launch(self.closing[parity])          # whether the destination refused
        q.copy(own + 8, self.sig_ptr + 8 * len(self.chunks), 8)
        q.launch(self.lane_released)            # were our waits released (passing the wait above)?
        q.signal_from(avail, own + 8)           # 0: the destination is past every wait on it
        q.write(packed, 0)                      # both lanes are past every wait on these
        q.write(copied, 0)
        q.copy(self.pack.status_ptr, agent.flags.word(STATUS), 16)
        q.flush()


class _PackTransfer(KVTransfer):
    """The ``pack`` engine: two-sided. The source side packs its blocks' pieces into its staging slot
    (a local kernel), copies the slot into the destination's staging on a copy engine and signals;
    the destination side waits, unpacks into its blocks and signals the slot free. Both sides prepare
    and post the same request (the source ``push``, the destination ``pull``, the same block IDs); the
    two derive the same descriptor order and chunks from the request. Chunk ``i`` of a transfer goes
    through slot ``i % PACK_SLOTS``; a chunk holds rows of one segment size, so row ``j`` of it sits at
    ``(j - first row) * size`` in the slot (no offsets to compute).

    The source packs on the posting stream and copies on a lane stream of its own, so chunk ``i + 1`` is
    packed while chunk ``i`` is on the wire (local words PACKED / COPIED hand the chunks between the
    two). Every flag value is a constant of the transfer's shape or a value decided on the device, so a
    post of a shape seen before is a graph replay per stream (:class:`_PackShape`): the words come in two
    sets, used by a pair's transfers in turn (parity ``p``: the n-th transfer in one direction uses set
    ``n % 2`` on both sides), and each word the peer waits on is reset by the side that writes it, once the
    waiting side is past its last wait (so a release of the words a side's peer signals into stays until the
    peer's next signal: the side's own queued work writes only its local PACKED and COPIED)::

        source agent                                              destination agent
        add_peer(destination's metadata): open its words,         add_peer(source's metadata): alike
          probe one-sided (remote writes or 8-byte copies)

        source stream (p)          source lane (p)                destination stream (p)
        upload, expand                                            upload, expand
                                                                  signal the source: FREE[p] := 0,
        wait GO[p] >= 1  <------------------------------------------------------- GO[p] := fp
        verdict: GO[p] == fp?
        chunk i:                   chunk i:                       chunk i:
         [wait COPIED[p] >= i+1-S]  wait PACKED[p] >= i + 1        wait AVAIL[p] >= i + 1
         pack -> own slot i % S     [wait FREE[p] >= i + 1 - S]    (i = 0: verdict: AVAIL[p] < REFUSED?
         PACKED[p] := i + 1         copy own slot -> peer's slot    signal the source: GO[p] := 0 [R])
                                    COPIED[p] := i + 1             unpack own slot -> blocks [nothing]
                                    signal AVAIL[p] := i + 1 [R] > signal the source: FREE[p] := i + 1 [R]
                                   wait FREE[p] >= chunks  <-----
                                   verdict: FREE[p] < REFUSED?
                                   signal AVAIL[p] := 0 [R]
                                   PACKED[p] := 0, COPIED[p] := 0
                                   STATUS -> the host's word      STATUS -> the host's word
        wait the lane (event)
        event (the data has landed)                               event (the data has landed)

    (S = ``PACK_SLOTS``; the words are the agent's flag words, :mod:`gpuxfer.kv.control`; a signal goes over
    the peer's flag link, :attr:`KVPeer.flags`: a stream write into the peer's word where
    :meth:`KVAgent.add_peer`'s one-sided probe saw one land, else a write into the link's stage word and an
    8-byte copy of it, :mod:`gpuxfer.flaglink`; a value decided on the device goes by an 8-byte copy of it.)

    The verdicts (:mod:`gpuxfer.kernels.verdict_kernel`): both sides' requests carry their fingerprint ``fp``
    (:func:`gpuxfer.kv.ids.request_fingerprint`, computed at prepare, equal for equal requests). The source
    compares the destination's with its own before its first pack; the values of its signals ``[R]`` are
    then the chunk counts and the closing 0, or all REFUSED (:data:`~gpuxfer.kv.control.REFUSED`) when they
    differ. The destination's verdict reads the first chunk signal: REFUSED or more (a refusal, or a failed
    agent's release) zeroes its descriptors' byte counts (its unpacks write nothing) and turns its signals
    to REFUSED; the source's last verdict sees the destination's refusal. REFUSED passes every wait, so a
    refused transfer drains on both sides whatever their numbers of chunks, and no byte of the destination's
    blocks is written. A refusal is recorded in the agent's STATUS word (sticky), which each post copies
    into a host word the agent reads at every call: both agents fail with
    :class:`~gpuxfer.errors.TransferMismatch` (:meth:`PackState.mismatch_error`). A side whose waits are released
    mid-transfer (its failure) may run a copy, pack or unpack ahead of the hand-offs: the release marks STATUS
    first, each side checks it before its last chunk signal (``released``: its signals then carry the release
    value; the source's lane, which a release lets run ahead of its stream, checks ``lane_released`` over entries
    of its own) and the peer's last verdict (the destination's after its last unpack, the source's closing one)
    refuses the transfer, so neither side reports success over bytes that did not land. A released side's
    transfers queued behind run on through its released waits and would overwrite the release values in the peer's
    words with ordinary ones (the destination's FREE reset, a go-ahead's chunk counts) before the peer's verdict
    read them: each side also checks STATUS before its first signals (the destination's reset and go), after its
    first verdict and before the source's closing signal, so a released side signals nothing below the refusal.

    Why the resets are safe: the source's transfer before last
    of parity ``p`` ended (its last wait on FREE[p]) before the destination's previous transfer could end; the
    destination passed its waits on AVAIL[p] before its last FREE[p]; each reset travels on the
    writer's stream ahead of anything it writes into the word later; the lane resets its local words
    once both lanes are past their waits, before the stream's next transfer (which waits for the lane).
    A transfer of no chunks moves nothing and touches no flag (both sides know). An agent's pack posts
    run one after another (a post on another stream waits for the one before): its staging serves both
    directions.
    """

    waits_on_peer = True

    def __init__(self, *a, pack: PackState, chunks: list, pooled, entries: int, shape_key: tuple, fingerprint: int,
                 **kw):
        self.pack = pack                # the agent's PackState
        self._chunks = chunks
        self.fingerprint = fingerprint  # of the request, the same on both sides (gpuxfer.kv.ids.request_fingerprint)
        self._pooled = pooled           # the host array's pool token: back to the pool when collected
        super().__init__(*a, **kw)
        self._req_bytes = entries * 8   # the request's entries (the pooled array may hold more)
        agent, poster, peer = self.agent, self.poster, self.peer
        self.source = self.op == "push"
        if agent.staging is None:
            raise BadInput(f"agent {agent.name!r} has no staging buffer: build it with engine='pack'")
        if self.source and peer.staging_ptr is None:
            raise BadInput(f"peer {peer.name!r} has no staging buffer (its agent does not run the pack engine)")
        self._buffers = (self._host_req,)
        self._shape_key = shape_key      # (id of the route, source?, segments per group)
        self._host_ptr = self._host_req.data_ptr()
        self._shape = None
        if chunks:
            with poster.lock:
                poster.check_usable(peer)   # a shape holds the peer: none for a removed one
                self._shape = pack.shape(poster, self)
                if self._shape.posts:       # a shape seen again: its graphs now, not inside a post
                    self._shape.graph(0)

    def post(self, stream: Stream | None = None) -> KVTransferHandle:
        """Enqueue this side's part (see the class docstring) on ``stream``; the handle completes when the
        data has landed on the destination. Host work: the request upload and, for a shape posted before,
        one graph launch (else the operations one by one), a notification if asked for, one event.

        A post that fails part way fails the agent (:meth:`KVAgent.fail`): the peer may already have acted on
        the signals it queued, so the two sides' transfers no longer pair up; its error is raised from every
        later call instead of a timeout of the next transfer."""
        agent, peer, pack = self.agent, self.peer, self.pack
        s = self.poster.stream(stream)
        with self.poster.lock:             # remove_peer and close exclude it: checked under it
            self.poster.check_usable(peer)
            if pack.status[0]:              # a refused transfer (TransferMismatch)
                agent.check()
            if pack.peer_uid not in (None, peer.meta.uid):
                raise BadInput(f"agent {agent.name!r} already runs pack transfers with another peer: its control "
                               "words hand chunks to one peer (use one agent per pack peer)")
            pack.peer_uid = peer.meta.uid
            try:
                return self._post(s)
            except Exception as exc:
                log.error("agent %s: posting %s failed part way (%s: %s); the agent fails", agent.name,
                          self.describe(), type(exc).__name__, exc)
                agent.fail(exc)
                raise

    def _post(self, s: Stream) -> KVTransferHandle:
        agent, poster, pack, peer = self.agent, self.poster, self.pack, self.peer
        plat = agent.platform
        tail = pack.tail
        if tail is not None and tail[0] is not s:
            plat.stream_wait_event(s, tail[1])
        keep: tuple = self._buffers
        shape = self._shape
        if shape is not None:
            parity = (peer.pack_sent if self.source else peer.pack_recv) % 2
            if s is agent.stream:
                poster.calls.copy(shape.req_ptr, self._host_ptr, self._req_bytes)
            else:
                plat.copy_async(s, shape.req_ptr, self._host_ptr, self._req_bytes)
            graphs = shape.graph(parity)
            lane = pack.lane_stream() if self.source else None
            if graphs is None:
                shape.record(s, parity)
                if lane is not None:
                    shape.record_copies(lane, parity)
            else:
                if s is agent.stream:
                    poster.calls.launch_graph(graphs[0])
                else:
                    plat.launch_graph(s, graphs[0])
                if lane is not None:
                    plat.launch_graph(lane, graphs[1])
            if lane is not None:            # the handle's event comes after the lane's copies
                pack.lane_event = plat.record_event(lane, pack.lane_event)
                plat.stream_wait_event(s, pack.lane_event)
            shape.posts += 1
            if self.source:                 # counted once the transfer is queued
                peer.pack_sent += 1
            else:
                peer.pack_recv += 1
            keep = (self, shape)
        value, event = self._finish(s)
        poster.track(event, keep, s)
        pack.tail = (s, event)
        return KVTransferHandle(self, event, s, value)

    def expanded_descriptors(self) -> np.ndarray:
        """The descriptors of the request (its shape's expansion; for checking, not a transfer path)."""
        agent, poster, pack = self.agent, self.poster, self.pack
        plat = agent.platform
        shape = self._shape
        if shape is None:
            return np.zeros((0, 3), dtype=np.int64)
        with poster.lock:
            poster.check_usable(self.peer)
            s = agent.stream
            tail = pack.tail
            if tail is not None and tail[0] is not s:
                plat.stream_wait_event(s, tail[1])
            plat.copy_async(s, shape.req.data_ptr(), self._host_ptr, self._req_bytes)
            if shape.expand is not None:
                plat.launch(s, shape.expand)
            rows = table_rows(poster, shape, s, self.descriptors)   # (the shape's next post rewrites its table)
            event = plat.record_event(s)
            pack.tail = (s, event)
            poster.track(event, (self, shape, rows), s)
        if not plat.synchronize(s, agent.timeout_s):
            raise TransferTimeout(rank=agent.rank, step=0, flag=f"request {self.name!r}", expected=1, seen=0,
                                  timeout_s=agent.timeout_s, what="expanding the descriptors")
        return rows.numpy().copy()
