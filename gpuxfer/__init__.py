"""gpuxfer: GPU-to-GPU transfers for LLM inference engines, in pure Python.

* :mod:`gpuxfer.pp` -- hand a pipeline stage's output tensors to the next stage's GPU.
* :mod:`gpuxfer.kv` -- hand paged KV caches from prefill to decode, and benchmark it.

Importing gpuxfer never touches a GPU.
"""
from .errors import (BackendUnavailable, BadInput, DriverError, GpuxferError, PlatformUnavailable,
                     TransferTimeout, VerificationFailed)

__version__ = "0.1.0"

__all__ = ["BackendUnavailable", "BadInput", "DriverError", "GpuxferError", "PlatformUnavailable",
           "TransferTimeout", "VerificationFailed", "__version__"]
