"""The values the API hands out: enums mirroring the C header and frozen snapshots.

Plain data, no behaviour that touches the C core: :mod:`kvlink._native`
builds them from the C structs, the object layer passes them on.  The enums'
values are those of csrc/include/kvlink.h (tests/unit/test_native.py checks
them against the header).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from ._errors import ErrorCode, InvalidArgumentError


class Op(IntEnum):
    """Direction of a transfer, from the initiator's point of view; PREPARE
    marks a pre-warm request (see :meth:`Agent.prepare`). (``kvl_op``)"""

    PUSH = 1
    PULL = 2
    PREPARE = 3


class TransferState(IntEnum):
    """(``kvl_xfer_state``)"""

    RUNNING = 0
    DONE = 1
    FAILED = 2


class PathState(IntEnum):
    """(``kvl_path_state``)"""

    UP = 0
    DEGRADED = 1
    DOWN = 2
    PROBING = 3
    STALLED = 4


class MemoryType(IntEnum):
    """Where registered memory lives. (``kvl_mem``)"""

    HOST = 0
    CUDA = 1


@dataclass(frozen=True)
class Region:
    """Memory registered with an agent.

    ``id`` is what peers use to address it (with ``name``, if given).
    """

    id: int
    address: int
    nbytes: int
    remote_read: bool
    remote_write: bool
    readonly: bool
    mem: MemoryType
    name: str
    _keepalive: Any = None
    # GPU memory (mem is CUDA): the device's ordinal, its PCI bus id and the
    # NUMA node it hangs off (-1 / "" for host memory, or when unknown)
    device: int = -1
    pci_bus_id: str = ""
    numa_node: int = -1

    def __repr__(self) -> str:
        rights = "r" if self.remote_read else "-"
        rights += "w" if self.remote_write else "-"
        where = f", mem=cuda:{self.device}" if self.mem == MemoryType.CUDA else ""
        return (
            f"Region(id={self.id}, name={self.name!r}, nbytes={self.nbytes}, "
            f"rights={rights}{where})"
        )


@dataclass(frozen=True)
class RemoteRegion:
    """A region a peer exposes (from its handshake)."""

    peer: str
    id: int
    nbytes: int
    remote_read: bool
    remote_write: bool
    mem: MemoryType
    name: str


@dataclass(frozen=True)
class ChunkEvent:
    """A verified chunk, in completion order.

    ``layers`` is the range of layers this chunk completed (possibly empty).
    """

    index: int
    path: int
    nbytes: int
    layers: range
    t_ns: int


@dataclass(frozen=True)
class TransferInfo:
    id: int
    state: TransferState
    bytes_total: int
    bytes_done: int
    chunks_total: int
    chunks_done: int
    layers: int
    retries: int
    t_submit_ns: int
    t_first_byte_ns: int
    t_done_ns: int
    error_code: ErrorCode
    message: str
    t_first_layer_ns: int = 0  # every chunk of layer 0 verified (0: not yet)


@dataclass(frozen=True)
class InboundInfo:
    """A snapshot of a push arriving here."""

    transfer_id: int  # the sender's transfer id
    peer: str
    state: TransferState
    bytes_total: int
    bytes_done: int
    chunks_total: int
    chunks_done: int
    layers: int
    layers_ready: int  # layers 0 .. layers_ready-1 are all verified here
    t_announce_ns: int
    t_first_byte_ns: int
    t_done_ns: int
    tag: bytes
    error_code: ErrorCode
    message: str


@dataclass(frozen=True)
class Notification:
    """A peer finished a transfer with us and attached ``tag`` (op PUSH or
    PULL), or announced one with :meth:`Agent.prepare` (op PREPARE)."""

    peer: str
    tag: bytes
    transfer_id: int
    op: Op

    def prepare_request(self) -> dict[str, Any]:
        """For op PREPARE: what the peer announced ({"nbytes": ..., "layout": ...}).

        Raises:
            InvalidArgumentError: this is not a PREPARE notification.
        """
        if self.op != Op.PREPARE:
            raise InvalidArgumentError(f"notification: op is {self.op.name}, not PREPARE")
        data = json.loads(self.tag)
        return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class InboundStats:
    """What peers' pushes and notifications hold on this agent (refreshed every
    monitor interval).  Each sender session's part is bounded (docs/security.md)."""

    senders: int  # sender sessions holding state here
    pushes: int  # announced, unended inbound pushes
    tombstones: int  # ended pushes remembered so late copies are drained
    chunks: int  # chunks of the live pushes
    layers: int
    tag_bytes: int  # tags of handles the engine holds
    notifications: int  # queued for next_notifications()
    notification_bytes: int
    queued_handles: int  # inbound pushes nobody took with inbound() yet
    refused_pushes: int  # over a sender's share, or out of room
    evicted_pushes: int  # dropped to make room (their handles failed)
    refused_notifications: int  # not acknowledged for room: their senders send them again


@dataclass(frozen=True)
class PathInfo:
    """Live statistics of one path (refreshed every monitor interval).

    Rates are in GB/s (gigabytes, 1e9 bytes per second), not gigabits.
    """

    peer: str
    index: int
    state: PathState
    local: str
    remote: str
    bytes_sent: int
    bytes_recv: int
    chunks_done: int
    inflight_bytes: int
    est_gbps: float  # GB/s (1e9 bytes/s): EWMA of the busy-period delivery rate
    rtt_us: float  # TCP_INFO while busy, PING probes while idle
    delivery_gbps: float  # the kernel's latest delivery-rate sample, GB/s
    nic_other_gbps: float  # traffic on the local NIC that is not ours, GB/s
    stall_ms: int  # time without progress while busy
    reconnects: int  # times re-established after going down
    hedges: int  # straggler copies sent on this path
    t_down_ns: int  # CLOCK_MONOTONIC time it last left service, STALLED or DOWN (0: never)
    last_error: str
    # what carries this path's payloads: "tcp", "shm", "ucx", or "fault" (tests only)
    transport: str = "tcp"
    transport_note: str = ""  # why this transport (e.g. why the peer refused UCX)
    bytes_put: int = 0  # payload a one-sided mover (UCX, fault) placed: pushed or pulled
    numa_node: int = -1  # NUMA node of the local NIC (sysfs); -1: unknown (loopback, virtual)
    reconnect_fails: int = 0  # reconnects that failed since the path was last up
    # transfers to this peer waiting for a path (every path DOWN or PROBING): each goes on
    # once one is back, or fails at its deadline naming each path's last_error
    waiting: int = 0
    # a relayed path (docs/architecture.md, "Relayed paths"): the relay agent's name and
    # address; hop one is local -> relay_addr, hop two the relay -> remote. "" when direct.
    relay: str = ""
    relay_addr: str = ""


@dataclass(frozen=True)
class PeerInfo:
    """A peer as :meth:`Agent.peers` sees it.

    ``discovered``: discovery (etcd) lists it now; ``connected``: this agent
    has added it (by hand or through discovery); ``instance`` changes when the
    peer's process restarts.
    """

    name: str
    instance: int
    addresses: tuple[tuple[str, int], ...]
    discovered: bool
    connected: bool
