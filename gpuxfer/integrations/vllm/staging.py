"""A decode step's block IDs on their way to the device: the worker pairs every load of the step into one host
array, copies it to the device once on the agent's stream and prepares each read with ``device_ids=True`` on
slices of the device copy (the agent checks them there, :mod:`gpuxfer.kv.device_ids`); before that, each load's
block IDs paired on the host, its params checked first (:func:`pair_load`), and the reads of host IDs prepared
(:func:`prepare_each_host`). No vLLM import.

An :class:`IdStaging` entry is a host array (pinned on a GPU) and a device array of the same size::

    reserve(n)     two entries of n IDs made at engine startup (n: twice the blocks the caches hold)
    take(n)        an entry no queued work reads any more: its fence (the event after the last post of the step
                   that used it) completed, or a new one
    send(e, n)     copy_async(agent stream, e.device, e.host, 8 n)     -> queued before the step's posts, which
                                                                          run on the same stream and read e.device
    e.fence = ...  the event of the step's last post (or one recorded after the copy where nothing was posted)

So the host array is not written while its copy may still read it, and the device array not while a check
may still read it. The device array comes from torch's allocator on the current (compute) stream, so the agent's
stream first waits for the work queued there when the array is made.
"""
from __future__ import annotations

import logging
from time import clock_gettime
from typing import Any

import numpy as np

from ...errors import GpuxferError
from . import lease
from .params import BadTransferParams, check_seal, pair_group, source_ranks

log = logging.getLogger("gpuxfer.vllm")

#: IDs an entry holds at least (32 KiB)
MIN_IDS = 4096
#: entries made at startup (a step's entry is read until its last post completes: two let the next step in)
RESERVE_ENTRIES = 2
#: the most IDs an entry made at startup holds (8 MiB of host and as much of device memory)
RESERVE_MAX_IDS = 1 << 20


class _Entry:
    __slots__ = ("host", "array", "device", "size", "fence", "ptrs")

    def __init__(self, host, device):
        self.host, self.device = host, device
        self.ptrs = device.data_ptr(), host.data_ptr()      # (fixed for the tensors' life: read once)
        self.array = host.numpy()
        self.size = int(host.shape[0])
        self.fence: Any = None          # the event after the last work that reads this entry; None: none queued


class IdStaging:
    """The staging entries of one agent's device-ID reads (see the module); the engine's thread alone uses it."""

    def __init__(self, agent):
        import torch
        self.torch, self.agent, self.platform = torch, agent, agent.platform
        self.device = agent.platform.torch_device(agent.device)
        self.entries: list[_Entry] = []

    def _free(self, e: _Entry) -> bool:
        if e.fence is None:
            return True
        try:
            done = self.platform.event_query(e.fence)
        except GpuxferError:            # the stream failed: none of its work runs any more
            done = True
        if done:
            e.fence = None
        return done

    def take(self, n: int) -> _Entry:
        """An entry of at least ``n`` IDs that nothing queued reads; free entries too small for ``n`` go."""
        for e in self.entries:
            if e.size >= n and (e.fence is None or self._free(e)):
                return e
        size = _size(n)
        self.entries = [e for e in self.entries if e.size >= size or not self._free(e)]
        return self._new(size)

    def reserve(self, n: int) -> None:
        """``RESERVE_ENTRIES`` entries of at least ``n`` IDs (at most ``RESERVE_MAX_IDS``) made now, at engine
        startup, so that steps of up to ``n`` IDs allocate nothing (pinned host memory takes milliseconds to
        allocate: in a step, it is most of that step's host time)."""
        for _ in range(RESERVE_ENTRIES):
            self._new(_size(min(n, RESERVE_MAX_IDS)))

    def _new(self, size: int) -> _Entry:
        torch, plat = self.torch, self.platform
        e = _Entry(torch.empty(size, dtype=torch.int64, pin_memory=not plat.host_memory),
                   torch.empty(size, dtype=torch.int64, device=self.device))
        # the new device memory may have been freed by work still queued on torch's stream: the agent's waits
        plat.stream_wait_event(self.agent.stream, plat.record_event(plat.current_stream(self.agent.device)))
        self.entries.append(e)
        return e

    def send(self, e: _Entry, n: int) -> None:
        """Queue the copy of ``e``'s first ``n`` IDs to the device on the agent's stream."""
        dst, src = e.ptrs
        self.platform.copy_async(self.agent.stream, dst, src, 8 * n)

    def fence_now(self, e: _Entry) -> None:
        """Fence ``e`` with an event recorded now on the agent's stream (a step that posted nothing after its
        copy); an entry that cannot be fenced is never used again."""
        try:
            e.fence = self.platform.record_event(self.agent.stream)
        except Exception:  # noqa: BLE001 - kept out of use instead
            self.entries = [x for x in self.entries if x is not e]
            _KEPT.append(e)


def _size(n: int) -> int:
    return max(MIN_IDS, 1 << (max(n, 1) - 1).bit_length())


#: entries that could not be fenced: kept for the life of the process (a copy may still read them)
_KEPT: list[_Entry] = []


