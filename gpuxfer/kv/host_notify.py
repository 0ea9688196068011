"""A KV agent's notification words mirrored in host memory: an agent made with ``host_notify=True`` keeps a copy of
its ``NOTIFY_SLOTS`` notification words in a shared-memory segment (:class:`~gpuxfer.hostwords.HostWords`, named
in its metadata), and a peer in another process of the same host maps it at ``add_peer``: each notification it
sends writes the word, then the same value into the segment, on the same stream. The receiving host then learns a
notification with a plain load (:meth:`KVAgent.host_notification <gpuxfer.kv.agent.KVAgent.host_notification>`),
no device read and nothing queued on its GPU::

    initiator I (a peer of R)                              receiver R (owns the segment)
    -------------------------                              -----------------------------
    stream s: the post's copies into R's blocks
    stream s: R's device word NOTIFY + k := n  (flag link)
    stream s: R's host word k := n             (segment)   --> host_notification(k) >= n (a load):
                                                               the post's bytes are in R's blocks

A host word is written after the device word and the data, in stream order, so a value read there was reached by
the device word too and the data of the first n notifying posts landed. The device word stays the authority: a
peer that cannot map the segment (another host, the NIXL route -- whose poller here writes both --, a gpuxfer
without it, a platform whose streams cannot reach host memory) writes the device word alone, and the host word
lags it; a reader polling the host words reads the device word now and then too.

The segment names the agent that made it (a digest of its uid, in a line after the words): a peer maps it only for
metadata of that agent, so metadata naming another agent's words -- whose host copy its notifications would move
past that agent's device word -- is ``BadMetadata``.
"""
from __future__ import annotations

import hashlib
import logging
import re

from ..errors import BadInput, BadMetadata, GpuxferError
from ..hostwords import KV_PREFIX, WORD_STRIDE, HostWords
from .control import NOTIFY_SLOTS

log = logging.getLogger("gpuxfer.kv.agent")

_NAME = re.compile("/" + KV_PREFIX + r"[0-9a-f]{1,8}-[0-9a-f]{12}")
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


def check_name(name) -> str | None:
    """A metadata's host words name: None, or a name :func:`create` gives (``BadMetadata`` otherwise: a peer's
    metadata never names another file)."""
    if name is None:
        return None
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadMetadata(f"metadata host_words: not a name of notification words: {name!r:.80}")
    return name


def open_peer(platform, device: int, name: str, peer: str, uid: str) -> HostWords | None:
    """Peer ``peer``'s (uid ``uid``) host words mapped for this agent's device, or None where they cannot be
    (another host, the segment gone or of another size, the platform's streams cannot reach host memory; logged):
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
