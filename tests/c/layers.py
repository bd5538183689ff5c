"""No two core modules call each other both ways (issue 18: "a core without a call circle").

Reads the symbol tables of the objects tests/c builds (nm): module A calls module B when A's
object needs a symbol B's defines.  Every transport folder (csrc/transport/<name>/) counts as one
module, and so does the registry with the transport interface.  Calls back up the layers go
through callbacks registered at init (kvl_loop_hooks, kvl_conn_hooks, a->revoke_rx), which leave
no symbol reference, so a pair found here is a real two-way dependency.  Exits 1 naming each pair
and the symbols on both sides.

    python3 layers.py build/agent.o build/conn.o ...
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys

TRANSPORT_PREFIXES = ("tcp", "shm", "ucx_", "fault", "tp_")


def module_of(obj: str) -> str:
    name = os.path.basename(obj)[:-2]
    if name in ("tcp", "stream", "iopool"):
        return "transport/tcp"
    if name in ("cma", "shm"):
        return "transport/shm"
    if name.startswith("ucx_"):
        return "transport/ucx"
    if name.startswith("fault"):
        return "transport/fault"
    if name.startswith("tp_"):
        return "transport"
    return name


def main(objs: list[str]) -> int:
    defs: dict[str, set[str]] = collections.defaultdict(set)
    needs: dict[str, set[str]] = collections.defaultdict(set)
    for obj in objs:
        mod = module_of(obj)
        out = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TDBR":
                defs[mod].add(parts[2])
            elif len(parts) == 2 and parts[0] == "U":
                needs[mod].add(parts[1])
    owner = {sym: mod for mod, syms in defs.items() for sym in syms}
    calls: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for mod, syms in needs.items():
        for sym in syms:
            if sym in owner and owner[sym] != mod:
                calls[(mod, owner[sym])].add(sym)
    bad = sorted((a, b) for (a, b) in calls if a < b and (b, a) in calls)
    for a, b in bad:
        print(f"layers: {a} and {b} call each other:")
        print(f"  {a} -> {b}: {', '.join(sorted(calls[(a, b)]))}")
        print(f"  {b} -> {a}: {', '.join(sorted(calls[(b, a)]))}")
    mods = len(defs)
    print(f"layers: {mods} modules, {len(calls)} call edges, {len(bad)} two-way pairs")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
