"""A KV agent's notification words mirrored in host memory: an agent made with ``host_notify=True`` keeps a copy of
its ``NOTIFY_SLOTS`` notification words in shared host memory (:class:`~gpuxfer.hostwords.HostWords`: a memory
file sealed at its size, else a shared-memory segment; referred to in its metadata), and a peer in another process
of the same host maps it at ``add_peer``: each notification it sends writes the word, then the same value into the
segment, on the same stream. The receiving host then learns a notification with a plain load
(:meth:`KVAgent.host_notification <gpuxfer.kv.agent.KVAgent.host_notification>`), no device read and nothing queued
on its GPU::

    initiator I (a peer of R)                              receiver R (owns the segment)
    -------------------------                              -----------------------------
    stream s: the post's copies into R's blocks
    stream s: R's device word NOTIFY + k := n  (flag link)
    stream s: R's host word k := n             (segment)   --> host_notification(k) >= n (a load):
                                                               the post's bytes are in R's blocks

A host word is written after the device word and the data, in stream order, so a value read there was reached by
the device word too and the data of the first n notifying posts landed. The device word stays the authority: a
peer that cannot map the segment (another host or PID namespace, the NIXL route -- whose poller here writes
both --, a gpuxfer without it, a platform whose streams cannot reach host memory) writes the device word alone, and
the host word lags it; a reader polling the host words reads the device word now and then too.

The segment names the agent that made it (a digest of its uid, in a line after the words): a peer maps it only for
metadata of that agent, so metadata naming another agent's words -- whose host copy its notifications would move
past that agent's device word -- is ``BadMetadata``.
"""
from __future__ import annotations

import hashlib
import logging

from ..errors import BadInput, BadMetadata, GpuxferError
from ..hostwords import KV_PREFIX, WORD_STRIDE, HostWords, is_ref
from .control import NOTIFY_SLOTS

log = logging.getLogger("gpuxfer.kv.agent")

_WORDS = NOTIFY_SLOTS + 1                   # the words, then a line holding the owner's mark
_OWNER = NOTIFY_SLOTS * WORD_STRIDE


def _mark(uid: str) -> tuple[int, int]:
    """The two int64 words that name agent ``uid`` in its segment (a digest: any string a metadata holds)."""
    d = hashlib.blake2b(uid.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return int.from_bytes(d[:8], "little", signed=True), int.from_bytes(d[8:], "little", signed=True)


def create(platform, device: int, agent: str, uid: str) -> HostWords | None:
    """Agent ``agent``'s (uid ``uid``) host words, marked as its own, or None where they cannot be made (logged):
    its notifications are then on the device alone."""
    try:
        words = HostWords.create(platform, device, _WORDS, KV_PREFIX)
    except (GpuxferError, OSError) as exc:
        log.info("agent %s: its notification words stay on the device alone (no host copy: %s)", agent, exc)
        return None
    a = words.loads()
    a[_OWNER], a[_OWNER + 1] = _mark(uid)
    return words


def metadata_entry(words: HostWords) -> dict:
    """The metadata entry that refers to ``words``: ``host_memfd`` for a sealed memory file (a key that an agent
    that does not know it ignores: its notifications then stay on the device words), ``host_words`` for a
    segment's name."""
    return {"host_memfd" if words.sealed else "host_words": words.ref}


def check_ref(name, memfd) -> str | None:
    """A metadata's reference to its host words (``name``: its ``host_words``, ``memfd``: its ``host_memfd``):
    None, or one :func:`create` gives under that key (``BadMetadata`` otherwise, and for both keys at once: a peer's
    metadata never names another file)."""
    if name is not None and memfd is not None:
        raise BadMetadata("metadata names both host_words and host_memfd")
    key, ref = ("host_words", name) if memfd is None else ("host_memfd", memfd)
    if ref is None:
        return None
    if not is_ref(ref, KV_PREFIX) or ref.startswith("memfd:") != (key == "host_memfd"):
        raise BadMetadata(f"metadata {key}: not a reference of notification words: {ref!r:.80}")
    return ref


def open_peer(platform, device: int, name: str, peer: str, uid: str) -> HostWords | None:
    """Peer ``peer``'s (uid ``uid``) host words (``name``: their reference) mapped for this agent's device, or None
    where they cannot be (another host or PID namespace, the words gone or of another size, a reference to a file
    that is not such words, the platform's streams cannot reach host memory; logged):
    its notifications then go to its device words alone. ``BadMetadata`` where the segment is another agent's."""
    try:
        words = HostWords.open(platform, device, name, _WORDS, KV_PREFIX)
    except (GpuxferError, BadInput, OSError) as exc:
        log.info("peer %s: its host notification words are not mapped (%s); notifications go to its device words "
                 "alone", peer, exc)
        return None
    a = words.loads()
    if (a[_OWNER], a[_OWNER + 1]) != _mark(uid):
        words.close()
        raise BadMetadata(f"peer {peer!r}: metadata host_words {name!r:.80} names another agent's notification words")
    return words
