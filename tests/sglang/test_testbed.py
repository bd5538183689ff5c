"""SGLang prefill and decode in two network namespaces joined by two emulated NICs (root): the
KV crosses both links, and a link that goes down and up again while requests flow changes
neither the tokens nor the outcome."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sglang import harness

pytestmark = [pytest.mark.root, pytest.mark.tools("ip", "tc"), pytest.mark.timeout(600)]
CLIENT = Path(__file__).with_name("pd_client.py")
# 8 layers x 8 KV heads x 128 x fp32: 64 KiB of KV a token, ~80 MiB for a 1300-token prompt,
# ~0.7 s on two 500mbit links
MODEL_ARGS = ["--layers", "8", "--hidden", "128", "--heads", "8", "--kv-heads", "8",
              "--head-dim", "128"]
LENGTHS = "1300,700,1300"


@pytest.fixture(scope="module")
def bed(sglang_model: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[dict[str, object]]:
    from kvlink.testbed import Testbed

    model = harness.make_model(tmp_path_factory.mktemp("kv64k") / "llama-kv64k", *MODEL_ARGS)
    secret = secrets.token_hex(16)
    tag = "sg" + secrets.token_hex(2)
    with Testbed(links=2, rate="500mbit", tag=tag) as tb:
        servers = []
        bport = harness.free_port()
        for side, mode, cpu in (("a", "prefill", 0), ("b", "decode", 1)):
            addrs = tb.addresses(side)
            servers.append(harness.Server(
                f"tb-{mode}", model, log_dir=log_dir, mode=mode, bootstrap_port=bport, cpu=cpu,
                host=addrs[0], prefix=tb.exec_prefix(side),
                env={"KVLINK_NICS": ",".join(addrs), "KVLINK_SECRET": secret,
                     "SGLANG_HOST_IP": addrs[0]}))
        try:
            client(tb, "wait", *(s.url for s in servers))
            yield {"tb": tb, "prefill": servers[0], "decode": servers[1], "bport": bport}
        finally:
            harness.close_all(servers)


def client(tb: object, *args: str) -> list[dict[str, object]]:
    run = subprocess.run([*tb.exec_prefix("a"), sys.executable, str(CLIENT), *args],  # type: ignore[attr-defined]
                         capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def tx_bytes(tb: object, link: int) -> int:
    dev = tb.device("a", link)  # type: ignore[attr-defined]
    out = subprocess.run([*tb.exec_prefix("a"), "cat",  # type: ignore[attr-defined]
                          f"/sys/class/net/{dev}/statistics/tx_bytes"],
                         capture_output=True, text=True, check=True, timeout=10)
    return int(out.stdout)


def pd(bed: dict[str, object]) -> list[dict[str, object]]:
    p, d = bed["prefill"], bed["decode"]
    return client(bed["tb"], "pd", p.url, d.url, str(bed["bport"]), LENGTHS)  # type: ignore[attr-defined]


def test_kv_crosses_every_link_and_survives_a_flapping_link(bed: dict[str, object]) -> None:
    tb = bed["tb"]
    before = [tx_bytes(tb, i) for i in range(2)]
    calm = pd(bed)
    assert all(r["decode_status"] == 200 and r["ids"] for r in calm), calm
    sent = [tx_bytes(tb, i) - b for i, b in enumerate(before)]
    # ~200 MiB of KV went: each link carried a good part of it (striping, not one path)
    assert min(sent) > 40 << 20, sent

    stop = threading.Event()
    flaps = []

    def flap() -> None:
        while not stop.is_set():
            tb.link_down(1)  # type: ignore[attr-defined]
            flaps.append(time.monotonic())
            stop.wait(0.4)
            tb.link_up(1)  # type: ignore[attr-defined]
            stop.wait(0.6)

    t = threading.Thread(target=flap, daemon=True)
    t.start()
    try:
        rough = pd(bed)
    finally:
        stop.set()
        t.join(timeout=10)
        tb.link_up(1)  # type: ignore[attr-defined]
    assert len(flaps) >= 2
    assert [r["decode_status"] for r in rough] == [200] * len(rough), rough
    assert [r["ids"] for r in rough] == [r["ids"] for r in calm]
