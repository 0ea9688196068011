"""SGLang 0.5.23's disaggregation queue code, run without a model.

Prefill: its ``PrefillBootstrapQueue`` (which builds the rank's ``KVArgs`` from the KV pool and makes the KV
manager and each request's ``KVSender``) and the prefill scheduler's ``send_kv_chunk`` (SGLang's
``SchedulerDisaggregationPrefillMixin``: page indices from the request's token locations, a partial last page
held back until the last chunk, the metadata row with it). What a real scheduler would hold and these do not
need (a model, a radix cache, GPU pools) is stood in for by the few attributes the queue code reads:
:class:`Pool` (SGLang's MHA or MLA pool class, its buffers this rank's), :class:`Req`, :class:`MetadataRows`
and :class:`PrefillScheduler`.

Decode: its ``DecodePreallocQueue`` (the rank's ``KVArgs``, KV manager and each request's ``KVReceiver``; the
handshake, admission, page allocation and ``send_metadata``) and ``DecodeTransferQueue`` (polling, the metadata
gate, committing or failing and releasing each request), run by the decode scheduler's own
``process_decode_queue`` (``SchedulerDisaggregationDecodeMixin``) over SGLang's ``Req``, ``DecodeReqToTokenPool``,
token or paged KV allocator and (disabled) ``RadixCache``; the scheduler's attributes the queues read and the
metadata buffers are stood in for (:func:`decode_scheduler`, :class:`MetadataRows`).

Imported only in a spawned rank process (``sglang_instance``) where SGLang is installed.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch


def init_world_of_one() -> None:
    """A one-rank gloo group: SGLang's poll all-reduce asks its world size (1: the polls pass unchanged); then,
    as SGLang's distributed bootstrap does once its groups exist, the shared Mooncake transfer engine where the
    server's transfer backend is Mooncake (a no-op for any other backend)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        maybe_init_shared_mooncake_transfer_engine)
    maybe_init_shared_mooncake_transfer_engine(gpu_id=0)


def make_pool(mla: bool, page_size: int, layers: int, heads: int, ptrs, lens, items):
    """An instance of SGLang's ``MLATokenToKVPool`` / ``MHATokenToKVPool`` class (so the queue's ``is_mla_backend``
    and pool checks see the real types) describing this rank's buffers; their constructors allocate on a GPU,
    so the attributes the queue reads are set here instead."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    class Pool(MLATokenToKVPool if mla else MHATokenToKVPool):
        def __init__(self):         # noqa: D107 -- no GPU allocation: the rank's own buffers
            self.page_size, self.start_layer, self.end_layer = page_size, 0, layers
            self.layer_num, self.head_num = layers, heads

        def get_contiguous_buf_infos(self):
            return list(ptrs), list(lens), list(items)

    return Pool()


class MetadataRows:
    """SGLang's ``MetadataBuffers`` as the queues use it, over this rank's aux buffers, the last of which is
    laid out as SGLang's ``bootstrap_room`` buffer (eight 64-bit slots a row, zero until a row is written).
    Prefill: ``set_buf`` writes the request's room into slot 0 of its row, as SGLang's does, and leaves the
    seeded rows as they are, so the decode can check every byte of the row it got. Decode: the metadata
    gate reads ``bootstrap_room``; ``get_buf`` (what the transfer queue reads when a request succeeded) keeps
    a copy of the row's bytes in every buffer for the check (``got``: room -> (row, [bytes per buffer]));
    ``clear_slot`` zeroes the room row, as SGLang's does."""

    def __init__(self, tensors, item_lens):
        self.tensors, self.item_lens = tensors, list(item_lens)
        self.set_rows: list[int] = []
        self.got: dict[int, tuple] = {}
        self.bootstrap_room = tensors[-1].view(-1, item_lens[-1]).view(torch.int64)

    def get_buf_infos(self):
        return [t.data_ptr() for t in self.tensors], [t.numel() for t in self.tensors], list(self.item_lens)

    def row(self, j: int, idx: int):
        return self.tensors[j].view(-1, self.item_lens[j])[idx]

    def set_buf(self, req) -> None:
        self.set_rows.append(req.metadata_buffer_index)
        self.bootstrap_room[req.metadata_buffer_index, 0] = req.bootstrap_room

    def get_buf(self, idx: int):
        rows = [self.row(j, idx).clone() for j in range(len(self.tensors))]
        room = self.bootstrap_room[idx].clone()
        self.got[int(room[0])] = (idx, rows)
        output_id, cached_tokens = rows[0].view(torch.int32), rows[1].view(torch.int32)
        # output id, cached tokens, 4 logprob rows, 3 sampling-mask rows, 2 top-k rows, hidden states,
        # DSA top-k, the room: SGLang's order; only the ones a request without logprobs or speculation reads
        return (output_id, cached_tokens, *([None] * 11), room)

    def clear_slot(self, idx: int) -> None:
        self.bootstrap_room[idx] = 0


