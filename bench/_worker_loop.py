"""The JSON-lines command loop shared by the benchmark workers (_proc.py,
_mn_proc.py).

Importing this module first points file descriptor 1 at stderr and keeps the
original stdout for the protocol, so nothing else (a stray print, a C library)
can corrupt the stream.  Each command line names a public method of the
worker; the answer is ``{"ok": true, ...}`` or ``{"ok": false, "error": ...,
"type": ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

PROTO = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)


def serve(worker: Any) -> int:
    """Answers commands from stdin until "exit" or end of input."""
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        cmd = req.pop("cmd")
        try:
            if cmd.startswith("_") or not hasattr(worker, cmd):
                raise ValueError(f"unknown command {cmd!r}")
            reply = {"ok": True, **getattr(worker, cmd)(**req)}
        except Exception as exc:  # reported to the driver, which decides
            traceback.print_exc()
            reply = {"ok": False, "error": str(exc), "type": type(exc).__name__}
        PROTO.write(json.dumps(reply) + "\n")
        if cmd == "exit":
            break
    return 0
