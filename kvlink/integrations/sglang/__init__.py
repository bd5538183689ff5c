"""SGLang integration: kvlink as a prefill/decode KV transfer backend.

Installed with kvlink, it registers itself through the ``sglang.srt.plugins`` entry point, so
an unmodified SGLang accepts ``--disaggregation-transfer-backend kvlink`` (docs/sglang.md).
Importing this package does not import SGLang; ``register()`` and the backend classes do.
"""

from __future__ import annotations

from typing import Any

from kvlink.integrations.sglang._plugin import BACKEND, register

__all__ = [
    "BACKEND",
    "KvlinkKVBootstrapServer",
    "KvlinkKVManager",
    "KvlinkKVReceiver",
    "KvlinkKVSender",
    "register",
]


def __getattr__(name: str) -> Any:
    if name in ("KvlinkKVManager", "KvlinkKVSender", "KvlinkKVReceiver",
                "KvlinkKVBootstrapServer"):
        from kvlink.integrations.sglang import _backend

        return getattr(_backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