class _TimeStats:
    def __getattr__(self, name):
        return lambda *a, **k: None

    @property
    def trace_ctx(self):
        return self


class Req:
    """The attributes of SGLang's ``Req`` that ``PrefillBootstrapQueue`` and ``send_kv_chunk`` read."""

    def __init__(self, room: int, tokens: int, pool_idx: int, host: str):
        self.rid, self.bootstrap_room, self.bootstrap_host = f"req-{room}", room, host
        self.origin_input_ids = [0] * tokens
        self.disagg_prefill_dp_rank = None
        self.sampling_params = SimpleNamespace(max_new_tokens=None)
        self.is_retracted, self.prefill_attempt_count, self.metadata_buffer_index = False, 0, -1
        self.pending_bootstrap, self.to_finish, self.finished_reason = False, None, None
        self.time_stats = _TimeStats()
        self.kv = SimpleNamespace(req_pool_idx=pool_idx, holds_kv=False, holds_mamba=False, retraction_backup=None)
        self.extend_end = self.start_send_idx = self.disagg_decode_prefix_len = 0
        self.swa_branching_seqlen, self.disagg_kv_sender = None, None


def prefill_scheduler(*, pool, meta: MetadataRows, page_size: int, layers: int, heads: int, total_heads: int,
                      port: int, server_args, max_reqs: int, max_tokens: int, aux_rows: int, backend):
    """A prefill scheduler with SGLang's ``send_kv_chunk`` and a ``PrefillBootstrapQueue`` of its own."""
    from sglang.srt.disaggregation.prefill import (PrefillBootstrapQueue, SchedulerDisaggregationPrefillMixin,
                                                   maybe_release_metadata_buffer)
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

    class PrefillScheduler(SchedulerDisaggregationPrefillMixin):
        def __init__(self):         # noqa: D107 -- what the queue and send_kv_chunk read of a Scheduler
            self.token_to_kv_pool_allocator = SimpleNamespace(page_size=page_size,
                                                              translate_kv_indices_for_transfer=lambda x: x)
            self.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(
                effective_logical_max_total_num_tokens=max_tokens * max_reqs, kv_cache_dtype_str="bfloat16"))
            self.kv_shard_widening, self.rust_server, self.tree_cache = 1, None, None
            self.model_config = SimpleNamespace(num_hidden_layers=layers, hf_text_config=None,
                                                get_total_num_kv_heads=lambda: total_heads)
            self.server_args = server_args
            self.req_to_token_pool = SimpleNamespace(
                req_to_token=torch.zeros((max_reqs, max_tokens), dtype=torch.int32))
            self.processed_tokens_counter, self.enable_staging, self.enable_overlap = 0, False, False
            self.attn_cp_cpu_group = self.attn_tp_cpu_group = None
            self.disagg_metadata_buffers = meta
            self.disagg_prefill_pending_chunk_rids: set = set()
            self.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(aux_rows)
            self.bootstrap_failed: list = []
            self.disagg_prefill_bootstrap_queue = PrefillBootstrapQueue(
                token_to_kv_pool=pool, draft_token_to_kv_pool=None,
                req_to_metadata_buffer_idx_allocator=self.req_to_metadata_buffer_idx_allocator,
                metadata_buffers=meta, gpu_id=0, bootstrap_port=port, max_total_num_tokens=max_tokens * max_reqs,
                scheduler=self, scheduler_stage_metrics=None, transfer_backend=backend)

        def handle_bootstrap_failure(self, req) -> None:
            """The scheduler's: the request leaves the queue failed, its metadata row freed (no output stream)."""
            self.bootstrap_failed.append(req.bootstrap_room)
            maybe_release_metadata_buffer(req, self.req_to_metadata_buffer_idx_allocator)
            req.pending_bootstrap = False

        def release(self, req) -> None:
            maybe_release_metadata_buffer(req, self.req_to_metadata_buffer_idx_allocator)

    return PrefillScheduler()


