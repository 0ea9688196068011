"""The connector's ``kv_transfer_params`` (what a prefill instance hands out with a finished request and a
decode instance receives with the new one), checked as hostile input, and the pairing of a request's
block IDs on the two instances. No vLLM import.

A prefill instance's ``request_finished`` returns::

    {"do_remote_prefill": True, "do_remote_decode": False, "gpuxfer": 1,
     "remote_engine_id": str, "remote_host": str, "remote_port": int, "remote_request_id": str,
     "remote_block_ids": [[int, ...], ...],      # per KV-cache group; 0 is vLLM's null block (skipped)
     "remote_block_sizes": [int, ...],           # tokens per block, per group
     "lease_deadline": float,                     # the prefill host's lease clock when the blocks go (lease.py)
     "tp_size": int,                              # the prefill instance's tensor parallel size N
     "remote_endpoints": [[host, port], ...],     # with N > 1: where each rank's side channel listens
     "remote_key": str,                           # the hold's key: a done or release message carries it
     "remote_prompt": str,                        # hex SHA-256 of the request's prompt tokens (prompt_digest)
     "remote_seal": str}                          # hex MAC of all the above under the engine's seal key

``remote_host`` / ``remote_port`` are rank 0's (``remote_endpoints[0]``). Decode worker rank i reads its KV shard
from prefill rank i, or, where the decode runs k times the prefill's tensor parallel size, from prefill rank
i // k (:func:`source_rank`).

The seal (made by :func:`build_params`) is a MAC under a key derived one way from the prefill engine's hold-key
secret (:func:`seal_key`), over a canonical encoding of what a decode worker acts on (:func:`_canonical`): engine,
request, the digest of each group's block IDs, block sizes, lease deadline, tensor parallel size, endpoints, hold
key and the digest of the request's prompt (:func:`prompt_digest`; a decode's scheduler side loads params only into a
request whose own prompt has that digest). The prefill's workers hand the seal key out in their handshake; a decode worker checks a load's params against
it before it reads (:func:`check_seal`), so params altered or forged by a client or proxy fail that load alone.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import math
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ...errors import BadInput
from ...kv.ids import count_nonzero

PARAMS_VERSION = 1
MAX_ID = (1 << 31) - 1
MAX_IDS = 1 << 22               # block IDs in one request's params, all groups
MAX_TEXT = 512
MAX_TP = 256                    # tensor parallel ranks named in one request's params
MAX_KEY = 64                    # characters of a hold's key
SEAL_BYTES = 32                 # a seal and a seal key: HMAC-SHA256 (hex in the params and the handshake)
_SEAL_LABEL = b"gpuxfer kv_transfer_params seal"
_INT64 = np.dtype(np.int64)     # (a dtype compares with a dtype at once, with a type by making one from it)


class BadTransferParams(BadInput):
    """``kv_transfer_params`` that are malformed, hostile or stale: the request is computed locally instead."""


class BadSeal(BadTransferParams):
    """``kv_transfer_params`` without their prefill engine's seal over what they name (:func:`check_seal`)."""


