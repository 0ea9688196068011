"""What the SGLang backend's prefill keeps per request: a decode rank's destination for it as the decode's
metadata message states it (:class:`TransferInfo`), the rooms decode ranks named that no request of this
prefill rank holds yet (:class:`Unrequested`), a ``send()`` chunk queued for the transfer thread
(:class:`_Chunk`), and the pushes posted and not yet waited for (:class:`_Posted`). No SGLang here."""
from __future__ import annotations

import queue
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np
import numpy.typing as npt

from ...errors import BadInput, BlockIdError
from .rows import token_number

MAX_SESSION_BYTES = 256     # a decode rank's name (SGLang's ``ip:port``), or its ip, in a message, at most


def ascii_frame(frame: bytes, what: str) -> str:
    """A control message's text frame; ``BadInput`` naming ``what`` where it is not ASCII."""
    try:
        return frame.decode("ascii")
    except UnicodeDecodeError:
        raise BadInput(f"a gpuxfer SGLang message's {what} is not ASCII: {frame[:40]!r}") from None


def int_frame(frame: bytes, what: str) -> int:
    """A control message's decimal integer frame; ``BadInput`` naming ``what`` where it is none."""
    text = ascii_frame(frame, what)
    try:
        return int(text)
    except ValueError:
        raise BadInput(f"a gpuxfer SGLang message's {what} is not an integer: {frame[:40]!r}") from None


def _int32_pages(kv_indices) -> bytes:
    """A decode's page indices as its metadata message carries them (int32s); ``BlockIdError`` for any that is
    no integer or does not fit (a cast would name another page)."""
    try:
        arr = np.asarray(kv_indices)
    except (TypeError, ValueError, RuntimeError) as exc:     # e.g. a device tensor, a ragged list
        raise BlockIdError(f"decode page indices must be a 1-D array of integers: {exc}") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise BlockIdError(f"decode page indices must be a 1-D array of integers, got {arr.dtype} {arr.shape}")
    if arr.size and not (0 <= int(arr.min()) and int(arr.max()) <= np.iinfo(np.int32).max):
        raise BlockIdError(f"decode page indices {int(arr.min())}..{int(arr.max())} do not fit an int32 page index")
    return np.ascontiguousarray(arr, dtype=np.int32).tobytes()


@dataclass
class TransferInfo:
    """One decode rank's destination for a room (the fields ``CommonKVManager`` reads: ``endpoint``,
    ``dst_port``, ``is_dummy``, ``required_dst_info_num``, ``decode_prefix_len``)."""

    room: int
    endpoint: str
    dst_port: int
    session: str
    dst_kv_indices: npt.NDArray[np.integer]    # int32 as the message names them; int64 once kept (staged)
    dst_aux_index: Optional[int]
    required_dst_info_num: int
    is_dummy: bool
    decode_prefix_len: Optional[int] = None
    token: Optional[bytes] = None       # the decode's name for this request of the room (echoed to it; None: none)
    # the token as a row's stamp carries it (None: its rows go on the control socket), staged once per request
    stamp_token: Optional[int] = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.stamp_token = token_number(self.token)

    @classmethod
    def from_zmq(cls, msg: List[bytes]) -> "TransferInfo":
        """The message's fields; its pages a view of its frame, nothing allocated for them (the manager checks
        them against the decode rank's pool before anything proportional to them)."""
        if len(msg) < 7:
            raise BadInput(f"a gpuxfer SGLang metadata message has {len(msg)} frames, not 7 to 9")
        if len(msg[1]) > MAX_SESSION_BYTES or len(msg[3]) > MAX_SESSION_BYTES:
            # no SGLang rank is named so (and what is kept of a rank's name, as its refusals', stays small)
            raise BadInput(f"a metadata message naming a {len(msg[3])}-byte decode rank at a {len(msg[1])}-byte ip "
                           f"(at most {MAX_SESSION_BYTES} bytes each)")
        token = msg[8] if len(msg) > 8 and msg[8] else None
        if token is not None and (len(token) > 20 or not token.isdigit()):
            raise BadInput(f"a request token must be at most 20 digits, got {token[:24]!r}")
        dummy = msg[4] == b"" and msg[5] == b""
        if not dummy and len(msg[4]) % 4:
            raise BadInput(f"decode page indices of {len(msg[4])} bytes are not int32s")
        pages = np.array([], dtype=np.int32) if dummy else np.frombuffer(msg[4], dtype=np.int32)
        return cls(room=int_frame(msg[0], "room"), endpoint=ascii_frame(msg[1], "ip"),
                   dst_port=int_frame(msg[2], "port"), session=ascii_frame(msg[3], "session (decode rank)"),
                   dst_kv_indices=pages, dst_aux_index=None if dummy else int_frame(msg[5], "aux (metadata row)"),
                   required_dst_info_num=int_frame(msg[6], "required ranks"), is_dummy=dummy,
                   decode_prefix_len=int_frame(msg[7], "decode prefix length") if len(msg) > 7 and msg[7] else None,
                   token=token)


