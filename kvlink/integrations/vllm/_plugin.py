"""kvlink's vLLM plugin: the ``vllm.general_plugins`` entry point ``kvlink`` (pyproject.toml),
which vLLM runs early in each of its processes (the API server before it builds its config, the
engine core, every worker). It does two things for whoever operates a server:

- **Settings checked at start.** As soon as vLLM has built its config
  (``EngineArgs.create_engine_config``, which ``LLM(...)``, the OpenAI server and ``vllm serve``
  all call first), a kvlink connector's ``kv_connector_extra_config`` is checked
  (:func:`~kvlink.integrations.vllm._settings.check_at_start`): a typo'd key, a bad value or a
  listener beyond loopback without a cluster secret stops the server within seconds with the
  ``kvlink.ConfigError`` that names the key. The connector itself is constructed only after
  the model has loaded (the example's server: 8 s against 24 s on 2 idle cores, minutes on
  busy ones). vLLM has no hook for checking a
  connector's config, so the plugin wraps that one method, once per process.
- **kvlink's log records in vLLM's log.** vLLM configures only its ``vllm`` logger; records of
  the ``kvlink`` logger (the C core's refused connections, e.g. from a peer holding another
  cluster secret, and path state changes with their reasons) would be dropped. They are handed
  to vLLM's handlers (WARNING and above unless the ``kvlink`` logger's level says otherwise).

Importing this module does not import vLLM; :func:`register` does.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from kvlink.integrations.vllm._settings import check_at_start

log = logging.getLogger("vllm.kvlink")
_MARK = "_kvlink_checks_at_start"


class _ToVllm(logging.Handler):
    """Hands each ``kvlink`` record to the ``vllm.kvlink`` logger, i.e. to whatever handlers
    vLLM's logging config gives ``vllm``. Decided per record: vLLM configures its logging
    after the plugin is loaded (and again in each process). When ``vllm`` has no handlers of
    its own (``VLLM_CONFIGURE_LOGGING=0``: the application's config rules), nothing is handed:
    the record reaches the application's handlers as any other logger's would."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger("vllm").handlers:
            log.handle(record)


def route_logs() -> None:
    """Makes vLLM's log show the ``kvlink`` logger's records (idempotent)."""
    kl = logging.getLogger("kvlink")
    if not any(isinstance(h, _ToVllm) for h in kl.handlers):
        kl.addHandler(_ToVllm())


def register() -> None:
    """The entry point vLLM calls (``load_general_plugins``), in every one of its processes."""
    route_logs()
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_engine_config
    if getattr(create, _MARK, False):
        return

    @functools.wraps(create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = create(self, *args, **kwargs)
        _check(getattr(config, "kv_transfer_config", None))
        return config

    setattr(create_engine_config, _MARK, True)
    EngineArgs.create_engine_config = create_engine_config


def _check(kv_transfer_config: Any) -> None:
    """:func:`check_at_start`: its ``ConfigError`` stops vLLM; anything else (a config shaped
    unlike the vLLM this was written against) is logged and left to the connector's own checks.

    Raises:
        kvlink.ConfigError: a setting a kvlink connector would refuse.
    """
    import kvlink

    try:
        check_at_start(kv_transfer_config)
    except kvlink.ConfigError:
        raise
    except Exception as exc:  # never let the plugin itself break vLLM
        log.warning("kvlink could not check its connector's settings at start (%s: %s); the "
                    "connector checks them when it is constructed", type(exc).__name__, exc)
