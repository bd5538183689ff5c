"""kvlink's exception hierarchy.

Every error is a :class:`KvlinkError` with a stable ``code`` (the C core's
``kvl_err``) and a message that says what to do.  Subclasses also derive from
the builtin they resemble, so ``except ValueError`` or ``except TimeoutError``
work as a caller expects.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Stable error codes shared with the C core (csrc/include/kvlink.h)."""

    OK = 0
    INVALID_ARG = 1
    NOMEM = 2
    SYSTEM = 3
    CLOSED = 4
    TIMEOUT = 5
    UNKNOWN_PEER = 6
    PEER_EXISTS = 7
    UNREACHABLE = 8
    HANDSHAKE = 9
    DUPLICATE_NAME = 10
    UNKNOWN_REGION = 11
    OUT_OF_BOUNDS = 12
    ACCESS_DENIED = 13
    BUSY = 14
    CONN_LOST = 15
    CHECKSUM = 16
    PROTOCOL = 17
    END = 18
    DEADLINE = 19
    AUTH = 20
    CANCELLED = 21


class KvlinkError(Exception):
    """Base of every kvlink error.

    Attributes:
        code: the stable :class:`ErrorCode`.
        peer: the peer the error concerns, when there is one.
        transfer_id: the transfer it concerns, when there is one.
    """

    default_code = ErrorCode.SYSTEM

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode | None = None,
        peer: str | None = None,
        transfer_id: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.peer = peer
        self.transfer_id = transfer_id

    def __str__(self) -> str:
        return self.message


class ConfigError(KvlinkError, ValueError):
    """A configuration value is invalid; the message names the field."""

    default_code = ErrorCode.INVALID_ARG


