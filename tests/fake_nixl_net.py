"""The fake NIXL of tests/fake_nixl.py, reaching across processes as a network transport would.

Inject it as the NIXL module of the benchmark's spawned ranks: ``GPUXFER_NIXL_MODULE=fake_nixl_net``
and ``FAKE_NIXL_NET_DIR`` = an empty directory (the notification mailboxes); ``tests/`` must be on
``sys.path`` (conftest.py puts it there, and spawned children inherit it).

What differs from ``FakeNixl``, whose agents share one process: an agent's metadata carries,
for every region it registered, the shared-memory file behind it (found in
``/proc/self/maps``: the host emulation's pools are POSIX shared memory); the peer maps
those files itself and a ``READ`` / ``WRITE`` copies through that mapping -- the benchmark's
own IPC mapping of the peer pool is never used. Notifications are files in the peer's mailbox
directory. Everything else (argument checks, call log, telemetry, handle bookkeeping) is
``FakeNixl``'s. Linux only.
"""
from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import pickle

import numpy as np

from fake_nixl import FakeNixl

DIR_ENV = "FAKE_NIXL_NET_DIR"


def _backing(addr: int) -> tuple[str, int]:
    """The file mapped at ``addr`` in this process and the offset of ``addr`` in it."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi and len(parts) == 6 and parts[5].strip().startswith("/"):
                return parts[5].strip(), int(parts[2], 16) + (addr - lo)
    raise AssertionError(f"0x{addr:x} is not inside a file mapping (not a host-emulation pool?)")


class NetFakeNixl(FakeNixl):
    """A module-like fake whose agents live in different processes."""

    def __init__(self, **kw):
        super().__init__(**kw)
        fake = self

        class nixl_agent(NetFakeNixl.NetAgent):  # noqa: N801 - NIXL's name
            def __init__(self, name, conf):
                super().__init__(fake, name, conf)

        self.nixl_agent = nixl_agent

    class NetAgent(FakeNixl.Agent):
        def __init__(self, fake, name, conf):
            super().__init__(fake, name, conf)
            self.mailbox = os.path.join(os.environ[DIR_ENV], name)
            os.makedirs(self.mailbox, exist_ok=True)
            self.peers: dict[str, dict] = {}       # name -> {"regions": [(addr, n, local_addr)], "mailbox"}
            self._maps: list = []
            self._seq = itertools.count()

        def get_agent_metadata(self):
            regions = [(a, n) + _backing(a) for a, n in self.regions]
            return pickle.dumps({"name": self.name, "regions": regions, "mailbox": self.mailbox})

        def add_remote_agent(self, md):
            info = pickle.loads(md)
            regions = []
            for a, n, path, off in info["regions"]:
                with open(path, "r+b") as f:
                    mm = mmap.mmap(f.fileno(), off + n)
                self._maps.append(mm)
                base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
                regions.append((a, n, base + off))
            self.peers[info["name"]] = {"regions": regions, "mailbox": info["mailbox"]}
            self.remotes.add(info["name"])
            self._log("add_remote_agent", info["name"])
            return info["name"]

        def _check_rows(self, owner, rows):
            regions = self.regions if owner == self.name else [(a, n) for a, n, _ in self.peers[owner]["regions"]]
            for a, n, _ in np.asarray(rows).tolist():
                assert any(ra <= a and a + n <= ra + rn for ra, rn in regions), \
                    f"row 0x{a:x}+{n} not inside a region registered by {owner}"

        def _here(self, peer: str, addr: int, n: int) -> int:
            for a, rn, local in self.peers[peer]["regions"]:
                if a <= addr and addr + n <= a + rn:
                    return local + (addr - a)
            raise AssertionError(f"0x{addr:x}+{n} is not in a region of {peer}")

        def _post(self, peer: str, msg: bytes) -> None:
            box = self.peers[peer]["mailbox"]
            name = f"{self.name}@{os.getpid()}-{next(self._seq):08d}"
            tmp = os.path.join(box, "." + name)
            with open(tmp, "wb") as f:
                f.write(msg)
            os.replace(tmp, os.path.join(box, name))

        def send_notif(self, remote, msg):
            self._post(remote, msg)

        def check_remote_xfer_done(self, remote, tag):
            for name in sorted(os.listdir(self.mailbox)):
                if not name.startswith(remote + "@"):
                    continue
                path = os.path.join(self.mailbox, name)
                with open(path, "rb") as f:
                    msg = f.read()
                if msg.startswith(tag):
                    os.unlink(path)
                    return True
            return False


_fake = NetFakeNixl()
nixl_agent = _fake.nixl_agent
nixl_agent_config = _fake.nixl_agent_config
