"""This host's identity, as far as shared memory between processes goes.

Two agents with the same id run on one kernel boot, in one PID namespace
and one network namespace: the kernel can copy between them (CMA), so
transport "auto" may give their paths a shared-memory end (docs/ucx.md).
Agents in different network namespaces stand for different hosts (the
multi-NIC testbed, containers): they keep their network paths.
"""

from __future__ import annotations

import os


def host_id() -> str:
    """``boot_id:pidns:netns`` of the calling thread ("" where /proc cannot
    tell: then no peer is same-host).  Not cached: a thread may enter
    another network namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/thread-self/ns/pid").st_ino
        netns = os.stat("/proc/thread-self/ns/net").st_ino
    except OSError:
        return ""
    return f"{boot}:{pidns}:{netns}"
