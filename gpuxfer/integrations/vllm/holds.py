"""The prefill role of the connector's worker: :class:`PrefillHolds` keeps a finished request's blocks until a
decode instance read them (its done message on the side channel), released them, or the request's lease ran
out. Where several decode ranks read shares of this rank's heads, each says so (a message's ``of``), and the
blocks go once every one of them did. No vLLM import."""
from __future__ import annotations

import heapq
import logging
from typing import Mapping

log = logging.getLogger("gpuxfer.vllm")

#: the most requests let go of before their hold came that a prefill worker remembers (the newest are kept)
MAX_RELEASED = 1 << 16


class PrefillHolds:
    """Requests held for decode instances: ``held`` (request -> lease deadline), a heap of the deadlines, the
    requests a decode instance let go of before their hold came (``released``: request -> when), the held
    ones it let go of, and the requests some but not all of their readers let go of (``heard``: request ->
    (when first, messages, readers)). ``stats``: the worker's counters, updated in place."""

    def __init__(self, *, engine_id: str, lease_s: float, stats: dict):
        self.engine_id, self.lease_s, self.stats = engine_id, lease_s, stats
        self.held: dict[str, float] = {}
        self._expiry: list[tuple[float, str]] = []
        self.released: dict[str, float] = {}
        self.heard: dict[str, tuple[float, int, int]] = {}
        self._prune_at = 1024                       # the size of ``released`` and ``heard`` that prunes them
        self._let_go: list[str] = []

    def hold(self, holds: Mapping[str, float]) -> None:
        """Hold these requests' blocks until their lease deadlines (``{request: deadline}``)."""
        for req, deadline in holds.items():
            self.held[req] = deadline
            heapq.heappush(self._expiry, (deadline, req))
            if self.released.pop(req, None) is not None:      # let go of before its hold came
                self._let_go.append(req)

    def drain(self, server, now: float) -> None:
        """What the decode instances said on the side channel (``server``): requests read or released. While
        requests are held, the engine thread serves the channel itself, once a step, so a done message ends its
        hold at the step it arrives by; while none are, the server's thread serves it and this only takes what
        that thread queued (no socket call on the engine thread)."""
        if self.held:
            server.pump()
        events = server.events
        while not events.empty():               # (this thread is the only one taking events)
            op, req, of = events.get_nowait()
            if op == "release":
                log.info("gpuxfer: engine %s: decode side released request %s without reading it", self.engine_id, req)
            if of > 1 or req in self.heard:
                t, n, most = self.heard.get(req, (now, 0, 1))
                n, most = n + 1, max(most, of)          # (never sooner than the most readers a message named)
                if n < most:
                    self.heard[req] = (t, n, most)
                    continue
                del self.heard[req]
            if req in self.held:
                self._let_go.append(req)
            else:
                self.released[req] = now
        if len(self.released) + len(self.heard) > self._prune_at:       # requests held nowhere, or not yet
            cutoff = now - 2 * self.lease_s
            kept = [(r, t) for r, t in self.released.items() if t >= cutoff]
            self.released = dict(kept[-(MAX_RELEASED // 2):])
            heard = [(r, v) for r, v in self.heard.items() if v[0] >= cutoff or r in self.held]
            self.heard = dict(heard[-(MAX_RELEASED // 2):])
            # the next prune once as many more came (each message pruned O(1) times), never past MAX_RELEASED
            self._prune_at = min(MAX_RELEASED, max(4 * len(self.held) + 1024,
                                                   2 * (len(self.released) + len(self.heard))))

    def finished(self, now: float) -> set[str]:
        """Held requests the decode side let go of, then those whose lease ran out: O(1) when neither (the
        expiries are a heap by deadline; an entry of a request no longer held, or held again, is skipped)."""
        done = set()
        if self._let_go:
            for req in self._let_go:
                if self.held.pop(req, None) is not None:
                    done.add(req)
                    self.stats["sends_done"] += 1
            self._let_go = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            deadline, req = heapq.heappop(heap)
            if self.held.get(req) != deadline:
                continue
            del self.held[req]
            self.heard.pop(req, None)
            done.add(req)
            self.stats["leases_expired"] += 1
            log.warning("gpuxfer: engine %s: request %s's lease ran out (%.0f s) before a decode instance read "
                        "its blocks; freeing them", self.engine_id, req, self.lease_s)
        return done
