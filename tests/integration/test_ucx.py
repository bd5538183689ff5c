"""The UCX transport as far as it is built (docs/ucx.md, "Status"): loading
libucp at run time, Config(transport=...), what paths() says, and the C-level
UCX path test (put + flush over UCX's TCP on loopback, byte-exact) run from
here so pytest reports it too.  Without UCX these skip saying why; in CI
(KVLINK_REQUIRE_ALL=1) they fail instead."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import kvlink
from kvlink import _transport
from tests.conftest import unavailable

ROOT = Path(__file__).resolve().parents[2]
UCX_ENV = {
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "lo",
    "UCX_MODULES": "^ib,ib_mlx5,ib_mlx5_ext",
}


def need_ucx() -> str:
    ok, why = _transport.ucx_status()
    if not ok:
        unavailable(f"UCX not usable here: {why}")
    return why


@pytest.mark.ucx
def test_ucx_loads_from_the_wheel():
    why = need_ucx()
    assert why.startswith("UCX 1."), why


def test_transport_config_values():
    assert kvlink.Config().transport == "auto"
    assert kvlink.Config(transport=" TCP ").transport == "tcp"
    with pytest.raises(kvlink.ConfigError, match="transport: expected one of auto, tcp, ucx"):
        kvlink.Config(transport="rdma")
    with pytest.raises(kvlink.ConfigError, match="transport"):
        kvlink.Config(transport=3)  # type: ignore[arg-type]


def test_transport_ucx_without_a_secret_is_refused(make_agent):
    # UCX set-up only between agents that proved the cluster secret (docs/ucx.md);
    # without UCX at all the ConfigError names the load error instead.
    with pytest.raises(kvlink.ConfigError, match="transport='ucx'"):
        make_agent("u", nics="loopback:1", transport="ucx")


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_paths_show_the_transport_and_why(make_agent, transport):
    rx = make_agent("rx", nics="loopback:2")
    dst = np.zeros(1 << 20, dtype=np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    tx = make_agent("tx", nics="loopback:2", transport=transport)
    src = np.arange(1 << 20, dtype=np.uint32).astype(np.uint8)
    tx.register(src)
    tx.add_peer(rx.metadata())
    tx.push("rx", src=src, dst="kv").wait(timeout_s=30)
    assert np.array_equal(src, dst)
    paths = tx.paths()
    assert len(paths) == 2
    for p in paths:
        assert p.transport == "tcp"
        if transport == "tcp":
            assert p.transport_note == "transport='tcp'"
        else:  # auto: UCX over TCP is not offered (no key bounds): 'ucx' opts in
            assert "UCX is not offered" in p.transport_note, p.transport_note


@pytest.mark.ucx
@pytest.mark.timeout(300)
def test_ucx_path_put_flush_byte_exact_c():
    """tests/c/test_ucx.c under ASan/UBSan: two UCX path ends over UCX's TCP on
    loopback; puts + flush placed byte-exact (memcmp and crc32c), bounds and bad
    key lengths refused with specific errors, an idle worker costs no CPU."""
    need_ucx()
    r = subprocess.run(
        ["make", "-s", "-C", str(ROOT / "tests" / "c"), "ucx"],
        env={**os.environ, **UCX_ENV},
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    out = r.stdout + r.stderr
    if "SKIPPED" in out:
        unavailable(out.strip().splitlines()[-1])
    assert r.returncode == 0, out
    assert "0 failed" in out, out
