"""The engine's log records, handed to ``logging.getLogger("kvlink")``.

C never calls Python: the engine queues records (path state changes with
their reasons, hedges, retries, cancels, failures) in a bounded ring, and a
daemon thread per agent takes them (``kvl_next_log``, GIL released while it
waits) and logs them with the peer and path they concern, as ``extra``
fields ``kvlink_peer`` and ``kvlink_path`` and in the message.

The thread owns the end of the native agent's life: :meth:`LogDrain.close_agent`
wakes it, joins it and only then frees the agent, so the thread is never
inside the C core when its memory goes.  If the last reference to an Agent
dies on this very thread (garbage collection runs anywhere), the thread
frees the agent itself once it is out of the C call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from . import _native
from ._errors import KvlinkError

log = logging.getLogger("kvlink")
log.addHandler(logging.NullHandler())  # a library: the application decides where logs go


def _context_defaults(record: logging.LogRecord) -> bool:
    """Every "kvlink" record carries kvlink_peer and kvlink_path (None when
    no peer or path is concerned), so format strings may name them."""
    for name in ("kvlink_peer", "kvlink_path"):
        if not hasattr(record, name):
            setattr(record, name, None)
    return True


log.addFilter(_context_defaults)

_WAIT_MS = 1000  # the thread is woken at close, so this only bounds a lost wake-up


class LogDrain:
    def __init__(self, agent: _native.Handle, name: str) -> None:
        self._a = agent
        self._stop = False
        self._free_on_exit = False
        # also handed every record (the metrics count state changes, retries ...)
        self.on_record: Callable[[_native.LogRecord], None] | None = None
        self._thread = threading.Thread(target=self._run, name=f"kvlink-log-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        buf = _native.new_log_record()
        while not self._stop:
            try:
                rec = _native.next_log(self._a, _WAIT_MS, buf)
            except KvlinkError:  # woken by close_agent
                break
            if rec is not None:
                hook = self.on_record
                if hook is not None:
                    hook(rec)
                _emit(rec)
        if self._free_on_exit:
            _native.agent_close(self._a)

    def close_agent(self) -> None:
        """Stops the thread, then closes and frees the native agent."""
        self._stop = True
        _native.log_wake(self._a)
        if threading.current_thread() is self._thread:
            self._free_on_exit = True  # we are in _run, outside the C call
            return
        self._thread.join()
        _native.agent_close(self._a)


def _emit(rec: _native.LogRecord) -> None:
    if rec.dropped:
        log.warning(
            "%d kvlink engine log records were dropped (nobody drained them in time)", rec.dropped
        )
    level = rec.level
    if not log.isEnabledFor(level):
        return
    peer = rec.peer
    path = rec.path
    where = f"peer {peer!r}" if peer else "agent"
    if path >= 0:
        where += f" path {path}"
    log.log(
        level,
        "%s: %s",
        where,
        rec.msg,
        extra={"kvlink_peer": peer or None, "kvlink_path": path if path >= 0 else None},
    )