@dataclass(frozen=True)
class RemotePrefill:
    """Checked ``kv_transfer_params`` of a decode request."""

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[np.ndarray, ...]       # per group, int64
    block_sizes: tuple[int, ...]
    lease_deadline: float
    endpoints: tuple[tuple[str, int], ...] = ()     # per tensor parallel rank; () means ((host, port),)
    key: str | None = None                          # the hold's key (None: the prefill gave none)
    seal: bytes | None = None                       # the params' seal (None: they carry none; :func:`check_seal`)
    ids_digest: bytes | None = None                 # with block_ids left out (:func:`for_release`): their digest
    # this decode instance's claim token for the request (the scheduler side's, one a request: every rank claims alike;
    # not part of the params a prefill made, nor of the seal)
    token: str | None = None
    # the digest of the prompt the prefill made the params for (:func:`prompt_digest`; b"": the params name none)
    prompt: bytes = b""

    @property
    def tp_size(self) -> int:
        return len(self.endpoints) or 1

    @functools.cached_property
    def signed(self) -> bytes:
        """What the seal covers (:func:`_canonical` of these fields), made once for this object: the scheduler side
        makes it as it hands the params to the workers (:func:`for_workers`), so their engine threads only MAC it.
        A copy with other fields (``dataclasses.replace``) is another object and makes its own."""
        eps = self.endpoints or ((self.host, self.port),)
        digest = ids_digest(self.block_ids) if self.ids_digest is None else self.ids_digest
        return _canonical(self.engine_id, self.request_id, digest, self.block_sizes, self.lease_deadline, eps,
                          self.key, self.prompt)

    def endpoint_of(self, rank: int, world: int | None = None) -> tuple[str, int, str]:
        """``(host, port, engine id)`` of the prefill worker that decode worker ``rank`` of ``world`` (default:
        the prefill's size) reads from: :func:`source_rank`; :class:`BadTransferParams` when there is none."""
        r = source_rank(rank, self.tp_size if world is None else world, self.tp_size)
        host, port = self.endpoints[r] if self.endpoints else (self.host, self.port)
        return host, port, self.engine_id

    def endpoints_of(self, rank: int, world: int) -> list[tuple[str, int, str]]:
        """``(host, port, engine id)`` of each prefill worker decode worker ``rank`` of ``world`` reads from
        (:func:`source_ranks`)."""
        eps = self.endpoints or ((self.host, self.port),)
        if len(eps) == world and 0 <= rank < world:        # (sizes alike, the usual case: rank i reads rank i)
            return [(*eps[rank], self.engine_id)]
        return [(*eps[r], self.engine_id) for r in source_ranks(rank, world, len(eps))]


def source_ranks(rank: int, world: int, prefill_world: int) -> list[int]:
    """The prefill tensor parallel ranks decode rank ``rank`` of ``world`` reads from: :func:`source_rank`'s one;
    or, with the prefill's size ``m`` times the decode's, ranks ``rank * m`` to ``rank * m + m - 1`` (each holds
    a part of this rank's heads); :class:`BadTransferParams` where neither size divides the other."""
    if world < prefill_world and 0 <= rank < world and prefill_world % world == 0:
        m = prefill_world // world
        return list(range(rank * m, rank * m + m))
    return [source_rank(rank, world, prefill_world)]


def source_rank(rank: int, world: int, prefill_world: int) -> int:
    """The prefill tensor parallel rank that decode rank ``rank`` of ``world`` reads from: with the decode's
    size ``k`` times the prefill's, prefill rank ``rank // k`` (whose heads ``k`` decode ranks share);
    :class:`BadTransferParams` where the prefill's size does not divide the decode's."""
    if not 0 <= rank < world or world % prefill_world:
        raise BadTransferParams(f"the prefill instance runs tensor parallel size {prefill_world}; it has no rank for "
                                f"decode rank {rank} of {world} to read from (the decode's tensor parallel size must "
                                "be a multiple of the prefill's, or the prefill's of the decode's)")
    return rank // (world // prefill_world)


def _text(params: Mapping, key: str) -> str:
    v = params.get(key)
    if not isinstance(v, str) or not 0 < len(v) <= MAX_TEXT:
        raise BadTransferParams(f"kv_transfer_params[{key!r}] must be a string of 1..{MAX_TEXT} characters, "
                                f"got {_show(v)}")
    return v


def _int(params: Mapping, key: str, low: int, high: int) -> int:
    v = params.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise BadTransferParams(f"kv_transfer_params[{key!r}] must be an integer in [{low}, {high}], got {_show(v)}")
    return v


