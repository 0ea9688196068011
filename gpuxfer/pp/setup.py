"""The collective setup phases of :func:`gpuxfer.pp.selection.connect`.

Every rank runs every phase and exchanges its errors with the others after each
one (no early returns), so all ranks reach the same verdict::

    connect ── setup_peer_memory   check ─ alloc ─ open ─ probe send ─ probe check ─ finish
           │     (a zero-SM backend; each step ends in an exchange of errors; a failure:
           │      close mappings, barrier, free)
           ├── setup_nccl          (the fallback, or forced)
           ├── setup_mailboxes     shared-memory metadata for same-host pairs
           └── setup_pair_groups   a two-rank gloo group per pair whose waits may time out

:func:`discard` cleans up after a setup that failed collectively.
"""
from __future__ import annotations

import logging

from ..errors import BackendUnavailable, GpuxferError, SetupFailed

log = logging.getLogger("gpuxfer.pp")


def reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def fail_if_injected(phases: set[str], phase: str) -> None:
    if phase in phases:
        raise GpuxferError(f"injected setup failure in phase {phase!r} (GPUXFER_PP_INJECT_FAILURE)")


def setup_mailboxes(exchange, infos, ends, tag_of, nonce: int, rank: int, mode: str) -> None:
    """Give each same-host pair with metadata a shared-memory mailbox (:mod:`gpuxfer.pp.mailbox`).

    Every rank runs both exchanges. Phase 1: each receiver creates its pair's mailbox;
    phase 2: the sender opens it where it was made. Both ends switch to it only if the
    sender opened it; the receiver unlinks the segment either way, so none outlives setup.
    A pair that cannot (another host, ``GPUXFER_PP_META_CHANNEL=group``, an error) keeps
    the CPU group; an error is logged.
    """
    from ..common import unlink_shm
    from .mailbox import Mailbox, segment_name

    def name(pair) -> str:       # pair = (sender, receiver); the receiver creates it
        return segment_name(infos[pair[1]]["pid"], nonce, tag_of[pair])

    def eligible(t) -> bool:
        return t.metadata and mode == "auto" and infos[t.peer]["host"] == infos[rank]["host"]

    created, made, boxes, opened = {}, {}, {}, {}
    try:
        for t in ends:
            if t.role == "recv" and eligible(t):
                pair = (t.peer, rank)
                try:
                    created[pair] = Mailbox.create(name(pair), t.specs.meta_len, nonce)
                    made[pair] = None
                except Exception as exc:  # noqa: BLE001 - the pair keeps the CPU group
                    made[pair] = reason(exc)
        seen = exchange({"rank": rank, "made": made}, ("made",))
        for t in ends:
            pair = (rank, t.peer)
            if t.role == "send" and eligible(t) and pair in seen[t.peer]["made"]:
                try:
                    if seen[t.peer]["made"][pair] is not None:
                        raise GpuxferError(f"rank {t.peer} could not create it: {seen[t.peer]['made'][pair]}")
                    boxes[pair] = Mailbox.open(name(pair), t.specs.meta_len, nonce)
                    opened[pair] = None
                except Exception as exc:  # noqa: BLE001
                    opened[pair] = reason(exc)
        got = exchange({"rank": rank, "opened": opened}, ("opened",))
    except SetupFailed:
        for t in ends:    # a receiver that died after creating its box left it: the surviving sender unlinks
            if t.role == "send" and eligible(t):
                unlink_shm(name((rank, t.peer)))
        for box in list(created.values()) + list(boxes.values()):
            box.close()
        raise
    finally:
        for box in created.values():
            box.unlink()
    for t in ends:
        if t.role == "send":
            pair = (rank, t.peer)
            if pair in boxes:
                t.meta = boxes[pair]
            elif opened.get(pair) is not None:
                log.warning("rank %d: metadata to rank %d over the CPU group: mailbox: %s", rank, t.peer,
                            opened[pair])
            continue
        pair = (t.peer, rank)
        if made.get(pair) is not None:
            log.warning("rank %d: metadata from rank %d over the CPU group: mailbox: %s", rank, t.peer, made[pair])
        box = created.get(pair)
        if box is not None and got[t.peer]["opened"].get(pair, "not opened") is None:
            t.meta = box
        elif box is not None:
            box.close()


