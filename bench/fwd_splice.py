"""A plain cut-through TCP forwarder, the baseline of the relay's CPU cost (bench/relay_testbed.py).

    python bench/fwd_splice.py LISTEN_ADDR LISTEN_PORT TARGET_ADDR TARGET_PORT [BIND_ADDR]

Accepts connections (iperf3 opens a control and a data connection), connects each to the
target (from BIND_ADDR), and moves bytes both ways with splice(2) through a 1 MiB pipe per
direction, one thread each, until SIGTERM; then prints {"cpu_s": ..., "bytes": ...} (this
process's CPU, bytes forwarded) as JSON.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import signal
import socket
import sys
import threading

PIPE = 1 << 20
moved = [0, 0]


def pump(src: socket.socket, dst: socket.socket, i: int) -> None:
    r, w = os.pipe()
    fcntl.fcntl(r, 1031, PIPE)  # F_SETPIPE_SZ
    try:
        while True:
            n = os.splice(src.fileno(), w, PIPE)
            if n == 0:
                break
            while n:
                m = os.splice(r, dst.fileno(), n)
                n -= m
                moved[i] += m
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def report(*_: object) -> None:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"cpu_s": ru.ru_utime + ru.ru_stime, "bytes": sum(moved)}), flush=True)
    os._exit(0)


def main() -> None:
    host, port, thost, tport = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    bind = sys.argv[5] if len(sys.argv) > 5 else None
    signal.signal(signal.SIGTERM, report)
    ls = socket.create_server((host, port))
    while True:
        c, _ = ls.accept()
        t = socket.create_connection((thost, tport), source_address=(bind, 0) if bind else None)
        for s in (c, t):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=pump, args=(c, t, 0), daemon=True).start()
        threading.Thread(target=pump, args=(t, c, 1), daemon=True).start()


if __name__ == "__main__":
    main()
