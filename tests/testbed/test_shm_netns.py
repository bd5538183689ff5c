"""Same-host copies and network namespaces (docs/ucx.md, "Same-host peers"): agents in two
namespaces of one host stand for two hosts and keep their network paths, and a listener
refuses a HELLO asking for same-host copies from a socket that is not in its namespace (a
peer elsewhere would learn our pid and addresses from READ_RESP descriptors)."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import pytest

from kvlink.bench import Worker

pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]

RAW_HELLO = """
import json, os, socket, struct, sys
from tests import wire_client as wc
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
body = wc.authenticate(s, "raw", 99, os.environ["KVLINK_SECRET"].encode(), wc.DATA_CONN, 0,
                       movers=int(sys.argv[3]))
print(json.dumps({"status": struct.unpack_from("<I", body)[0], "text": body.decode("latin-1")}))
"""


def test_namespaces_keep_tcp_and_a_foreign_cma_hello_is_refused(testbed):
    tb = testbed(tag="sh" + secrets.token_hex(2), links=1, rate="1gbit")
    rx = Worker("rx", name="rx", nics=",".join(tb.addresses("b")), prefix=tb.exec_prefix("b"))
    tx = Worker("tx", name="tx", nics=",".join(tb.addresses("a")), prefix=tb.exec_prefix("a"))
    try:
        rx.call("alloc", key="kv", nbytes=1 << 20, remote_write=True, name="kv")
        tx.call("add_peer", metadata=rx.call("hello")["metadata"])
        assert {p["transport"] for p in tx.call("paths")["paths"]} == {"tcp"}
        host, port = json.loads(rx.metadata)["addrs"][0]

        def hello(movers: int) -> dict:
            out = subprocess.run(
                [*tb.exec_prefix("a"), sys.executable, "-c", RAW_HELLO, host, str(port),
                 str(movers)],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout  # fmt: skip
            return json.loads(out)

        plain = hello(0)
        assert plain["status"] == 0, plain
        cma = hello(1)  # HELLO naming the shm mover, from another namespace
        assert cma["status"] != 0, cma
        assert "refused same-host copies" in cma["text"], cma["text"]
    finally:
        tx.close()
        rx.close()