def _finite(v: int | float) -> bool:
    """Whether ``v`` is a finite float or an integer a float holds (one past that overflows ``isfinite``)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def parse_remote_prefill(params: Any, local_block_sizes: Sequence[int]) -> RemotePrefill:
    """Check a decode request's params against this instance's groups; :class:`BadTransferParams` names
    the first thing wrong. Nothing here trusts a length or a value it has not bounded."""
    if not isinstance(params, Mapping):
        raise BadTransferParams(f"kv_transfer_params must be a mapping, got {type(params).__name__}")
    if params.get("gpuxfer") != PARAMS_VERSION:
        raise BadTransferParams(f"kv_transfer_params were not made by GpuxferConnector version {PARAMS_VERSION} "
                                f"(gpuxfer={_show(params.get('gpuxfer'))})")
    tp = _int(params, "tp_size", 1, MAX_TP) if "tp_size" in params else 1
    engine_id = _text(params, "remote_engine_id")
    host = _text(params, "remote_host")
    port = _int(params, "remote_port", 1, 65535)
    endpoints = _endpoints(params.get("remote_endpoints"), tp)
    if endpoints and endpoints[0] != (host, port):
        raise BadTransferParams(f"kv_transfer_params['remote_endpoints'][0] {_show(list(endpoints[0]))} is not "
                                f"remote_host and remote_port {_show([host, port])}")
    request_id = _text(params, "remote_request_id")
    key = params.get("remote_key")
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= MAX_KEY or not key.isascii()):
        raise BadTransferParams(f"kv_transfer_params['remote_key'] must be an ASCII string of 1..{MAX_KEY} "
                                f"characters, got {_show(key)}")
    seal = _seal(params.get("remote_seal"), "kv_transfer_params['remote_seal']")
    prompt = params.get("remote_prompt")
    prompt = b"" if prompt is None else _seal(prompt, "kv_transfer_params['remote_prompt']")
    deadline = params.get("lease_deadline")
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not _finite(deadline):
        raise BadTransferParams(f"kv_transfer_params['lease_deadline'] must be a finite number, got {_show(deadline)}")
    n_groups = len(local_block_sizes)
    sizes = params.get("remote_block_sizes")
    if not isinstance(sizes, (list, tuple)) or len(sizes) != n_groups:
        raise BadTransferParams(f"kv_transfer_params['remote_block_sizes'] must list {n_groups} block sizes (one "
                                f"per KV-cache group of this instance), got {_show(sizes)}")
    for g, (rs, ls) in enumerate(zip(sizes, local_block_sizes)):
        if isinstance(rs, bool) or not isinstance(rs, int) or not 0 < rs <= 1 << 20:
            raise BadTransferParams(f"remote_block_sizes[{g}] must be a positive integer, got {_show(rs)}")
        if rs % ls and ls % rs:
            raise BadTransferParams(f"group {g}: the prefill instance's {rs}-token blocks and this instance's "
                                    f"{ls}-token blocks do not divide one another")
    ids = params.get("remote_block_ids")
    if not isinstance(ids, (list, tuple)) or len(ids) != n_groups:
        raise BadTransferParams(f"kv_transfer_params['remote_block_ids'] must hold {n_groups} lists of block IDs "
                                f"(one per KV-cache group), got {_show(ids)}")
    total = 0
    arrays = []
    for g, lst in enumerate(ids):
        if not isinstance(lst, (list, tuple)):
            raise BadTransferParams(f"remote_block_ids[{g}] must be a list of block IDs, got {_show(lst)}")
        total += len(lst)
        if total > MAX_IDS:
            raise BadTransferParams(f"remote_block_ids hold more than {MAX_IDS} block IDs")
        # plain ints (what JSON gives) are told apart in one pass over their types; anything else is looked at
        # one by one (an int subclass other than bool is an integer too)
        if set(map(type, lst)) - {int} and any(isinstance(x, bool) or not isinstance(x, int) for x in lst):
            raise BadTransferParams(f"remote_block_ids[{g}] must hold integers only")
        try:
            a = np.fromiter(lst, dtype=np.int64, count=len(lst))
        except OverflowError:
            raise BadTransferParams(f"remote_block_ids[{g}] holds an ID outside [0, {MAX_ID}]") from None
        if a.size and (int(a.min()) < 0 or int(a.max()) > MAX_ID):
            raise BadTransferParams(f"remote_block_ids[{g}] holds an ID outside [0, {MAX_ID}]")
        arrays.append(a)
    return RemotePrefill(engine_id, host, port, request_id, tuple(arrays), tuple(int(s) for s in sizes),
                         float(deadline), endpoints, key, seal, prompt=prompt)


def _endpoints(eps: Any, tp: int) -> tuple[tuple[str, int], ...]:
    """``remote_endpoints`` checked: ``tp`` pairs of a host and a port; () when absent with ``tp`` 1."""
    if eps is None and tp == 1:
        return ()
    if not isinstance(eps, (list, tuple)) or len(eps) != tp:
        raise BadTransferParams(f"kv_transfer_params['remote_endpoints'] must list {tp} [host, port] pairs (one per "
                                f"tensor parallel rank, tp_size={tp}), got {_show(eps)}")
    out = []
    for r, ep in enumerate(eps):
        if not isinstance(ep, (list, tuple)) or len(ep) != 2:
            raise BadTransferParams(f"remote_endpoints[{r}] must be [host, port], got {_show(ep)}")
        h, p = ep
        if not isinstance(h, str) or not 0 < len(h) <= MAX_TEXT:
            raise BadTransferParams(f"remote_endpoints[{r}]'s host must be a string of 1..{MAX_TEXT} characters, "
                                    f"got {_show(h)}")
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 65535:
            raise BadTransferParams(f"remote_endpoints[{r}]'s port must be an integer in [1, 65535], got {_show(p)}")
        out.append((h, p))
    return tuple(out)


def tokens_to_load(num_prompt_tokens: int, num_computed: int, local_block_sizes: Sequence[int],
                   remote: RemotePrefill) -> int:
    """How many tokens past ``num_computed`` the decode side loads: every prompt token but the last
    (vLLM recomputes it), 0 when nothing is left or the local prefix hit does not fall on a block
    boundary of both instances. Raises :class:`BadTransferParams` when the params list too few blocks."""
    end = num_prompt_tokens - 1
    if end <= num_computed:
        return 0
    for g, (ls, rs) in enumerate(zip(local_block_sizes, remote.block_sizes)):
        if num_computed % rs or num_computed % ls:
            return 0
        need = -(-end // rs)
        if remote.block_ids[g].size < need:
            raise BadTransferParams(f"remote_block_ids[{g}] lists {remote.block_ids[g].size} blocks; the prompt's "
                                    f"{end} tokens need {need} blocks of {rs} tokens")
    return end - num_computed


def pair_group(local: np.ndarray, remote: np.ndarray, ls: int, rs: int, start: int, end: int,
               lk: int, rk: int) -> tuple[np.ndarray, np.ndarray]:
    """Kernel-block IDs that move tokens ``[start, end)`` of one group: ``(local, remote)``.

    ``local`` / ``remote``: the request's manager-block IDs on each side (0 is vLLM's null block, a
    position outside a sliding window); ``ls`` / ``rs`` their tokens per block; ``lk`` / ``rk`` the
    tokens per kernel block each side registered (a manager block is ``ls // lk`` kernel blocks in a
    row). Leading null blocks on this side are skipped (nothing to load there); a null block after a
    loaded one, or a remote null under a local block to load, raises :class:`BadTransferParams`.
    The lists come out as the agent pairs them: the side with larger blocks lists ``ceil(n / ratio)``.
    """
    lo_l, hi_l = start // ls, -(-end // ls)
    loc = local[lo_l:hi_l]
    if ls == rs == lk == rk and loc.size == hi_l - lo_l and local.dtype == remote.dtype == _INT64:
        # one block size everywhere, no null block on either side: the blocks pair one to one (four NumPy
        # calls; anything else, an error included, takes the general path below)
        rem = remote[lo_l:hi_l]
        n = loc.size
        if rem.size == n and count_nonzero(loc) == n and count_nonzero(rem) == n:
            return loc, rem
    if loc.size < hi_l - lo_l:
        raise BadTransferParams(f"the request holds {local.size} local blocks; tokens up to {end} need {hi_l}")
    live = np.flatnonzero(loc)
    if live.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    first = int(live[0])
    if live.size != loc.size - first:
        raise BadTransferParams("a null block follows a loaded block in the local block table")
    tok0 = (lo_l + first) * ls
    if tok0 % rs:
        raise BadTransferParams(f"the first block to load starts at token {tok0}, not on a boundary of the "
                                f"prefill instance's {rs}-token blocks")
    n_tok = end - tok0
    l_man = local[tok0 // ls: -(-end // ls)]
    r_man = remote[tok0 // rs: -(-end // rs)]
    if r_man.size < -(-end // rs) - tok0 // rs:
        raise BadTransferParams(f"the prefill instance listed too few blocks for tokens [{tok0}, {end})")
    if not r_man.all():
        raise BadTransferParams(f"the prefill instance no longer holds some of tokens [{tok0}, {end}) "
                                "(a null block where this instance needs data)")
    lr, rr = ls // lk, rs // rk
    l_ker = (l_man[:, None] * lr + np.arange(lr)).reshape(-1)[: -(-n_tok // lk)]
    r_ker = (r_man[:, None] * rr + np.arange(rr)).reshape(-1)[: -(-n_tok // rk)]
    return l_ker, r_ker


def build_params(*, engine_id: str, endpoints: Sequence[tuple[str, int]], request_id: str,
                 block_ids: Sequence[Sequence[int]], block_sizes: Sequence[int], lease_deadline: float,
                 key: str | None = None, seal_key: bytes, prompt: bytes = b"") -> dict:
    """The ``kv_transfer_params`` a prefill instance returns for a finished request, sealed with ``seal_key``
    (:func:`seal_key`); ``endpoints``: each tensor parallel rank's side channel, by rank; ``key``: the hold's;
    ``prompt``: the request's :func:`prompt_digest`, which the seal covers."""
    host, port = endpoints[0]
    arrays = [np.asarray(b, dtype=np.int64).reshape(-1) for b in block_ids]
    sizes = [int(s) for s in block_sizes]
    eps = tuple((h, int(p)) for h, p in endpoints)
    out = {"do_remote_prefill": True, "do_remote_decode": False, "gpuxfer": PARAMS_VERSION,
           "remote_engine_id": engine_id, "remote_host": host, "remote_port": int(port),
           "remote_request_id": request_id, "remote_block_ids": [a.tolist() for a in arrays],
           "remote_block_sizes": sizes, "lease_deadline": float(lease_deadline), "tp_size": len(endpoints)}
    if key is not None:
        out["remote_key"] = key
    if prompt:
        out["remote_prompt"] = prompt.hex()
    if len(endpoints) > 1:
        out["remote_endpoints"] = [[h, p] for h, p in eps]
    out["remote_seal"] = hmac.digest(seal_key, _canonical(engine_id, request_id, ids_digest(arrays), sizes,
                                                          float(lease_deadline), eps, key, prompt), "sha256").hex()
    return out


