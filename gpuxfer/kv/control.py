"""The control words every :class:`~gpuxfer.kv.agent.KVAgent` allocates and exports (8 bytes each):
the notification slots, the ``pack`` engine's hand-off words (two sets, by parity) and the probe
word; and the number of slots of a ``pack`` agent's staging. Both agents of a pair index the
same words: this layout is part of what they agree on, like the metadata version."""
from __future__ import annotations

NOTIFY_SLOTS = 64                           # notification words per agent
# the pack engine's words, two of each (a transfer of parity p uses word + p; see _PackTransfer):
_AVAIL = NOTIFY_SLOTS                       # chunks of the transfer the peer's source copied into our staging
_FREE = NOTIFY_SLOTS + 2                    # chunks of our source's transfer the peer's destination unpacked
_GO = NOTIFY_SLOTS + 4                      # the peer's destination posted the transfer (1), or reset it (0)
_PACKED = NOTIFY_SLOTS + 6                  # chunks of our source's transfer packed (its lane copies them)
_COPIED = NOTIFY_SLOTS + 8                  # chunks of our source's transfer its lane copied out of our staging
_PACK_WORDS = tuple(range(NOTIFY_SLOTS, NOTIFY_SLOTS + 10))
_PROBE = NOTIFY_SLOTS + 15                  # where a pack agent's probe of remote stream writes lands (the peer's)
_CTRL_WORDS = NOTIFY_SLOTS + 16
_CTRL_BYTES = _CTRL_WORDS * 8
#: the pack engine's staging: this many slots (of the agent's ``slot_bytes`` each)
PACK_SLOTS = 2
