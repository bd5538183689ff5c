"""kvlink.bench.ports: ports for servers that bind them later must not come from the range
the kernel gives every outgoing connection (an SGLang server in CI died with "address already
in use" 70 s after its port was chosen by bind(0))."""

from __future__ import annotations

import socket

from kvlink.bench import ports


def test_ports_come_from_below_the_ephemeral_range_and_are_bindable() -> None:
    start = ports._ephemeral_start()
    got = ports.free_ports(50)
    assert len(set(got)) == 50, "a port was handed out twice"
    for port in got:
        assert 10000 <= port < start, f"port {port} is in the ephemeral range from {start}"
        with socket.create_server(("127.0.0.1", port)):
            pass


def test_an_outgoing_connection_cannot_take_the_port() -> None:
    """200 outgoing connections (their local ports come from the ephemeral range) neither
    land on a port handed out nor keep it from binding afterwards."""
    port = ports.free_port()
    conns: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0), backlog=256) as srv:
        target = srv.getsockname()
        try:
            for _ in range(200):
                conns.append(socket.create_connection(target, timeout=5))
            assert port not in {c.getsockname()[1] for c in conns}
        finally:
            for c in conns:
                c.close()
    with socket.create_server(("127.0.0.1", port)):
        pass


def test_a_port_in_use_is_not_handed_out() -> None:
    held = []
    try:
        for _ in range(20):
            port = ports.free_port()
            held.append(socket.create_server(("127.0.0.1", port)))
        taken = {s.getsockname()[1] for s in held}
        ports._given.clear()  # even forgetting what it gave, it checks the bind
        assert not taken & set(ports.free_ports(200))
    finally:
        for s in held:
            s.close()
