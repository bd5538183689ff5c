"""kvlink: KV-cache transfer for disaggregated LLM serving.

Moves KV caches between prefill and decode nodes over every NIC at once,
verifies every byte (crc32c per chunk) and reports per-layer completion so
the receiver starts on the first layers while the rest is in flight.
See docs/api.md for a guided tour.
"""

from __future__ import annotations

from ._agent import Agent
from ._config import Config, GiB, KiB, MiB, Scheduler
from ._errors import (
    ArgumentTypeError,
    AuthenticationError,
    ChecksumError,
    ClosedError,
    ConfigError,
    ConnectionLostError,
    DiscoveryError,
    DuplicateNameError,
    ErrorCode,
    HandshakeError,
    InvalidArgumentError,
    KvlinkError,
    NotRegisteredError,
    OutOfBoundsError,
    PeerError,
    PeerUnreachableError,
    ProtocolError,
    RegionBusyError,
    RegistrationError,
    RemoteAccessError,
    RemoteRefusedError,
    SizeMismatchError,
    TransferAbortedError,
    TransferCancelledError,
    TransferError,
    TransferTimeoutError,
    UnknownPeerError,
    UnknownRegionError,
)
from ._inbound import InboundTransfer
from ._segments import SEGMENT_DTYPE, Segment
from ._transfer import Transfer
from ._types import (
    ChunkEvent,
    InboundInfo,
    InboundStats,
    MemoryType,
    Notification,
    Op,
    PathInfo,
    PathState,
    PeerInfo,
    Region,
    RemoteRegion,
    TransferInfo,
    TransferState,
)

__version__ = "0.1.0"

__all__ = [
    "SEGMENT_DTYPE",
    "Agent",
    "ArgumentTypeError",
    "AuthenticationError",
    "ChecksumError",
    "ChunkEvent",
    "ClosedError",
    "Config",
    "ConfigError",
    "ConnectionLostError",
    "DiscoveryError",
    "DuplicateNameError",
    "ErrorCode",
    "GiB",
    "HandshakeError",
    "InboundInfo",
    "InboundStats",
    "InboundTransfer",
    "InvalidArgumentError",
    "KiB",
    "KvlinkError",
    "MemoryType",
    "MiB",
    "NotRegisteredError",
    "Notification",
    "Op",
    "OutOfBoundsError",
    "PathInfo",
    "PathState",
    "PeerError",
    "PeerInfo",
    "PeerUnreachableError",
    "ProtocolError",
    "Region",
    "RegionBusyError",
    "RegistrationError",
    "RemoteAccessError",
    "RemoteRefusedError",
    "RemoteRegion",
    "Scheduler",
    "Segment",
    "SizeMismatchError",
    "Transfer",
    "TransferAbortedError",
    "TransferCancelledError",
    "TransferError",
    "TransferInfo",
    "TransferState",
    "TransferTimeoutError",
    "UnknownPeerError",
    "UnknownRegionError",
    "__version__",
]