# ---------------------------------------------------------------------------------------------------- the seal

def seal_key(secret: bytes) -> bytes:
    """The key a prefill engine seals its params with: a MAC of a fixed label under the engine's hold-key secret
    (:func:`.holds.make_key`), so the seal key, which its workers hand out in their handshake, tells nothing of the
    secret (with which a done or release for any hold could be made)."""
    return hmac.digest(secret, _SEAL_LABEL, "sha256")


def seal_key_from_hex(v: Any, what: str) -> bytes:
    """A seal key as a peer's handshake carries it (hex), checked; :class:`BadInput` naming ``what`` otherwise."""
    try:
        return _seal(v, what)
    except BadTransferParams as exc:
        raise BadInput(str(exc)) from None


def _seal(v: Any, what: str) -> bytes:
    """A seal (or a seal key) from its hex form: :data:`SEAL_BYTES` bytes, or :class:`BadTransferParams`."""
    b = None
    if isinstance(v, str) and len(v) == 2 * SEAL_BYTES and v.isascii():
        try:
            b = bytes.fromhex(v)
        except ValueError:
            pass
    if b is None or len(b) != SEAL_BYTES:       # (fromhex skips whitespace: such a string gives fewer bytes)
        raise BadTransferParams(f"{what} must be {2 * SEAL_BYTES} hexadecimal digits, got {_show(v)}")
    return b


