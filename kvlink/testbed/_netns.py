"""Namespaces: the names a tag gives, the ip/tc commands, and teardown and inspection of a
live testbed. Teardown and inspection work from the tag alone, so the CLI needs no state file."""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Final

from ._errors import TestbedConfigError, TestbedError
from ._rates import format_rate, tbf_parameters

log = logging.getLogger("kvlink.testbed")

# Every testbed object (namespace, veth) starts with this, so `ip netns list | grep ^kvl`
# finds all of them and cleanup never touches anything else.
NAME_PREFIX: Final = "kvl"
# Tags are short so f"kvl{tag}a{i}" stays within IFNAMSIZ-1 = 15 characters for two-digit i.
_TAG_RE: Final = re.compile(r"[a-z0-9]{1,8}")
# Host names of a topology: a letter first, so "kvl{tag}{host}" never reads as another tag's
# legacy side a/b namespace with a digit-led host; the device-name length is checked separately.
_HOST_RE: Final = re.compile(r"[a-z][a-z0-9]{0,7}")
# Written on each namespace's loopback as its ifalias, so teardown and attach can tell which tag
# and host a namespace belongs to from the kernel alone (kvl{tag}{host} alone is ambiguous:
# tag "tb" with host "ab" and tag "tba" with host "b" are both kvltbab).
_MARKER: Final = "kvlink-testbed"
# No ip/tc call should take long; one that hangs (e.g. on a wedged netns mount) must not hang us.
_CMD_TIMEOUT_S: Final = 30.0
# How long down() lets processes left in a namespace exit after SIGTERM before SIGKILL.
_KILL_GRACE_S: Final = 2.0
_TOOL_DIRS: Final = "/usr/sbin:/sbin:/usr/bin:/bin:/usr/local/sbin:/usr/local/bin"


class Side(str, enum.Enum):
    """One end of the testbed: each side is one network namespace."""

    A = "a"
    B = "b"


def _find_tool(name: str) -> str | None:
    # Non-root PATHs often lack /usr/sbin, where ip and tc live.
    return shutil.which(name) or shutil.which(name, path=_TOOL_DIRS)


def _has_net_admin() -> bool:
    if os.geteuid() == 0:
        return True
    # Without euid 0, accept a process holding both CAP_NET_ADMIN (12) and CAP_SYS_ADMIN (21):
    # `ip netns` needs the latter to mount namespaces.
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    caps = int(line.split()[1], 16)
                    return bool(caps & (1 << 12)) and bool(caps & (1 << 21))
    except OSError:
        pass
    return False


def is_available() -> tuple[bool, str]:
    """Tell whether a testbed can be built here: Linux, root, and iproute2's ip and tc.

    Returns:
        (True, "ok") or (False, a sentence saying what is missing and what to do).
    """
    if not sys.platform.startswith("linux"):
        return False, f"the testbed needs Linux network namespaces; this is {sys.platform}"
    if not _has_net_admin():
        return False, "the testbed needs root (CAP_NET_ADMIN): run as root"
    for tool in ("ip", "tc"):
        if _find_tool(tool) is None:
            return False, f"`{tool}` not found: install iproute2 (apt-get install -y iproute2)"
    return True, "ok"


def _require_available() -> None:
    ok, reason = is_available()
    if not ok:
        raise TestbedError(reason)


def _tool(name: str) -> str:
    path = _find_tool(name)
    if path is None:
        raise TestbedError(f"`{name}` not found: install iproute2 (apt-get install -y iproute2)")
    return path


