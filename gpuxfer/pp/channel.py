"""What the two ends of a pair exchange outside the data path: metadata messages over the CPU group
(:class:`CpuChannel`) and keys in the process group's store (:class:`PairSignals`: teardown barriers and
the "gone" note a failed, aborted or closed end leaves for its peer's watchdog).
"""
from __future__ import annotations

import logging
import time
from datetime import timedelta

import numpy as np

log = logging.getLogger("gpuxfer.pp")


# --------------------------------------------------------------------------- CPU channel


class CpuChannel:
    """Tagged metadata messages to one peer over a CPU (gloo) group.

    gloo's timed ``wait`` closes the pair on timeout, so a timed-out channel is
    dead; the transport is then broken anyway (TransferTimeout is final). To keep
    the caller's group out of that, :func:`~gpuxfer.pp.selection.connect` gives
    each pair whose metadata travels this way a two-rank gloo group of its own
    (:meth:`use_pair_group`); without one (a transport made by hand) messages go
    over ``group`` with global ranks.
    """

    RING = 4
    what = "the CPU group"

    def __init__(self, group, peer: int, tag_base: int, meta_len: int):
        import torch
        self.group, self.peer, self.tag_meta, self.tag_barrier = group, peer, tag_base, tag_base + 1
        self._pair: tuple | None = None      # (a two-rank gloo ProcessGroup, the peer's rank in it)
        self._ring = [torch.zeros(meta_len, dtype=torch.int64) for _ in range(self.RING)]
        self.send_buffers = [t.numpy() for t in self._ring]
        self._works: list = [None] * self.RING
        self._i = 0
        self._recv_buf = torch.zeros(meta_len, dtype=torch.int64)
        self.recv_np = self._recv_buf.numpy()

    def next_send_buffer(self, timeout_s: float, cancelled=None) -> int:
        i = self._i % self.RING
        w = self._works[i]
        if w is not None:
            w.wait(timeout=timedelta(seconds=timeout_s))
            self._works[i] = None
        return i

    def use_pair_group(self, pg, peer_rank: int) -> None:
        """Send and receive over ``pg`` (two ranks; the peer is ``peer_rank`` in it) from now on."""
        self._pair = (pg, peer_rank)

    def send(self, i: int) -> None:
        if self._pair is not None:
            pg, dst = self._pair
            self._works[i] = pg.send([self._ring[i]], dst, self.tag_meta)
        else:
            import torch.distributed as dist
            self._works[i] = dist.isend(self._ring[i], dst=self.peer, group=self.group, tag=self.tag_meta)
        self._i += 1

    def recv(self, timeout_s: float, cancelled=None) -> np.ndarray:
        if self._pair is not None:
            pg, src = self._pair
            w = pg.recv([self._recv_buf], src, self.tag_meta)
        else:
            import torch.distributed as dist
            w = dist.irecv(self._recv_buf, src=self.peer, group=self.group, tag=self.tag_meta)
        w.wait(timeout=timedelta(seconds=timeout_s))
        return self.recv_np

    def close(self) -> None:
        """Drop the pair group (its gloo threads end with it). Idempotent."""
        self._works = [None] * self.RING
        self._pair = None

    def drain(self, timeout_s: float) -> None:
        for i, w in enumerate(self._works):
            if w is not None:
                try:
                    w.wait(timeout=timedelta(seconds=timeout_s))
                except RuntimeError:
                    pass
                self._works[i] = None


class PairSignals:
    """What the two ends of a pair tell each other outside the transfer: keys in the store of the
    default process group (``prefix`` is unique to the pair and the connection).

    * ``barrier(label)``: :meth:`post` sets ``prefix/label/rank``; :meth:`finish` waits (bounded)
      for the peer's key. A store wait that times out breaks nothing, unlike a gloo one.
    * ``gone``: :meth:`leave` sets ``prefix/gone/rank`` (why: failed, aborted, closed);
      :meth:`peer_gone` reads the peer's, without waiting.

    A store that fails (its server died with rank 0) makes barriers fail and ``peer_gone`` say
    nothing: the waits' own timeouts still bound everything.
    """

    def __init__(self, store, prefix: str, rank: int, peer: int):
        self.store, self.prefix, self.rank, self.peer = store, prefix, rank, peer

    @classmethod
    def default(cls, prefix: str, rank: int, peer: int) -> "PairSignals | None":
        try:
            from torch.distributed.distributed_c10d import _get_default_store
            return cls(_get_default_store(), prefix, rank, peer)
        except Exception as exc:  # noqa: BLE001 - teardown then relies on timeouts alone
            log.warning("rank %d: no process-group store for the pair with rank %d (%s): teardown barriers "
                        "and peer-gone notes are off", rank, peer, exc)
            return None

    def _key(self, label: str, rank: int) -> str:
        return f"{self.prefix}/{label}/{rank}"

    def post(self, label: str) -> bool:
        try:
            self.store.set(self._key(label, self.rank), b"1")
            return True
        except Exception as exc:  # noqa: BLE001
            log.warning("rank %d: %s barrier with rank %d not posted: %s", self.rank, label, self.peer, exc)
            return False

    def finish(self, label: str, deadline: float) -> bool:
        """Poll for the peer's key until ``deadline`` (polls, not ``store.wait``: a client's blocking wait
        holds its connection, and the watchdog reads "gone" notes through the same store)."""
        key = self._key(label, self.peer)
        nap = 1e-3
        try:
            while not self.store.check([key]):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(nap)
                nap = min(2 * nap, 0.02)
        except Exception:  # noqa: BLE001 - a dead store: the caller logs and carries on
            return False
        try:
            self.store.delete_key(key)     # seen: the peer posted it, nobody reads it again
        except Exception:  # noqa: BLE001 - a store without delete keeps a few bytes
            pass
        return True

    def leave(self, why: str) -> None:
        try:
            self.store.set(self._key("gone", self.rank), why.encode()[:512])
        except Exception as exc:  # noqa: BLE001
            log.debug("rank %d: gone note for rank %d not set: %s", self.rank, self.peer, exc)

    def peer_gone(self) -> str | None:
        key = self._key("gone", self.peer)
        try:
            if not self.store.check([key]):
                return None
            return self.store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001
            return None