class Unrequested:
    """The rooms decode ranks named pages for (their metadata messages) while no request of this prefill rank
    holds the room. The request usually follows within moments; one that never does (a room sent to another
    prefill, a request that ended here before the decode's message came, a broken or hostile decode's made-up
    rooms) would hold the room's destinations forever. So each decode rank (``session``) holds at most
    ``max_rooms`` such rooms, naming together at most the pages :meth:`note` is given, each for ``max_age_s`` at
    most (the decode's waiting timeout: by then it gave the room up); :meth:`note` and :meth:`expired` return
    the rooms past these bounds, for the manager to drop."""

    def __init__(self, max_rooms: int, max_age_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_rooms, self.max_age_s, self._clock = int(max_rooms), float(max_age_s), clock
        # session -> room -> (when first named, the pages it names), oldest first
        self._by_session: Dict[str, "OrderedDict[int, Tuple[float, int]]"] = {}
        self._pages: Dict[str, int] = {}                                # session -> the pages its rooms name
        self._sessions: Dict[int, Set[str]] = {}                        # room -> the sessions that named it

    def note(self, session: str, room: int, pages: int = 0, max_pages: Optional[int] = None) -> List[int]:
        """``session`` named ``pages`` pages for ``room``, which no request holds: kept (from its first naming;
        its pages the latest named). Returns the session's oldest rooms past ``max_rooms``, or naming pages past
        ``max_pages`` (None: no bound) together with the later ones, forgotten here; ``room`` itself stays."""
        rooms = self._by_session.setdefault(session, OrderedDict())
        when, before = rooms.get(room, (self._clock(), 0))
        rooms[room] = (when, int(pages))
        self._pages[session] = self._pages.get(session, 0) + int(pages) - before
        self._sessions.setdefault(room, set()).add(session)
        over, count, total = [], len(rooms), self._pages[session]
        for old, (_, n) in rooms.items():
            if old == room or not (count > self.max_rooms or (max_pages is not None and total > max_pages)):
                break
            over.append(old)
            count, total = count - 1, total - n
        for old in over:
            self.forget(old)
        return over

    def expired(self) -> List[int]:
        """The rooms named ``max_age_s`` ago or earlier, forgotten here."""
        now, out = self._clock(), {}
        for rooms in self._by_session.values():
            for room, (when, _) in rooms.items():
                if now - when < self.max_age_s:
                    break
                out[room] = None
        for room in out:
            self.forget(room)
        return list(out)

    def forget(self, room: int) -> None:
        """``room`` is held by a request now, or dropped: no session's any more."""
        for session in self._sessions.pop(room, ()):
            rooms = self._by_session.get(session)
            if rooms is not None and room in rooms:
                self._pages[session] -= rooms.pop(room)[1]
                if not rooms:
                    del self._by_session[session]
                    del self._pages[session]

    def rooms(self, session: str) -> List[int]:
        return list(self._by_session.get(session, ()))

    def pages(self, session: str) -> int:
        """The pages ``session``'s rooms kept here name together."""
        return self._pages.get(session, 0)


@dataclass
class _Chunk:
    room: int
    pages: Optional[npt.NDArray[np.int32]]      # None: no chunk, the room's pushes to be drained (an abort)
    index_slice: slice
    is_last: bool
    aux_index: Optional[int]
    wait_event: Any = None                      # SGLang's event after which the pages hold the chunk's KV
    infos: Any = None                           # the room's decode destinations when the chunk was queued


def _span(chunk: _Chunk) -> bool:
    """Whether ``chunk`` sends a 1-D array of pages onto positions ``[start, stop)`` of the decode's list, one
    page per position: only such chunks join, so a joined chunk sends each page where its own chunk named it."""
    s, pages = chunk.index_slice, chunk.pages
    return (pages is not None and pages.ndim == 1 and isinstance(s, slice) and s.step in (None, 1)
            and isinstance(s.start, (int, np.integer)) and isinstance(s.stop, (int, np.integer))
            and 0 <= s.start and s.stop - s.start == len(pages))


def _joins(chunk: _Chunk, nxt: _Chunk) -> bool:
    """Whether ``nxt`` continues ``chunk``: the same request's next pages, right after its own in the
    decode's list, of the same type (joined, no array is cast: the agent checks each one's IDs as given),
    with no event of its own to wait for (``chunk``'s is waited for before both are posted)."""
    return (_span(chunk) and _span(nxt) and nxt.pages.dtype == chunk.pages.dtype and nxt.room == chunk.room
            and nxt.infos is chunk.infos and not chunk.is_last and nxt.wait_event is None
            and chunk.index_slice.stop == nxt.index_slice.start)


def coalesce(chunk: _Chunk, waiting: "queue.Queue[_Chunk]") -> Tuple[_Chunk, Optional[_Chunk]]:
    """``chunk`` joined with the chunks queued right behind it that continue it (:func:`_joins`): one push
    for what the scheduler sent while the transfer thread was busy, as a request sent back to back is one
    push of its pages. Returns the joined chunk and the first queued item that does not continue it (None:
    the queue was empty), which the caller handles next, so the queue's order is kept."""
    parts = [chunk]
    while True:
        try:
            nxt = waiting.get_nowait()
        except queue.Empty:
            nxt = None
            break
        if not _joins(parts[-1], nxt):
            break
        parts.append(nxt)
    if len(parts) == 1:
        return chunk, nxt
    last = parts[-1]
    return _Chunk(chunk.room, np.concatenate([c.pages for c in parts]),
                  slice(chunk.index_slice.start, last.index_slice.stop), last.is_last, last.aux_index,
                  chunk.wait_event, chunk.infos), nxt


def _drain_marker(room: int) -> _Chunk:
    return _Chunk(room, None, slice(0, 0), False, None)


@dataclass
class _Posted:
    """A room's pushes posted and not yet waited for (the transfer thread's alone): ``chunks`` is what the
    room counts in ``_staging_outstanding`` for them, ``handles`` the posts' ``(TransferInfo, handle)``, ``sent``
    where in the decode's page list the chunks posted so far end (the next one starts there), ``infos`` the
    room's decode destinations of the request that posted them (a room id names one request after another)."""

    infos: Any = None
    chunks: int = 0
    handles: List[tuple] = field(default_factory=list)
    sent: int = 0
