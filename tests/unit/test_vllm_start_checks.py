"""What the vLLM plugin checks as soon as vLLM has built its config, before the model loads
(kvlink.integrations.vllm.check_at_start), without vLLM: KVTransferConfig's attributes on a
namespace. tests/vllm/test_start.py starts real engines and servers with these mistakes."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

import kvlink
from kvlink import _nics
from kvlink.integrations.vllm import check_at_start
from kvlink.integrations.vllm._plugin import _ToVllm, route_logs

SECRET = "s" * 32


def ktc(extra: object, connector: str = "KvlinkConnector",
        module: str | None = "kvlink.integrations.vllm") -> SimpleNamespace:
    return SimpleNamespace(kv_connector=connector, kv_connector_module_path=module,
                           kv_connector_extra_config=extra)


def public_address() -> str:
    addrs = [a for a in _nics.resolve("auto") if not a.startswith("127.")]
    if not addrs:
        pytest.skip("this host has no IPv4 address beyond loopback")
    return addrs[0]


@pytest.fixture(autouse=True)
def _no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KVLINK_SECRET", "KVLINK_SECRET_FILE", "KVLINK_ALLOW_UNAUTHENTICATED"):
        monkeypatch.delenv(var, raising=False)


def test_a_typo_is_named() -> None:
    with pytest.raises(kvlink.ConfigError, match=r"unknown key 'mdoe' \(did you mean 'mode'\?\)"):
        check_at_start(ktc({"nics": "loopback:2", "mdoe": "pull"}))
    with pytest.raises(kvlink.ConfigError, match=r"\['lease_s'\]"):
        check_at_start(ktc({"lease_s": -1}, connector="KvlinkStoreConnector"))


def test_a_kvlink_connector_inside_multiconnector_is_checked() -> None:
    multi = ktc({"connectors": [
        {"kv_connector": "NixlConnector"},
        {"kv_connector": "KvlinkStoreConnector",
         "kv_connector_module_path": "kvlink.integrations.vllm",
         "kv_connector_extra_config": {"nics": "loopback:1", "stroe": {}}},
    ]}, connector="MultiConnector", module=None)
    with pytest.raises(kvlink.ConfigError, match="unknown key 'stroe'"):
        check_at_start(multi)


@pytest.mark.parametrize("config", [
    None,
    ktc({"mdoe": 1}, connector="NixlConnector", module=None),  # not ours
    ktc({"mdoe": 1}, connector="KvlinkConnector", module="someone.else"),
    ktc({"nics": "loopback:4"}),  # loopback needs no secret
])
def test_other_configs_pass(config: object) -> None:
    check_at_start(config)


def test_no_secret_beyond_loopback_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    addr = public_address()
    with pytest.raises(kvlink.ConfigError, match=rf"\['nics'\]: .* listens on {addr}.*"
                       r"KVLINK_SECRET"):
        check_at_start(ktc({"nics": [addr]}))
    with pytest.raises(kvlink.ConfigError, match="'auto' listens on"):  # the default: every NIC
        check_at_start(ktc(None))
    check_at_start(ktc({"nics": [addr], "secret": SECRET}))
    check_at_start(ktc({"nics": [addr], "allow_unauthenticated": True}))
    monkeypatch.setenv("KVLINK_SECRET", SECRET)
    check_at_start(ktc({"nics": [addr]}))


def test_kvlink_records_reach_vllms_handlers() -> None:
    """route_logs: a "kvlink" record goes to the handlers vLLM gives its "vllm" logger."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    vllm, kl = logging.getLogger("vllm"), logging.getLogger("kvlink")
    keep, propagate = Keep(), vllm.propagate
    try:
        route_logs()
        route_logs()  # once only
        assert sum(isinstance(h, _ToVllm) for h in kl.handlers) == 1
        kl.warning("before vLLM configured its logging: not handed")
        vllm.addHandler(keep)  # as vLLM's logging config does, after the plugin loaded
        vllm.propagate = False
        kl.warning("refused a connection claiming to be %r", "vllm-x")
        assert [r.getMessage() for r in records] == ["refused a connection claiming to be 'vllm-x'"]
    finally:
        vllm.removeHandler(keep)
        vllm.propagate = propagate
        for h in [h for h in kl.handlers if isinstance(h, _ToVllm)]:
            kl.removeHandler(h)
