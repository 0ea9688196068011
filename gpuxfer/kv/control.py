"""The flag words every :class:`~gpuxfer.kv.agent.KVAgent` allocates and exports (one
:class:`~gpuxfer.flaglink.FlagWords`, shared by the agent's per-peer :class:`~gpuxfer.flaglink.FlagLink`):
after the link's probe words, the notification slots, then the ``pack`` engine's hand-off words (two
sets, by parity); and the number of slots of a ``pack`` agent's staging. Both agents of a pair index the
same words: this layout is part of what they agree on, like the metadata version."""
from __future__ import annotations

from ..errors import BadInput
from ..flaglink import FIRST_WORD, FLAG_STRIDE

NOTIFY_SLOTS = 64                           # notification words per agent
NOTIFY = FIRST_WORD                         # word of notification slot k: NOTIFY + k


def check_slot(slot, what: str = "notification slot") -> int:
    """``slot`` when it names a notification slot (an int in ``0 .. NOTIFY_SLOTS - 1``), else :class:`BadInput`."""
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < NOTIFY_SLOTS:
        raise BadInput(f"{what} must be an int in 0..{NOTIFY_SLOTS - 1}, got {slot!r}")
    return slot


# the pack engine's words, two of each (a transfer of parity p uses word + p; see _PackTransfer):
AVAIL = NOTIFY + NOTIFY_SLOTS               # chunks of the transfer the peer's source copied into our staging
FREE = AVAIL + 2                            # chunks of our source's transfer the peer's destination unpacked
GO = AVAIL + 4                              # the peer's destination posted the transfer (1), or reset it (0)
PACKED = AVAIL + 6                          # chunks of our source's transfer packed (its lane copies them)
COPIED = AVAIL + 8                          # chunks of our source's transfer its lane copied out of our staging
PACK_WORDS = tuple(range(AVAIL, AVAIL + 10))
#: a pack agent's refusal (its own, never signalled): entry 0 the fingerprint of the first request refused
#: (0: none), entry 1 what was seen instead (the peer's fingerprint, or the peer's refusal); sticky
STATUS = AVAIL + 10
#: the agent's words after the probe's
AGENT_WORDS = NOTIFY_SLOTS + len(PACK_WORDS) + 1
#: a pack signal of at least this value means the transfer is refused (REFUSED: the two sides' requests
#: differ) or released (an agent failed: :data:`~gpuxfer.platforms.base.RELEASE_VALUE`, above it); it passes
#: every wait of the protocol, and a fingerprint is always below it
REFUSED = 1 << 61
#: the bytes of an agent's flag words (what its metadata's ``control`` handle must hold)
AGENT_FLAG_BYTES = (FIRST_WORD + AGENT_WORDS) * FLAG_STRIDE
#: the pack engine's staging: this many slots (of the agent's ``slot_bytes`` each)
PACK_SLOTS = 2
