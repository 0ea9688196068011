"""A module-like fake of NIXL's Python API (``FakeNixl``): agents in one process that really copy.

The ``fake_nixl`` fixture (tests/kv/conftest.py) installs it as the NIXL module; tests/fake_nixl_net.py
builds on it to reach across processes.
"""
from __future__ import annotations

import ctypes
import types

import numpy as np


class FakeNixl:
    """A module-like fake of NIXL's Python API that moves bytes in this process (ctypes.memmove).

    Agents in one process see each other through a shared registry, so a READ or a
    WRITE really copies. ``stuck=True`` leaves every transfer in PROC forever.
    """

    def __init__(self, *, stuck=False, plugins=("UCX",), telemetry=True):
        self.calls: list[tuple] = []
        self.agents: dict[str, "FakeNixl.Agent"] = {}
        self.stuck, self.plugins, self.with_telemetry = stuck, list(plugins), telemetry
        fake = self

        class nixl_agent_config:  # noqa: N801 - NIXL's name
            def __init__(self, enable_prog_thread=True, enable_listen_thread=False, listen_port=0,
                         capture_telemetry=False, num_threads=0, backends=("UCX",)):
                self.backends, self.capture_telemetry = list(backends), capture_telemetry

        class nixl_agent(FakeNixl.Agent):  # noqa: N801
            def __init__(self, name, conf):
                super().__init__(fake, name, conf)

        self.nixl_agent_config = nixl_agent_config
        self.nixl_agent = nixl_agent

    class Handle:
        def __init__(self, kind, **kw):
            self.kind, self.released, self.__dict__["kw"] = kind, False, kw

    class Agent:
        def __init__(self, fake, name, conf):
            self.fake, self.name, self.conf = fake, name, conf
            self.regions: list[tuple[int, int]] = []
            self.remotes: set[str] = set()
            self.notifs: dict[str, list[bytes]] = {}
            fake.agents[name] = self
            self._log("nixl_agent", name)

        def _log(self, *call):
            self.fake.calls.append((self.name,) + call)

        def get_plugin_list(self):
            return list(self.fake.plugins)

        def register_memory(self, regs, mem_type):
            self._log("register_memory", mem_type, len(regs))
            self.regions += [(a, n) for a, n, _dev, _meta in regs]
            return FakeNixl.Handle("reg", regs=regs)

        def deregister_memory(self, h):
            self._log("deregister_memory")

        def get_agent_metadata(self):
            return self.name.encode()

        def add_remote_agent(self, md):
            name = md.decode()
            assert name in self.fake.agents, "metadata of an unknown agent"
            self.remotes.add(name)
            self._log("add_remote_agent", name)
            return name

        def remove_remote_agent(self, name):
            self._log("remove_remote_agent", name)
            self.remotes.discard(name)

        def make_connection(self, remote):
            self._log("make_connection", remote)

        def _check_rows(self, owner, rows):
            regions = self.fake.agents[owner].regions
            for a, n, _ in rows.tolist():
                assert any(ra <= a and a + n <= ra + rn for ra, rn in regions), \
                    f"row 0x{a:x}+{n} not inside a region registered by {owner}"

        def prep_xfer_dlist(self, agent_name, rows, mem_type):
            owner = self.name if agent_name in ("NIXL_INIT_AGENT", "") else agent_name
            assert owner == self.name or owner in self.remotes, f"prep for unknown agent {owner}"
            rows = np.asarray(rows)
            assert rows.dtype == np.uint64 and rows.ndim == 2 and rows.shape[1] == 3
            self._check_rows(owner, rows)
            self._log("prep_xfer_dlist", "local" if owner == self.name else "remote", len(rows))
            return FakeNixl.Handle("dlist", rows=rows.copy(), owner=owner)

        def release_dlist_handle(self, h):
            assert not h.released
            h.released = True
            self._log("release_dlist_handle")

        def make_prepped_xfer(self, op, lh, li, rh, ri, notif=b""):
            assert op in ("READ", "WRITE") and not lh.released and not rh.released
            li, ri = np.asarray(li), np.asarray(ri)
            assert li.dtype == np.int32 and ri.dtype == np.int32 and len(li) == len(ri)
            self._log("make_prepped_xfer", op, len(li))
            return FakeNixl.Handle("xfer", op=op, local=lh.kw["rows"][li], remote=rh.kw["rows"][ri],
                                   peer=rh.kw["owner"], notif=notif)

        def get_xfer_descs(self, rows, mem_type):
            rows = np.asarray(rows)
            assert rows.dtype == np.uint64
            return rows.copy()

        def initialize_xfer(self, op, loc, rem, remote, notif=b""):
            assert remote in self.remotes
            self._check_rows(self.name, loc)
            self._check_rows(remote, rem)
            self._log("initialize_xfer", op, len(loc))
            return FakeNixl.Handle("xfer", op=op, local=loc, remote=rem, peer=remote, notif=notif)

        def transfer(self, h, notif_msg=b""):
            assert not h.released
            self._log("transfer", h.kw["op"])
            if self.fake.stuck:
                h.state = "PROC"
                return "PROC"
            peer = h.kw["peer"]
            for (la, n, _), (ra, rn, _) in zip(h.kw["local"].tolist(), h.kw["remote"].tolist()):
                assert n == rn
                there = self._here(peer, ra, n)
                if h.kw["op"] == "READ":
                    ctypes.memmove(la, there, n)
                else:
                    ctypes.memmove(there, la, n)
            if h.kw["notif"]:
                self.send_notif(peer, h.kw["notif"])
            h.state = "DONE"
            return "PROC"  # report DONE on the first check, as a real asynchronous transfer would

        def _here(self, peer, addr, n):
            """The peer's address ``addr`` as seen from this process (one process: the same)."""
            return addr

        def check_xfer_state(self, h):
            return h.state

        def get_xfer_telemetry(self, h):
            if not self.fake.with_telemetry:
                raise RuntimeError("telemetry was not captured")
            return types.SimpleNamespace(postDuration=3, xferDuration=7, descCount=len(h.kw["local"]),
                                         totalBytes=int(h.kw["local"][:, 1].sum()), startTime=0)

        def query_xfer_backend(self, h):
            return "UCX"

        def release_xfer_handle(self, h):
            assert not h.released
            h.released = True
            self._log("release_xfer_handle")

        def send_notif(self, remote, msg):
            self.fake.agents[remote].notifs.setdefault(self.name, []).append(msg)

        def get_new_notifs(self):
            out, self.notifs = self.notifs, {}
            return out

        def check_remote_xfer_done(self, remote, tag):
            msgs = self.notifs.get(remote, [])
            for m in msgs:
                if m.startswith(tag):
                    msgs.remove(m)
                    return True
            return False
