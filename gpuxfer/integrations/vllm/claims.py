"""A decode worker's claims on prefill requests, against forged params: :class:`~.loads.DecodeLoads` records, as a
load starts, ``claims[(prefill endpoint, prefill request)] = (engine, lease deadline)`` and refuses every other load
of that request while the claim stands (vLLM gives each of a request's n > 1 children the parent's params; only one
may read them). A claim is made before its params' seal can be checked (the seal key comes with the engine's
handshake; a ready engine's loads are checked when the step posts them), so params forged to name a genuine request
would, claiming first, fail the genuine load. Instead, a load that finds the claim made by a load whose params were
not checked yet waits (``DecodeLoads._deferred``) and :func:`settle`, at each start and poll, decides it once they
were::

    load A (params unchecked)  claims (engine, request)
    load B, same request       deferred on A's claim: reported nothing yet
    A's seal fails             A fails, its claim dropped          -> B starts (claims, reads) as if A never came
    A's seal holds             A reads                             -> B fails: loaded twice (as before)
    A ends unchecked           A fails, its claim dropped          -> B starts on its own (e.g. a fresh handshake)

A wait is bounded: A's params are checked when its read is posted, or A ends within the handshake timeout. No vLLM
import.
"""
from __future__ import annotations

#: a load refused because another load of this instance claims its prefill request
TWICE = ("request {!r} of prefill engine {} is loaded by another request of this instance already (its blocks are "
         "freed once that load ends)")


def unchecked(st) -> bool:
    """Whether ``st`` (a load state, or None) is a load whose params' seal was not checked yet (neither held nor
    failed)."""
    return st is not None and st.load.sealed is None and not st.forged


def settle(loads) -> None:
    """For :class:`~.loads.DecodeLoads` ``loads``: each claim's deferred loads, once its maker's params were checked
    or its maker ended: failed as loaded twice where the claim stands, started anew where it was dropped."""
    restart = []
    for claim, sts in list(loads._deferred.items()):
        if unchecked(loads._claimants.get(claim)):
            continue
        del loads._deferred[claim]
        if claim in loads.claims:
            for st in sts:
                st.error = TWICE.format(st.load.remote.request_id, claim[0][2])
                loads.ended.append(st)
        else:
            for st in sts:
                del loads.pending[st.key]
            restart.extend(st.load for st in sts)
    if restart:
        loads.start(restart)
