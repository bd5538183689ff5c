"""Topologies: any number of hosts (one namespace each) joined pairwise by shaped veth links,
e.g. a prefill host a, a decode host b and a relay r beside a. Nothing is routed between links
and no namespace forwards, so a program on r is the only way from a to b through r."""

from __future__ import annotations

import logging
import re
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

from ._errors import TestbedConfigError, TestbedError
from ._netns import (
    _claim,
    _cmd,
    _delete_namespace,
    _exec_prefix,
    _host_device,
    _host_namespace,
    _host_state,
    _list_netns,
    _marker,
    _Processes,
    _require_available,
    _shape,
    _tag_namespaces,
    _tool,
    _validate_host,
    _validate_tag,
    teardown,
)
from ._rates import RateLike, _optional_rate, format_rate
from ._testbed import _SUBNETS_IN_RANGE, MAX_LINKS

log = logging.getLogger("kvlink.testbed")

# Named topologies the CLI and Topology() accept in place of a spec.
TOPOLOGY_PRESETS: Final[Mapping[str, str]] = {
    # Prefill a, decode b, and a relay r on a's fast local link with its own links to b: the
    # relay adds 2 x 2gbit to a-b's own 2 x 2gbit.
    "relay3": "a-b:2x2gbit,a-r:1x8gbit,r-b:2x2gbit",
}
# The kernel's IFNAMSIZ less the terminating NUL.
_IFNAME_MAX: Final = 15
_ITEM_RE: Final = re.compile(r"([^-:\s]+)-([^-:\s]+):(\d+)x(\S+)")
_UNSHAPED: Final = ("none", "unshaped")
_ITEM_HELP: Final = "write it as X-Y:NxRATE, e.g. a-b:2x2gbit, a-r:1x8gbit or a-b:1xnone"


