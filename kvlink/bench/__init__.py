"""kvlink's benchmark engine: what ``kvlink-bench``, the ``bench/`` scenarios and the tests'
two-process fixtures all run on.

- :mod:`.worker`: kvlink agents in a child process, driven over JSON lines (:class:`Worker`)
- :mod:`.protocol`: that protocol, over a pipe or a TCP connection, every wait with a deadline
- :mod:`.iperf3`: the one iperf3 runner (the limit kvlink is measured against)
- :mod:`.peers`: the peer libraries (Mooncake, NIXL, ucxx) run the same way
- :mod:`.measure`: data patterns and their check, CPU and memory, how sizes are written
- :mod:`.runner`: ``kvlink-bench serve`` and ``run``
- :mod:`.report`: progress, tables, JSON lines, CSV and plots

Throughput named ``gbps`` anywhere here is GB/s (1e9 bytes per second).
"""

import os
import secrets

from .protocol import BenchError, WorkerError, WorkerTimeout
from .worker import Worker


def share_run_secret() -> None:
    """Gives every agent of this run (in this process and its children) one
    cluster secret: KVLINK_SECRET or KVLINK_SECRET_FILE as set, else a random
    one made now.  Agents on testbed addresses need one (docs/security.md);
    runs that start their own children call this before the first agent."""
    if not os.environ.get("KVLINK_SECRET") and not os.environ.get("KVLINK_SECRET_FILE"):
        os.environ["KVLINK_SECRET"] = secrets.token_hex(32)


__all__ = ["BenchError", "Worker", "WorkerError", "WorkerTimeout", "share_run_secret"]
