"""The prefill role of the connector's worker: :class:`PrefillHolds` keeps a finished request's blocks until a
decode instance read them (its done message on the side channel), released them, or the request's lease ran
out. A hold has a key (in the request's ``kv_transfer_params``): a done or release message counts only with the
hold's key, so a peer that never saw the params cannot end a hold while its reader still reads. The key is a
random nonce and the request's MAC under the prefill engine's secret (:func:`make_key`; the scheduler side makes
the secret and hands it to its workers with each step's metadata), so a word that comes before its hold is
checked as it comes: forged words cannot take the room a real one needs. Where several decode ranks read shares
of this rank's heads, each says so (a message's ``of``), and the blocks go once every one of them did. No vLLM
import."""
from __future__ import annotations

import heapq
import hmac
import logging
import secrets
from typing import Mapping

log = logging.getLogger("gpuxfer.vllm")

#: the most requests with words that came before their hold that a prefill worker remembers (the newest are kept)
MAX_RELEASED = 1 << 16
#: the most kinds of word (readers named, key) kept for a request before its hold
EARLY_KINDS = 4
_NONCE = 8                  # hex digits of a key's nonce; its MAC takes the next 16


def make_key(secret: bytes, request: str) -> str:
    """A hold's key for ``request``: a fresh nonce, then the request's and the nonce's MAC under ``secret``."""
    nonce = secrets.token_hex(_NONCE // 2)
    return nonce + _mac(secret, request, nonce)


def _mac(secret: bytes, request: str, nonce: str) -> str:
    # (a request ID off the side channel is any JSON string, lone surrogates included: they pass as bytes)
    return hmac.new(secret, f"{request}\0{nonce}".encode("utf-8", "surrogatepass"), "sha256").hexdigest()[:16]


def authentic(secret: bytes, request: str, key) -> bool:
    """``key`` was made by :func:`make_key` for ``request`` under ``secret``."""
    return (isinstance(key, str) and len(key) == _NONCE + 16 and key.isascii()
            and hmac.compare_digest(key[_NONCE:], _mac(secret, request, key[:_NONCE])))


def _same_key(key, want: str) -> bool:
    """Whether ``key`` (a peer's: any string, or None) is the hold's key ``want``, compared in constant time (a
    comparison that stops at the first character that differs would let a peer learn the key a character at a time)."""
    return isinstance(key, str) and hmac.compare_digest(key.encode("utf-8", "surrogatepass"), want.encode())


class PrefillHolds:
    """Requests held for decode instances: ``held`` (request -> lease deadline) and their keys, a heap of the
    deadlines, the words of decode ranks that came before their request's hold (``early``: request -> [[when
    first, readers, key, words]], looked at when the hold comes), the held requests let go of, and the held
    requests some but not all of their readers let go of (``heard``: request -> (messages, readers)).
    ``stats``: the worker's counters, updated in place. ``secret``: the engine's key secret, once the scheduler
    side's metadata brought it (None before: early words are then kept unchecked, as many kinds as fit)."""

    def __init__(self, *, engine_id: str, lease_s: float, stats: dict):
        self.engine_id, self.lease_s, self.stats = engine_id, lease_s, stats
        self.held: dict[str, float] = {}
        self.keys: dict[str, str | None] = {}
        self._expiry: list[tuple[float, str]] = []
        self.early: dict[str, list[list]] = {}
        self.heard: dict[str, tuple[int, int]] = {}
        self._prune_at = 1024                       # the size of ``early`` that prunes it
        self._let_go: list[str] = []
        self.secret: bytes | None = None

    def hold(self, holds: Mapping[str, tuple[float, str | None]]) -> None:
        """Hold these requests' blocks until their lease deadlines (``{request: (deadline, key)}``; a key of None
        takes any message)."""
        for req, (deadline, key) in holds.items():
            self.held[req] = deadline
            self.keys[req] = key
            heapq.heappush(self._expiry, (deadline, req))
            for _, of, got, n in self.early.pop(req, ()):       # words that came before the hold
                for _ in range(n):
                    self._heard("done", req, of, got)

    def _heard(self, op: str, req: str, of: int, key: str | None) -> None:
        """A held request's word from a decode rank: counted when it carries the hold's key, and let go of once
        its readers all spoke."""
        want = self.keys.get(req)
        if want is not None and not _same_key(key, want):
            self.stats["forged"] += 1
            log.warning("gpuxfer: engine %s: a %s message for request %s without its key (not from a reader of "
                        "its kv_transfer_params); ignored", self.engine_id, op, req)
            return
        if op == "release":         # (logged once it counts: anyone reaching the side channel can send releases)
            log.info("gpuxfer: engine %s: decode side released request %s without reading it", self.engine_id, req)
        if of > 1 or req in self.heard:
            n, most = self.heard.get(req, (0, 1))
            n, most = n + 1, max(most, of)          # (never sooner than the most readers a message named)
            if n < most:
                self.heard[req] = (n, most)
                return
            del self.heard[req]
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
            op, req, of, key = events.get_nowait()
            if req in self.held:
                self._heard(op, req, of, key)
            elif self.secret is not None and not authentic(self.secret, req, key):
                self.stats["forged"] += 1
                log.debug("gpuxfer: engine %s: a %s message for request %s, not held, without a key of this "
                          "engine's; ignored", self.engine_id, op, req)
            else:
                # words alike (readers and key) are counted in one entry, at most EARLY_KINDS entries a request:
                # a peer naming many readers cannot have each of its words kept
                words = self.early.setdefault(req, [])
                for w in words:
                    if w[1] == of and w[2] == key:
                        if w[3] < 2 * of:       # (a reader's word each; more are noise)
                            w[3] += 1
                        break
                else:
                    if len(words) < EARLY_KINDS:
                        words.append([now, of, key, 1])
        if len(self.early) > self._prune_at:        # words of requests held nowhere
            cutoff = now - 2 * self.lease_s
            kept = [(r, w) for r, w in self.early.items() if w[0][0] >= cutoff]
            self.early = dict(kept[-(MAX_RELEASED // 2):])
            # the next prune once as many more came (each word pruned O(1) times), never past MAX_RELEASED
            self._prune_at = min(MAX_RELEASED, max(4 * len(self.held) + 1024, 2 * len(self.early)))

    def finished(self, now: float) -> set[str]:
        """Held requests the decode side let go of, then those whose lease ran out: O(1) when neither (the
        expiries are a heap by deadline; an entry of a request no longer held, or held again, is skipped)."""
        done = set()
        if self._let_go:
            for req in self._let_go:
                if self.held.pop(req, None) is not None:
                    self.keys.pop(req, None)
                    self.heard.pop(req, None)
                    done.add(req)
                    self.stats["sends_done"] += 1
            self._let_go = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            deadline, req = heapq.heappop(heap)
            if self.held.get(req) != deadline:
                continue
            del self.held[req]
            self.keys.pop(req, None)
            self.heard.pop(req, None)
            done.add(req)
            self.stats["leases_expired"] += 1
            log.warning("gpuxfer: engine %s: request %s's lease ran out (%.0f s) before a decode instance read "
                        "its blocks; freeing them", self.engine_id, req, self.lease_s)
        return done
