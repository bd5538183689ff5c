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

from .protocol import BenchError, WorkerError, WorkerTimeout
from .worker import Worker

__all__ = ["BenchError", "Worker", "WorkerError", "WorkerTimeout"]
