"""Typed errors for gpuxfer.

Every failure a user can act on has its own class, so callers can catch what they
can handle and let the rest through. All derive from :class:`GpuxferError`.
"""
from __future__ import annotations


#: the exit code of a process that ends itself on a failed wait (``on_timeout="exit"``): EX_SOFTWARE
EXIT_CODE = 70


class GpuxferError(Exception):
    """Base class of every gpuxfer error."""


class PlatformUnavailable(GpuxferError):
    """A platform (CUDA, ROCm, host) cannot be used here; ``reason`` says why."""

    def __init__(self, platform: str, reason: str):
        super().__init__(f"platform {platform!r} is unavailable: {reason}")
        self.platform = platform
        self.reason = reason


class DriverError(GpuxferError):
    """A CUDA/HIP/HSA call failed.

    Carries the API name, the status name (``CUDA_ERROR_NOT_SUPPORTED``...),
    the numeric status and what gpuxfer was doing when it failed.
    """

    def __init__(self, api: str, status_name: str, status: int, doing: str, detail: str = ""):
        msg = f"{api} failed with {status_name} ({status}) while {doing}"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)
        self.api = api
        self.status_name = status_name
        self.status = status
        self.doing = doing


class TransferTimeout(GpuxferError):
    """A host- or GPU-side wait did not complete in time.

    Names the rank, the step, the flag and the last value seen, so a hang becomes
    a message that says who was waiting for what.
    """

    def __init__(self, *, rank: int, step: int, flag: str, expected: int, seen: int | None,
                 timeout_s: float, what: str = ""):
        seen_s = "unreadable" if seen is None else str(seen)
        msg = (f"rank {rank}: timed out after {timeout_s:g} s at step {step} waiting for flag "
               f"{flag!r} >= {expected} (last value seen: {seen_s})")
        if what:
            msg += f" [{what}]"
        super().__init__(msg)
        self.rank = rank
        self.step = step
        self.flag = flag
        self.expected = expected
        self.seen = seen
        self.timeout_s = timeout_s


class BadInput(GpuxferError, ValueError):
    """The caller passed something gpuxfer cannot use (shape, dtype, size, preset...)."""


class GraphModeError(BadInput):
    """Graph-mode and eager steps were mixed: a graph-mode transport used outside CUDA graph capture, or its
    captured receive materialized after the capture ended."""


class VerificationFailed(GpuxferError):
    """Transferred bytes do not match what was sent."""

    def __init__(self, message: str, *, wrong_bytes: int, first_bad: int | None = None):
        super().__init__(message)
        self.wrong_bytes = wrong_bytes
        self.first_bad = first_bad


class BackendUnavailable(GpuxferError):
    """A transport backend or KV engine cannot run here.

    ``reasons`` maps rank (or a label) to that rank's reason, so a forced backend
    fails on every rank with every rank's reason.
    """

    def __init__(self, backend: str, reasons: dict):
        lines = "; ".join(f"rank {r}: {why}" for r, why in sorted(reasons.items(), key=lambda kv: str(kv[0])))
        super().__init__(f"backend {backend!r} is unusable: {lines}")
        self.backend = backend
        self.reasons = dict(reasons)


class NotExportable(GpuxferError):
    """Memory cannot be shared with another process over IPC on this platform.

    E.g. torch's expandable segments or other virtual-memory (``cuMemCreate``)
    allocations on CUDA, managed or host memory, or, on the host emulation, memory
    that is not a shared-memory buffer of the platform. ``reason`` says which.
    """

    def __init__(self, what: str, reason: str):
        super().__init__(f"{what} cannot be exported over IPC: {reason}")
        self.reason = reason


class BlockIdError(BadInput):
    """A KV transfer's block IDs are unusable: out of range, duplicated on the destination,
    or not matching the other side's count. Names the group and the first offending ID."""


class LayoutMismatch(BadInput):
    """Two sides' registered KV caches cannot be paired: a group, a layer or a piece differs."""


class NotRegistered(BadInput):
    """A tensor, group or peer the call names was never registered (or was removed)."""


class BadMetadata(BadInput):
    """Peer metadata bytes are malformed, of another version, or describe impossible memory."""


class PeerLost(TransferTimeout):
    """The peer of a pair is gone: its connection closed (it crashed or exited) before a wait finished.

    A :class:`TransferTimeout` (a caller that handles timeouts handles this too), raised as
    soon as the CPU group reports the closed connection instead of when the timeout expires.
    """

    def __init__(self, *, rank: int, peer: int, step: int, flag: str, after_s: float, detail: str = "",
                 why: str = ""):
        why = why or f"its connection closed (rank {peer} crashed or exited)"
        GpuxferError.__init__(
            self, f"rank {rank}: lost rank {peer} after {after_s:.2f} s at step {step} while waiting for "
                  f"{flag!r}: {why}" + (f" [{detail}]" if detail else ""))
        self.rank, self.peer, self.step, self.flag = rank, peer, step, flag
        self.expected, self.seen, self.timeout_s = step, None, after_s


class ProtocolError(GpuxferError):
    """A peer sent something the protocol forbids (metadata out of order, a shape larger than its slot...)."""


class TransferMismatch(ProtocolError):
    """The two sides of a two-sided (``pack``) transfer posted different requests: other block IDs, groups, layers
    or block counts, or their posts paired up in another order. Found on the device before the destination's
    blocks are touched; both agents fail with it (their pairing of transfers is lost)."""


class SetupFailed(GpuxferError):
    """A collective setup (``pp.connect``) could not finish: a rank died or left mid-way."""
