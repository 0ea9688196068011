"""The prefill role of the connector's worker: :class:`PrefillHolds` keeps a finished request's blocks until a
decode instance read them (its done message on the side channel), released them, or the request's lease ran
out. A hold has a key (in the request's ``kv_transfer_params``): a done or release message counts only with the
hold's key, so a peer that never saw the params cannot end a hold while its reader still reads. The key is a
random nonce and the request's MAC under the prefill engine's secret (:func:`make_key`; the scheduler side makes
the secret and hands it to its workers with each step's metadata), so a word that comes before its hold is
checked as it comes: forged words cannot take the room a real one needs. Where several decode ranks read shares
of this rank's heads, each says so (a message's ``of``), and the blocks go once every one of them did.

A hold has one reader: :class:`ClaimBook` grants a request to the first decode instance that claims it (the
claim's token, one per request and decode instance, shared by its ranks) and refuses every other, and a done or
release counts only with the granted token (a release also where no claim came: that release is then the
request's owner, and later claims are refused), so genuine params handed to two decode instances never let one
free the blocks under the other's read. No vLLM import."""
from __future__ import annotations

import collections
import heapq
import hmac
import logging
import secrets
import threading
import time
from typing import Mapping

log = logging.getLogger("gpuxfer.vllm")

#: the most requests with words that came before their hold that a prefill worker remembers (the newest are kept)
MAX_RELEASED = 1 << 16
#: the most kinds of word (op, readers named, key, token) kept for a request before its hold
EARLY_KINDS = 4
#: the most requests whose hold ended that a claim book remembers past their lease (a claim on one is refused)
MAX_ENDED = 1 << 20
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


class ClaimBook:
    """Who reads each request of this prefill worker: ``owners`` (request -> the token of the claim granted, or of
    the release that counted with no claim before it; None: a release without a token), and the requests whose hold
    ended (``ended``: read, released or expired; a claim on one is refused). :meth:`claim` is called by whichever
    thread pumps the side channel, :meth:`word` and :meth:`end` by the engine thread: every decision is made under
    one lock, so a claim and a word that race are decided in one order. ``secret``: the engine's key secret (None
    before the first step's metadata: claims then wait); ``lease_s``: how long an ended request is remembered at
    least (a claim after its lease fails the read's own lease check), up to :data:`MAX_ENDED`."""

    def __init__(self, lease_s: float = 120.0):
        self.lease_s = lease_s
        self.secret: bytes | None = None
        self.owners: dict[str, tuple[str | None, float]] = {}
        self.ended: "collections.OrderedDict[str, float]" = collections.OrderedDict()
        self.granted = self.refused = 0         # claims answered, since :meth:`take_counts`
        self._lock = threading.Lock()

    def claim(self, req: str, key, token: str) -> bool | None:
        """Grant ``req`` to ``token`` (True) when it has no owner yet or is this token's and its hold did not end;
        refuse it (False) otherwise, or when ``key`` is not a key of this engine for ``req``; None while the secret
        is not known (the side channel asks again later)."""
        secret = self.secret
        if secret is None:
            return None
        ok = mine = authentic(secret, req, key)
        with self._lock:
            if ok and req in self.ended:
                ok = False
            elif ok:
                got = self.owners.get(req)
                if got is None:
                    self.owners[req] = (token, time.monotonic())
                else:
                    ok = got[0] is not None and hmac.compare_digest(got[0].encode(), token.encode())
            if ok:
                self.granted += 1
            else:
                self.refused += 1
        if not ok:      # (at info only for genuine params: anyone reaching the side channel can send claims)
            log.log(logging.INFO if mine else logging.DEBUG, "gpuxfer: a claim on request %s refused (%s)", req,
                    "another decode instance claimed or released it, or its hold ended" if mine else
                    "not a key of this engine")
        return ok

    def word(self, op: str, req: str, token: str | None) -> bool:
        """Whether a done or release (with its hold's key) of a held request counts: one with the owner's token; a
        release where the request has no owner yet, which makes ``token`` its owner."""
        with self._lock:
            got = self.owners.get(req)
            if got is None:
                if op != "release":
                    return False
                self.owners[req] = (token, time.monotonic())
                return True
        return token is not None and got[0] is not None and hmac.compare_digest(got[0].encode(), token.encode())

    def end(self, reqs, now: float) -> None:
        """These requests' holds ended: later claims on them are refused."""
        with self._lock:
            ended = self.ended
            for req in reqs:
                self.owners.pop(req, None)
                ended[req] = now
                ended.move_to_end(req)
            cutoff = now - self.lease_s - 1.0
            while ended and (len(ended) > MAX_ENDED or next(iter(ended.values())) < cutoff
                             and len(ended) > MAX_RELEASED):
                ended.popitem(last=False)

    def prune(self, held, now: float) -> None:
        """Forget the owners of requests not held whose claim is older than twice the lease (a hold that never came
        here)."""
        with self._lock:
            cutoff = now - 2 * self.lease_s
            self.owners = {r: o for r, o in self.owners.items() if r in held or o[1] >= cutoff}

    def take_counts(self) -> tuple[int, int]:
        """Claims granted and refused since the last call."""
        with self._lock:
            out = self.granted, self.refused
            self.granted = self.refused = 0
        return out


