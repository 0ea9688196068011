"""The clock a prefill instance's leases are kept on, and how a decode instance on another host reads a lease
deadline on its own clock. No vLLM import.

A prefill instance hands out ``lease_deadline`` on its host's lease clock (:func:`now`:
``CLOCK_MONOTONIC_RAW``, which NTP does not slew) and frees the blocks at a step after it. A decode instance
on the same host (the IPC route) compares that deadline with its own clock as it is. One on another host (the
NIXL route) cannot: the two clocks share no origin. Its handshake bounds the offset instead::

    decode (its clock)                       prefill (its clock)
    sent = now(), connect, hello  ------->
                                             hello read; p = now(); answer: description, metadata, p
    <-------------------------------------   (p was read after the hello left: at decode time >= sent)

So the prefill's instant ``p`` happened at decode time ``sent`` or later, and its deadline ``D`` at decode
time ``sent + (D - p)`` or later, less what the two clocks' rates can differ over ``D - p``
(:data:`RATE_BOUND`) and a fixed :data:`MARGIN`. :meth:`PeerClock.deadline` gives that instant: a read seen
complete before it completed before the prefill could free the blocks. The price is the hello's round trip,
how long the prefill took to answer and the margins (about a second of a lease of minutes). What no bound
covers: a host whose clock stops while the other's runs (a suspended VM).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ... import config

#: how much two hosts' raw monotonic clocks may differ in rate (1000 ppm: a crystal is within ~100 ppm)
RATE_BOUND = 1e-3
#: seconds taken off every deadline read across hosts besides the rate bound
MARGIN = 0.25

_SHIFT = float(config.get("GPUXFER_VLLM_TEST_CLOCK_SHIFT_S"))
#: :func:`now` is ``time.clock_gettime(RAW) + SHIFT`` (the engine thread's hot path reads it so: one C call)
RAW, SHIFT = time.CLOCK_MONOTONIC_RAW, _SHIFT


def now() -> float:
    """This host's lease clock: ``CLOCK_MONOTONIC_RAW`` (the same for every process of a host; NTP changes neither
    its value nor its rate), plus the test hook ``GPUXFER_VLLM_TEST_CLOCK_SHIFT_S``, which stands in for another
    host's clock."""
    return time.clock_gettime(time.CLOCK_MONOTONIC_RAW) + _SHIFT


@dataclass(frozen=True)
class PeerClock:
    """A prefill engine's lease clock as this instance reads it. ``sent``: this clock when the hello left;
    ``peer``: the prefill's clock when it answered; ``same``: one host (deadlines compare as they are)."""

    sent: float = 0.0
    peer: float = 0.0
    same: bool = True

    def deadline(self, peer_deadline: float) -> float:
        """The earliest instant of this clock at which the prefill's clock can read ``peer_deadline`` (NaN where
        the two make no finite number: callers compare with ``not now < deadline``, so that has run out)."""
        if self.same:
            return peer_deadline
        ahead = peer_deadline - self.peer
        return self.sent + ahead - RATE_BOUND * abs(ahead) - MARGIN


SAME_HOST = PeerClock()