def setup_peer_memory(name, cls, exchange, infos, my_pairs, common, tag_of, nonce, *, recv_slots, flag_path,
                       inline_bytes, inject, recv_views=False):
    """The collective setup of a zero-SM backend; returns (ok, reasons by rank, ends)."""
    import torch.distributed as dist
    rank, plat, device = common["rank"], common["platform"], common["device"]
    ends: list = []
    failed: dict[int, str] = {}

    def step(fn, obj=None):
        nonlocal failed
        err = None
        if not failed:
            try:
                obj = fn()
            except Exception as exc:  # noqa: BLE001 - exchanged below
                err = reason(exc)
        try:
            got = exchange({"rank": rank, "err": err, "obj": obj}, ("err", "obj"))
        except SetupFailed:
            discard(ends)
            raise
        if not failed:
            failed = {r: g["err"] for r, g in got.items() if g["err"]}
        return got

    # 1. local checks, allocation, export
    def prepare():
        fail_if_injected(inject, "check")
        why = cls.unavailable_reason(plat, device)
        if why:
            raise GpuxferError(why)
        me = infos[rank]
        for role, peer, pair, spec in my_pairs:
            pi = infos[peer]
            if pi["host"] != me["host"]:
                raise GpuxferError(f"rank {peer} runs on host {pi['host']!r}, this rank on {me['host']!r}: "
                                   f"{name} needs both stages on one node")
            peer_dev = local_index(plat, pi)
            link = plat.link(device, peer_dev)
            if not link.is_fast:
                raise GpuxferError(f"device {device} and rank {peer}'s device {peer_dev} are linked by {link.kind}"
                                   f"{' (' + link.detail + ')' if link.detail else ''}, not NVLink-class")
        fail_if_injected(inject, "alloc")
        payloads = {}
        for role, peer, pair, spec in my_pairs:
            t = cls(role=role, peer=peer, specs=spec, tag_base=tag_of[pair], recv_slots=recv_slots,
                    flag_path=flag_path, inline_bytes=inline_bytes, recv_views=recv_views, **common)
            ends.append(t)
            payloads[pair] = t.setup_prepare()
        return payloads

    got = step(prepare, {})

    def peer_obj(g, t):
        pair = (t.rank, t.peer) if t.role == "send" else (t.peer, t.rank)
        return g[t.peer]["obj"][pair]

    # 2. open the peers' handles
    def open_():
        fail_if_injected(inject, "open")
        for t in ends:
            t.setup_open(peer_obj(got, t))
        return {}

    step(open_, {})

    # 3. probe: write into the peers' probe words
    def probe_send():
        fail_if_injected(inject, "probe")
        return {((t.rank, t.peer) if t.role == "send" else (t.peer, t.rank)): t.setup_probe_send(nonce) for t in ends}

    sent = step(probe_send, {})

    # 4. probe: check what the peers wrote here
    def probe_check():
        return {((t.rank, t.peer) if t.role == "send" else (t.peer, t.rank)): t.setup_probe_check(peer_obj(sent, t))
                for t in ends}

    checked = step(probe_check, {})

    # 5. choose the flag paths (a forced path that does not work fails here)
    def finish():
        for t in ends:
            t.setup_finish(peer_obj(checked, t))
        return {}

    step(finish, {})

    if not failed:
        return True, {}, ends
    # every rank: close mappings, barrier, free
    for t in ends:
        try:
            t._release_waits()
            t._close_mappings()
        except Exception as exc:  # noqa: BLE001
            log.warning("rank %d: closing %s mappings after a failed setup: %s", rank, name, exc)
    try:
        dist.barrier(group=common["group"])
    except RuntimeError as exc:
        discard(ends)
        raise SetupFailed(f"rank {rank}: pp connect: the barrier after a failed {name} setup failed: a rank "
                          f"died or left connect() ({exc})") from exc
    for t in ends:
        try:
            t._free()
        except Exception as exc:  # noqa: BLE001
            log.warning("rank %d: freeing %s buffers after a failed setup: %s", rank, name, exc)
        t._state = "closed"
    return False, failed, []


