"""The decode side of the SGLang backend's requests (:class:`Inbox`): the token a decode rank names each request of a
room by, the metadata row that request named, and the prefill's messages about it (its metadata row, its landing
value, its status), each taken only for the room's current request. A room id names one request after another: an
earlier request's late row, landing value or status (it was given up here first) never writes, ends or fails the new
one. A request's row comes either in a message or into this rank's rows in host memory (:mod:`.rows`: the row a
request named, written by the prefill before its last push, stamped with its token, the slot and the value that push
writes); a room whose row came in no message takes it from the rows when its word says that push landed or its
Success status arrives, and fails where the rows hold no row of its request. No SGLang here: the decode's KV manager
(:mod:`.conn`) hands its control messages over and is asked about SGLang's state of a room (:class:`DecodeRooms`),
SGLang's ``KVPoll`` values handed in.
"""
from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Dict, List, Optional, Protocol, Tuple

from ...errors import BadInput, GpuxferError
from .landing import Landings, parse_landing
from .layout import write_aux_rows
from .pushes import AUX_TAG, AUX_TAG_V1, AUX_TAG_V2
from .requests import int_frame
from .rows import AuxRows, decode_stamp, token_number

log = logging.getLogger("gpuxfer.sglang")

# rooms ended by their word whose prefill conclusion (an earlier gpuxfer's, with no token to tell it apart) is
# still to be dropped, at most: the oldest go first (a conclusion that never came)
ENDED_KEPT = 65536


class DecodeRooms(Protocol):
    """What :class:`Inbox` asks of the decode's KV manager: SGLang's state of a room (``CommonKVManager``'s)."""

    request_status: Dict[int, Any]
    required_prefill_response_num_table: Dict[int, int]
    kv_args: Any

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None: ...

    def update_status(self, bootstrap_room: int, status: Any) -> None: ...

    def handle_abort_ack_message(self, msg: List[bytes]) -> bool: ...

    def parse_kv_status_message(self, msg: List[bytes]) -> Optional[tuple]: ...

    def apply_prefill_status(self, *, bootstrap_room: int, status: Any, prefill_rank: int,
                             failure_reason: Optional[str]) -> None: ...