class QueueDriver:
    """One prefill rank's requests through SGLang's queue: ``add`` (the queue makes each ``KVSender``), then
    ``run``: ``pop_bootstrapped`` until every request left the queue, each popped request's chunks sent with
    ``send_kv_chunk`` as the scheduler sends them after each chunked-prefill forward (the last with
    ``last_chunk=True``). Each ``KVSender.send`` call SGLang makes is timed (host time)."""

    def __init__(self, sched, host: str):
        self.sched, self.host = sched, host
        self.queue = sched.disagg_prefill_bootstrap_queue
        self.reqs: dict[int, Req] = {}
        self.chunks: dict[int, int] = {}
        self.send_s: list[float] = []               # host time of each KVSender.send call
        self.chunk_s: list[float] = []              # host time of each send_kv_chunk call
        self.first_send: dict[int, float] = {}      # room -> time.monotonic() at its first send_kv_chunk
        self.last_send: dict[int, float] = {}       # room -> time.monotonic() at its last send_kv_chunk
        self.forward_s = 0.0                        # the scheduler thread sleeps this long after each chunk but
                                                    # the last (a forward pass that leaves the GIL free)
        self._slots = list(range(sched.req_to_token_pool.req_to_token.shape[0]))

    def add(self, room: int, pages, tokens: int, chunk_tokens: int) -> str:
        """Request ``room`` of ``tokens`` tokens in prefill ``pages`` (``page_size`` tokens each, the last may be
        partial), prefilled ``chunk_tokens`` at a time. Returns its sender's status (SGLang's ``KVPoll`` int)."""
        ps = self.sched.token_to_kv_pool_allocator.page_size
        if not (len(pages) - 1) * ps < tokens <= len(pages) * ps:
            raise ValueError(f"room {room}: {tokens} tokens do not fill {len(pages)} pages of {ps}")
        slot = self._slots.pop(0)
        locs = torch.tensor(pages, dtype=torch.int32).repeat_interleave(ps) * ps + torch.arange(ps).repeat(len(pages))
        self.sched.req_to_token_pool.req_to_token[slot, :tokens] = locs[:tokens]
        req = Req(room, tokens, slot, self.host)
        self.queue.add(req, num_kv_heads=1)
        self.reqs[room], self.chunks[room] = req, chunk_tokens
        sender = req.disagg_kv_sender
        send = sender.send

        def timed_send(*a, **k):
            t0 = time.perf_counter()
            try:
                return send(*a, **k)
            finally:
                self.send_s.append(time.perf_counter() - t0)
        sender.send = timed_send
        return int(sender.poll())

    def run(self, timeout: float) -> dict:
        """Pop and send until every added request left the queue or ``timeout`` passed: ``{"left": rooms still
        queued, "failed": rooms the queue failed, "rows": room -> metadata row}``."""
        deadline = time.monotonic() + timeout
        while self.queue.queue and time.monotonic() < deadline:
            for req in self.queue.pop_bootstrapped():
                self._prefill(req)
            time.sleep(0.001)
        return {"left": sorted(r.bootstrap_room for r in self.queue.queue),
                "failed": sorted(self.sched.bootstrap_failed),
                "rows": {room: r.metadata_buffer_index for room, r in self.reqs.items()}}

    def _prefill(self, req: Req) -> None:
        n, step = len(req.origin_input_ids), self.chunks[req.bootstrap_room]
        for end in range(step, n + step, step):
            req.extend_end = min(end, n)
            if self.forward_s and end > step:
                time.sleep(self.forward_s)
            self.first_send.setdefault(req.bootstrap_room, time.monotonic())     # CLOCK_MONOTONIC: any process's
            self.last_send[req.bootstrap_room] = time.monotonic()
            t0 = time.perf_counter()
            self.sched.send_kv_chunk(req, last_chunk=req.extend_end == n)
            self.chunk_s.append(time.perf_counter() - t0)

    def release(self, room: int) -> None:
        req = self.reqs.pop(room, None)
        if req is not None:
            self.sched.release(req)
            self._slots.append(req.kv.req_pool_idx)


