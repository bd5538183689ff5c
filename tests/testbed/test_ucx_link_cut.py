"""A UCX path whose link is cut (docs/ucx.md; the issue: "a UCX path that fails to connect
or dies falls back to TCP on the same NIC"): two agents with transport="ucx" in two network
namespaces joined by two shaped veth links; link 1 goes down mid-push, the push completes
verified over the other link, and when link 1 comes back its path reconnects running TCP on
the same addresses (no UCX offer) and carries the next push in-stream."""

from __future__ import annotations

import secrets
import time

import pytest

import kvlink.testbed as kt
from kvlink import _transport
from tests.conftest import unavailable
from tests.testbed.test_multinic import Pair

pytestmark = [pytest.mark.root, pytest.mark.ucx, pytest.mark.timeout(180)]

MiB = 1 << 20


@pytest.fixture(autouse=True)
def ucx_over_tcp(monkeypatch):
    """UCX's TCP transport only, in the workers too (they inherit the environment)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_MODULES", "^ib,ib_mlx5,ib_mlx5_ext")
    ok, why = _transport.ucx_status()
    if not ok:
        unavailable(f"UCX not usable here: {why}")


def test_cut_ucx_path_comes_back_as_tcp_on_the_same_nic(testbed):
    tb = testbed(tag="v4" + secrets.token_hex(2), links=2, rate="1gbit")
    p = Pair(tb, 256 * MiB, {"transport": "ucx"})
    try:
        before = p.paths()
        assert [x["transport"] for x in before] == ["ucx", "ucx"], before
        xid = p.push()
        faults = kt.FaultSchedule(tb, [(0.3, ("down", 1))])
        faults.start()
        p.wait(xid, timeout=120)
        faults.join()
        assert p.verified(), "every byte verified after losing a UCX link"
        tb.link_up(1)
        deadline = time.monotonic() + 60
        while True:
            ps = p.paths()
            if ps[1]["state"] in ("UP", "DEGRADED") and ps[1]["reconnects"] >= 1:
                break
            assert time.monotonic() < deadline, f"path 1 did not come back: {ps[1]}"
            time.sleep(0.2)
        cut = ps[1]
        assert (cut["local"], cut["remote"]) == (before[1]["local"], before[1]["remote"])
        assert cut["transport"] == "tcp", cut
        assert cut["transport_note"].startswith("UCX path died ("), cut["transport_note"]
        assert ps[0]["transport"] == "ucx", ps[0]  # the other path kept UCX
        put1, sent1 = cut["bytes_put"], cut["bytes_sent"]
        p.wait(p.push(), timeout=120)
        assert p.verified()
        after = p.paths()[1]
        assert after["bytes_put"] == put1, after  # nothing by put on the fallen-back path
        assert after["bytes_sent"] > sent1, after  # but it carried chunks, in-stream
    finally:
        p.stop()