def prompt_digest(token_ids: Sequence[int] | None) -> bytes:
    """SHA-256 of a request's prompt token IDs (none: an empty prompt) as little-endian int64s: the seal binds params
    to the prompt whose KV they name, so a decode loads them only into a request of that prompt (loaded into another,
    the KV of one prompt would run as another's, and land in the prefix cache under its tokens)."""
    ids = () if token_ids is None else token_ids
    return hashlib.sha256(np.fromiter(ids, dtype="<i8", count=len(ids))).digest()


def ids_digest(block_ids: Sequence[np.ndarray]) -> bytes:
    """SHA-256 of a request's block IDs as a seal covers them: their group count, then each group's length and IDs
    as little-endian int64s."""
    h = hashlib.sha256(struct.pack("<I", len(block_ids)))
    for a in block_ids:
        a = np.ascontiguousarray(a, dtype="<i8")
        h.update(struct.pack("<Q", a.size))
        h.update(a)
    return h.digest()


def _canonical(engine_id: str, request_id: str, digest: bytes, block_sizes: Sequence[int], lease_deadline: float,
               endpoints: Sequence[tuple[str, int]], key: str | None, prompt: bytes = b"") -> bytes:
    """What a seal covers, one encoding for both instances: every string and list length-prefixed, the block IDs'
    :func:`ids_digest`, the deadline as a little-endian double; ``endpoints``: every rank's ``(host, port)``
    (their count is the tensor parallel size); then, where given, the :func:`prompt_digest` (length-prefixed: the
    encoding's length tells whether it is there)."""
    u = "utf-8", "surrogatepass"                   # (a JSON string may hold lone surrogates)
    e, r, k = engine_id.encode(*u), request_id.encode(*u), (key or "").encode(*u)
    digest = bytes(memoryview(digest))             # its bytes whatever their length (a fixed "32s" pads or cuts)
    hosts = [h.encode(*u) for h, _ in endpoints]
    ranks = []
    for h, (_, port) in zip(hosts, endpoints):
        ranks += len(h), h, port
    # every string a little-endian uint32 length, then its bytes
    fmt = "".join([f"I{len(h)}sI" for h in hosts])
    fmt = f"<17sI{len(e)}sI{len(r)}s{len(digest)}sI{len(block_sizes)}qdI{fmt}I{len(k)}s"
    out = struct.pack(fmt, b"gpuxfer-params-1\0", len(e), e, len(r), r, digest, len(block_sizes), *block_sizes,
                      lease_deadline, len(endpoints), *ranks, len(k), k)
    if prompt:
        out += struct.pack("<I", len(prompt)) + bytes(prompt)
    return out


