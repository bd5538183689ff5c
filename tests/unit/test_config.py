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
        ("chunk_bytes", "64 apples", "chunk_bytes: not a size"),
        ("chunk_bytes", 1.5, "chunk_bytes: expected an integer"),
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
    # a value that parses but is out of range names the variable too
    monkeypatch.setenv("KVLINK_CHUNK_BYTES", "7")
    with pytest.raises(kvlink.ConfigError, match=r"KVLINK_CHUNK_BYTES='7' .*outside"):
        kvlink.Config.load()
    kvlink.Config.load(chunk_bytes=4096, min_chunk_bytes=4096)  # an explicit value wins
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


@pytest.mark.parametrize("raw,expected", [("1", True), ("On", True), ("no", False), ("0", False)])
def test_env_booleans(monkeypatch, raw, expected):
    monkeypatch.setenv("KVLINK_HEDGE", raw)
    assert kvlink.Config.load().hedge is expected


@pytest.mark.parametrize("raw", ["maybe", "", "2", "yess"])
def test_env_boolean_that_is_not_one_is_refused(monkeypatch, raw):
    monkeypatch.setenv("KVLINK_HEDGE", raw)
    accepted = r"use 1, true, yes, on to turn it on, 0, false, no, off to turn it off"
    with pytest.raises(kvlink.ConfigError, match=rf"KVLINK_HEDGE: .* is not a boolean; {accepted}"):
        kvlink.Config.load()


def test_env_typo_warns_with_the_closest_name(monkeypatch):
    monkeypatch.setenv("KVLINK_CHUNK_BYTE", "1MiB")
    with pytest.warns(UserWarning, match=r"KVLINK_CHUNK_BYTE .*ignored.*'KVLINK_CHUNK_BYTES'"):
        c = kvlink.Config.load()
    assert c.chunk_bytes == kvlink.Config().chunk_bytes


def test_env_variables_kvlink_reads_elsewhere_do_not_warn(monkeypatch):
    monkeypatch.setenv("KVLINK_PEERS_DIR", "/tmp")
    monkeypatch.setenv("KVLINK_REQUIRE_ALL", "0")
    kvlink.Config.load()  # filterwarnings = error: a warning fails here


def test_sizes_in_env_file_and_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLINK_CHUNK_BYTES", "64MiB")
    monkeypatch.setenv("KVLINK_WINDOW_BYTES", "0x2000000")
    c = kvlink.Config.load()
    assert c.chunk_bytes == 64 * kvlink.MiB and c.window_bytes == 32 * kvlink.MiB
    f = tmp_path / "kvlink.json"
    f.write_text(json.dumps({"min_chunk_bytes": "256KiB"}))
    assert kvlink.Config.load(f).min_chunk_bytes == 256 * kvlink.KiB
    assert kvlink.Config(chunk_bytes="1.5MiB").chunk_bytes == 3 * 512 * kvlink.KiB
    monkeypatch.setenv("KVLINK_CHUNK_BYTES", "64 megs")
    with pytest.raises(kvlink.ConfigError, match="KVLINK_CHUNK_BYTES: not a size: '64 megs'"):
        kvlink.Config.load()


def test_unknown_field_suggests_the_closest(monkeypatch):
    with pytest.raises(kvlink.ConfigError, match=r"unknown field 'chunk_size'.*'chunk_bytes'"):
        kvlink.Config(chunk_size=1)
    with pytest.raises(kvlink.ConfigError, match=r"unknown field 'hedging'.*'hedge'"):
        kvlink.Config().replace(hedging=False)
    with pytest.raises(kvlink.ConfigError, match=r"unknown config keys.*'chunk_bytes'"):
        kvlink.Config.load(chunk_size=1)


def test_scheduler_is_an_enum_that_takes_its_names():
    assert kvlink.Config().scheduler is kvlink.Scheduler.EARLIEST_FINISH
    c = kvlink.Config(scheduler="round_robin")
    assert c.scheduler is kvlink.Scheduler.ROUND_ROBIN
    assert kvlink.Config(scheduler=kvlink.Scheduler.ROUND_ROBIN) == c
    with pytest.raises(kvlink.ConfigError, match=r"scheduler: .*'roundrobin'.*'round_robin'"):
        kvlink.Config(scheduler="roundrobin")
    with pytest.raises(kvlink.ConfigError, match="scheduler: unknown scheduler 3"):
        kvlink.Config(scheduler=3)


def test_nics_are_checked_when_the_config_is_made():
    for bad, match in [
        ("nosuchnic0", "no up interface named 'nosuchnic0'"),
        ("loopback:0", "1 <= N"),
        (["127.0.0.1", "127.0.0.1"], "listed twice"),
    ]:
        with pytest.raises(kvlink.ConfigError, match=match):
            kvlink.Config(nics=bad)