class Inbox:
    """A decode rank's requests as the prefill's messages name them. ``landings``: the rank's notification
    slots (:class:`.landing.Landings`); ``kv_poll``: SGLang's ``KVPoll``; ``rows``: the rank's metadata rows
    registered with its agent (None: rows come in messages alone)."""

    def __init__(self, rooms: DecodeRooms, landings: Landings, kv_poll: Any, rows: Optional[AuxRows] = None):
        self.rooms, self.landings, self.kv_poll, self.rows = rooms, landings, kv_poll, rows
        # room -> [its token as a stamp names it, the slot its prefill rank was given (None: none known yet),
        # the word's value its stamp was last read at]: rooms whose row may come into the rows, until a message
        # brings it or the room is taken or forgotten
        self.by_rows: Dict[int, list] = {}
        self._ended_lock = threading.Lock()         # a room ended by its word against its status message
        # room -> the token of its request ended by its word, whose prefill conclusion is still to be dropped
        self.ended_by_word: Dict[int, Optional[bytes]] = {}
        self.tokens: Dict[int, bytes] = {}          # room -> the token its current request was named by
        self.aux_index: Dict[int, int] = {}         # room -> the metadata row its current request named
        self._token_seq = itertools.count(1)

    def name_request(self, room: int, aux_index: Optional[int]) -> bytes:
        """The token of ``room``'s current request, which names its pages to the prefill ranks (one for every
        prefill rank, until :meth:`forget`): the prefill echoes it in the room's row and status messages, so an
        earlier request's late ones, naming the same room id, are told apart and dropped. ``aux_index``: the
        metadata row it named (None: a dummy rank's message, none)."""
        if room not in self.tokens:         # (named again to its next prefill rank: its landing is this request's)
            self.landings.forget(room)      # a landing heard of before belongs to an earlier request
        token = self.tokens.setdefault(room, str(next(self._token_seq)).encode("ascii"))
        if aux_index is not None:
            # armed once, when the request first names its row: named again to its next prefill rank (several
            # answer it: rows in messages), the row one of them sent meanwhile stays this request's
            first = room not in self.aux_index
            self.aux_index[room] = int(aux_index)
            if first and self.rows is not None and token_number(token) is not None:
                self.rows.clear(int(aux_index))     # what an earlier request left in the row is no stamp of this one
                self.by_rows[room] = [token_number(token), None, -1]
        return token

    def forget(self, room: int) -> None:
        """``room``'s request was cleared: the room id's next request gets a new token, and nothing is kept for
        this one's late conclusion (it names this token: dropped by that alone)."""
        self.landings.forget(room)
        with self._ended_lock:
            if self.ended_by_word.get(room) is not None:
                del self.ended_by_word[room]
        self.tokens.pop(room, None)
        self.aux_index.pop(room, None)
        self.by_rows.pop(room, None)

    def current(self, room: int, token: Optional[bytes]) -> bool:
        """Whether a message naming ``room`` with ``token`` is about the room's current request (a message
        without a token, from a prefill of an earlier gpuxfer, is taken as it always was)."""
        return token is None or self.tokens.get(room) == token

    def on_message(self, msg: List[bytes]) -> None:
        """One control message from a prefill rank: a metadata row, SGLang's ABORT_ACK or a status."""
        if msg and msg[0] == AUX_TAG:
            self._on_aux(msg[1:4], msg[4] if len(msg) > 4 else b"", msg[5:])
            return
        if msg and msg[0] == AUX_TAG_V2:        # a prefill that had no token (an earlier gpuxfer)
            self._on_aux(msg[1:4], None, msg[4:])
            return
        if msg and msg[0] == AUX_TAG_V1:        # a prefill of an earlier gpuxfer: the row, no landing value
            self._on_aux([*msg[1:3], b""], None, msg[3:])
            return
        if self.rooms.handle_abort_ack_message(msg):
            return
        parsed = self.rooms.parse_kv_status_message(msg)
        if parsed is None:
            return
        room, status, rank, reason = parsed
        token = msg[4] if len(msg) > 4 and msg[4] else None     # after room, status, rank and reason
        with self._ended_lock:
            if status in (self.kv_poll.Success, self.kv_poll.Failed) and room in self.ended_by_word:
                ended = self.ended_by_word.pop(room)
                if token is None or ended is None or token == ended:
                    # the prefill's conclusion of a request this rank already ended by its word: never applied
                    # (the room may already be a new request's)
                    return
            if not self.current(room, token):
                log.debug("gpuxfer: room %s: status %s of an earlier request of the room id dropped", room, status)
                return
            # a room that ended here (given up: its row index SGLang's to release to the next request) takes no row
            over = self.rooms.request_status.get(room) in (self.kv_poll.Success, self.kv_poll.Failed)
            if (status == self.kv_poll.Success and room in self.by_rows and not over
                    and not self._take(room, landed=False)):
                return          # its pushes were waited for: the row is in place, its word at its value, or it fails
            self.rooms.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank,
                                            failure_reason=reason)

    def landed_by_row(self, room: int) -> bool:
        """Whether ``room``'s row came into the rows and its word says the push posted after it landed: the row's
        stamp names the room's request, the slot its prefill rank was given (:meth:`prefill_slot`) and a value that
        word holds; then the row is taken (:meth:`_take`). The row is read only once the word grew since it was
        last read. A room of several prefill ranks ends by their Success messages."""
        armed = self.by_rows.get(room)
        if armed is None or armed[1] is None or self.rooms.required_prefill_response_num_table.get(room) != 1:
            return False
        seen = self.landings.word(armed[1])
        if seen == armed[2]:
            return False
        armed[2] = seen
        try:        # the stamp and the rows in one read, after the word's
            raw = self.rows.row(self.aux_index[room])
        except (GpuxferError, KeyError):     # (a device error: the room ends by its Success message or timeout)
            return False
        stamp = decode_stamp(raw)
        # the rows count only where the word read before them holds the stamp's value: the push that wrote them had
        # landed when they were read (a word read after them would not say the rows read were whole)
        if stamp is None or stamp[:2] != (armed[0], armed[1]) or stamp[2] > seen:
            return False
        with self._ended_lock:
            return self._take(room, raw, stamp=stamp)

    def prefill_slot(self, room: int, slot: Optional[int], seen: Optional[int] = None) -> None:
        """``room``'s metadata went to one prefill rank, whose registration was given notification ``slot``
        (None: none): the word its row's landing is read on. ``seen``: the word's value as this rank knew it
        before the metadata left (:meth:`Landings.seen <.landing.Landings.seen>`), which no push of the room can
        have bumped yet: the row is first read once the word grew past it (without it, at the first poll)."""
        armed = self.by_rows.get(room)
        if armed is not None:
            armed[1] = slot
            if seen is not None and slot is not None:
                armed[2] = seen

    def _take(self, room: int, raw: Optional[bytes] = None, landed: bool = True,
              stamp: Optional[Tuple[int, int, int]] = None) -> bool:
        """``room``'s row from the rank's rows into SGLang's (under ``_ended_lock``): False, the room Failed,
        where they hold no row of its request (a row index the prefill did not write, a stamp of another
        request) or, ``landed`` False (a Success message), where the word of the stamp's slot (read now; any slot
        this rank handed out: a prefill rank registered again bumps its new slot) does not hold the stamp's value:
        the prefill writes the row before the push it stamps is posted, so only that word says the push landed
        (a push that failed never writes it). ``stamp``: ``raw``'s, decoded by the caller."""
        armed = self.by_rows.pop(room, None)
        if armed is None:
            return self.rooms.request_status.get(room) not in (self.kv_poll.Success, self.kv_poll.Failed)
        try:
            index = self.aux_index[room]
            if not landed:
                raw = self.rows.row(index)
                stamp = decode_stamp(raw)
                if stamp is None or not self.landings.reached_now(stamp[1], stamp[2]):
                    raise BadInput(f"metadata row {index} holds no row whose push landed (stamp {stamp!r})")
            self.rows.take(index, armed[0], raw, stamp)
        except (GpuxferError, KeyError) as exc:
            self.rooms.record_failure(room, f"its metadata row did not arrive: {exc}")
            self.rooms.update_status(room, self.kv_poll.Failed)
            return False
        return True

    def end_by_word(self, room: int) -> None:
        """``room`` landed by its notification word: Success, unless a status got there first; then the
        prefill's own conclusion of it, still on its way, is dropped when it arrives."""
        with self._ended_lock:
            if self.rooms.request_status.get(room) in (self.kv_poll.WaitingForInput, self.kv_poll.Transferring):
                self.rooms.update_status(room, self.kv_poll.Success)
                self.ended_by_word[room] = self.tokens.get(room)
                while len(self.ended_by_word) > ENDED_KEPT:
                    del self.ended_by_word[next(iter(self.ended_by_word))]

    def _on_aux(self, head: List[bytes], token: Optional[bytes], rows: List[bytes]) -> None:
        """A room's metadata row (``head``: room, row index, landing), written into its row here, and the
        notification that says its KV landed: from then on :meth:`Landings.landed <.landing.Landings.landed>`
        may end the room before its Success message arrives (a room one prefill rank sends, from a slot this
        rank handed out). ``token``: the request it is for; a row of another request of the room id (an earlier
        one's, late) is dropped, neither written nor armed."""
        if len(head) < 3:
            raise BadInput(f"a gpuxfer metadata row message has {len(head) + 1} frames")
        room = int_frame(head[0], "room")
        status = self.rooms.request_status.get(room)
        if status is None:
            return
        if not self.current(room, token):
            log.debug("gpuxfer: room %s: the metadata row of an earlier request of the room id dropped", room)
            return
        if status in (self.kv_poll.Success, self.kv_poll.Failed):
            # every row of a room comes before the status or word that concludes it: this one is no part of it
            # (and the row may already be read)
            log.warning("gpuxfer: room %s: a metadata row after the room ended (%s) dropped", room, status)
            return
        try:
            # (parsed here: a row of the room's request that cannot be written fails it, never left to its Success)
            index = int_frame(head[1], "metadata row index")
            own = self.aux_index.get(room)
            if index != own:        # another request's row, or a room this rank named no pages for
                raise BadInput(f"the prefill names metadata row {index}; the room's is {own}")
            landing = parse_landing(head[2])
            if landing is not None and self.rooms.required_prefill_response_num_table.get(room) != 1:
                landing = None          # several prefill ranks: SGLang's Success messages count them
            if landing is not None:
                self.landings.check(landing)
            write_aux_rows(self.rooms.kv_args, index, list(rows))
            self.by_rows.pop(room, None)   # the row came in this message
        except BadInput as exc:     # the room must not succeed without its row (Failed is final)
            self.rooms.record_failure(room, f"its metadata row could not be written: {exc}")
            self.rooms.update_status(room, self.kv_poll.Failed)
            return
        if landing is not None:
            self.landings.expect(room, landing)
