"""A decode worker's claims on prefill requests, against forged params: :class:`~.loads.DecodeLoads` records, as a
load starts, ``claims[(prefill endpoint, prefill request)] = (engine, lease deadline)`` and refuses every other load
of that request while the claim stands (vLLM gives each of a request's n > 1 children the parent's params; only one
may read them). A claim is made before its params' seal can be checked (the seal key comes with the engine's
handshake; a ready engine's loads are checked when the step posts them), so params forged to name a genuine request
would, claiming first, fail the genuine load. Instead, a load that finds the claim made by a load whose params were
not checked yet waits (``DecodeLoads._deferred``; a load of several prefill ranks, each of its parts so claimed) and
:func:`settle`, at each start and poll, decides it once they were::

    load A (params unchecked)  claims (engine, request)
    load B, same request       deferred on A's claim: reported nothing yet
    A's seal fails             A fails, its claim dropped          -> B starts (claims, reads) as if A never came
    A's seal holds             A reads                             -> B fails: loaded twice (as before)
    A ends unchecked           A fails, its claim dropped          -> B starts on its own (e.g. a fresh handshake)

Of several loads waiting on one claim dropped, the first starts and the others wait on its claim in turn.

A wait is bounded: A's params are checked when its read is posted, or A ends within the handshake timeout. No vLLM
import.
"""
from __future__ import annotations

import time

#: a load refused because another load of this instance claims its prefill request
TWICE = ("request {!r} of prefill engine {} is loaded by another request of this instance already (its blocks are "
         "freed once that load ends)")


def unchecked(st) -> bool:
    """Whether ``st`` (a load state, or None) is a load whose params' seal was not checked yet against its engine's
    key (neither held nor failed: a load of several ranks checked at another rank, whose key may differ, is not)."""
    return st is not None and not st.forged and (st.load.sealed is None or st.load.sealed != st.remote.seal_key)


def settle(loads) -> None:
    """For :class:`~.loads.DecodeLoads` ``loads``: each claim's deferred loads (or parts of a load of several prefill
    ranks), once its maker's params were checked or its maker ended: failed as loaded twice where the claim stands;
    where it was dropped, the first started as if it had never been made (:func:`resume`) and the others deferred on
    its claim in turn."""
    while True:
        ready = []
        for claim, sts in list(loads._deferred.items()):
            if unchecked(loads._claimants.get(claim)):
                continue
            del loads._deferred[claim]
            if claim in loads.claims:
                for st in sts:
                    st.error = TWICE.format(st.load.remote.request_id, claim[0][2])
                    loads.ended.append(st)
            else:
                if resume(loads, sts[0], claim):
                    ready.append(sts[0])
                if len(sts) > 1:
                    loads._deferred[claim] = sts[1:]
        if not ready:
            return
        loads._post(ready, blocking=False)      # (checked now: the loads deferred on them are decided next round)


def resume(loads, st, claim) -> bool:
    """Start the deferred load (part) ``st`` on ``claim``, dropped, as :meth:`~.loads.DecodeLoads.start` does (its
    handshake timeout counted from now): whether its engine is ready (its read to post)."""
    key, rp, engines = claim[0], st.load.remote, loads.engines
    r = engines.remotes.get(key)
    if r is None or r.state != "ready" or r.client is None or not r.client.alive:
        r = engines.get(key)
    st.remote, st.t_start = r, time.monotonic()
    loads.claims[claim] = st.held = (r, rp.lease_deadline)
    loads._claimants[claim] = st
    r.loads += 1
    loads.waiting[st.key] = st
    if r.state == "pending":
        engines.advance(r)
    return r.state == "ready"
