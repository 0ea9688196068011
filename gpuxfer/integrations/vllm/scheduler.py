"""The scheduler side of the connector: which requests load remote KV, which finished prefills hold
their blocks for a decode instance, and the per-step payload for the worker side. No vLLM import
(requests and block lists are used through their attributes).
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
from typing import Sequence

import numpy as np

from . import lease
from .holds import make_key
from .params import (BadTransferParams, RemotePrefill, build_params, for_release, for_workers, parse_remote_prefill,
                     prompt_digest, seal_key, tokens_to_load)
from .loads import Load
from .wire import encode_load

log = logging.getLogger("gpuxfer.vllm")

_HOLD_STATUSES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


class SchedulerSide:
    """``block_sizes``: tokens per block of each KV-cache group of this instance; ``endpoints``: each tensor
    parallel rank's side channel, by rank (from the workers' handshake metadata; None until known)."""

    def __init__(self, *, engine_id: str, block_sizes: Sequence[int], lease_s: float,
                 endpoints: Sequence[tuple[str, int]] | None, wire: bool = False):
        self.engine_id = engine_id
        self.wire = wire                            # make each load's record for a loader process (.wire)
        self.block_sizes = [int(b) for b in block_sizes]
        self.lease_s = lease_s
        self.endpoints = list(endpoints) if endpoints else None
        self._parsed: dict[str, RemotePrefill] = {}
        self._foreign: set[str] = set()             # requests whose params name another prompt's KV
        self._loads: list[Load] = []
        self._holds: dict[str, tuple[float, str]] = {}
        self._releases: list[RemotePrefill] = []
        self.bad_params = 0
        self.secret = secrets.token_bytes(16)      # the holds' keys' MAC secret (holds.make_key): this engine's only
        self.seal_key = seal_key(self.secret)       # what its params are sealed with (params.check_seal)

    def _remote(self, request) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if not params or not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        rp = self._parsed.get(request.request_id)
        if rp is None:
            try:
                rp = parse_remote_prefill(params, self.block_sizes)
            except BadTransferParams as exc:
                self.bad_params += 1
                params["do_remote_prefill"] = False     # computed here; asked once
                log.error("gpuxfer: engine %s: request %s has bad kv_transfer_params (%s); computing its prompt "
                          "locally", self.engine_id, request.request_id, exc)
                return None
            self._parsed[request.request_id] = rp
            if rp.prompt != prompt_digest(getattr(request, "prompt_token_ids", None)):
                self._foreign.add(request.request_id)
        return rp

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        rp = self._remote(request)
        if rp is None:
            return 0, False
        try:
            n = tokens_to_load(request.num_prompt_tokens, num_computed_tokens, self.block_sizes, rp)
            if n > 0 and request.request_id in self._foreign:
                # (the seal covers the params' prompt digest: genuine params of another prompt name another KV)
                raise BadTransferParams("its kv_transfer_params were made for another prompt")
        except BadTransferParams as exc:
            self.bad_params += 1
            log.error("gpuxfer: engine %s: request %s: %s; computing its prompt locally", self.engine_id,
                      request.request_id, exc)
            return 0, False
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rp = self._remote(request)
        if rp is None:
            return
        request.kv_transfer_params["do_remote_prefill"] = False      # a preempted request computes again
        self._parsed.pop(request.request_id, None)
        self._foreign.discard(request.request_id)
        rp = _claimed(rp)
        if num_external_tokens > 0:
            ids = blocks.get_block_ids()
            local = tuple(np.fromiter(g, dtype=np.int64, count=len(g)) for g in ids)
            end = request.num_prompt_tokens - 1
            start = max(0, end - num_external_tokens)
            load = Load(request.request_id, for_workers(rp), local, start, end)
            if self.wire:
                load.wire = encode_load(load)
            self._loads.append(load)
        else:
            self._releases.append(for_release(rp))

    def build_payload(self) -> dict:
        out = {"loads": self._loads, "holds": self._holds, "releases": self._releases, "secret": self.secret}
        self._loads, self._holds, self._releases = [], {}, []
        return out

    def request_finished(self, request, block_ids: Sequence[Sequence[int]]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params
        rid = request.request_id
        self._parsed.pop(rid, None)
        self._foreign.discard(rid)
        if not params or not isinstance(params, dict):
            return False, None
        if params.get("do_remote_prefill"):
            # a decode request that never loaded (aborted while waiting): let the prefill free its blocks
            try:
                rp = parse_remote_prefill(params, self.block_sizes)
                self._releases.append(for_release(_claimed(rp)))
            except BadTransferParams:
                pass
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        status = getattr(getattr(request, "status", None), "name", "")
        if status not in _HOLD_STATUSES:
            return False, None
        if not any(len(b) for b in block_ids):
            return False, None
        if not self.endpoints:
            log.error("gpuxfer: engine %s: request %s asks for remote decode, but this instance's workers announced "
                      "no side channel of every rank; freeing its blocks", self.engine_id, rid)
            return False, None
        deadline = lease.now() + self.lease_s
        key = make_key(self.secret, rid)    # what a done or release for the hold must carry (holds.PrefillHolds)
        self._holds[rid] = (deadline, key)
        return True, build_params(engine_id=self.engine_id, endpoints=self.endpoints, request_id=rid,
                                  block_ids=block_ids, block_sizes=self.block_sizes, lease_deadline=deadline,
                                  key=key, seal_key=self.seal_key,
                                  prompt=prompt_digest(getattr(request, "prompt_token_ids", None)))


def _claimed(rp: RemotePrefill) -> RemotePrefill:
    """``rp`` with a fresh claim token of this instance (:class:`~.holds.ClaimBook`): every worker of the instance
    claims, reads and releases the request with it."""
    return dataclasses.replace(rp, token=secrets.token_hex(8))
