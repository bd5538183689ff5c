"""vLLM integration: ``KvlinkConnector``, a KV connector for disaggregated prefill/decode, and
``KvlinkStoreConnector``, one for reuse through kvlink.store.

Load it with ``KVTransferConfig(kv_connector="KvlinkConnector",
kv_connector_module_path="kvlink.integrations.vllm", kv_role=..., kv_connector_extra_config={...})``
(docs/vllm.md). Installed with kvlink, ``register`` is vLLM's ``vllm.general_plugins`` entry
point: it checks a kvlink connector's settings as soon as vLLM has built its config (before the
model loads) and shows kvlink's own log records in vLLM's log. Importing this package does not
import vLLM; only ``KvlinkConnector`` and ``register()`` do, so kvlink never depends on vLLM.
"""

from __future__ import annotations

from typing import Any

from kvlink.integrations.vllm._plugin import register, route_logs
from kvlink.integrations.vllm._settings import Mode, Settings, check_at_start, parse_settings

__all__ = [
    "KvlinkConnector",
    "KvlinkStoreConnector",
    "Mode",
    "Settings",
    "check_at_start",
    "parse_settings",
    "register",
]


def __getattr__(name: str) -> Any:
    if name == "KvlinkConnector":
        from kvlink.integrations.vllm._connector import KvlinkConnector

        route_logs()  # also where the plugin is not installed (VLLM_PLUGINS leaves it out)
        return KvlinkConnector
    if name == "KvlinkStoreConnector":
        from kvlink.integrations.vllm._store_connector import KvlinkStoreConnector

        route_logs()
        return KvlinkStoreConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