@dataclass(frozen=True)
class LinkGroup:
    """``count`` parallel links between two hosts, each shaped to ``rate`` (None: unshaped).

    ``ends`` is kept sorted, so ``ends[0]`` is the host that gets the .1 addresses.
    """

    ends: tuple[str, str]
    count: int = 1
    rate: RateLike = None
    rate_bps: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Validate the hosts, count and rate.

        Raises:
            TestbedConfigError: a field is invalid; the message names it and the fix.
        """
        self._validate("link group")

    def _validate(self, name: str) -> None:
        if isinstance(self.ends, str) or len(self.ends) != 2:
            raise TestbedConfigError(f"{name}: ends must be two host names, got {self.ends!r}")
        x, y = (_validate_host(h, name=f"{name}: host") for h in self.ends)
        if x == y:
            raise TestbedConfigError(
                f"{name}: links host {x!r} to itself; join two different hosts, e.g. a-b"
            )
        object.__setattr__(self, "ends", (min(x, y), max(x, y)))
        if isinstance(self.count, bool) or not isinstance(self.count, int):
            raise TestbedConfigError(f"{name}: count: expected an int, got {self.count!r}")
        if not 1 <= self.count <= MAX_LINKS:
            raise TestbedConfigError(
                f"{name}: count: {self.count} links; give 1 to {MAX_LINKS} per group"
            )
        if isinstance(self.rate, str) and self.rate.strip().lower() in _UNSHAPED:
            object.__setattr__(self, "rate", None)
        object.__setattr__(self, "rate_bps", _optional_rate(self.rate, name=f"{name}: rate"))

    def spec(self) -> str:
        """This group as one spec item, e.g. "a-b:2x2gbit"."""
        rate = "none" if self.rate_bps is None else format_rate(self.rate_bps)
        return f"{self.ends[0]}-{self.ends[1]}:{self.count}x{rate}"


# A link group as a tuple: (host, host, number of links, rate).
LinkGroupLike: TypeAlias = LinkGroup | tuple[str, str, int, RateLike]


def parse_topology(spec: str) -> tuple[LinkGroup, ...]:
    """Parse a topology spec (or a preset name from ``TOPOLOGY_PRESETS``) into link groups.

    A spec is comma-separated items ``X-Y:NxRATE``: N links between hosts X and Y, each shaped
    to RATE (as :func:`parse_rate` reads it; ``none`` or ``unshaped`` for no shaping). Links are
    numbered in the order written, from 0.

    Raises:
        TestbedConfigError: the spec is empty or an item is malformed; the message names the
            item and says how to write it.
    """
    if not isinstance(spec, str):
        raise TestbedConfigError(f"topology: expected a spec string, got {spec!r}")
    text = TOPOLOGY_PRESETS.get(spec.strip(), spec)
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise TestbedConfigError(
            f"topology: empty spec {spec!r}; {_ITEM_HELP} (items joined by commas), "
            f"or a preset: {', '.join(sorted(TOPOLOGY_PRESETS))}"
        )
    groups = []
    for n, item in enumerate(items):
        name = f"topology item {n} {item!r}"
        match = _ITEM_RE.fullmatch(item)
        if match is None:
            raise TestbedConfigError(f"{name}: not understood; {_ITEM_HELP}")
        x, y, count, rate = match.groups()
        groups.append(_group((x, y, int(count), rate), name))
    return tuple(groups)


def _group(value: Any, name: str) -> LinkGroup:
    if isinstance(value, LinkGroup):
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 4:
        raise TestbedConfigError(
            f"{name}: expected a LinkGroup or (host, host, count, rate), got {value!r}"
        )
    group = object.__new__(LinkGroup)  # validated below, with this item's name in the messages
    object.__setattr__(group, "ends", tuple(value[:2]))
    object.__setattr__(group, "count", value[2])
    object.__setattr__(group, "rate", value[3])
    group._validate(name)
    return group


@dataclass(frozen=True)
class TopologyConfig:
    """A validated topology: link groups (links numbered across them in order), tag and the
    third octet of link 0's subnet. :class:`Topology` takes the same arguments."""

    groups: tuple[LinkGroup, ...]
    # Parallel topologies need distinct tags; "tb" is the one the CLI uses by default.
    tag: str = "tb"
    # Third octet of link 0's subnet; parallel topologies may share it (namespaces isolate them).
    subnet_base: int = 0

    def __post_init__(self) -> None:
        """Validate every field and the names the topology will create.

        Raises:
            TestbedConfigError: a field is invalid, or a device name would be too long or
                clash; the message names the field and the fix.
        """
        _validate_tag(self.tag)
        if not self.groups:
            raise TestbedConfigError(f"topology: no link groups; {_ITEM_HELP}")
        links = sum(g.count for g in self.groups)
        if links > MAX_LINKS:
            raise TestbedConfigError(
                f"topology: {links} links in all; at most {MAX_LINKS} (use fewer or smaller groups)"
            )
        if isinstance(self.subnet_base, bool) or not isinstance(self.subnet_base, int):
            raise TestbedConfigError(f"subnet_base: expected an int, got {self.subnet_base!r}")
        if not 0 <= self.subnet_base <= _SUBNETS_IN_RANGE - links:
            raise TestbedConfigError(
                f"subnet_base: {self.subnet_base} with {links} links leaves 198.18.0.0/15; "
                f"use 0..{_SUBNETS_IN_RANGE - links}"
            )
        owners: dict[str, str] = {}
        index = 0
        for group in self.groups:
            for _ in range(group.count):
                for host in group.ends:
                    dev = _host_device(self.tag, host, index)
                    if len(dev) > _IFNAME_MAX:
                        raise TestbedConfigError(
                            f"tag {self.tag!r}, host {host!r} and link {index} make device name "
                            f"{dev!r} ({len(dev)} characters, the kernel allows {_IFNAME_MAX}): "
                            "use a shorter tag or host name"
                        )
                    owner = f"host {host!r} link {index}"
                    if dev in owners:
                        raise TestbedConfigError(
                            f"device name {dev!r} would be both {owners[dev]} and {owner}: "
                            "rename one of the hosts (e.g. end host names with a letter)"
                        )
                    owners[dev] = owner
                index += 1

    @property
    def spec(self) -> str:
        """The canonical spec string (hosts of each item sorted, rates in tc spelling)."""
        return ",".join(g.spec() for g in self.groups)


@dataclass(frozen=True)
class TopoLink:
    """One veth link of a topology: its index, the two hosts it joins (sorted), its rate (tc
    spelling, None: unshaped), its /24, and each end's address (no prefix) and device."""

    index: int
    ends: tuple[str, str]
    rate: str | None
    subnet: str
    addrs: Mapping[str, str] = field(hash=False)
    devs: Mapping[str, str] = field(hash=False)

    def peer(self, host: str) -> str:
        """The host at the other end from ``host``.

        Raises:
            TestbedConfigError: ``host`` is not an end of this link.
        """
        if host not in self.ends:
            raise TestbedConfigError(
                f"host: {host!r} is not an end of link {self.index} {self.ends}"
            )
        return self.ends[1] if host == self.ends[0] else self.ends[0]


