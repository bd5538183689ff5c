"""TCP ports for servers that a test or a benchmark starts and that bind them moments later.

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range
(``net.ipv4.ip_local_port_range``), the same range every outgoing connection takes its local
port from. Between the check and the server's own bind (an SGLang or vLLM server binds ~70 s
after it was launched on a loaded 2-core host) any ``connect()`` on the host can take it, and
the server then dies with "address already in use". So these ports come from below the
ephemeral range, where the kernel never allocates by itself: only an explicit bind can take
one, and the ports handed out by this process are never handed out twice.
"""

from __future__ import annotations

import random
import socket
import threading

_LOWEST = 10000            # below: well-known and registered services people run
_DEFAULT_EPHEMERAL = 32768  # Linux's default start of ip_local_port_range
_given: set[int] = set()
_lock = threading.Lock()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bindable(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, outside the ephemeral range, not given out before by
    this process. Falls back to a kernel-chosen port only where no such range exists."""
    top = _ephemeral_start()
    with _lock:
        if top - _LOWEST >= 1000:
            for _ in range(200):
                port = random.randrange(_LOWEST, top)
                if port not in _given and _bindable(host, port) and _bindable("0.0.0.0", port):
                    _given.add(port)
                    return port
        with socket.socket(_family(host)) as s:  # an odd port range: the kernel's choice
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        _given.add(port)
        return port


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports as :func:`free_port` gives them."""
    return [free_port(host) for _ in range(n)]
