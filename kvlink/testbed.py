"""Multi-NIC network testbed: two network namespaces joined by shaped veth pairs.

A testbed is two namespaces, ``kvl{tag}a`` and ``kvl{tag}b``, joined by ``links`` veth pairs.
Link ``i`` is ``kvl{tag}a{i}`` (address ``198.18.{subnet_base+i}.1/24``) paired with
``kvl{tag}b{i}`` (``.2``), so traffic to a side-b address leaves side a over exactly one link.
Each link can be rate-limited with tbf on both ends, re-shaped, or taken down and up while
traffic flows; :class:`FaultSchedule` does that on a timetable for benchmarks.

Everything here shells out to iproute2 (``ip``, ``tc``) and needs root (CAP_NET_ADMIN and
CAP_SYS_ADMIN, for ``ip netns``). Only addresses in 198.18.0.0/15 (RFC 2544's benchmarking
range) are used, and nothing is routed outside the two namespaces.

Kernel facts this relies on (see shared/peers.md): tbf works, netem does not exist here,
``ip link set DEV down/up`` and ``tc qdisc change ... tbf rate R`` work mid-transfer.
"""

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Final, TypeAlias

from ._errors import KvlinkError

__all__ = [
    "MAX_LINKS",
    "MIN_RATE_BPS",
    "Fault",
    "FaultKind",
    "FaultSchedule",
    "FiredFault",
    "RateLike",
    "Side",
    "TbfParams",
    "Testbed",
    "TestbedConfig",
    "TestbedConfigError",
    "TestbedError",
    "format_rate",
    "inspect",
    "is_available",
    "parse_rate",
    "tbf_parameters",
    "teardown",
]

log = logging.getLogger("kvlink.testbed")

# Every testbed object (namespace, veth) starts with this, so `ip netns list | grep ^kvl`
# finds all of them and cleanup never touches anything else.
NAME_PREFIX: Final = "kvl"
# Tags are short so f"kvl{tag}a{i}" stays within IFNAMSIZ-1 = 15 characters for two-digit i.
_TAG_RE: Final = re.compile(r"[a-z0-9]{1,8}")
# 64 links is far more than a 2-core machine can drive, and keeps device names <= 15 chars.
MAX_LINKS: Final = 64
# Link i lives in 198.18.0.0/15 at third octet subnet_base+i; the /15 holds 512 /24s.
_SUBNETS_IN_RANGE: Final = 512
# tbf stores the burst as transmit time in 32-bit scheduler ticks: a 64 KiB burst overflows below
# about 10 kbit/s. 100 kbit/s keeps well clear, and slower links are useless for KV transfers.
MIN_RATE_BPS: Final = 100_000
# No ip/tc call should take long; one that hangs (e.g. on a wedged netns mount) must not hang us.
_CMD_TIMEOUT_S: Final = 30.0
# How long down() lets processes left in a namespace exit after SIGTERM before SIGKILL.
_KILL_GRACE_S: Final = 2.0
_TOOL_DIRS: Final = "/usr/sbin:/sbin:/usr/bin:/bin:/usr/local/sbin:/usr/local/bin"


class TestbedError(KvlinkError, RuntimeError):
    """A testbed operation failed; the message says what failed and what to do about it."""

    # Not a pytest test class despite the name: without this, importing it into a test module
    # makes pytest warn, which filterwarnings=error turns into a failure.
    __test__ = False


class TestbedConfigError(TestbedError, ValueError):
    """An argument given to the testbed is invalid; the message names the argument."""

    __test__ = False


class Side(str, enum.Enum):
    """One end of the testbed: each side is one network namespace."""

    A = "a"
    B = "b"


# A rate as users write it: "2gbit", an int in bit/s, or None for an unshaped link.
RateLike: TypeAlias = str | int | None


# ----------------------------------------------------------------------------------------------
# Rates and tbf parameters


_RATE_RE: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")
# tc's own unit names: SI multiples of bits, and the IEC ones.
_RATE_UNITS: Final[dict[str, int]] = {
    "": 1,
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
}
_BYTE_UNITS: Final = {"bps", "kbps", "mbps", "gbps", "tbps", "kibps", "mibps", "gibps", "tibps"}