def setup_pair_groups(ends, tag_of, nonce: int, rank: int) -> None:
    """Give each pair whose metadata travels over the CPU group (and each ``nccl`` pair on the host
    emulation, whose data would) a two-rank gloo group of its own, so a wait that times out (gloo then
    closes the pair) never breaks the caller's group.

    Made through the default group's store, pair by pair in one global order (sorted by (sender,
    receiver)), so no two ranks wait on each other's later pair; the sender is rank 0 of its pair.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store
    from datetime import timedelta

    def pair_of(t):
        return (t.rank, t.peer) if t.role == "send" else (t.peer, t.rank)

    todo = sorted((t for t in ends if (t.metadata and t.meta is t.channel) or getattr(t, "wants_pair_group", False)),
                  key=pair_of)
    for t in todo:
        pair = pair_of(t)
        store = dist.PrefixStore(f"gpuxfer-pp/{nonce:x}/{tag_of[pair]:x}/group", _get_default_store())
        try:
            pg = dist.ProcessGroupGloo(store, 0 if t.role == "send" else 1, 2,
                                       timedelta(seconds=min(t.timeout_s, 120.0)))
        except RuntimeError as exc:
            raise SetupFailed(f"rank {rank}: pp connect: the metadata group of the pair {pair[0]} -> {pair[1]} "
                              f"could not be made: rank {t.peer} died or left connect() ({exc})") from exc
        peer_rank = 1 if t.role == "send" else 0
        t.channel.use_pair_group(pg, peer_rank)
        if getattr(t, "wants_pair_group", False):
            t.use_pair_group(pg, peer_rank)


def discard(ends) -> None:
    """After a failed collective setup: drop the names of what was exported (no peer opens them now), release
    and free what no peer maps (as abort does)."""
    for t in ends:
        try:
            t._unpublish()
            t._release_waits()
            t._close_mappings()
            t._free_local()
            t._close_meta()
        except Exception as exc:  # noqa: BLE001 - best effort, the setup error is what the caller needs
            log.warning("rank %d: cleaning up after a failed setup: %s", t.rank, exc)
        t._state = "closed"


def local_index(plat, peer_info) -> int:
    """The peer's device as numbered in this process (PCI bus id where the platform knows it)."""
    pci = peer_info.get("pci")
    if pci is None:
        return int(peer_info["device"])
    for i in range(plat.device_count()):
        if plat.device_info(i).pci_bus_id == pci:
            return i
    raise GpuxferError(f"rank {peer_info['rank']}'s device (PCI {pci}) is not visible in this process "
                       f"(CUDA_VISIBLE_DEVICES?)")


def nccl_same_device(infos, my_pairs, not_nccl: bool) -> str | None:
    """Why NCCL cannot join this rank's pairs: two ranks on one device, which NCCL refuses at its first
    operation ("Duplicate GPU detected"); None if every pair spans two devices (or gloo moves the tensors)."""
    if not_nccl:
        return None
    for _role, _peer, (a, b), _spec in my_pairs:
        ia, ib = infos[a], infos[b]
        if ia["host"] != ib["host"]:
            continue
        if (ia["pci"] == ib["pci"]) if ia["pci"] is not None else (ia["device"] == ib["device"]):
            where = f"device {ia['device']}" + (f" (PCI {ia['pci']})" if ia["pci"] else "")
            return (f"ranks {a} and {b} share {where}: NCCL refuses two ranks on one device; "
                    "use copy_engine for a same-device pair")
    return None


def setup_nccl(exchange, infos, my_pairs, common, tag_of, plat, group, device_group, unavailable: str | None):
    import torch.distributed as dist
    from .nccl import NcclTransport
    rank = common["rank"]
    why = unavailable or nccl_same_device(infos, my_pairs, plat.collective_backend != "nccl")
    got = exchange({"rank": rank, "err": why}, ("err",))
    failed = {r: g["err"] for r, g in got.items() if g["err"]}
    if failed:
        raise BackendUnavailable(NcclTransport.name, failed)
    if device_group is None:
        if plat.collective_backend != "nccl" or "nccl" in str(dist.get_backend(group)).lower():
            device_group = group
        else:   # collective over the default group: every process calls connect
            device_group = dist.new_group(ranks=sorted(infos), backend="nccl")
    ends, err = [], None
    try:
        for role, peer, pair, spec in my_pairs:
            ends.append(NcclTransport(role=role, peer=peer, specs=spec, tag_base=tag_of[pair],
                                      device_group=device_group, data_tag=tag_of[pair] + 2, **common))
    except Exception as exc:  # noqa: BLE001
        err = reason(exc)
    try:
        got = exchange({"rank": rank, "err": err}, ("err",))
    except SetupFailed:
        discard(ends)
        raise
    failed = {r: g["err"] for r, g in got.items() if g["err"]}
    if failed:
        for t in ends:
            t._free()
            t._state = "closed"
        raise BackendUnavailable(NcclTransport.name, failed)
    return ends
