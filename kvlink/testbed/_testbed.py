"""The testbed: two namespaces joined by shaped veth pairs, brought up, changed while up (rates,
links down and up) and taken down, with programs run inside."""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ._errors import TestbedConfigError, TestbedError
from ._netns import (
    Side,
    _claim,
    _cmd,
    _device,
    _exec_prefix,
    _namespace,
    _Processes,
    _require_available,
    _shape,
    _side,
    _side_state,
    _tool,
    _validate_tag,
    inspect,
    teardown,
)
from ._rates import RateLike, _optional_rate, format_rate

log = logging.getLogger("kvlink.testbed")

# 64 links is far more than a 2-core machine can drive, and keeps device names <= 15 chars.
MAX_LINKS: Final = 64
# Link i lives in 198.18.0.0/15 at third octet subnet_base+i; the /15 holds 512 /24s.
_SUBNETS_IN_RANGE: Final = 512


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
        self._procs = _Processes(self.tag)

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
        for side in Side:
            ns = _claim(self.tag, side.value, hint=hint)
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
        self._procs.stop_all()
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
        hint = self._hint()
        for side in Side:
            _shape(_namespace(self.tag, side), _device(self.tag, side, link), rate_bps, hint=hint)

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
        return _exec_prefix(self.namespace(side))

    def run(
        self, side: str | Side, argv: Sequence[str], **popen_kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``side``'s namespace with :class:`subprocess.Popen`.

        The process is stopped by :meth:`down` if it is still running then.

        Raises:
            TestbedConfigError: side is bad, or argv is a string or empty.
            TestbedError: `ip` is missing or the process could not start.
        """
        return self._procs.start(self.namespace(side), argv, **popen_kwargs)