def for_release(rp: RemotePrefill) -> RemotePrefill:
    """What a worker needs to release a request (its rank's endpoint, the engine, the request, and what checks its
    seal): the params with the digest of their block IDs in place of the arrays, which would travel to every worker
    with the step's metadata (:func:`for_workers`)."""
    return for_workers(dataclasses.replace(rp, block_ids=(), ids_digest=ids_digest(rp.block_ids)))


def for_workers(rp: RemotePrefill) -> RemotePrefill:
    """``rp`` with what its seal covers made now (:attr:`RemotePrefill.signed`, kept with it as the step's metadata
    goes to the workers): the scheduler side's work, not the engine threads'."""
    rp.signed
    return rp


def seal_of(rp: RemotePrefill, key: bytes) -> bytes:
    """The seal of checked params ``rp`` under seal key ``key``."""
    h = (_KEYED.get(key) or keyed_mac(key)).copy()
    h.update(rp.signed)
    return h.digest()


try:        # OpenSSL's HMAC object (C), where hmac.new's wraps it in Python
    from _hashlib import hmac_new as _hmac_new
except ImportError:
    def _hmac_new(key: bytes, digestmod: str):
        return hmac.new(key, digestmod=digestmod)
#: per seal key: its HMAC-SHA256 object (:func:`keyed_mac`)
_KEYED: dict[bytes, Any] = {}


def keyed_mac(key: bytes):
    """Seal key ``key``'s HMAC-SHA256 object, made once a key: a seal is a copy of it updated with what the seal
    covers (three C calls), where ``hmac.digest`` looks OpenSSL's HMAC and SHA-256 up anew each time (tens of
    microseconds on caches a step left cold)."""
    h = _KEYED.get(key)
    if h is None:
        if len(_KEYED) >= 64:       # (keys of engines gone; an engine's key stays while it does)
            _KEYED.clear()
        h = _KEYED[bytes(key)] = _hmac_new(bytes(key), digestmod="sha256")
    return h


def check_seal(rp: RemotePrefill, key: bytes | None) -> None:
    """:class:`BadSeal` unless ``rp`` carries the seal the prefill engine whose seal key is ``key`` (from
    its handshake) made for them: params altered or forged after the prefill made them."""
    if key is None:
        raise BadSeal(f"prefill engine {rp.engine_id}'s handshake carried no seal key: its params cannot be checked")
    if rp.seal is None or not hmac.compare_digest(seal_of(rp, key), rp.seal):
        raise BadSeal(f"the kv_transfer_params of request {rp.request_id!r} do not carry prefill engine "
                      f"{rp.engine_id}'s seal over what they name and this request's prompt (altered, forged, made "
                      "for another prompt, or from before the engine restarted)")