def prepare_on_device(loads, batches: list, xs: list, owners: list):
    """For :class:`~.loads.DecodeLoads` ``loads``: one read per prefill engine of its loads in ``batches``, with
    their block IDs on the device: per engine and group, every load's local IDs then every load's remote IDs, all
    of the step's in one host array,
    copied to the device at once on the agent's stream (:class:`IdStaging`) before the posts that read it;
    each read is prepared on slices of that copy (``device_ids=True``: checked on the device at the post).
    Returns the staging entry the step used. A read the agent refuses at prepare goes by host IDs, load by
    load, so the load at fault fails alone."""
    parts, spans, n = [], [], 0
    for batch in batches:
        span = {}
        one = batch[0].pairs if len(batch) == 1 else None
        for name in loads._group_names:
            if one is not None:         # (one load: its arrays as they are, no list made by a call)
                if name not in one[0]:
                    continue
                loc, rem = [one[0][name]], [one[1][name]]
                a = n
                b = a + loc[0].size
                n = b + rem[0].size
            else:
                loc = [st.pairs[0][name] for st in batch if name in st.pairs[0]]
                if not loc:
                    continue
                rem = [st.pairs[1][name] for st in batch if name in st.pairs[1]]
                a = n
                b = a + sum([x.size for x in loc])     # (a list: a generator is a Python call per load)
                n = b + sum([x.size for x in rem])
            parts += loc
            parts += rem
            span[name] = (a, b, n)
        spans.append(span)
    staging = loads.staging
    try:
        entry = staging.take(n)
        np.concatenate(parts, out=entry.array[:n])
        staging.send(entry, n)
    except (GpuxferError, RuntimeError) as exc:        # (torch's allocator raises RuntimeErrors)
        log.warning("gpuxfer: engine %s: staging block IDs for the device failed (%s: %s); this step's reads "
                    "go with host IDs", loads.engine_id, type(exc).__name__, exc)
        for batch in batches:
            prepare_each_host(loads, batch, xs, owners)
        return None
    dev = entry.device
    for batch, span in zip(batches, spans):
        first, together = batch[0], len(batch)
        name = first.load.req_id if together == 1 else f"{first.load.req_id} and {together - 1} more"
        local, remote = {}, {}
        for k, (a, b, c) in span.items():
            local[k], remote[k] = dev[a:b], dev[b:c]
        try:
            x = loads.agent.prepare(first.remote.peer, "pull", name=name, device_ids=True,
                                   local_blocks=local, remote_blocks=remote)
        except GpuxferError:
            prepare_each_host(loads, batch, xs, owners)
            continue
        for st in batch:
            st.together, st.device_ids = together, True
        xs.append(x)
        owners.append(batch)
    return entry


def prepare_each_host(loads, batch: list, xs: list, owners: list) -> None:
    """For :class:`~.loads.DecodeLoads` ``loads``: each load's read with its IDs on the host (checked there by
    :meth:`KVAgent.prepare`), a load the agent refuses failing alone."""
    prepare = loads.agent.prepare
    for st in batch:
        try:
            local, remote = st.pairs
            st.device_ids = False
            xs.append(prepare(st.remote.peer, "pull", local_blocks=local, remote_blocks=remote,
                              name=st.load.req_id, device_ids=False))
            owners.append((st,))
        except GpuxferError as exc:
            st.error = f"{type(exc).__name__}: {exc}"


def pair_load(loads, st) -> tuple[dict, dict] | None:
    """For :class:`~.loads.DecodeLoads` ``loads``: load ``st``'s kernel block IDs paired per group, ``(local,
    remote)`` by group name, or None when nothing is to be moved; first its engine is alive, its params carry the
    engine's seal (:func:`.params.check_seal`, once a load) and their lease has not run out, and the engine is the
    prefill rank they name (:class:`.params.BadTransferParams` or :class:`.params.BadSeal` otherwise). The engine
    thread's path of every load: each Python or C call here costs it microseconds, so the checks read what the
    handshake made once (the seal key's HMAC, the engine's clock) and call nothing more."""
    load, r = st.load, st.remote
    rp = load.remote
    if r.client is None or not r.client.alive:
        raise BadTransferParams(f"prefill engine {r.key[2]} is gone: {r.client and r.client.closed_reason}")
    key = r.seal_key
    if load.sealed is None or load.sealed != key:       # nothing of the params is acted on before
        check_seal(rp, key)
        load.sealed = key
    clock = r.clock
    deadline = rp.lease_deadline if clock.same else clock.deadline(rp.lease_deadline)
    if not clock_gettime(lease.RAW) + lease.SHIFT < deadline:     # (lease.now(); a NaN deadline has run out)
        raise BadTransferParams("the prefill instance's lease on the blocks ran out before the read started")
    # the peer must be the prefill rank the params name for this read, of the size they name: a part's view of
    # this worker's heads comes from the peer's own rank and size, so another rank (one rank under two
    # addresses) or a prefill of more ranks than the params list would leave heads written by no read
    # (with the sizes equal, r.sources are the ranks the load's parts were made from: st.part indexes them)
    if r.world != (len(rp.endpoints) if rp.endpoints else 1) or r.rank != r.sources[st.part]:     # (rp.tp_size)
        want = source_ranks(loads.tp_rank, loads.tp_size, rp.tp_size)[st.part]
        raise BadTransferParams(f"prefill engine {r.key[2]} at {r.key[0]}:{r.key[1]} is rank {r.rank} of "
                                f"{r.world}; the params name rank {want} of {rp.tp_size} there")
    local, remote, nbytes = {}, {}, 0
    for g, name, ls, lk, rs, rk, per_block, share in r.reads:
        if rp.block_sizes[g] != rs:
            raise BadTransferParams(f"group {g}: the params say {rp.block_sizes[g]}-token blocks, "
                                    f"the engine's handshake {rs}")
        li, ri = pair_group(load.local_ids[g], rp.block_ids[g], ls, rs, load.start, load.end, lk, rk)
        if li.size:
            local[name], remote[name] = li, ri
            nbytes += int(li.size * per_block * share)
    st.nbytes = nbytes
    return (local, remote) if local else None
