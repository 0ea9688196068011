"""Notification words mirrored in host memory (:mod:`gpuxfer.kv.host_notify`): an agent made with
``host_notify=True`` refers to a shared-memory copy of its notification words (a sealed memory file) in its metadata, a peer's notifying
posts write it after the device word, and the agent reads it with a load. Forged names are refused; a copy a peer
cannot map leaves its notifications on the device words alone. (Two processes: ``test_kv_agent_two_procs.py``.)"""
from __future__ import annotations

import json
import os
import struct

import pytest

from _agent_arena import Arena, same_bytes, vllm_layers
from gpuxfer.errors import BadInput, BadMetadata
from gpuxfer.kv.agent import KVAgent
from gpuxfer.kv.metadata import METADATA_VERSION


@pytest.fixture
def mirrored(plat):
    """A prefill agent and a decode agent with host notification words, each with a group, peered both ways."""
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("prefill", platform=plat, device=0, engine="triton", timeout_s=60)
    dec = KVAgent("decode", platform=plat, device=1, engine="triton", timeout_s=60, host_notify=True)
    src, dst = vllm_layers(a0, 1, 4, 4, seed=1), vllm_layers(a1, 1, 4, 4, seed=2)
    pre.register_group("full", 4, src)
    dec.register_group("full", 4, dst)
    p_of_pre = pre.add_peer(dec.metadata())
    yield pre, dec, p_of_pre, src, dst
    dec.close()
    pre.close()
    a0.close()
    a1.close()


def _reblob(blob: bytes, **fields) -> bytes:
    body = json.loads(blob[12:])
    body.update(fields)
    raw = json.dumps(body).encode()
    return struct.pack("<4sHHI", b"GXKV", METADATA_VERSION, 0, len(raw)) + raw


def test_a_notifying_post_writes_the_host_copy_after_the_word(mirrored):
    pre, dec, p_of_pre, src, dst = mirrored
    body = json.loads(dec.metadata()[12:])
    assert body["host_memfd"].startswith("memfd:gpuxfer-kvw-") and "host_words" not in body
    assert p_of_pre.host_words is not None
    assert dec.host_notification(5) == 0 and dec.host_notification(6) == 0
    for n in (1, 2):
        pre.transfer(p_of_pre, "push", local_blocks={"full": [0, 1]}, remote_blocks={"full": [2, 3]},
                     notify_slot=5).wait(60)
        assert dec.host_notification(5) == dec.notification(5) == n     # the data, the word, then its copy
    assert dec.host_notification(6) == 0
    key = next(iter(src))
    assert same_bytes(dst[key][:, 2:4], src[key][:, 0:2])
    for bad in (-1, 64, True, "5"):
        with pytest.raises(BadInput, match="notification slot"):
            dec.host_notification(bad)


def test_an_agent_without_host_words_names_none(pair):
    pre, dec, _, _ = pair
    assert "host_words" not in json.loads(dec.metadata()[12:]) and dec.host_notification(0) is None


_MEMFD = "memfd:gpuxfer-kvw-1f-0123456789ab:3:1a"


@pytest.mark.parametrize("key,name", [
    *[("host_words", n) for n in ["/etc/passwd", "/gpuxfer-ppw-1f-0123456789ab", "/gpuxfer-kvw-1f-0123456789ab/..",
                                  "gpuxfer-kvw-1f-0123456789ab", "/gpuxfer-kvw-1f-0123456789AB", "", 7, ["x"], True,
                                  _MEMFD]],
    *[("host_memfd", n) for n in ["/gpuxfer-kvw-1f-0123456789ab", _MEMFD.replace("kvw", "ppw"), _MEMFD + ":0",
                                  _MEMFD.replace(":3:", ":-3:"), _MEMFD.replace(":3:", ":/proc/self/fd/3:"),
                                  "memfd:/etc/passwd:3:1a", "", 3, True]]])
def test_metadata_naming_other_files_is_refused(mirrored, key, name):
    pre, dec, p_of_pre, _, _ = mirrored
    pre.remove_peer(p_of_pre)
    with pytest.raises(BadMetadata, match=key):
        pre.add_peer(_reblob(dec.metadata(), **{"host_memfd": None, key: name}))


def test_metadata_naming_both_a_segment_and_a_memory_file_is_refused(mirrored):
    pre, dec, p_of_pre, _, _ = mirrored
    pre.remove_peer(p_of_pre)
    with pytest.raises(BadMetadata, match="both"):
        pre.add_peer(_reblob(dec.metadata(), host_words="/gpuxfer-kvw-1f-0123456789ab"))


@pytest.mark.parametrize("key", ["host_words", "host_memfd"])
def test_host_words_a_peer_cannot_map_leave_its_notifications_on_the_device(mirrored, key):
    """A well-formed reference to no words here (another host's or PID namespace's, gone, or forged: a descriptor of
    the decode that is not its words): the peer is added, its notifications reach the device word, and the host copy
    stays behind it (a reader reads the device word too)."""
    pre, dec, p_of_pre, _, _ = mirrored
    pre.remove_peer(p_of_pre)
    ref = json.loads(dec.metadata()[12:])["host_memfd"]
    ghosts = {"host_words": [f"/gpuxfer-kvw-{os.getpid():x}-{'0' * 12}"],
              "host_memfd": [ref.replace(ref.split(":")[1], f"gpuxfer-kvw-{os.getpid():x}-{'0' * 12}"),
                             ref.replace(f":{ref.split(':')[2]}:", ":0:"),          # the decode's stdin
                             ref.replace(f":{ref.split(':')[2]}:", ":99999:")]}     # a descriptor not open
    for slot, ghost in enumerate(ghosts[key], 2):
        peer = pre.add_peer(_reblob(dec.metadata(), **{"host_memfd": None, key: ghost}))
        assert peer.host_words is None
        pre.transfer(peer, "push", local_blocks={"full": [0]}, remote_blocks={"full": [1]}, notify_slot=slot).wait(60)
        assert dec.notification(slot) == 1 and dec.host_notification(slot) == 0
        pre.remove_peer(peer)


def test_host_notification_of_a_closed_agent_is_refused(mirrored):
    pre, dec, _, _, _ = mirrored
    dec.close()
    with pytest.raises(BadInput, match="closed"):
        dec.host_notification(0)


def test_metadata_naming_another_agents_host_words_is_refused(mirrored, plat):
    """A name of the right shape whose segment is another agent's (here: a second decode agent of this host): the
    peer's notifications would move that agent's host copy past its device word, a request of its read as landed
    before any of its bytes came. The segment names the agent that made it: such metadata is ``BadMetadata``."""
    pre, dec, p_of_pre, _, _ = mirrored
    other = KVAgent("decode-2", platform=plat, device=1, engine="triton", timeout_s=60, host_notify=True)
    try:
        pre.remove_peer(p_of_pre)
        theirs = json.loads(other.metadata()[12:])["host_memfd"]
        with pytest.raises(BadMetadata, match="host_words"):
            peer = pre.add_peer(_reblob(dec.metadata(), host_memfd=theirs))
            pre.transfer(peer, "push", local_blocks={"full": [0]}, remote_blocks={"full": [1]}, notify_slot=3).wait(60)
        assert other.host_notification(3) == other.notification(3) == 0
        peer = pre.add_peer(dec.metadata())     # its own name still maps
        assert peer.host_words is not None
    finally:
        other.close()


def test_host_notify_must_be_a_bool(plat):
    for bad in ("no", 1, None):
        with pytest.raises(BadInput, match="host_notify"):
            KVAgent("decode", platform=plat, device=1, engine="triton", timeout_s=60, host_notify=bad)