class Topology:
    """Hosts (one network namespace each) joined by shaped veth links, as a spec says.

    ``Topology("a-b:2x2gbit,a-r:1x8gbit,r-b:2x2gbit", tag="x")`` (or a preset name, or a list
    of :class:`LinkGroup` / ``(host, host, count, rate)``) numbers the links in the order
    written: here 0-1 a-b, 2 a-r, 3-4 r-b. Naming and addressing:

    * host H's namespace is ``kvl{tag}H``; its end of link i is the device ``kvl{tag}H{i}``;
    * link i is 198.18.{subnet_base+i}.0/24 (continuing into 198.19 past 255); of its two hosts
      the one that sorts first gets .1 and the other .2;
    * every link is shaped with tbf on both ends, as :class:`Testbed` does;
    * nothing is routed between links and IPv4 forwarding is off in every namespace, so a host
      reaches only the addresses of links it is an end of.

    A two-host spec "a-b:Nx<rate>" gives exactly the namespaces, devices and addresses of
    ``Testbed(links=N, rate=<rate>)`` with the same tag, so either class can attach to it.
    Use as a context manager (up on entry, always down on exit) or call :meth:`up` and
    :meth:`down`. The object holds no kernel state; :meth:`attach` rebuilds one for a live
    topology.
    """

    def __init__(
        self,
        spec: str | Sequence[LinkGroupLike],
        tag: str = "tb",
        subnet_base: int = 0,
    ) -> None:
        """Validate the topology; nothing is created until :meth:`up`.

        Raises:
            TestbedConfigError: the spec or an argument is invalid; the message names it.
        """
        if isinstance(spec, str):
            groups = parse_topology(spec)
        elif isinstance(spec, Sequence):
            groups = tuple(_group(g, f"link_groups[{i}]") for i, g in enumerate(spec))
        else:
            raise TestbedConfigError(
                f"spec: expected a spec string or a list of link groups, got {spec!r}"
            )
        self.config = TopologyConfig(groups=groups, tag=tag, subnet_base=subnet_base)
        ends: list[tuple[str, str]] = []
        rates: list[int | None] = []
        for group in groups:
            ends += [group.ends] * group.count
            rates += [group.rate_bps] * group.count
        self._ends: tuple[tuple[str, str], ...] = tuple(ends)
        hosts: dict[str, None] = {}
        for x, y in ends:
            hosts.update({x: None, y: None})
        self._hosts = tuple(hosts)
        self._lock = threading.Lock()
        self._rates = rates
        self._procs = _Processes(tag)

    @classmethod
    def attach(cls, tag: str = "tb") -> Topology:
        """Build an object for the live topology ``tag`` (hosts, links, rates, subnets read
        back). Works on a :class:`Testbed` too (a two-host topology). Consecutive links with
        the same ends and rate become one group.

        Raises:
            TestbedError: nothing with that tag is up, it is only partly built, or inspection
                failed.
        """
        state = inspect_topology(tag)
        if not state["hosts"]:
            raise TestbedError(
                f"no testbed with tag {tag!r} is up: start one with "
                f"`kvlink testbed up --topology SPEC --tag {tag}`"
            )
        indices = [link["link"] for link in state["links"]]
        if not state["up"] or indices != list(range(len(indices))):
            raise TestbedError(
                f"testbed {tag!r} is only partly built (hosts {sorted(state['hosts'])}, links "
                f"{indices}): recreate it with `kvlink testbed down --tag {tag}` then "
                f"`kvlink testbed up --topology SPEC --tag {tag}`"
            )
        groups: list[list[Any]] = []
        for link in state["links"]:
            x, y = link["ends"]
            rate = link["hosts"][x]["rate_bps"]
            if groups and groups[-1][0] == (x, y) and groups[-1][2] == rate:
                groups[-1][1] += 1
            else:
                groups.append([(x, y), 1, rate])
        octets = state["links"][0]["subnet"].split("/")[0].split(".")
        base = (int(octets[1]) - 18) * 256 + int(octets[2])
        return cls([(x, y, n, rate) for (x, y), n, rate in groups], tag=tag, subnet_base=base)

    # -- names and addresses ----------------------------------------------------------------

    @property
    def tag(self) -> str:
        """The short id in every name this topology creates."""
        return self.config.tag

    @property
    def spec(self) -> str:
        """The canonical spec of the configured topology (not of later set_rate calls)."""
        return self.config.spec

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts, in the order they first appear in the spec."""
        return self._hosts

    @property
    def rates(self) -> list[str | None]:
        """Current per-link rates in tc spelling (None: unshaped), as set through this object."""
        with self._lock:
            return [None if r is None else format_rate(r) for r in self._rates]

    def __len__(self) -> int:
        """Number of links."""
        return len(self._ends)

    def namespace(self, host: str) -> str:
        """Name of ``host``'s namespace, ``kvl{tag}{host}``.

        Raises:
            TestbedConfigError: not a host of this topology.
        """
        return _host_namespace(self.tag, self._check_host(host))

    def link(self, index: int) -> TopoLink:
        """Link ``index``.

        Raises:
            TestbedConfigError: bad link index.
        """
        i = self._check_link(index)
        ends = self._ends[i]
        octet = self.config.subnet_base + i
        net = f"198.{18 + octet // 256}.{octet % 256}"
        with self._lock:
            rate = self._rates[i]
        return TopoLink(
            index=i,
            ends=ends,
            rate=None if rate is None else format_rate(rate),
            subnet=f"{net}.0/24",
            addrs={ends[0]: f"{net}.1", ends[1]: f"{net}.2"},
            devs={h: _host_device(self.tag, h, i) for h in ends},
        )

    def links(self, host: str | None = None, peer: str | None = None) -> list[TopoLink]:
        """Every link in index order; only those of ``host`` (and to ``peer``) if given.

        Raises:
            TestbedConfigError: ``host`` or ``peer`` is not a host of this topology.
        """
        if host is not None:
            self._check_host(host)
        if peer is not None:
            self._check_host(peer)
        return [
            self.link(i)
            for i, ends in enumerate(self._ends)
            if (host is None or host in ends) and (peer is None or peer in ends)
        ]

    def address(self, host: str, link: int) -> str:
        """IPv4 address (no prefix) of ``host``'s end of ``link``.

        Raises:
            TestbedConfigError: bad link index, or ``host`` is not an end of that link.
        """
        return self.link(link).addrs[self._check_end(host, link)]

    def device(self, host: str, link: int) -> str:
        """Name of ``host``'s end of ``link``, ``kvl{tag}{host}{link}``.

        Raises:
            TestbedConfigError: bad link index, or ``host`` is not an end of that link.
        """
        return _host_device(self.tag, self._check_end(host, link), link)

    def addresses(self, host: str, peer: str | None = None) -> list[str]:
        """``host``'s addresses in link order; with ``peer``, only those on links to ``peer``
        (e.g. ``addresses("b", "r")``: where r can reach b).

        Raises:
            TestbedConfigError: ``host`` or ``peer`` is not a host of this topology, or they
                are the same host.
        """
        if peer is not None and peer == host:
            raise TestbedConfigError(f"peer: {peer!r} is the host itself; give another host")
        return [link.addrs[host] for link in self.links(host, peer)]

    def subnet(self, link: int) -> str:
        """The /24 of ``link``, e.g. "198.18.0.0/24".

        Raises:
            TestbedConfigError: bad link index.
        """
        return self.link(link).subnet

    def _check_host(self, host: str) -> str:
        if host not in self._hosts:
            raise TestbedConfigError(
                f"host: {host!r} is not a host of topology {self.tag!r} "
                f"(hosts: {', '.join(self._hosts)})"
            )
        return host

    def _check_link(self, link: int) -> int:
        n = len(self._ends)
        if isinstance(link, bool) or not isinstance(link, int) or not 0 <= link < n:
            raise TestbedConfigError(
                f"link: {link!r} is not a link of topology {self.tag!r} (0..{n - 1})"
            )
        return link

    def _check_end(self, host: str, link: int) -> str:
        ends = self._ends[self._check_link(link)]
        if host not in ends:
            self._check_host(host)
            raise TestbedConfigError(
                f"host: {host!r} is not an end of link {link} (it joins {ends[0]} and {ends[1]})"
            )
        return host

    def _hint(self) -> str:
        return (
            f"; is topology {self.tag!r} up? check `kvlink testbed status --tag {self.tag}`, "
            f"or rebuild it with `kvlink testbed down --tag {self.tag}` and up()"
        )

    # -- lifecycle ------------------------------------------------------------------------------

    def up(self) -> None:
        """Create (or repair) the namespaces, links, addresses and shaping. Idempotent.

        Existing pieces are kept and brought to the configured state; hosts and links left by
        an earlier topology or testbed with this tag that this one lacks are removed. On
        failure everything with this tag is torn down before the error propagates.

        Raises:
            TestbedError: not root, iproute2 missing, a namespace belongs to another tag, or a
                command failed.
        """
        _require_available()
        try:
            self._up()
        except BaseException:
            log.error("topology %s: up() failed; tearing down what was created", self.tag)
            try:
                self.down()
            except TestbedError as exc:  # keep the original error, report the cleanup one
                log.error("topology %s: cleanup after failed up() also failed: %s", self.tag, exc)
            raise

    def _up(self) -> None:
        ip = _tool("ip")
        hint = self._hint()
        for host, ns in _tag_namespaces(self.tag).items():
            if host not in self._hosts:
                _delete_namespace(ns, self.tag)
        for host in self._hosts:
            ns = _claim(self.tag, host, hint=hint)
            _cmd([ip, "-n", ns, "link", "set", "lo", "up"], hint=hint)
            # A new namespace inherits init_net's IPv4 forwarding (devconf_inherit_init_net=0):
            # turn it off, or a relay host would route a's packets to b at the IP layer.
            _cmd(
                [*_exec_prefix(ns), _tool("sysctl"), "-q", "-w", "net.ipv4.ip_forward=0"],
                hint=hint,
            )
        n = len(self._ends)

        def live() -> dict[str, dict[int, dict[str, Any]]]:
            return {h: _host_state(self.tag, h) for h in self._hosts}

        # Remove ends that are not where this topology wants them (beyond its links, or on a
        # link that now joins other hosts); deleting one end of a veth deletes its peer.
        existing = live()
        for host in self._hosts:
            for index, info in existing[host].items():
                if index >= n or host not in self._ends[index]:
                    ns, dev = self.namespace(host), info["device"]
                    done = _cmd([ip, "-n", ns, "link", "del", dev], check=False)
                    # Gone already when its peer, deleted just before, took it along.
                    if done.returncode != 0 and "Cannot find device" not in done.stderr:
                        raise TestbedError(f"could not delete {dev} in {ns}: {done.stderr}{hint}")
        existing = live()
        for i, (x, y) in enumerate(self._ends):
            link = self.link(i)
            have = [h for h in (x, y) if i in existing[h]]
            if len(have) == 1:  # its peer went with a deleted end or namespace: recreate both
                ns = self.namespace(have[0])
                _cmd([ip, "-n", ns, "link", "del", link.devs[have[0]]], hint=hint)
                have = []
            if not have:
                # Created straight inside the namespaces, so host interface names never clash.
                _cmd(
                    [ip, "link", "add", link.devs[x], "netns", self.namespace(x), "type", "veth",
                     "peer", "name", link.devs[y], "netns", self.namespace(y)],
                    hint=hint,
                )  # fmt: skip
            for host in (x, y):
                ns, dev = self.namespace(host), link.devs[host]
                addr = f"{link.addrs[host]}/24"
                old = existing[host].get(i, {}).get("addresses", [])
                if old and old != [addr]:  # left by a topology with another subnet_base
                    _cmd([ip, "-n", ns, "addr", "flush", "dev", dev], hint=hint)
                _cmd([ip, "-n", ns, "addr", "replace", addr, "dev", dev], hint=hint)
            with self._lock:
                rate = self._rates[i]
            self._apply_rate(i, rate)
            for host in (x, y):
                ns = self.namespace(host)
                _cmd([ip, "-n", ns, "link", "set", link.devs[host], "up"], hint=hint)
        log.info("topology %s: up, %s", self.tag, self.spec)

    def down(self) -> None:
        """Stop processes started by :meth:`run`, then remove every namespace of this tag.

        Idempotent, and works on a partly created topology.

        Raises:
            TestbedError: not root, iproute2 missing, or a namespace could not be deleted.
        """
        self._procs.stop_all()
        teardown(self.tag)
        # A namespace up() created but had not marked yet is not found by its tag alone.
        present = _list_netns()
        for host in self._hosts:
            ns = _host_namespace(self.tag, host)
            if ns in present and _marker(ns) in (None, (self.tag, host)):
                _delete_namespace(ns, self.tag)

    def __enter__(self) -> Topology:
        self.up()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    def __repr__(self) -> str:
        return f"Topology({self.spec!r}, tag={self.tag!r}, subnet_base={self.config.subnet_base})"

    # -- changes while up -----------------------------------------------------------------------

    def _apply_rate(self, link: int, rate_bps: int | None) -> None:
        for host in self._ends[link]:
            _shape(self.namespace(host), self.device(host, link), rate_bps, hint=self._hint())

    def set_rate(self, link: int, rate: RateLike) -> None:
        """Reshape ``link`` (both ends) to ``rate``; None removes shaping. Works mid-transfer.

        Raises:
            TestbedConfigError: bad link index or rate.
            TestbedError: the topology is not up or tc failed.
        """
        self._check_link(link)
        rate_bps = _optional_rate(rate, name="rate")
        self._apply_rate(link, rate_bps)
        with self._lock:
            self._rates[link] = rate_bps
        log.info("topology %s: link %d rate %s", self.tag, link, rate or "unshaped")

    def _set_link(self, link: int, state: str) -> None:
        ip = _tool("ip")
        for host in self._ends[self._check_link(link)]:
            dev = self.device(host, link)
            _cmd([ip, "-n", self.namespace(host), "link", "set", dev, state], hint=self._hint())
        log.info("topology %s: link %d %s", self.tag, link, state)

    def link_down(self, link: int) -> None:
        """Take both ends of ``link`` down (its route disappears; TCP over it stalls).

        Raises:
            TestbedConfigError: bad link index.
            TestbedError: the topology is not up or ip failed.
        """
        self._set_link(link, "down")

    def link_up(self, link: int) -> None:
        """Bring both ends of ``link`` back up (addresses and shaping are kept while down).

        Raises:
            TestbedConfigError: bad link index.
            TestbedError: the topology is not up or ip failed.
        """
        self._set_link(link, "up")

    def status(self) -> dict[str, Any]:
        """Live state: :func:`inspect_topology`'s dict plus ``config``.

        Raises:
            TestbedError: not root, iproute2 missing, or a command failed.
        """
        state = inspect_topology(self.tag)
        state["config"] = {
            "spec": self.spec,
            "rates": self.rates,
            "subnet_base": self.config.subnet_base,
        }
        return state

    # -- running programs inside ----------------------------------------------------------------

    def exec_prefix(self, host: str) -> list[str]:
        """The argv prefix that runs a command in ``host``'s namespace.

        Raises:
            TestbedConfigError: not a host of this topology.
            TestbedError: `ip` is missing.
        """
        return _exec_prefix(self.namespace(host))

    def run(self, host: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``host``'s namespace with :class:`subprocess.Popen`.

        The process is stopped by :meth:`down` if it is still running then.

        Raises:
            TestbedConfigError: host is bad, or argv is a string or empty.
            TestbedError: `ip` is missing or the process could not start.
        """
        return self._procs.start(self.namespace(host), argv, **popen_kwargs)