class InvalidArgumentError(KvlinkError, ValueError):
    """An argument is invalid; the message names it."""

    default_code = ErrorCode.INVALID_ARG


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type; the message names it and what it takes."""


class RegistrationError(KvlinkError, ValueError):
    """Memory cannot be registered (type, layout or device)."""

    default_code = ErrorCode.INVALID_ARG


class NotRegisteredError(KvlinkError, ValueError):
    """A local buffer used in a transfer lies outside every registered region."""

    default_code = ErrorCode.UNKNOWN_REGION


class SizeMismatchError(KvlinkError, ValueError):
    """Source and destination of a transfer differ in size."""

    default_code = ErrorCode.INVALID_ARG


class UnknownRegionError(KvlinkError, ValueError):
    """A region id or name is not registered on that side."""

    default_code = ErrorCode.UNKNOWN_REGION


class OutOfBoundsError(KvlinkError, ValueError):
    """A segment reaches outside its region."""

    default_code = ErrorCode.OUT_OF_BOUNDS


class RemoteAccessError(KvlinkError, PermissionError):
    """The region lacks the right the operation needs (remote_read / remote_write)."""

    default_code = ErrorCode.ACCESS_DENIED


class RegionBusyError(KvlinkError, RuntimeError):
    """The region is still used by a transfer in flight."""

    default_code = ErrorCode.BUSY


class ClosedError(KvlinkError, RuntimeError):
    """The agent was closed."""

    default_code = ErrorCode.CLOSED


class PeerError(KvlinkError):
    """Base of errors about a peer."""


class UnknownPeerError(PeerError, LookupError):
    """No peer by that name: call ``add_peer`` first."""

    default_code = ErrorCode.UNKNOWN_PEER


class DuplicateNameError(PeerError, ValueError):
    """Two live agents share one name."""

    default_code = ErrorCode.DUPLICATE_NAME


class PeerUnreachableError(PeerError, ConnectionError):
    """Cannot connect to the peer."""

    default_code = ErrorCode.UNREACHABLE


class HandshakeError(PeerError, ConnectionError):
    """The peer speaks another protocol version, or is not the agent expected."""

    default_code = ErrorCode.HANDSHAKE


class AuthenticationError(HandshakeError, PermissionError):
    """The peer does not hold this agent's cluster secret, holds none, or
    this agent has none and the peer requires one (docs/security.md)."""

    default_code = ErrorCode.AUTH


class DiscoveryError(KvlinkError, ConnectionError):
    """etcd could not be reached, refused a request, or answered something that
    is not what discovery stores (docs/cluster.md)."""

    default_code = ErrorCode.UNREACHABLE


class ProtocolError(KvlinkError):
    """A malformed frame arrived."""

    default_code = ErrorCode.PROTOCOL


class TransferError(KvlinkError):
    """A transfer failed; nothing it reported complete holds a wrong byte."""

    default_code = ErrorCode.SYSTEM


class TransferTimeoutError(TransferError, TimeoutError):
    """A wait ran out of time, or the transfer missed its deadline."""

    default_code = ErrorCode.TIMEOUT


class ConnectionLostError(TransferError, ConnectionError):
    """Every path to the peer failed during the transfer."""

    default_code = ErrorCode.CONN_LOST


class ChecksumError(TransferError):
    """A chunk failed its crc32c check more times than allowed."""

    default_code = ErrorCode.CHECKSUM


class TransferAbortedError(TransferError):
    """The agent was closed while the transfer ran."""

    default_code = ErrorCode.CLOSED


class TransferCancelledError(TransferError):
    """The transfer was cancelled (``Transfer.cancel``, or the sender cancelled a push):
    nothing it moved counts."""

    default_code = ErrorCode.CANCELLED


class RemoteRefusedError(TransferError, PermissionError):
    """The peer refused a chunk: its region went away, shrank or lost a right
    after this side validated the transfer."""

    default_code = ErrorCode.ACCESS_DENIED


_GENERAL: dict[ErrorCode, type[KvlinkError]] = {
    ErrorCode.INVALID_ARG: InvalidArgumentError,
    ErrorCode.CLOSED: ClosedError,
    ErrorCode.TIMEOUT: TransferTimeoutError,
    ErrorCode.UNKNOWN_PEER: UnknownPeerError,
    ErrorCode.PEER_EXISTS: DuplicateNameError,
    ErrorCode.UNREACHABLE: PeerUnreachableError,
    ErrorCode.HANDSHAKE: HandshakeError,
    ErrorCode.DUPLICATE_NAME: DuplicateNameError,
    ErrorCode.UNKNOWN_REGION: UnknownRegionError,
    ErrorCode.OUT_OF_BOUNDS: OutOfBoundsError,
    ErrorCode.ACCESS_DENIED: RemoteAccessError,
    ErrorCode.BUSY: RegionBusyError,
    ErrorCode.CONN_LOST: ConnectionLostError,
    ErrorCode.CHECKSUM: ChecksumError,
    ErrorCode.PROTOCOL: ProtocolError,
    ErrorCode.DEADLINE: TransferTimeoutError,
    ErrorCode.AUTH: AuthenticationError,
}

# A transfer that fails reports a TransferError whatever the cause.
_TRANSFER: dict[ErrorCode, type[KvlinkError]] = {
    ErrorCode.TIMEOUT: TransferTimeoutError,
    ErrorCode.DEADLINE: TransferTimeoutError,
    ErrorCode.CONN_LOST: ConnectionLostError,
    ErrorCode.UNREACHABLE: ConnectionLostError,
    ErrorCode.CHECKSUM: ChecksumError,
    ErrorCode.CLOSED: TransferAbortedError,
    ErrorCode.ACCESS_DENIED: RemoteRefusedError,
    ErrorCode.UNKNOWN_REGION: RemoteRefusedError,
    ErrorCode.OUT_OF_BOUNDS: RemoteRefusedError,
    ErrorCode.CANCELLED: TransferCancelledError,
}


def error_for(
    code: int,
    message: str,
    *,
    transfer: bool = False,
    peer: str | None = None,
    transfer_id: int | None = None,
) -> KvlinkError:
    """The exception for a C error code (``transfer`` picks the transfer family)."""
    try:
        ec = ErrorCode(code)
    except ValueError:
        ec = ErrorCode.SYSTEM
    table = _TRANSFER if transfer else _GENERAL
    cls = table.get(ec, TransferError if transfer else KvlinkError)
    return cls(message or ec.name, code=ec, peer=peer, transfer_id=transfer_id)