def parse_rate(rate: str | int, *, name: str = "rate") -> int:
    """Parse a link rate into bits per second.

    Accepts tc-style strings ("2gbit", "500mbit", "1.5gbit", "100kbit", "1000000") and ints
    in bit/s. ``name`` is the argument named in error messages.

    Raises:
        TestbedConfigError: the rate cannot be parsed, is not a whole number of bit/s, or is
            below MIN_RATE_BPS.
    """
    if isinstance(rate, bool) or not isinstance(rate, (str, int)):
        raise TestbedConfigError(
            f"{name}: expected a rate such as '2gbit' or an int in bit/s, got {rate!r}"
        )
    if isinstance(rate, int):
        bps = rate
    else:
        text = rate.strip().lower()
        match = _RATE_RE.fullmatch(text)
        if match is None:
            raise TestbedConfigError(
                f"{name}: cannot parse {rate!r}; write a number and a unit such as '2gbit', "
                "'500mbit' or '1.5gbit' (or an int in bit/s)"
            )
        number, unit = match.groups()
        if unit in _BYTE_UNITS:
            bits = Decimal(number) * _RATE_UNITS[unit[:-3] + "bit"] * 8
            hint = format_rate(int(bits)) if bits == bits.to_integral_value() else "a rate in bit"
            raise TestbedConfigError(
                f"{name}: {rate!r} is in bytes per second (tc reads '{unit}' as bytes); "
                f"write bits instead, e.g. '{hint}'"
            )
        if unit not in _RATE_UNITS:
            raise TestbedConfigError(
                f"{name}: unknown unit {unit!r} in {rate!r}; use one of bit, kbit, mbit, gbit, tbit"
            )
        try:
            exact = Decimal(number) * _RATE_UNITS[unit]
        except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
            raise TestbedConfigError(f"{name}: cannot parse {rate!r}") from exc
        if exact != exact.to_integral_value():
            raise TestbedConfigError(f"{name}: {rate!r} is not a whole number of bit/s")
        bps = int(exact)
    if bps < MIN_RATE_BPS:
        raise TestbedConfigError(
            f"{name}: {rate!r} is below the minimum of {format_rate(MIN_RATE_BPS)} "
            "(tbf cannot hold a 64 KiB burst at slower rates); for an unshaped link use None "
            "(on the command line: none)"
        )
    return bps


def format_rate(bps: int) -> str:
    """Format bits per second the way tc spells rates: 2000000000 -> "2gbit", 1.5e9 -> "1.5gbit".

    Up to three decimals are used; other values are written in plain "bit".
    """
    for unit, scale in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= scale:
            value = Decimal(bps) / scale
            if value == value.quantize(Decimal("0.001")):
                return f"{value.normalize():f}{unit}"
    return f"{bps}bit"


def _optional_rate(rate: RateLike, *, name: str) -> int | None:
    return None if rate is None else parse_rate(rate, name=name)


@dataclass(frozen=True)
class TbfParams:
    """The tbf settings used for one rate (what benchmarks should report beside their figures)."""

    rate_bps: int
    burst_bytes: int
    limit_bytes: int

    def tc_args(self) -> list[str]:
        """The ``tbf ...`` part of a ``tc qdisc replace`` command line."""
        return [
            "tbf",
            "rate",
            f"{self.rate_bps}bit",
            "burst",
            str(self.burst_bytes),
            "limit",
            str(self.limit_bytes),
        ]


