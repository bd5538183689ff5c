"""Config validation, precedence and NIC selection."""

from __future__ import annotations

import json

import pytest

import kvlink
from kvlink import _nics


def test_defaults_are_valid():
    c = kvlink.Config()
    assert c.chunk_bytes == 64 * kvlink.MiB and c.monitor_interval_ms == 100


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("chunk_bytes", 100, r"chunk_bytes: 100 is outside"),
        ("chunk_bytes", "64MiB", "chunk_bytes: expected an integer"),
        ("min_chunk_bytes", 128 * kvlink.MiB, "min_chunk_bytes"),
        ("port", 70000, "port"),
        ("connect_timeout_s", 0, "connect_timeout_s"),
        ("max_attempts", 0, "max_attempts"),
        ("nics", 5, "nics: expected"),
        ("nics", [], "nics: the list is empty"),
    ],
)
def test_invalid_values_name_the_field(field, value, match):
    with pytest.raises(kvlink.ConfigError, match=match):
        kvlink.Config(**{field: value})


def test_precedence_explicit_over_file_over_env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLINK_CHUNK_BYTES", str(8 * kvlink.MiB))
    monkeypatch.setenv("KVLINK_MAX_ATTEMPTS", "7")
    monkeypatch.setenv("KVLINK_NICS", "loopback:2")
    f = tmp_path / "kvlink.json"
    f.write_text(json.dumps({"chunk_bytes": 16 * kvlink.MiB}))
    c = kvlink.Config.load(f, max_attempts=9)
    assert c.chunk_bytes == 16 * kvlink.MiB  # file beats env
    assert c.max_attempts == 9  # explicit beats env
    assert c.nics == "loopback:2"  # env beats default


def test_bad_env_and_file_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLINK_CHUNK_BYTES", "lots")
    with pytest.raises(kvlink.ConfigError, match="KVLINK_CHUNK_BYTES"):
        kvlink.Config.load()
    monkeypatch.delenv("KVLINK_CHUNK_BYTES")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(kvlink.ConfigError, match="not valid JSON"):
        kvlink.Config.load(bad)
    with pytest.raises(kvlink.ConfigError, match="unknown config keys"):
        kvlink.Config.load(chunk_size=1)


def test_nic_selection():
    assert _nics.resolve("loopback:3") == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert _nics.resolve("127.0.0.5,127.0.0.6") == ["127.0.0.5", "127.0.0.6"]
    assert _nics.resolve(("lo",)) == ["127.0.0.1"]
    assert all(not a.startswith("127.") for a in _nics.resolve("auto")) or _nics.resolve(
        "auto"
    ) == ["127.0.0.1"]
    for bad, match in [
        ("loopback:0", "1 <= N"),
        ("loopback:x", "1 <= N"),
        ("nosuchnic0", "no up interface named 'nosuchnic0'"),
        ("127.0.0.1,127.0.0.1", "listed twice"),
    ]:
        with pytest.raises(kvlink.ConfigError, match=match):
            _nics.resolve(bad)


def test_agent_rejects_bad_name():
    with pytest.raises(kvlink.InvalidArgumentError, match="name"):
        kvlink.Agent("", kvlink.Config(nics="loopback:1"))
    with pytest.raises(kvlink.InvalidArgumentError, match="name"):
        kvlink.Agent("x" * 64, kvlink.Config(nics="loopback:1"))