def inspect_topology(tag: str = "tb") -> dict[str, Any]:
    """Describe topology (or testbed) ``tag`` as it is live.

    Returns:
        A JSON-ready dict: ``tag``; ``up`` (some namespace present, at least one link, and
        every link with exactly two ends); ``hosts`` ({host: {"name", "present"}}); and
        ``links``: one dict per link index with ``link``, ``subnet``, ``ends`` (the hosts that
        hold an end, sorted) and ``hosts`` ({host: the end's state as :func:`inspect` gives a
        side's: ``device``, ``address``, ``addresses``, ``admin_up``, ``operstate``, ``qdisc``,
        ``rate``, ``rate_bps``, ``burst_bytes``, ``queue_latency_us``}).

    Raises:
        TestbedConfigError: the tag is invalid.
        TestbedError: not root, iproute2 missing, or a command failed.
    """
    _validate_tag(tag)
    _require_available()
    namespaces = _tag_namespaces(tag)
    per_host = {host: _host_state(tag, host) for host in namespaces}
    links: list[dict[str, Any]] = []
    for index in sorted({i for state in per_host.values() for i in state}):
        ends = sorted(h for h, state in per_host.items() if index in state)
        address = next(
            (per_host[h][index]["address"] for h in ends if per_host[h][index]["address"]), None
        )
        subnet = None
        if address:
            subnet = address.rsplit(".", 1)[0] + ".0/" + address.rsplit("/", 1)[1]
        links.append(
            {
                "link": index,
                "subnet": subnet,
                "ends": ends,
                "hosts": {h: per_host[h][index] for h in ends},
            }
        )
    complete = all(len(link["ends"]) == 2 and link["subnet"] for link in links)
    return {
        "tag": tag,
        "up": bool(namespaces) and bool(links) and complete,
        "hosts": {h: {"name": ns, "present": True} for h, ns in namespaces.items()},
        "links": links,
    }