def _cmd(
    argv: Sequence[str], *, check: bool = True, hint: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run one ip/tc command, capturing its output.

    Raises:
        TestbedError: the tool is missing, timed out, or (with check) exited non-zero; the
            message has the command line, its stderr and ``hint``.
    """
    line = shlex.join(argv)
    log.debug("run: %s", line)
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False
        )
    except FileNotFoundError as exc:
        raise TestbedError(
            f"`{argv[0]}` not found: install iproute2 (apt-get install -y iproute2)"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"`{line}` did not finish within {_CMD_TIMEOUT_S:.0f} s{hint}") from exc
    if check and done.returncode != 0:
        detail = done.stderr.strip() or done.stdout.strip() or "no output"
        raise TestbedError(f"`{line}` failed (exit {done.returncode}): {detail}{hint}")
    return done


def _json_cmd(argv: Sequence[str]) -> list[dict[str, Any]]:
    out = _cmd(argv).stdout.strip()
    if not out:
        return []
    try:
        data = json.loads(out)
    except ValueError as exc:
        raise TestbedError(
            f"`{shlex.join(argv)}` printed output that is not JSON; iproute2 is too old "
            "(need -j support, iproute2 >= 4.14)"
        ) from exc
    return data if isinstance(data, list) else []


def _list_netns() -> set[str]:
    out = _cmd([_tool("ip"), "netns", "list"]).stdout
    # Lines look like "kvltba (id: 3)" or just "kvltba".
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _validate_tag(tag: str) -> str:
    if not isinstance(tag, str) or _TAG_RE.fullmatch(tag) is None:
        raise TestbedConfigError(
            f"tag: {tag!r} must be 1-8 lowercase letters or digits "
            "(it becomes part of interface names, which are at most 15 characters)"
        )
    return tag


def _validate_host(host: str, *, name: str = "host") -> str:
    if not isinstance(host, str) or _HOST_RE.fullmatch(host) is None:
        raise TestbedConfigError(
            f"{name}: {host!r} must be a lowercase letter followed by up to 7 lowercase letters "
            "or digits (it becomes part of namespace and interface names), e.g. 'a' or 'r1'"
        )
    return host


def _host_namespace(tag: str, host: str) -> str:
    return f"{NAME_PREFIX}{tag}{host}"


def _host_device(tag: str, host: str, link: int) -> str:
    return f"{NAME_PREFIX}{tag}{host}{link}"


def _namespace(tag: str, side: Side) -> str:
    return _host_namespace(tag, side.value)


def _device(tag: str, side: Side, link: int) -> str:
    return _host_device(tag, side.value, link)


def _side(side: str | Side) -> Side:
    try:
        return Side(side)
    except ValueError:
        raise TestbedConfigError(f"side: {side!r} must be 'a' or 'b'") from None


def _pids_in(ns: str) -> list[int]:
    done = _cmd([_tool("ip"), "netns", "pids", ns], check=False)
    return [int(tok) for tok in done.stdout.split() if tok.isdigit()]


def _still_in_ns(pid: int) -> bool:
    # A zombie has no /proc/PID/ns/net, so this is False once the process has exited.
    return os.path.exists(f"/proc/{pid}/ns/net")


def _kill_pids(ns: str, pids: list[int]) -> None:
    if not pids:
        return
    log.warning("testbed: stopping %d process(es) still in %s: %s", len(pids), ns, pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + _KILL_GRACE_S
        while time.monotonic() < deadline:
            pids = [pid for pid in pids if _still_in_ns(pid)]
            if not pids:
                return
            time.sleep(0.02)


def _marker(ns: str) -> tuple[str, str] | None:
    """(tag, host) written on ``ns``'s loopback by :func:`_claim`, or None (none, or gone)."""
    done = _cmd([_tool("ip"), "-j", "-n", ns, "link", "show", "lo"], check=False)
    if done.returncode != 0:
        return None
    try:
        entries = json.loads(done.stdout or "[]")
    except ValueError:
        return None
    alias = str(entries[0].get("ifalias", "")) if entries else ""
    fields = dict(kv.split("=", 1) for kv in alias.split()[1:] if "=" in kv)
    if not alias.startswith(_MARKER + " ") or "tag" not in fields or "host" not in fields:
        return None
    return fields["tag"], fields["host"]


def _claim(tag: str, host: str, *, hint: str = "") -> str:
    """Create (if missing) and mark the namespace of ``host`` in testbed ``tag``; its name.

    Raises:
        TestbedError: the namespace belongs to another tag's testbed, or ip failed.
    """
    ip = _tool("ip")
    ns = _host_namespace(tag, host)
    if ns in _list_netns():
        mark = _marker(ns)
        if mark is not None and mark != (tag, host):
            raise TestbedError(
                f"namespace {ns} is host {mark[1]!r} of testbed {mark[0]!r}, not host {host!r} "
                f"of {tag!r}: use a tag that is not a prefix of {mark[0]!r}'s names"
            )
    else:
        _cmd([ip, "netns", "add", ns], hint=hint)
    marker = f"{_MARKER} tag={tag} host={host}"
    _cmd([ip, "-n", ns, "link", "set", "lo", "alias", marker], hint=hint)
    return ns


def _tag_namespaces(tag: str, present: set[str] | None = None) -> dict[str, str]:
    """The live namespaces of testbed ``tag``, keyed by host: every namespace marked with the
    tag, plus unmarked ``kvl{tag}a``/``kvl{tag}b`` (a testbed made before markers, or one whose
    up() stopped between creating a namespace and marking it)."""
    if present is None:
        present = _list_netns()
    prefix = f"{NAME_PREFIX}{tag}"
    found: dict[str, str] = {}
    for ns in sorted(present):
        host = ns[len(prefix) :]
        if not ns.startswith(prefix) or not host:
            continue
        mark = _marker(ns)
        legacy = mark is None and host in (Side.A.value, Side.B.value)
        if legacy or mark == (tag, host):
            found[host] = ns
    return found


def _delete_namespace(ns: str, tag: str) -> None:
    """Stop every process in ``ns``, then delete it (its veths and their peers go with it).

    Raises:
        TestbedError: the namespace could not be deleted.
    """
    _kill_pids(ns, _pids_in(ns))
    done = _cmd([_tool("ip"), "netns", "del", ns], check=False)
    if done.returncode != 0 and ns in _list_netns():
        raise TestbedError(
            f"could not delete namespace {ns}: {done.stderr.strip()}; "
            f"check `ip netns pids {ns}` and retry `kvlink testbed down --tag {tag}`"
        )
    log.info("testbed %s: deleted namespace %s", tag, ns)


def _shape(ns: str, dev: str, rate_bps: int | None, *, hint: str = "") -> None:
    """Shape the egress of ``dev`` in ``ns`` with tbf at ``rate_bps``; None removes shaping.

    Raises:
        TestbedError: tc failed.
    """
    tc = _tool("tc")
    if rate_bps is None:
        done = _cmd([tc, "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        # Deleting the default (noqueue) root fails harmlessly: already unshaped.
        if done.returncode != 0 and "handle of zero" not in done.stderr:
            raise TestbedError(
                f"could not remove shaping from {dev} in {ns}: {done.stderr.strip()}{hint}"
            )
    else:
        # `replace` on an existing tbf is a change in place: traffic keeps flowing.
        params = tbf_parameters(rate_bps)
        _cmd([tc, "-n", ns, "qdisc", "replace", "dev", dev, "root", *params.tc_args()], hint=hint)


def _exec_prefix(ns: str) -> list[str]:
    """The argv prefix that runs a command in namespace ``ns``.

    Raises:
        TestbedError: `ip` is missing.
    """
    return [_tool("ip"), "netns", "exec", ns]


class _Processes:
    """Programs started inside a testbed's namespaces, so that down() can stop them."""

    def __init__(self, tag: str) -> None:
        self._tag = tag
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen[Any]] = []

    def start(self, ns: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``ns`` with :class:`subprocess.Popen` and remember it.

        Raises:
            TestbedConfigError: argv is a string or empty.
            TestbedError: `ip` is missing or the process could not start.
        """
        if isinstance(argv, (str, bytes)) or not argv:
            raise TestbedConfigError(
                f"argv: expected a non-empty list of arguments, got {argv!r} "
                "(use shlex.split for a command line)"
            )
        full = [*_exec_prefix(ns), *map(str, argv)]
        log.debug("testbed %s: run %s", self._tag, shlex.join(full))
        try:
            proc: subprocess.Popen[Any] = subprocess.Popen(full, **popen_kwargs)
        except OSError as exc:
            raise TestbedError(f"could not start `{shlex.join(full)}`: {exc}") from exc
        with self._lock:
            self._procs = [p for p in self._procs if p.poll() is None]
            self._procs.append(proc)
        return proc

    def stop_all(self) -> None:
        """SIGTERM every process still running, SIGKILL those that outlive the grace time."""
        with self._lock:
            procs, self._procs = self._procs, []
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=_KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def teardown(tag: str = "tb") -> bool:
    """Remove testbed ``tag``: stop processes in its namespaces, then delete every namespace
    of it (both sides of a :class:`Testbed`, every host of a :class:`Topology`).

    Deleting a namespace deletes its veth ends, and with them their peers. Works on a partly
    built testbed and is a no-op when nothing is there. A namespace is the tag's when its
    loopback carries the tag's marker, or, unmarked, when it is ``kvl{tag}a`` or ``kvl{tag}b``.

    Returns:
        True if anything was removed.

    Raises:
        TestbedConfigError: the tag is invalid.
        TestbedError: not root, iproute2 missing, or a namespace could not be deleted.
    """
    _validate_tag(tag)
    _require_available()
    removed = False
    for ns in _tag_namespaces(tag).values():
        _delete_namespace(ns, tag)
        removed = True
    return removed


def _side_state(tag: str, side: Side) -> dict[int, dict[str, Any]]:
    """Per-link state of one side, keyed by link index, read from the live namespace."""
    return _host_state(tag, side.value)


def _host_state(tag: str, host: str) -> dict[int, dict[str, Any]]:
    """Per-link state of one host, keyed by link index, read from the live namespace."""
    ns = _host_namespace(tag, host)
    dev_re = re.compile(re.escape(f"{NAME_PREFIX}{tag}{host}") + r"(\d+)")
    links: dict[int, dict[str, Any]] = {}
    for entry in _json_cmd([_tool("ip"), "-j", "-n", ns, "addr", "show"]):
        name = str(entry.get("ifname", ""))
        match = dev_re.fullmatch(name)
        if match is None:
            continue
        inet = [a for a in entry.get("addr_info", []) if a.get("family") == "inet"]
        addresses = [f"{a['local']}/{a['prefixlen']}" for a in inet]
        links[int(match.group(1))] = {
            "device": name,
            "address": addresses[0] if addresses else None,
            "addresses": addresses,
            "admin_up": "UP" in entry.get("flags", []),
            "operstate": str(entry.get("operstate", "UNKNOWN")).lower(),
            "qdisc": None,
            "rate": None,
            "rate_bps": None,
            "burst_bytes": None,
            "queue_latency_us": None,
        }
    by_dev = {info["device"]: info for info in links.values()}
    for q in _json_cmd([_tool("tc"), "-j", "-n", ns, "qdisc", "show"]):
        info = by_dev.get(str(q.get("dev", "")))
        if info is None or not q.get("root"):
            continue
        info["qdisc"] = q.get("kind")
        opts = q.get("options", {})
        if q.get("kind") == "tbf" and "rate" in opts:
            # tc's JSON gives tbf's rate in bytes per second, and its queue limit only as the
            # time it takes to drain the queue beyond the burst ("lat", microseconds).
            bps = int(opts["rate"]) * 8
            info.update(
                rate=format_rate(bps),
                rate_bps=bps,
                burst_bytes=opts.get("burst"),
                queue_latency_us=opts.get("lat"),
            )
    return links


def inspect(tag: str = "tb") -> dict[str, Any]:
    """Describe testbed ``tag`` as it is live (namespaces, links, addresses, states, rates).

    Returns:
        A JSON-ready dict: ``tag``, ``up`` (both namespaces and at least one link present),
        ``namespaces`` ({side: {"name", "present"}}), and ``links``: one dict per link index
        with ``link``, ``subnet`` and, per side "a"/"b" (None if missing), ``device``,
        ``address`` (the first IPv4 address/prefix), ``addresses`` (all of them), ``admin_up``,
        ``operstate``, ``qdisc``, ``rate`` (tc spelling or None when unshaped), ``rate_bps``,
        ``burst_bytes`` and ``queue_latency_us`` (tbf's queue limit as drain time).

    Raises:
        TestbedConfigError: the tag is invalid.
        TestbedError: not root, iproute2 missing, or a command failed.
    """
    _validate_tag(tag)
    _require_available()
    present = _list_netns()
    namespaces = {
        side.value: {"name": _namespace(tag, side), "present": _namespace(tag, side) in present}
        for side in Side
    }
    sides = {
        side.value: (_side_state(tag, side) if namespaces[side.value]["present"] else {})
        for side in Side
    }
    links: list[dict[str, Any]] = []
    for index in sorted(set(sides["a"]) | set(sides["b"])):
        a, b = sides["a"].get(index), sides["b"].get(index)
        address = (a or b or {}).get("address")
        subnet = None
        if address:
            subnet = address.rsplit(".", 1)[0] + ".0/" + address.rsplit("/", 1)[1]
        links.append({"link": index, "subnet": subnet, "a": a, "b": b})
    up = all(ns["present"] for ns in namespaces.values()) and bool(links)
    return {"tag": tag, "up": up, "namespaces": namespaces, "links": links}
