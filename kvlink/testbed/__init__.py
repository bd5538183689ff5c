"""Multi-NIC network testbed: two network namespaces joined by shaped veth pairs, or a
:class:`Topology` of more hosts (e.g. prefill a, decode b and a relay r) joined pairwise.

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

# One module per concern; this package is the public face and the only import others need:
#   _rates    parse_rate, format_rate, tbf_parameters (pure; no root)
#   _netns    names, ip/tc commands, is_available, teardown, inspect
#   _testbed  TestbedConfig and Testbed (up, reshape, links down/up, run inside, down)
#   _faults   FaultSchedule and its records
#   _topology Topology: more hosts than a and b, joined pairwise by shaped links
#   _iperf    iperf3_aggregate: one iperf3 stream per (src, dst, link) of a topology, at once
from ._errors import TestbedConfigError, TestbedError
from ._faults import Fault, FaultKind, FaultSchedule, FiredFault
from ._faults import FaultSpec as FaultSpec
from ._iperf import AggregateResult, FlowResult, iperf3_aggregate
from ._netns import NAME_PREFIX as NAME_PREFIX
from ._netns import Side, inspect, is_available, teardown
from ._netns import _list_netns as _list_netns  # the test fixtures list namespaces with it
from ._rates import MIN_RATE_BPS, RateLike, TbfParams, format_rate, parse_rate, tbf_parameters
from ._testbed import MAX_LINKS, Testbed, TestbedConfig
from ._topology import (
    TOPOLOGY_PRESETS,
    LinkGroup,
    LinkGroupLike,
    TopoLink,
    Topology,
    TopologyConfig,
    inspect_topology,
    parse_topology,
)

__all__ = [
    "MAX_LINKS",
    "MIN_RATE_BPS",
    "TOPOLOGY_PRESETS",
    "AggregateResult",
    "Fault",
    "FaultKind",
    "FaultSchedule",
    "FiredFault",
    "FlowResult",
    "LinkGroup",
    "LinkGroupLike",
    "RateLike",
    "Side",
    "TbfParams",
    "Testbed",
    "TestbedConfig",
    "TestbedConfigError",
    "TestbedError",
    "TopoLink",
    "Topology",
    "TopologyConfig",
    "format_rate",
    "inspect",
    "inspect_topology",
    "iperf3_aggregate",
    "is_available",
    "parse_rate",
    "parse_topology",
    "tbf_parameters",
    "teardown",
]
