"""Pipeline-parallel stage hand-off: move a stage's output tensors to the next stage's GPU.

``connect()`` (collective over a CPU group) picks a backend -- ``copy_engine``
(peer copies on copy engines, GPU-side flags, no SM kernel) where every rank
can use it, else ``nccl`` -- and returns this rank's transports::

    conn = connect(group, recv_from=prev, send_to=nxt, specs={"hidden": ((4096, 8192), torch.bfloat16)},
                   options=ConnectOptions(timeout_s=60.0))
    x = conn.receiver().recv().tensors          # deferred: the GPU wait is queued on first access
    conn.sender().send({"hidden": y})
    conn.close()

With ``connect(..., graph=True)`` the steps are captured in the caller's CUDA
graphs and moved by replays, with no host call per step (:mod:`gpuxfer.pp.graph`). Those graphs are the
caller's: never replay one after ``conn.close()`` (its captured steps point at the freed slots and flags).

Importing this package touches no GPU.
"""
from .options import ConnectOptions
from .selection import (BACKENDS, ENV_TRANSPORT, Connection, backend_report, connect, register_backend,
                        requested_backend)
from .spec import SpecTable
from .transport import ENV_TIMEOUT, Received, Transport
from .watchdog import close_all

__all__ = ["BACKENDS", "ENV_TIMEOUT", "ENV_TRANSPORT", "ConnectOptions", "Connection", "Received", "SpecTable", "Transport",
           "backend_report", "close_all", "connect", "register_backend", "requested_backend"]