# ---------------------------------------------------------------------- decode


def decode_scheduler(*, pool, meta: MetadataRows, page_size: int, pages: int, layers: int, server_args,
                     max_reqs: int, aux_rows: int, backend, seed: int):
    """A decode scheduler with SGLang's ``process_decode_queue`` over its own ``DecodePreallocQueue`` and
    ``DecodeTransferQueue``, SGLang's ``DecodeReqToTokenPool``, its token or paged KV allocator over ``pages``
    pages (page 0 padding; the free pages shuffled from ``seed``, as a server's are after some traffic) and
    its radix cache disabled (a decode server without ``--disaggregation-decode-enable-radix-cache``)."""
    from sglang.srt.disaggregation.decode import (DecodePreallocQueue, DecodeReqToTokenPool, DecodeTransferQueue,
                                                  SchedulerDisaggregationDecodeMixin)
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    size = (pages - 1) * page_size
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", pool, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cpu", pool, need_sort=False)
        # its page indices live on the CPU (the KV buffers may be CUDA's): SGLang picks its Triton kernels by the
        # platform, which cannot take CPU tensors where CUDA is present
        allocator.use_triton_kernels = False
    order = torch.randperm(len(allocator.free_pages), generator=torch.Generator().manual_seed(seed))
    allocator.free_pages = allocator.free_pages[order]
    req_to_token = DecodeReqToTokenPool(size=max_reqs, max_context_len=size, device="cpu",
                                        enable_memory_saver=False, pre_alloc_size=0)
    tree = RadixCache(CacheInitParams(disable=True, req_to_token_pool=req_to_token,
                                      token_to_kv_pool_allocator=allocator, page_size=page_size))

    class DecodeScheduler(SchedulerDisaggregationDecodeMixin):
        def __init__(self):         # noqa: D107 -- what the decode queues and process_decode_queue read
            self.server_args, self.random_seed, self.enable_decode_hicache = server_args, seed, False
            self.scheduler_stage_metrics = None
            self.tp_worker = SimpleNamespace(is_hybrid_swa=False,
                                             model_runner=SimpleNamespace(kv_cache_dtype_str="bfloat16"))
            self.enable_hisparse, self.hisparse_coordinator, self.enable_lora = False, None, False
            self.enable_priority_scheduling, self.sliding_window_size, self.last_batch = False, None, None
            self.model_config = SimpleNamespace(num_hidden_layers=layers)
            self.running_batch = SimpleNamespace(reqs=[])
            self.metrics_reporter = SimpleNamespace(enable_metrics=False)
            self.spec_algorithm = SimpleNamespace(is_none=lambda: True)
            self.batch_result_processor = SimpleNamespace(_maybe_update_reasoning_tokens=lambda req, tok: None)
            self.output_streamer = SimpleNamespace(stream_output=self._stream_output)
            self.waiting_queue: list = []           # requests whose KV arrived: the next decode batch's
            self.aborted: list = []                 # requests SGLang ended with an abort, as streamed out
            self.tree_cache, self.req_to_token_pool, self.token_to_kv_pool_allocator = tree, req_to_token, allocator
            self.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(aux_rows)
            self.disagg_metadata_buffers = meta
            self.disagg_decode_prealloc_queue = None
            self.disagg_decode_transfer_queue = DecodeTransferQueue(
                req_to_metadata_buffer_idx_allocator=self.req_to_metadata_buffer_idx_allocator,
                metadata_buffers=meta, scheduler=self, tree_cache=tree)
            self.disagg_decode_prealloc_queue = DecodePreallocQueue(
                req_to_token_pool=req_to_token, token_to_kv_pool_allocator=allocator, draft_token_to_kv_pool=None,
                req_to_metadata_buffer_idx_allocator=self.req_to_metadata_buffer_idx_allocator,
                metadata_buffers=meta, scheduler=self, transfer_queue=self.disagg_decode_transfer_queue,
                tree_cache=tree, gpu_id=0, bootstrap_port=server_args.disaggregation_bootstrap_port,
                max_total_num_tokens=size, num_reserved_decode_tokens=page_size, transfer_backend=backend)

        def _stream_output(self, reqs, return_logprob, *a, **k) -> None:
            self.aborted.extend(reqs)

        def retire_unadmitted_request(self, req) -> None:
            self.aborted.append(req)

        def abort(self, rid: str) -> None:
            """The decode branch of SGLang's ``Scheduler.abort_request``: the receiver of a request still in
            either queue aborted (its queue then fails and releases it)."""
            for q in (self.disagg_decode_prealloc_queue, self.disagg_decode_transfer_queue):
                for decode_req in q.queue:
                    if decode_req.req.rid == rid:
                        decode_req.kv_receiver.abort()

    return DecodeScheduler()


