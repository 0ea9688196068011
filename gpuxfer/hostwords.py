"""Flag words in host memory shared by processes on one host: the owner's host reads them with a plain load, and
the processes' streams write and wait on them (:meth:`Platform.map_host_words`). Two users: a ``copy_engine``
pair of the stage hand-off (below), and a KV agent's notification words (:mod:`gpuxfer.kv.host_notify`).

A ``copy_engine`` sender keeps its ``empty[j]`` words (the slots its receiver gave back) here, so
``send()`` sees on the host whether slot j is free and queues its GPU wait only when it is not::

    sender S (owns the words)                        receiver R
    -------------------------                        ----------
    create /gpuxfer-ppw-...: R words of 64 bytes
      (zero), map for S's device         --name-->   open, map for R's device, check a stream write
                                                     and an 8-byte copy into a scratch word land
    step k, slot j:
      empty[j] >= k - R on the host? (a load)
        yes: the slot is free: no GPU wait           ... R's stream after the work on slot j:
        no:  queue the GPU wait as before    <------   publish empty[j] = k' (into host memory)

A word's value only grows and is written by R's stream after R's work on the slot completed, so a value
the host saw stays true: the slot is free for good. The sender's value words (the source of the 8-byte
copy that publishes a step from inside its copy graph) sit after the empty words in the same segment.
The owner drops the name once the peer opened it. A process killed between the create and that unlink
leaves the name behind; a later create on the host removes every ``gpuxfer-ppw-<pid>-<12 hex>`` segment
whose creator ``<pid>`` no longer exists (and is ours: same user; at least an hour old, so a live creator's
in another PID namespace is left) and that no owner holds (a KV agent's words stay named for its life: its lock
keeps them), and touches no other name.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import secrets

from .common import hold_shm, map_shm, sweep_shm_orphans, unlink_shm
from .errors import GpuxferError
from .flaglink import FLAG_STRIDE

log = logging.getLogger("gpuxfer.pp")

PAGE = 4096
WORD_STRIDE = FLAG_STRIDE // 8     # int64 words per flag line: word i of loads() is at i * WORD_STRIDE
_PROBE_WRITE, _PROBE_COPY = 0, 1   # scratch lines after the n flag words (the peer's setup check)
PREFIX = "gpuxfer-ppw-"             # the stage hand-off's give-back words
KV_PREFIX = "gpuxfer-kvw-"          # a KV agent's notification words
_NAME = re.compile(PREFIX + r"([0-9a-f]{1,8})-[0-9a-f]{12}")     # as create() names them: creator pid, token
_NAMES = {PREFIX: _NAME, KV_PREFIX: re.compile(KV_PREFIX + r"([0-9a-f]{1,8})-[0-9a-f]{12}")}


class HostWords:
    """``n`` 64-bit flag words, each on its own 64-byte line, in a POSIX shared-memory segment mapped for
    ``device``'s streams; ``create`` makes one (the owner), ``open`` maps a peer's by name."""

    def __init__(self, platform, device: int, name: str, n: int, create: bool):
        self.platform, self.device, self.name, self.n = platform, device, name, int(n)
        self.nbytes = -(-(self.n + 2) * FLAG_STRIDE // PAGE) * PAGE
        self._mm = map_shm(name, self.nbytes, create=create, reserve=True)    # (a full /dev/shm: OSError here)
        self.owner = self.linked = create
        # the owner's lock while it lives: a sweep of another PID namespace, where its pid names no process, leaves it
        self._hold = hold_shm(name) if create else None
        self._words = None
        self.dptr = None
        try:
            self._words = (ctypes.c_int64 * (self.nbytes // 8)).from_buffer(self._mm)
            self.host_ptr = ctypes.addressof(self._words)
            self.dptr = platform.map_host_words(self.host_ptr, self.nbytes, device)
            if self.dptr is None:
                raise GpuxferError(f"the {platform.name} platform cannot map host memory for its streams")
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls, platform, device: int, n: int, prefix: str = PREFIX) -> "HostWords":
        """New words named ``/<prefix><pid hex>-<12 hex>``, after removing the segments of that prefix whose
        creator is gone (:func:`~gpuxfer.common.sweep_shm_orphans`)."""
        sweep_shm_orphans(_NAMES[prefix], "give-back" if prefix == PREFIX else "notification")
        return cls(platform, device, f"/{prefix}{os.getpid():x}-{secrets.token_hex(6)}", n, True)

    @classmethod
    def open(cls, platform, device: int, name: str, n: int, prefix: str = PREFIX) -> "HostWords":
        """A peer's words, by the name its :meth:`create` gave them (``GpuxferError`` for any other name)."""
        if not isinstance(name, str) or not _NAMES[prefix].fullmatch(name[1:]) or name[:1] != "/":
            raise GpuxferError(f"not a flag-word segment name: {name!r:.80}")
        return cls(platform, device, name, n, False)

    def ptr(self, i: int) -> int:
        """The stream address of word ``i``."""
        return self.dptr + i * FLAG_STRIDE

    def loads(self):
        """A ctypes array over the words: ``a[i * WORD_STRIDE]`` loads word ``i`` (no copy, no caching)."""
        return self._words

    def read(self, i: int) -> int:
        """Word ``i`` (a load); 0 once closed."""
        words = self._words
        return 0 if words is None else words[i * WORD_STRIDE]

    def store(self, i: int, value: int) -> None:
        """Word ``i`` := ``value`` (a store); nothing once closed."""
        words = self._words
        if words is not None:
            words[i * WORD_STRIDE] = value

    def check_peer_writes(self, stream, copy, timeout_s: float) -> None:
        """A peer's check that its stream reaches these words: a flag write into one scratch line and an
        8-byte copy (from ``copy(stream, dst)``'s source) into another land, seen by a host load."""
        p = self.platform
        nonce = int.from_bytes(secrets.token_bytes(6), "little") | 1
        a, b = self.n + _PROBE_WRITE, self.n + _PROBE_COPY
        p.write_flag(stream, self.ptr(a), nonce)
        copy(stream, self.ptr(b), nonce + 1)
        if not p.synchronize(stream, timeout_s):
            raise GpuxferError(f"a stream write into host flag words did not finish in {timeout_s:g} s")
        got = (self.read(a), self.read(b))
        if got != (nonce, nonce + 1):
            raise GpuxferError(f"stream writes into host flag words did not land: read {got}, "
                               f"expected {(nonce, nonce + 1)}")

    def unlink(self) -> None:
        """Drop the name (the owner's; idempotent): the mappings stay."""
        if self.linked:
            self.linked = False
            unlink_shm(self.name)

    def close(self) -> None:
        """Unmap for the device and the process (after the streams using the words drained). Idempotent."""
        if self.dptr is not None:
            self.dptr = None
            try:
                self.platform.unmap_host_words(self.host_ptr, self.device)
            except Exception as exc:  # noqa: BLE001 - the process exit unmaps it
                log.warning("unmapping host flag words %s: %s", self.name, exc)
        self._words = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:     # a ctypes view still alive elsewhere: unmapped when it dies
                pass
            self._mm = None
        self.unlink()
        hold, self._hold = self._hold, None
        if hold is not None:
            os.close(hold)
