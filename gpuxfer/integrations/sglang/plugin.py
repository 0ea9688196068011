"""The ``sglang.srt.plugins`` entry point: makes ``gpuxfer`` a transfer backend SGLang accepts and builds,
without editing SGLang. SGLang's ``load_plugins()`` calls :func:`register` in every process (server, engine,
scheduler, detokenizer) before it parses arguments; nothing here imports SGLang until then.

* the backend name joins SGLang's ``--disaggregation-transfer-backend`` choices
  (``add_disagg_transfer_backend_choices``, provided for this);
* a member ``GPUXFER = "gpuxfer"`` joins the closed ``TransferBackend`` enum, so ``TransferBackend("gpuxfer")``
  resolves;
* ``get_kv_class`` (a closed if/elif over the built-in backends) is wrapped through SGLang's hook registry,
  which also rebinds the modules that imported it earlier: for ``TransferBackend.GPUXFER`` it returns this
  package's classes, for every other backend the original answers.
"""
from __future__ import annotations

BACKEND = "gpuxfer"
_TARGET = "sglang.srt.disaggregation.utils.get_kv_class"


def _add_member(enum_cls, name: str, value: str):
    """Add ``name = value`` to a closed ``Enum`` (idempotent): Python offers no public way, so the member is
    built as ``Enum`` builds one and entered in the class's maps."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    member.__init__(value)
    type.__setattr__(enum_cls, name, member)        # before the member map: EnumType refuses to rebind members
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def _get_kv_class(original, transfer_backend, class_type):
    from sglang.srt.disaggregation.utils import KVClassType
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from . import conn
    return {KVClassType.MANAGER: conn.GpuxferKVManager, KVClassType.SENDER: conn.GpuxferKVSender,
            KVClassType.RECEIVER: conn.GpuxferKVReceiver,
            KVClassType.BOOTSTRAP_SERVER: conn.GpuxferKVBootstrapServer}.get(class_type)


def register() -> None:
    """SGLang's plugin callback (entry point ``gpuxfer`` in the ``sglang.srt.plugins`` group)."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    _add_member(TransferBackend, "GPUXFER", BACKEND)
    if not any(h is _get_kv_class for _, h, _ in HookRegistry._hooks.get(_TARGET, ())):
        HookRegistry.register(_TARGET, _get_kv_class, HookType.AROUND)
