"""vLLM integration: ``KvlinkConnector``, a KV connector for disaggregated prefill/decode, and
``KvlinkStoreConnector``, one for reuse through kvlink.store.

Load it with ``KVTransferConfig(kv_connector="KvlinkConnector",
kv_connector_module_path="kvlink.integrations.vllm", kv_role=..., kv_connector_extra_config={...})``
(docs/vllm.md). Importing this package does not import vLLM; only ``KvlinkConnector`` does, so
kvlink never depends on vLLM.
"""

from __future__ import annotations

from typing import Any

from kvlink.integrations.vllm._settings import Mode, Settings, parse_settings

__all__ = ["KvlinkConnector", "KvlinkStoreConnector", "Mode", "Settings", "parse_settings"]


def __getattr__(name: str) -> Any:
    if name == "KvlinkConnector":
        from kvlink.integrations.vllm._connector import KvlinkConnector

        return KvlinkConnector
    if name == "KvlinkStoreConnector":
        from kvlink.integrations.vllm._store_connector import KvlinkStoreConnector

        return KvlinkStoreConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
