"""iperf3 over a topology's links: one stream per (source, destination, link) at once, the
baseline a relay is compared with (the aggregate iperf3 gets over the same capacity)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._errors import TestbedConfigError, TestbedError
from ._topology import Topology


@dataclass(frozen=True)
class FlowResult:
    """One iperf3 stream from ``src`` to ``dst`` over link ``link``, as its receiver saw it."""

    src: str
    dst: str
    link: int
    bytes: int  # received
    seconds: float  # the receiver's measuring time
    bytes_per_s: float
    retransmits: int


@dataclass(frozen=True)
class AggregateResult:
    """Every stream of one :func:`iperf3_aggregate` run, and their sum."""

    flows: tuple[FlowResult, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes received over all streams."""
        return sum(f.bytes for f in self.flows)

    @property
    def total_bytes_per_s(self) -> float:
        """Sum of the streams' receiver rates (they ran over the same seconds)."""
        return sum(f.bytes_per_s for f in self.flows)


def iperf3_aggregate(
    topo: Topology,
    flows: Sequence[tuple[str, str, int]],
    seconds: float,
    timeout_s: float | None = None,
) -> AggregateResult:
    """Run one iperf3 TCP stream per ``(src_host, dst_host, link)`` at once for ``seconds``.

    Each stream's server runs in ``dst_host``'s namespace bound to its address on ``link``, and
    its client in ``src_host``'s, bound to its own address on that link, so each stream crosses
    exactly that link. For the relay baseline over "a-b:2x2gbit,a-r:1x8gbit,r-b:2x2gbit":
    ``[("a", "b", 0), ("a", "b", 1), ("r", "b", 3), ("r", "b", 4)]``.

    Raises:
        TestbedConfigError: a flow is malformed or its link does not join its two hosts, or
            ``seconds`` is not positive.
        TestbedError: iperf3 is missing, failed or did not finish within ``timeout_s``
            (default: ``seconds`` + 30).
    """
    from kvlink.bench import iperf3  # the bench engine is heavy; only this helper needs it

    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
        raise TestbedConfigError(f"seconds: expected a positive number, got {seconds!r}")
    if not flows:
        raise TestbedConfigError("flows: give at least one (src_host, dst_host, link)")
    checked: list[tuple[str, str, int]] = []
    streams = []
    for n, flow in enumerate(flows):
        if isinstance(flow, (str, bytes)) or len(flow) != 3:
            raise TestbedConfigError(
                f"flows[{n}]: expected (src_host, dst_host, link index), got {flow!r}"
            )
        src, dst, link = flow
        try:
            if topo.link(link).peer(src) != dst:
                raise TestbedConfigError(f"link {link} does not join {src} and {dst}")
            server, client = topo.address(dst, link), topo.address(src, link)
        except TestbedConfigError as exc:
            raise TestbedConfigError(f"flows[{n}] {flow!r}: {exc}") from None
        checked.append((src, dst, link))
        streams.append(
            iperf3.Stream(
                server,
                bind=client,
                seconds=float(seconds),
                server_prefix=topo.exec_prefix(dst),
                client_prefix=topo.exec_prefix(src),
            )
        )
    try:
        results = iperf3.run(streams, timeout_s=seconds + 30 if timeout_s is None else timeout_s)
    except iperf3.Iperf3Error as exc:
        raise TestbedError(f"iperf3 over topology {topo.tag!r}: {exc}") from exc
    out = []
    for (src, dst, link), res in zip(checked, results, strict=True):
        received = res.report["end"]["sum_received"]
        out.append(
            FlowResult(
                src=src,
                dst=dst,
                link=link,
                bytes=int(received["bytes"]),
                seconds=float(received["seconds"]),
                bytes_per_s=res.received_bps / 8,
                retransmits=res.retransmits,
            )
        )
    return AggregateResult(tuple(out))