def tbf_parameters(rate: str | int) -> TbfParams:
    """Choose tbf burst and limit for a rate.

    burst = max(4 ms of traffic, 64 KiB) and limit = burst + max(5 ms of traffic, 128 KiB).
    Measured here (one iperf3 stream over one veth pair, tbf on both ends, 2 cores):

    * The 64 KiB floor is what matters most: veth hands tbf GSO super-packets of up to 64 KiB,
      and a burst smaller than one of them forces tbf to split and drop. At 2gbit a 64 KiB
      burst gave 1.78-1.90 Gbit/s with 1200-2200 retransmits; 250 KB (1 ms) or more gave
      1.913-1.917 Gbit/s (95.6-95.9%) with none, whatever the queue (1, 5 or 20 ms).
    * 4 ms of burst (1 MB at 2gbit) is past the knee at every rate tried, and still small
      enough that a rate change or a short measurement is not skewed by a long line-rate burst.
    * The limit barely moves throughput (95-96% from 20mbit to 6gbit): at low rates TCP fills
      any queue and loses a few packets either way. 5 ms, floored at 128 KiB, keeps queueing
      delay low at multi-gbit rates without starving slow links.

    Raises:
        TestbedConfigError: the rate is invalid (see parse_rate).
    """
    bps = parse_rate(rate)
    bytes_per_s = bps // 8
    burst = max(bytes_per_s // 250, 64 * 1024)
    limit = burst + max(bytes_per_s // 200, 128 * 1024)
    return TbfParams(rate_bps=bps, burst_bytes=burst, limit_bytes=limit)


# ----------------------------------------------------------------------------------------------
# Tools and commands


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


def _namespace(tag: str, side: Side) -> str:
    return f"{NAME_PREFIX}{tag}{side.value}"


def _device(tag: str, side: Side, link: int) -> str:
    return f"{NAME_PREFIX}{tag}{side.value}{link}"


def _side(side: str | Side) -> Side:
    try:
        return Side(side)
    except ValueError:
        raise TestbedConfigError(f"side: {side!r} must be 'a' or 'b'") from None


# ----------------------------------------------------------------------------------------------
# Teardown and inspection work from the tag alone, so the CLI needs no state file.


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


def teardown(tag: str = "tb") -> bool:
    """Remove testbed ``tag``: stop processes in its namespaces, then delete both namespaces.

    Deleting a namespace deletes its veth ends, and with them their peers. Works on a partly
    built testbed and is a no-op when nothing is there.

    Returns:
        True if anything was removed.

    Raises:
        TestbedConfigError: the tag is invalid.
        TestbedError: not root, iproute2 missing, or a namespace could not be deleted.
    """
    _validate_tag(tag)
    _require_available()
    ip = _tool("ip")
    present = _list_netns()
    removed = False
    for side in Side:
        ns = _namespace(tag, side)
        if ns not in present:
            continue
        _kill_pids(ns, _pids_in(ns))
        done = _cmd([ip, "netns", "del", ns], check=False)
        if done.returncode != 0 and ns in _list_netns():
            raise TestbedError(
                f"could not delete namespace {ns}: {done.stderr.strip()}; "
                f"check `ip netns pids {ns}` and retry `kvlink testbed down --tag {tag}`"
            )
        log.info("testbed %s: deleted namespace %s", tag, ns)
        removed = True
    return removed


def _side_state(tag: str, side: Side) -> dict[int, dict[str, Any]]:
    """Per-link state of one side, keyed by link index, read from the live namespace."""
    ns = _namespace(tag, side)
    dev_re = re.compile(re.escape(f"{NAME_PREFIX}{tag}{side.value}") + r"(\d+)")
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


# ----------------------------------------------------------------------------------------------
# The testbed


@dataclass(frozen=True)
class TestbedConfig:
    """A validated testbed description; :class:`Testbed` takes the same arguments.

    ``rates`` (one per link; None means unshaped) overrides ``rate`` (the same for all links).
    """

    __test__ = False

    # 4 links is what the multi-rail benchmarks use (4 x 2gbit, see shared/peers.md).
    links: int = 4
    # 2gbit per link is the highest rate that stays clean on a 2-core machine under load.
    rate: RateLike = "2gbit"
    rates: tuple[RateLike, ...] | None = None
    # Parallel testbeds need distinct tags; "tb" is the one the CLI uses by default.
    tag: str = "tb"
    # Third octet of link 0's subnet; parallel testbeds may share it (namespaces isolate them).
    subnet_base: int = 0
    rates_bps: tuple[int | None, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Validate every field.

        Raises:
            TestbedConfigError: a field is invalid; the message names it and the fix.
        """
        _validate_tag(self.tag)
        if isinstance(self.links, bool) or not isinstance(self.links, int):
            raise TestbedConfigError(f"links: expected an int, got {self.links!r}")
        if not 1 <= self.links <= MAX_LINKS:
            raise TestbedConfigError(f"links: {self.links} must be between 1 and {MAX_LINKS}")
        if isinstance(self.subnet_base, bool) or not isinstance(self.subnet_base, int):
            raise TestbedConfigError(f"subnet_base: expected an int, got {self.subnet_base!r}")
        if not 0 <= self.subnet_base <= _SUBNETS_IN_RANGE - self.links:
            raise TestbedConfigError(
                f"subnet_base: {self.subnet_base} with {self.links} links leaves 198.18.0.0/15; "
                f"use 0..{_SUBNETS_IN_RANGE - self.links}"
            )
        if self.rates is not None:
            if isinstance(self.rates, str) or len(self.rates) != self.links:
                raise TestbedConfigError(
                    f"rates: give a list of exactly {self.links} rates (one per link), "
                    f"got {self.rates!r}"
                )
            object.__setattr__(self, "rates", tuple(self.rates))
            parsed = tuple(_optional_rate(r, name=f"rates[{i}]") for i, r in enumerate(self.rates))
        else:
            parsed = (_optional_rate(self.rate, name="rate"),) * self.links
        object.__setattr__(self, "rates_bps", parsed)


class Testbed:
    """Two network namespaces joined by ``links`` shaped veth pairs.

    Use as ``with Testbed(links=4, rate="2gbit", tag="x") as tb: ...`` (up on entry, always down
    on exit), or call :meth:`up` and :meth:`down` yourself. The object holds no kernel state:
    everything lives in the namespaces, so :meth:`attach` rebuilds an object for a live testbed.
    """

    __test__ = False

    def __init__(
        self,
        links: int = 4,
        rate: RateLike = "2gbit",
        rates: Sequence[RateLike] | None = None,
        tag: str = "tb",
        subnet_base: int = 0,
    ) -> None:
        """Validate the configuration; nothing is created until :meth:`up`.

        Raises:
            TestbedConfigError: an argument is invalid; the message names it.
        """
        self.config = TestbedConfig(
            links=links,
            rate=rate,
            rates=None if rates is None else tuple(rates),
            tag=tag,
            subnet_base=subnet_base,
        )
        self._lock = threading.Lock()
        self._rates: list[int | None] = list(self.config.rates_bps)
        self._procs: list[subprocess.Popen[Any]] = []

    @classmethod
    def attach(cls, tag: str = "tb") -> Testbed:
        """Build an object for the live testbed ``tag`` (links, rates, subnets read back).

        Raises:
            TestbedError: no complete testbed with that tag is up, or inspection failed.
        """
        state = inspect(tag)
        if not state["up"]:
            raise TestbedError(
                f"no testbed with tag {tag!r} is up: start one with `kvlink testbed up --tag {tag}`"
            )
        indices = [link["link"] for link in state["links"]]
        if indices != list(range(len(indices))) or any(
            link["a"] is None or link["b"] is None or link["a"]["address"] is None
            for link in state["links"]
        ):
            raise TestbedError(
                f"testbed {tag!r} is only partly built (links {indices}): recreate it with "
                f"`kvlink testbed down --tag {tag}` then `kvlink testbed up --tag {tag}`"
            )
        octets = state["links"][0]["a"]["address"].split("/")[0].split(".")
        base = (int(octets[1]) - 18) * 256 + int(octets[2])
        return cls(
            links=len(indices),
            rates=[link["a"]["rate_bps"] for link in state["links"]],
            tag=tag,
            subnet_base=base,
        )

    # -- names and addresses ----------------------------------------------------------------

    @property
    def tag(self) -> str:
        """The short id in every name this testbed creates."""
        return self.config.tag

    @property
    def links(self) -> int:
        """Number of veth pairs."""
        return self.config.links

    @property
    def rates(self) -> list[str | None]:
        """Current per-link rates in tc spelling (None: unshaped), as set through this object."""
        with self._lock:
            return [None if r is None else format_rate(r) for r in self._rates]

    def namespace(self, side: str | Side) -> str:
        """Name of the namespace of ``side`` ("a" or "b").

        Raises:
            TestbedConfigError: side is not "a" or "b".
        """
        return _namespace(self.tag, _side(side))

    def device(self, side: str | Side, link: int) -> str:
        """Name of the veth end of ``link`` on ``side``.

        Raises:
            TestbedConfigError: bad side or link index.
        """
        return _device(self.tag, _side(side), self._check_link(link))

    def address(self, side: str | Side, link: int) -> str:
        """IPv4 address (no prefix) of ``side``'s end of ``link``: 198.18.{base+link}.1 or .2.

        Raises:
            TestbedConfigError: bad side or link index.
        """
        host = 1 if _side(side) is Side.A else 2
        octet = self.config.subnet_base + self._check_link(link)
        return f"198.{18 + octet // 256}.{octet % 256}.{host}"

    def addresses(self, side: str | Side) -> list[str]:
        """Addresses of ``side``, one per link in link order.

        Raises:
            TestbedConfigError: side is not "a" or "b".
        """
        return [self.address(side, i) for i in range(self.links)]

    def subnet(self, link: int) -> str:
        """The /24 of ``link``, e.g. "198.18.0.0/24".

        Raises:
            TestbedConfigError: bad link index.
        """
        return self.address(Side.A, link).rsplit(".", 1)[0] + ".0/24"

    def _check_link(self, link: int) -> int:
        if isinstance(link, bool) or not isinstance(link, int) or not 0 <= link < self.links:
            raise TestbedConfigError(
                f"link: {link!r} is not a link of testbed {self.tag!r} (0..{self.links - 1})"
            )
        return link

    def _hint(self) -> str:
        return (
            f"; is testbed {self.tag!r} up? check `kvlink testbed status --tag {self.tag}`, "
            f"or rebuild it with `kvlink testbed down --tag {self.tag}` and up()"
        )

    # -- lifecycle ------------------------------------------------------------------------------

    def up(self) -> None:
        """Create (or repair) the namespaces, links, addresses and shaping. Idempotent.

        Existing pieces are kept and brought to the configured state; links beyond
        ``links`` left by an earlier, larger testbed with this tag are removed. On failure
        everything with this tag is torn down before the error propagates.

        Raises:
            TestbedError: not root, iproute2 missing, or a command failed.
        """
        _require_available()
        try:
            self._up()
        except BaseException:
            log.error("testbed %s: up() failed; tearing down what was created", self.tag)
            try:
                self.down()
            except TestbedError as exc:  # keep the original error, report the cleanup one
                log.error("testbed %s: cleanup after failed up() also failed: %s", self.tag, exc)
            raise

    def _up(self) -> None:
        ip = _tool("ip")
        hint = self._hint()
        present = _list_netns()
        for side in Side:
            ns = _namespace(self.tag, side)
            if ns not in present:
                _cmd([ip, "netns", "add", ns], hint=hint)
            _cmd([ip, "-n", ns, "link", "set", "lo", "up"], hint=hint)
        ns_a, ns_b = self.namespace(Side.A), self.namespace(Side.B)
        existing = {side: _side_state(self.tag, side) for side in Side}
        for index in sorted(i for i in existing[Side.A] if i >= self.links):
            # Deleting one end of a veth pair deletes the other.
            _cmd([ip, "-n", ns_a, "link", "del", existing[Side.A][index]["device"]], hint=hint)
        for i in range(self.links):
            dev_a, dev_b = self.device(Side.A, i), self.device(Side.B, i)
            if i not in existing[Side.A]:
                # Created straight inside the namespaces, so host interface names never clash.
                _cmd(
                    [ip, "link", "add", dev_a, "netns", ns_a, "type", "veth",
                     "peer", "name", dev_b, "netns", ns_b],
                    hint=hint,
                )  # fmt: skip
            for side, ns, dev in ((Side.A, ns_a, dev_a), (Side.B, ns_b, dev_b)):
                addr = f"{self.address(side, i)}/24"
                old = existing[side].get(i, {}).get("addresses", [])
                if old and old != [addr]:  # left by a testbed with another subnet_base
                    _cmd([ip, "-n", ns, "addr", "flush", "dev", dev], hint=hint)
                _cmd([ip, "-n", ns, "addr", "replace", addr, "dev", dev], hint=hint)
            with self._lock:
                rate = self._rates[i]
            self._apply_rate(i, rate)
            for ns, dev in ((ns_a, dev_a), (ns_b, dev_b)):
                _cmd([ip, "-n", ns, "link", "set", dev, "up"], hint=hint)
        log.info(
            "testbed %s: up, %d links, rates %s",
            self.tag,
            self.links,
            ", ".join(r or "unshaped" for r in self.rates),
        )

    def down(self) -> None:
        """Stop processes started by :meth:`run`, then remove both namespaces. Idempotent.

        Works on a partly created testbed; removing a namespace removes its veths.

        Raises:
            TestbedError: not root, iproute2 missing, or a namespace could not be deleted.
        """
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
        teardown(self.tag)

    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    def __repr__(self) -> str:
        return (
            f"Testbed(links={self.links}, rates={self.rates!r}, tag={self.tag!r}, "
            f"subnet_base={self.config.subnet_base})"
        )

    # -- changes while up -----------------------------------------------------------------------

    def _apply_rate(self, link: int, rate_bps: int | None) -> None:
        tc = _tool("tc")
        hint = self._hint()
        for side in Side:
            ns, dev = _namespace(self.tag, side), _device(self.tag, side, link)
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
                _cmd(
                    [tc, "-n", ns, "qdisc", "replace", "dev", dev, "root", *params.tc_args()],
                    hint=hint,
                )

    def set_rate(self, link: int, rate: RateLike) -> None:
        """Reshape ``link`` (both ends) to ``rate``; None removes shaping. Works mid-transfer.

        Raises:
            TestbedConfigError: bad link index or rate.
            TestbedError: the testbed is not up or tc failed.
        """
        self._check_link(link)
        rate_bps = _optional_rate(rate, name="rate")
        self._apply_rate(link, rate_bps)
        with self._lock:
            self._rates[link] = rate_bps
        log.info("testbed %s: link %d rate %s", self.tag, link, rate or "unshaped")

    def _set_link(self, link: int, state: str) -> None:
        self._check_link(link)
        ip = _tool("ip")
        for side in Side:
            ns, dev = _namespace(self.tag, side), _device(self.tag, side, link)
            _cmd([ip, "-n", ns, "link", "set", dev, state], hint=self._hint())
        log.info("testbed %s: link %d %s", self.tag, link, state)

    def link_down(self, link: int) -> None:
        """Take both ends of ``link`` down (its route disappears; TCP over it stalls).

        Raises:
            TestbedConfigError: bad link index.
            TestbedError: the testbed is not up or ip failed.
        """
        self._set_link(link, "down")

    def link_up(self, link: int) -> None:
        """Bring both ends of ``link`` back up (addresses and shaping are kept while down).

        Raises:
            TestbedConfigError: bad link index.
            TestbedError: the testbed is not up or ip failed.
        """
        self._set_link(link, "up")

    def status(self) -> dict[str, Any]:
        """Live state of this testbed: :func:`inspect`'s dict plus ``config``.

        Raises:
            TestbedError: not root, iproute2 missing, or a command failed.
        """
        state = inspect(self.tag)
        state["config"] = {
            "links": self.links,
            "rates": self.rates,
            "subnet_base": self.config.subnet_base,
        }
        return state

    # -- running programs inside ----------------------------------------------------------------

    def exec_prefix(self, side: str | Side) -> list[str]:
        """The argv prefix that runs a command in ``side``'s namespace.

        Raises:
            TestbedConfigError: side is not "a" or "b".
            TestbedError: `ip` is missing.
        """
        return [_tool("ip"), "netns", "exec", self.namespace(side)]

    def run(
        self, side: str | Side, argv: Sequence[str], **popen_kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``side``'s namespace with :class:`subprocess.Popen`.

        The process is stopped by :meth:`down` if it is still running then.

        Raises:
            TestbedConfigError: side is bad, or argv is a string or empty.
            TestbedError: `ip` is missing or the process could not start.
        """
        if isinstance(argv, (str, bytes)) or not argv:
            raise TestbedConfigError(
                f"argv: expected a non-empty list of arguments, got {argv!r} "
                "(use shlex.split for a command line)"
            )
        full = [*self.exec_prefix(side), *map(str, argv)]
        log.debug("testbed %s: run %s", self.tag, shlex.join(full))
        try:
            proc: subprocess.Popen[Any] = subprocess.Popen(full, **popen_kwargs)
        except OSError as exc:
            raise TestbedError(f"could not start `{shlex.join(full)}`: {exc}") from exc
        with self._lock:
            self._procs = [p for p in self._procs if p.poll() is None]
            self._procs.append(proc)
        return proc


# ----------------------------------------------------------------------------------------------
# Fault injection on a timetable


class FaultKind(enum.Enum):
    """What a fault does to a link."""

    DOWN = "down"
    UP = "up"
    RATE = "rate"


@dataclass(frozen=True)
class Fault:
    """One scheduled change: at ``at_s`` seconds after start, do ``kind`` to ``link``."""

    at_s: float
    kind: FaultKind
    link: int
    rate: RateLike = None  # only for FaultKind.RATE; None removes shaping

    def action(self) -> tuple[Any, ...]:
        """The action tuple this fault was written as: ("down", 0), ("rate", 1, "200mbit")."""
        if self.kind is FaultKind.RATE:
            return (self.kind.value, self.link, self.rate)
        return (self.kind.value, self.link)


@dataclass(frozen=True)
class FiredFault:
    """When a fault actually happened, in time.monotonic() seconds."""

    fault: Fault
    planned_at: float  # start + fault.at_s
    fired_at: float  # just before the ip/tc commands ran
    done_at: float  # after they returned (the fault is in effect from here)
    error: str | None = None  # the TestbedError text if it failed

    @property
    def late_s(self) -> float:
        """How much later than planned the fault started firing."""
        return self.fired_at - self.planned_at

    def as_dict(self, started_at: float) -> dict[str, Any]:
        """A JSON-ready record with times relative to ``started_at`` (for benchmark logs)."""
        return {
            "action": list(self.fault.action()),
            "planned_s": self.fault.at_s,
            "fired_s": self.fired_at - started_at,
            "done_s": self.done_at - started_at,
            "error": self.error,
        }


FaultSpec: TypeAlias = Fault | tuple[float, tuple[Any, ...]]


def _to_fault(spec: FaultSpec, testbed: Testbed, index: int) -> Fault:
    where = f"faults[{index}]"
    if isinstance(spec, Fault):
        at_s, action = spec.at_s, spec.action()
    else:
        try:
            at_s, action = spec
        except (TypeError, ValueError):
            raise TestbedConfigError(
                f"{where}: expected (t_seconds, action) such as (1.0, ('down', 0)), got {spec!r}"
            ) from None
    if isinstance(at_s, bool) or not isinstance(at_s, (int, float)) or not at_s >= 0:
        raise TestbedConfigError(f"{where}: time {at_s!r} must be a number of seconds >= 0")
    if not isinstance(action, (tuple, list)) or not action:
        raise TestbedConfigError(f"{where}: action {action!r} must be a tuple like ('down', 0)")
    try:
        kind = FaultKind(action[0])
    except ValueError:
        raise TestbedConfigError(
            f"{where}: unknown action {action[0]!r}; use 'down', 'up' or 'rate'"
        ) from None
    expected = 3 if kind is FaultKind.RATE else 2
    if len(action) != expected:
        shape = "('rate', link, '200mbit')" if kind is FaultKind.RATE else f"('{kind.value}', link)"
        raise TestbedConfigError(f"{where}: action {tuple(action)!r} must look like {shape}")
    try:
        link = testbed._check_link(action[1])
    except TestbedConfigError as exc:
        raise TestbedConfigError(f"{where}: {exc}") from None
    rate: RateLike = None
    if kind is FaultKind.RATE:
        rate = action[2]
        _optional_rate(rate, name=f"{where}: rate")
    return Fault(at_s=float(at_s), kind=kind, link=link, rate=rate)


class FaultSchedule:
    """Apply link faults on a timetable in a background thread.

    ``faults`` are ``(t_seconds, action)`` pairs (or :class:`Fault`), with ``action`` one of
    ``("down", link)``, ``("up", link)``, ``("rate", link, "200mbit")``. Times are relative
    to :meth:`start`. Each fault's actual firing time is kept in :attr:`fired`.
    A fault that fails is recorded with its error and the schedule goes on; :meth:`join`
    raises the first failure. As a context manager it starts on entry and, on exit, skips the
    faults not yet due and waits for the thread.
    """

    def __init__(self, testbed: Testbed, faults: Iterable[FaultSpec]) -> None:
        """Validate the faults against ``testbed``.

        Raises:
            TestbedConfigError: a fault is malformed; the message names its index.
        """
        self.testbed = testbed
        parsed = [_to_fault(spec, testbed, i) for i, spec in enumerate(faults)]
        # Stable sort: faults at the same time fire in the order given.
        self.faults: tuple[Fault, ...] = tuple(sorted(parsed, key=lambda f: f.at_s))
        self.started_at: float | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._fired: list[FiredFault] = []
        self._errors: list[TestbedError] = []
        self._thread: threading.Thread | None = None

    @property
    def fired(self) -> list[FiredFault]:
        """The faults fired so far, in firing order."""
        with self._lock:
            return list(self._fired)

    @property
    def running(self) -> bool:
        """True while the background thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def records(self) -> list[dict[str, Any]]:
        """:attr:`fired` as JSON-ready dicts with times relative to start (empty before start)."""
        if self.started_at is None:
            return []
        return [f.as_dict(self.started_at) for f in self.fired]

    def start(self) -> float:
        """Start the clock and the thread.

        Returns:
            The start time (time.monotonic()) that fault times are relative to.

        Raises:
            TestbedError: the schedule was already started (make a new one to run it again).
        """
        if self._thread is not None:
            raise TestbedError("this FaultSchedule was already started; create a new one")
        self.started_at = time.monotonic()
        self._thread = threading.Thread(
            target=self._loop, args=(self.started_at,), name=f"kvlink-faults-{self.testbed.tag}",
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        return self.started_at

    def _loop(self, started_at: float) -> None:
        for fault in self.faults:
            planned = started_at + fault.at_s
            if self._stop.wait(max(0.0, planned - time.monotonic())):
                return
            fired_at = time.monotonic()
            error: str | None = None
            try:
                if fault.kind is FaultKind.DOWN:
                    self.testbed.link_down(fault.link)
                elif fault.kind is FaultKind.UP:
                    self.testbed.link_up(fault.link)
                else:
                    self.testbed.set_rate(fault.link, fault.rate)
            except TestbedError as exc:
                error = str(exc)
                log.error("testbed %s: fault %s failed: %s", self.testbed.tag, fault.action(), exc)
                with self._lock:
                    self._errors.append(exc)
            record = FiredFault(fault, planned, fired_at, time.monotonic(), error)
            with self._lock:
                self._fired.append(record)
            log.info(
                "testbed %s: fault %s at +%.3f s (%.1f ms late)",
                self.testbed.tag, fault.action(), fired_at - started_at, record.late_s * 1e3,
            )  # fmt: skip

    def stop(self) -> None:
        """Skip the faults not yet fired (one firing now completes). Does not wait."""
        self._stop.set()

    def join(self, timeout_s: float | None = None, *, raise_errors: bool = True) -> None:
        """Wait for the thread to finish (all faults fired, or stopped).

        Raises:
            TestbedError: the thread is still running after ``timeout_s``, or (with
                raise_errors) a fault failed; the first failure is chained as the cause.
        """
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TestbedError(
                    f"fault schedule still running after {timeout_s} s; call stop() first "
                    "or wait longer"
                )
        with self._lock:
            errors = list(self._errors)
        if raise_errors and errors:
            raise TestbedError(f"{len(errors)} fault(s) failed; first: {errors[0]}") from errors[0]

    def __enter__(self) -> FaultSchedule:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        self.join(raise_errors=False)
