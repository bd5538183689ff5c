"""Makes ``--disaggregation-transfer-backend kvlink`` a choice of an unmodified SGLang.

SGLang loads every entry point of the group ``sglang.srt.plugins`` early in each of its
processes (the launcher before it parses arguments, the scheduler, the tokenizer, ...). The
backend choice itself is three closed lists in SGLang 0.5.x, so the plugin extends each:

1. the CLI's choices (``add_disagg_transfer_backend_choices``),
2. the ``TransferBackend`` enum (a member ``KVLINK = "kvlink"``),
3. ``get_kv_class``, wrapped so that it returns kvlink's classes for that member and defers to
   SGLang for every other; the modules that imported it by name before the plugin ran get the
   wrapper too.
"""

from __future__ import annotations

import enum
import sys
from typing import Any

BACKEND = "kvlink"


def _add_enum_member(cls: type[enum.Enum], name: str, value: str) -> enum.Enum:
    """Adds ``name = value`` to a closed Enum (what a subclass cannot do: enums with members are
    final). Idempotent."""
    existing = cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls  # type: ignore[attr-defined]
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)
    type.__setattr__(cls, name, member)
    return member


def register() -> None:
    """The ``sglang.srt.plugins`` entry point. Imports SGLang (never kvlink itself)."""
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils

    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])
    member = _add_enum_member(utils.TransferBackend, "KVLINK", BACKEND)
    original = utils.get_kv_class
    if getattr(original, "_kvlink_wrapper", False):
        return

    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        if transfer_backend is member and class_type != utils.KVClassType.KVARGS:
            from kvlink.integrations.sglang import _backend as b

            return {
                utils.KVClassType.MANAGER: b.KvlinkKVManager,
                utils.KVClassType.SENDER: b.KvlinkKVSender,
                utils.KVClassType.RECEIVER: b.KvlinkKVReceiver,
                utils.KVClassType.BOOTSTRAP_SERVER: b.KvlinkKVBootstrapServer,
            }[class_type]
        return original(transfer_backend, class_type)

    get_kv_class._kvlink_wrapper = True  # type: ignore[attr-defined]
    get_kv_class.__doc__ = original.__doc__
    utils.get_kv_class = get_kv_class
    for name, module in list(sys.modules.items()):
        if name.startswith("sglang.") and getattr(module, "get_kv_class", None) is original:
            module.get_kv_class = get_kv_class  # type: ignore[attr-defined]
