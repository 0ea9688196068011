"""SGLang 0.5.23's prefill-side queue code, run without a model: its ``PrefillBootstrapQueue`` (which builds the
rank's ``KVArgs`` from the KV pool and makes the KV manager and each request's ``KVSender``) and the prefill
scheduler's ``send_kv_chunk`` (SGLang's ``SchedulerDisaggregationPrefillMixin``: page indices from the
request's token locations, a partial last page held back until the last chunk, the metadata row with it).

What a real scheduler would hold and these do not need (a model, a radix cache, GPU pools) is stood in for by
the few attributes the queue code reads: :class:`Pool` (SGLang's MHA or MLA pool class, its buffers this
rank's), :class:`Req`, :class:`MetadataRows` and :class:`PrefillScheduler`. Imported only in a spawned rank
process (``sglang_instance``) where SGLang is installed.
"""
from __future__ import annotations

import time
from types import SimpleNamespace


def init_world_of_one() -> None:
    """A one-rank gloo group: SGLang's poll all-reduce asks its world size (1: the polls pass unchanged)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


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
    """SGLang's ``MetadataBuffers`` as the queue uses it, over this rank's aux buffers: ``set_buf`` (the
    request's first output token and the like) leaves the seeded rows as they are, so the decode can check
    every byte of the row it got."""

    def __init__(self, tensors, item_lens):
        self.tensors, self.item_lens = tensors, list(item_lens)
        self.set_rows: list[int] = []

    def get_buf_infos(self):
        return [t.data_ptr() for t in self.tensors], [t.numel() for t in self.tensors], list(self.item_lens)

    def set_buf(self, req) -> None:
        self.set_rows.append(req.metadata_buffer_index)


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


def prefill_scheduler(*, pool, meta: MetadataRows, page_size: int, layers: int, heads: int, port: int,
                      server_args, max_reqs: int, max_tokens: int, aux_rows: int, backend):
    """A prefill scheduler with SGLang's ``send_kv_chunk`` and a ``PrefillBootstrapQueue`` of its own."""
    import torch
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
                                                get_total_num_kv_heads=lambda: heads)
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
        self._slots = list(range(sched.req_to_token_pool.req_to_token.shape[0]))

    def add(self, room: int, pages, tokens: int, chunk_tokens: int) -> str:
        """Request ``room`` of ``tokens`` tokens in prefill ``pages`` (``page_size`` tokens each, the last may be
        partial), prefilled ``chunk_tokens`` at a time. Returns its sender's status (SGLang's ``KVPoll`` int)."""
        import torch
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
            self.first_send.setdefault(req.bootstrap_room, time.monotonic())     # CLOCK_MONOTONIC: any process's
            t0 = time.perf_counter()
            self.sched.send_kv_chunk(req, last_chunk=req.extend_end == n)
            self.chunk_s.append(time.perf_counter() - t0)

    def release(self, room: int) -> None:
        req = self.reqs.pop(room, None)
        if req is not None:
            self.sched.release(req)
            self._slots.append(req.kv.req_pool_idx)
