"""Pools owned by a helper process on another device, opened here over IPC.

Used by ``gpuxfer bench kernels`` (and tests) to get a peer GPU's memory into this
process exactly the way a KV engine does: the owner allocates raw buffers with
the platform, exports IPC handles, and this process opens them on its own device
and wraps them with ``platform.as_tensor``. The helper also fills and verifies its
own buffers on request, so a check can run in the process that owns the bytes.

Every wait on the helper has a timeout (:class:`TransferTimeout` naming the
command); :meth:`PeerPools.close` joins it with a timeout and checks its exit code.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback

from ..errors import BadInput, GpuxferError, TransferTimeout

_POLL_S = 0.5


def _helper_main(platform_name: str, device: int, sizes: list[int], conn, parent_pid: int) -> None:
    import numpy as np  # noqa: F401 - the descriptor arrays arrive as numpy
    import torch

    from ..platforms import get_platform
    from . import launch

    plat = get_platform(platform_name)
    bufs = []
    try:
        plat.set_device(device)
        bufs = [plat.alloc(n, device) for n in sizes]
        conn.send(("ok", [plat.export_handle(b) for b in bufs]))
        while True:
            if not conn.poll(_POLL_S):
                if os.getppid() != parent_pid:     # the parent died: do not linger
                    return
                continue
            cmd, *args = conn.recv()
            try:
                if cmd == "exit":
                    conn.send(("ok", None))
                    return
                t = plat.as_tensor(bufs[args[0]])
                if cmd == "fill":
                    launch.fill_pattern(t, args[1])
                    if t.device.type == "cuda":
                        torch.cuda.synchronize(t.device)
                    conn.send(("ok", None))
                elif cmd == "verify":
                    d = torch.from_numpy(args[1]).to(t.device)
                    r = launch.verify(t, d, args[2])
                    conn.send(("ok", (r.wrong_bytes, r.first_bad)))
                else:
                    conn.send(("error", f"unknown command {cmd!r}"))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        raise
    finally:
        for b in bufs:
            b.close()
        plat.close()


class PeerPools:
    """``len(sizes)`` buffers allocated on ``peer_device`` by a helper process,
    opened in this process on ``local_device``.

    ``tensors[i]`` is a uint8 tensor over buffer ``i`` on the local device (a CPU
    tensor on the host emulation). Close (or use as a context manager) to unmap
    the buffers and stop the helper.
    """

    def __init__(self, platform, peer_device: int, local_device: int, sizes: list[int], *,
                 timeout_s: float = 180.0):
        self.platform, self.peer_device, self.local_device = platform, peer_device, local_device
        self.timeout_s = timeout_s
        self.mappings, self.tensors = [], []
        self._closed = False
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_helper_main, name=f"gpuxfer-peer-{peer_device}",
                                 args=(platform.name, peer_device, list(sizes), child, os.getpid()), daemon=True)
        self._proc.start()
        child.close()
        try:
            handles = self._reply("start", timeout_s)
            for h in handles:
                m = platform.open_handle(h, local_device)
                self.mappings.append(m)
                self.tensors.append(platform.as_tensor(m))
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _reply(self, what: str, timeout_s: float):
        waited = 0.0
        while not self._conn.poll(_POLL_S):
            waited += _POLL_S
            if not self._proc.is_alive():
                raise GpuxferError(f"peer helper (pid {self._proc.pid}, device {self.peer_device}) exited with "
                                   f"code {self._proc.exitcode} during {what!r}")
            if waited >= timeout_s:
                raise TransferTimeout(rank=self.peer_device, step=0, flag=f"peer helper reply to {what!r}",
                                      expected=1, seen=None, timeout_s=timeout_s,
                                      what=f"helper pid {self._proc.pid}")
        status, value = self._conn.recv()
        if status != "ok":
            raise GpuxferError(f"peer helper (pid {self._proc.pid}) failed during {what!r}:\n{value}")
        return value

    def call(self, cmd: str, *args, timeout_s: float | None = None):
        """Run ``fill(index, seed)`` or ``verify(index, descs_numpy, seed) -> (wrong, first_bad)`` in the helper."""
        if self._closed:
            raise BadInput(f"peer pools of helper pid {self._proc.pid} are closed: no {cmd!r}")
        try:
            self._conn.send((cmd, *args))
        except OSError as exc:          # the helper's end of the pipe is gone
            raise GpuxferError(f"peer helper (pid {self._proc.pid}, device {self.peer_device}) cannot take "
                               f"{cmd!r}: {exc} (exit code {self._proc.exitcode})") from None
        return self._reply(cmd, self.timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.tensors.clear()
        for m in self.mappings:
            m.close()
        self.mappings.clear()
        try:
            if self._proc.is_alive():
                self._conn.send(("exit",))
                self._reply("exit", 60.0)
        except Exception:
            pass
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
            raise GpuxferError(f"peer helper (pid {self._proc.pid}) did not exit within 30 s; killed")
        self._conn.close()
        if self._proc.exitcode != 0:
            raise GpuxferError(f"peer helper (pid {self._proc.pid}) exited with code {self._proc.exitcode}")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
