"""What a party of a KV transfer (a :class:`~gpuxfer.kv.agent.KVAgent`, a benchmark side) does when one of its
bounded waits on the peer times out: release every GPU wait it queued, keep the error, and, asked to, end the
process (:data:`~gpuxfer.errors.EXIT_CODE`).
"""
from __future__ import annotations

import logging
import os
import sys

from .. import config
from ..errors import EXIT_CODE

__all__ = ["ENV_KV_ON_TIMEOUT", "FailsOnTimeout", "on_timeout_from_env"]

#: the one logger every failing party reports to
log = logging.getLogger("gpuxfer.kv.engines")

ENV_KV_ON_TIMEOUT = "GPUXFER_KV_ON_TIMEOUT"


def on_timeout_from_env(value: str | None) -> str:
    """``value``, else ``$GPUXFER_KV_ON_TIMEOUT``, else ``raise``: what a side does when a bounded wait
    times out (``raise``: store the error, release every GPU wait, raise on every later call; ``exit``: the
    same, then log and end the process with :data:`EXIT_CODE`)."""
    return config.resolve(ENV_KV_ON_TIMEOUT, value, option="on_timeout")


class FailsOnTimeout:
    """What a party (a benchmark :class:`Side`, a :class:`~gpuxfer.kv.agent.KVAgent`) does when one of its
    bounded waits times out: :meth:`fail` releases every GPU-side wait it queued (its
    :meth:`release_waits` writes :data:`~gpuxfer.platforms.base.RELEASE_VALUE` into its local flag words), keeps the first
    error, which :meth:`check` raises from every later call, and with ``on_timeout == "exit"`` logs it
    and ends the process with :data:`EXIT_CODE`. Subclasses set ``failed`` (None) and ``on_timeout``
    (:func:`on_timeout_from_env`) and name themselves in :meth:`failure_name`."""

    failed: BaseException | None = None
    on_timeout: str | None = None

    def release_waits(self) -> None:
        """Satisfy every GPU wait this party queued (best effort: the abort path)."""

    def failure_name(self) -> str:
        return type(self).__name__

    def fail(self, exc: BaseException) -> None:
        """A bounded wait timed out: release every GPU wait, keep ``exc`` (the first error) for every later
        call, and with ``on_timeout="exit"`` log and end the process."""
        if self.failed is None:
            self.failed = exc
        self.release_waits()
        if self.on_timeout == "exit":
            msg = (f"gpuxfer kv: {self.failure_name()} failed: {type(self.failed).__name__}: {self.failed}; "
                   f"on_timeout=exit: every GPU wait released, exiting with code {EXIT_CODE}")
            log.critical("%s", msg)
            try:
                print(msg, file=sys.stderr, flush=True)
            finally:
                os._exit(EXIT_CODE)

    def check(self) -> None:
        """Raise the error that failed this party, if any."""
        if self.failed is not None:
            raise self.failed