class DecodeQueueDriver:
    """One decode rank's requests through SGLang's queues: ``add`` (``DecodePreallocQueue.add`` makes each
    ``KVReceiver``), then ``step`` runs the scheduler's ``process_decode_queue`` (``pop_preallocated``: the
    handshake, pages allocated and ``send_metadata``; ``pop_transferred``: the requests whose KV and metadata
    arrived, or that failed, released). What each request handed the prefill (its page indices and metadata
    row) is noted as ``send_metadata`` is called."""

    def __init__(self, sched, host: str, port: int):
        self.sched, self.host, self.port = sched, host, port
        self.prealloc = sched.disagg_decode_prealloc_queue
        self.reqs: dict[int, object] = {}
        self.sent: dict[int, tuple] = {}            # room -> (decode page indices, metadata row)
        self.ended: dict[int, tuple] = {}           # room -> ("Success" | "Failed", seconds after add, reason)
        self._added: dict[int, float] = {}

    def add(self, room: int, tokens: int):
        """Request ``room`` of ``tokens`` prompt tokens, prefilled by the prefill at ``host:port``; its
        receiver."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams
        req = Req(f"req-{room}", "", array("q", [0] * tokens), SamplingParams(max_new_tokens=1),
                  bootstrap_host=self.host, bootstrap_port=self.port, bootstrap_room=room)
        self.prealloc.add(req)
        decode_req = next(d for d in self.prealloc.queue if d.req is req)
        receiver = decode_req.kv_receiver
        send_metadata = receiver.send_metadata

        def noted(kv_indices, aux_index=None, *a, **k):
            self.sent[room] = ([int(p) for p in kv_indices], int(aux_index))
            return send_metadata(kv_indices, aux_index, *a, **k)
        receiver.send_metadata = noted
        self.reqs[room], self._added[room] = req, time.monotonic()
        return receiver

    def step(self) -> None:
        s = self.sched
        s.process_decode_queue()
        now = time.monotonic()
        for req in s.waiting_queue:
            self.ended[req.bootstrap_room] = ("Success", round(now - self._added[req.bootstrap_room], 3), None)
        for req in s.aborted:
            self.ended[req.bootstrap_room] = ("Failed", round(now - self._added[req.bootstrap_room], 3),
                                              req.finished_reason.message)
        s.waiting_queue.clear()
        s.aborted.clear()

    def until(self, done, timeout: float) -> bool:
        """``step`` until ``done()`` or ``timeout`` passed; whether ``done()``."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                return False
            self.step()
            time.sleep(0.001)
        return True
