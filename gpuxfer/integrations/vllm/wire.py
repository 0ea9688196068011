"""A decode load as the loader process receives it (:mod:`.loader`): plain values -- strings, numbers, the block
IDs as raw int64 bytes -- pickled, since a pickle of numpy arrays and dataclasses costs a cold engine thread several
times more. The scheduler side makes each load's record as it hands the load to the workers (:func:`encode_load`,
kept in :attr:`.loads.Load.wire`), as it makes what the params' seal covers; a load without one is encoded when
it is sent.
"""
from __future__ import annotations

import dataclasses
import pickle
from typing import Sequence

import numpy as np

from .loads import Load
from .params import RemotePrefill

_RP_FIELDS = tuple(f.name for f in dataclasses.fields(RemotePrefill))
_RP_IDS = _RP_FIELDS.index("block_ids")
_I64 = np.dtype(np.int64)


def _ids(arrays) -> tuple[bytes, ...]:
    return tuple((a if a.dtype == _I64 else a.astype(_I64)).tobytes() for a in arrays)


def _arrays(ids) -> tuple[np.ndarray, ...]:
    return tuple(np.frombuffer(b, dtype=_I64) for b in ids)


def encode_load(ld: Load) -> bytes:
    """One load's record."""
    rp = ld.remote
    vals = [getattr(rp, f) for f in _RP_FIELDS]
    vals[_RP_IDS] = _ids(vals[_RP_IDS])
    return pickle.dumps((ld.req_id, ld.start, ld.end, _ids(ld.local_ids), vals, rp.__dict__.get("signed")), 5)


def encode_loads(loads: Sequence[Load]) -> bytes:
    """A step's loads as one command of the loader's ring."""
    return pickle.dumps(("start", [ld.wire or encode_load(ld) for ld in loads]), 5)


def decode_load(rec: bytes) -> Load:
    req, start, end, local, vals, signed = pickle.loads(rec)
    vals = list(vals)
    vals[_RP_IDS] = _arrays(vals[_RP_IDS])
    rp = RemotePrefill(*vals)
    if signed is not None:
        rp.__dict__["signed"] = signed              # (the scheduler side's, as a worker in its process gets it)
    return Load(req, rp, _arrays(local), start, end)
