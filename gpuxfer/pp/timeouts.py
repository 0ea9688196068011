"""The two timeout settings of a stage hand-off: how long a wait may last and what a failed transport does.

Below :mod:`~gpuxfer.pp.transport`, :mod:`~gpuxfer.pp.watchdog` and :mod:`~gpuxfer.pp.options`, which all
read them.
"""
from __future__ import annotations

from .. import config
from ..sync import check_timeout

ENV_TIMEOUT = "GPUXFER_PP_TIMEOUT_S"
ENV_ON_TIMEOUT = "GPUXFER_PP_ON_TIMEOUT"


def resolve_timeout(timeout_s: float | None) -> float:
    """``timeout_s``, else ``$GPUXFER_PP_TIMEOUT_S``, else 300 s (checked: :func:`gpuxfer.sync.check_timeout`)."""
    if timeout_s is None:
        return config.get(ENV_TIMEOUT)
    return check_timeout(timeout_s, "the transfer timeout")


def resolve_on_timeout(value: str | None) -> str:
    """``value``, else ``$GPUXFER_PP_ON_TIMEOUT``, else ``raise``: what a failed transport does
    (``raise``: store the error, release its GPU waits, raise on every later call; ``exit``: also
    log every transport's state and end the process with :data:`~gpuxfer.errors.EXIT_CODE`)."""
    return config.resolve(ENV_ON_TIMEOUT, value, option="on_timeout")