@pytest.mark.parametrize(
    ("nics", "hint"),
    [("loopback", "loopback:N"), ("::1", "IPv6"), ("999.1.1.1", "not a valid IPv4")],
)
def test_a_nic_that_looks_like_something_else_gets_a_hint(nics, hint):
    with pytest.raises(kvlink.ConfigError, match=hint):
        kvlink.Config(nics=nics)


@pytest.mark.parametrize(
    "value,match",
    [
        (-1, r"io_threads: -1 is outside \[0, 64\]"),
        (65, r"io_threads: 65 is outside"),
        ("many", r"io_threads: expected 'auto' or a count 0..64, got 'many'"),
        (2.0, "io_threads: expected an integer"),
        (True, "io_threads: expected an integer"),
    ],
)
def test_io_threads_refused_values_say_what_is_taken(value, match):
    with pytest.raises(kvlink.ConfigError, match=match):
        kvlink.Config(io_threads=value)


def test_io_threads_auto_follows_the_usable_cores(monkeypatch):
    import os

    cfg = kvlink.Config()
    assert cfg.io_threads == "auto"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    assert cfg.resolved_io_threads(4) == 0  # each side's engine thread has its core
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert cfg.resolved_io_threads(4) == 4  # one per path
    assert cfg.resolved_io_threads(64) == 8  # at most half the cores
    assert kvlink.Config(io_threads=3).resolved_io_threads(64) == 3


def test_io_threads_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVLINK_IO_THREADS", "2")
    assert kvlink.Config.load().io_threads == 2
    monkeypatch.setenv("KVLINK_IO_THREADS", "auto")
    assert kvlink.Config.load().io_threads == "auto"
    monkeypatch.setenv("KVLINK_IO_THREADS", "lots")
    with pytest.raises(kvlink.ConfigError, match="io_threads"):
        kvlink.Config.load()


@pytest.mark.parametrize(
    "url,match",
    [
        ("http://127.0.0.1:2379", "discovery: unknown scheme"),
        ("127.0.0.1:2379", "discovery: unknown scheme"),
        ("etcd://", "discovery: no etcd host"),
        ("etcd://a:2379,,b:2379/x", "discovery: no etcd host"),
        ("etcd://host:99999/x", "discovery: bad host"),
        ("etcd://user:pw@host:2379/x", r"discovery: .* carries credentials"),
        ("etcd://host:2379/x?y=1", r"discovery: .* query"),
        ("etcd://host:2379/a b", "discovery: prefix"),
        (42, "discovery: expected etcd://"),
    ],
)
def test_bad_discovery_urls_are_named(url, match):
    with pytest.raises(kvlink.ConfigError, match=match):
        kvlink.Config(discovery=url)


def test_discovery_url_parts():
    from kvlink._discovery import parse_url

    u = parse_url("etcds://a,b:2390,[::1]:2391/prod/kv/")
    assert u.endpoints == (("a", 2379), ("b", 2390), ("::1", 2391))
    assert u.prefix == "/prod/kv/" and u.tls
    assert parse_url("etcd://h").prefix == "/kvlink/"


def test_discovery_settings_from_env_and_checks(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLINK_DISCOVERY", "etcd://127.0.0.1:2379/p")
    monkeypatch.setenv("KVLINK_METRICS_PORT", "9400")
    c = kvlink.Config.load()
    assert c.discovery == "etcd://127.0.0.1:2379/p" and c.metrics_port == 9400
    monkeypatch.setenv("KVLINK_DISCOVERY", "etcd:/oops")
    with pytest.raises(kvlink.ConfigError, match=r"KVLINK_DISCOVERY='etcd:/oops'"):
        kvlink.Config.load()
    monkeypatch.delenv("KVLINK_DISCOVERY")
    monkeypatch.setenv("KVLINK_DISCOVERY_PASSWORD", "hunter2-not-shown")
    with pytest.raises(kvlink.ConfigError, match="needs both") as info:
        kvlink.Config.load()
    assert "hunter2" not in str(info.value)
    assert "hunter2" not in repr(kvlink.Config(discovery_user="u", discovery_password="hunter2"))
    with pytest.raises(kvlink.ConfigError, match="discovery_ca_file"):
        kvlink.Config(discovery_ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(kvlink.ConfigError, match=r"discovery_refresh_s: .* more than half"):
        kvlink.Config(discovery_ttl_s=4, discovery_refresh_s=3)
    with pytest.raises(kvlink.ConfigError, match="metrics_port"):
        kvlink.Config(metrics_port=70000)


def test_a_ca_file_that_is_not_pem_is_named(tmp_path):
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    with pytest.raises(kvlink.ConfigError, match=r"discovery_ca_file .*cannot set up TLS"):
        kvlink.Agent("tls", nics="loopback:1", discovery="etcds://127.0.0.1:1/x",
                     discovery_ca_file=str(bad))