class PrefillHolds:
    """Requests held for decode instances: ``held`` (request -> lease deadline) and their keys, a heap of the
    deadlines, the words of decode ranks that came before their request's hold (``early``: request -> [[when
    first, readers, key, words]], looked at when the hold comes), the held requests let go of, and the held
    requests some but not all of their readers let go of (``heard``: request -> (messages, readers)).
    ``stats``: the worker's counters, updated in place. ``secret``: the engine's key secret, once the scheduler
    side's metadata brought it (None before: early words are then kept unchecked, as many kinds as fit);
    ``claims``: the worker's :class:`ClaimBook`, which says which words count."""

    def __init__(self, *, engine_id: str, lease_s: float, stats: dict):
        self.engine_id, self.lease_s, self.stats = engine_id, lease_s, stats
        self.held: dict[str, float] = {}
        self.keys: dict[str, str | None] = {}
        self.expiry: list[tuple[float, str]] = []
        self.early: dict[str, list[list]] = {}
        self.heard: dict[str, tuple[int, int]] = {}
        self._prune_at = 1024                       # the size of ``early`` that prunes it
        self._prune_owners_at = 4096                # the size of the claim book's owners that prunes them
        self.let_go: list[str] = []
        self.claims = ClaimBook(lease_s)

    @property
    def secret(self) -> bytes | None:
        return self.claims.secret

    @secret.setter
    def secret(self, value: bytes | None) -> None:
        self.claims.secret = value

    def hold(self, holds: Mapping[str, tuple[float, str | None]]) -> None:
        """Hold these requests' blocks until their lease deadlines (``{request: (deadline, key)}``; a key of None
        takes any message)."""
        for req, (deadline, key) in holds.items():
            self.held[req] = deadline
            self.keys[req] = key
            heapq.heappush(self.expiry, (deadline, req))
            for _, of, got, n, op, token in self.early.pop(req, ()):       # words that came before the hold
                for _ in range(n):
                    self._heard(op, req, of, got, token)

    def _heard(self, op: str, req: str, of: int, key: str | None, token: str | None = None) -> None:
        """A held request's word from a decode rank: counted when it carries the hold's key and the token of the
        request's claim (:meth:`ClaimBook.word`), and let go of once its readers all spoke. (A hold with no key
        takes any word.)"""
        want = self.keys.get(req)
        if want is not None and not _same_key(key, want):
            self.stats["forged"] += 1
            log.warning("gpuxfer: engine %s: a %s message for request %s without its key (not from a reader of "
                        "its kv_transfer_params); ignored", self.engine_id, op, req)
            return
        if want is not None and not self.claims.word(op, req, token):
            self.stats["forged"] += 1
            log.warning("gpuxfer: engine %s: a %s message for request %s from a decode instance that did not claim "
                        "it (its params went to another decode instance too); ignored", self.engine_id, op, req)
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
        self.let_go.append(req)

    def drain(self, server, now: float) -> None:
        """What the decode instances said on the side channel (``server``): requests read or released. While
        requests are held, the engine thread serves the channel itself, once a step, so a done message ends its
        hold at the step it arrives by; while none are, the server's thread serves it and this only takes what
        that thread queued (no socket call on the engine thread)."""
        if self.held:
            server.pump()
        if len(self.claims.owners) > self._prune_owners_at:
            self.claims.prune(self.held, now)
            self._prune_owners_at = max(4096, 2 * len(self.claims.owners))
        events = server.events
        if events.empty():                      # (the usual: no word; only the words below add to ``early``)
            return
        while not events.empty():               # (this thread is the only one taking events)
            op, req, of, key, token = events.get_nowait()
            if req in self.held:
                self._heard(op, req, of, key, token)
            elif self.secret is not None and not authentic(self.secret, req, key):
                self.stats["forged"] += 1
                log.debug("gpuxfer: engine %s: a %s message for request %s, not held, without a key of this "
                          "engine's; ignored", self.engine_id, op, req)
            else:
                # words alike (readers and key) are counted in one entry, at most EARLY_KINDS entries a request:
                # a peer naming many readers cannot have each of its words kept
                words = self.early.setdefault(req, [])
                for w in words:
                    if w[1] == of and w[2] == key and w[4] == op and w[5] == token:
                        if w[3] < 2 * of:       # (a reader's word each; more are noise)
                            w[3] += 1
                        break
                else:
                    if len(words) < EARLY_KINDS:
                        words.append([now, of, key, 1, op, token])
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
        if self.let_go:
            for req in self.let_go:
                if self.held.pop(req, None) is not None:
                    self.keys.pop(req, None)
                    self.heard.pop(req, None)
                    done.add(req)
                    self.stats["sends_done"] += 1
            self.let_go = []
        heap = self.expiry
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
        if done:
            self.claims.end(done, time.monotonic())
        return done
