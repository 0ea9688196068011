"""KV transfer engines: one interface, measured on the same descriptors.

An *engine* moves a burst of descriptor tables (:class:`DescriptorBurst`) from the prefill side's pool
to the decode side's pool; both sides build it over a :class:`Side` (see :mod:`.base` for the
interface, armed posting and the failure path). The package, one module per engine or family:

* :mod:`.base` -- :class:`Role`, :class:`Side`, :class:`DescriptorBurst`, :class:`Prepared` (the transfer
  record), :class:`Gate`, :class:`Engine`, the bounded waits;
* :mod:`.chunks` -- splitting and chunking descriptor tables; :mod:`.launch` -- what kernel engines share;
* :mod:`.kvagent` (``triton``, ``pack``, ``copy_engine``: through the public KV API, by block ID);
  :mod:`.triton` (``triton-table``), :mod:`.pack` (``pack-table``), :mod:`.copy_engine`
  (``copy_engine-table``, ``bulk``): the same copies over descriptor tables handed in per burst;
  :mod:`.nixl` over :mod:`gpuxfer.kv.nixl_ffi`, :mod:`.mooncake`, :mod:`.mori`;
* :mod:`.registry` -- ``ENGINES``, the one registry (name -> class or ``"module:Class"``).

Built-in engines (the default rows go through :class:`~gpuxfer.kv.agent.KVAgent`: each side registers
its pool layout as KV-cache groups, the two swap metadata bytes, every request is one transfer by block
ID; a ``-table`` engine is handed the burst's descriptor tables and uploads them per burst):

* ``triton`` / ``triton-table`` -- the copy kernel (``triton``: KVAgent's, by default over the block IDs;
  ``triton-table``: over the descriptor tables): pull runs on the decode GPU reading the
  peer pool through the IPC mapping, push on the prefill GPU writing it. Uses SMs of the initiating GPU,
  none of the other.
* ``pack`` / ``pack-table`` -- pack the pages into a staging buffer on the source, one copy-engine transfer
  per chunk into the destination's staging buffer, unpack on the destination; chunked and pipelined. No
  SM touches the wire. Both sides post.
* ``copy_engine`` / ``copy_engine-table`` -- ``copy_batch_async`` over the descriptors, no SM at all; a
  fixed cost per descriptor.
* ``bulk`` -- one descriptor of the same total bytes on the copy engines: the ceiling every row is divided by.

Importing the package imports neither torch, Triton nor any engine's optional library.
"""
from __future__ import annotations

from .base import (CROSS_HOST_PEER_MAPPING, ENV_KV_ON_TIMEOUT, EXIT_CODE, BurstShape, DescriptorBurst, Engine,
                   EngineOptions, FailsOnTimeout, Gate, Prepared, Role, Side, as_descriptors, check_direction,
                   initiator_of, on_timeout_from_env)
from .chunks import bulk_descriptors, chunk_plan, split_large
from .copy_engine import BulkEngine, CopyEngineEngine
from .pack import PackEngine
from .registry import (DEFAULT_ENGINES, ENGINES, engine_class, engine_report, engine_unavailable_reason,
                       measurement_order, parse_engines, register_engine)
from .triton import TritonEngine

__all__ = ["CROSS_HOST_PEER_MAPPING", "DEFAULT_ENGINES", "ENGINES", "ENV_KV_ON_TIMEOUT", "EXIT_CODE",
           "BulkEngine", "BurstShape", "CopyEngineEngine", "DescriptorBurst", "Engine", "EngineOptions",
           "FailsOnTimeout", "Gate", "PackEngine", "Prepared", "Role", "Side", "TritonEngine", "as_descriptors",
           "bulk_descriptors", "check_direction", "chunk_plan", "engine_class", "engine_report",
           "engine_unavailable_reason", "initiator_of", "measurement_order", "on_timeout_from_env",
           "parse_engines", "register_engine", "split_large"]
