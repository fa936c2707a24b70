"""Wire constants shared by the codec: framings, protocols, message and field types.

"Framing" is what Apache Thrift calls a transport (framed, buffered, THeader);
the name avoids a clash with asyncio's Transport.
"""

from __future__ import annotations

import enum


class Framing(enum.Enum):
    """How messages are delimited on a connection."""

    FRAMED = "framed"            # i32 length prefix, then the message
    BUFFERED = "buffered"        # no prefix: the end is found by scanning the struct
    HEADER = "header"            # THeader: length, 0x0FFF magic, info headers, payload
    FRAMED_HEADER = "framed_header"  # a whole THeader frame inside a framed frame

    # Members are singletons compared by identity: hash them so too, in C (Enum's own
    # __hash__ is Python code, and pools and request caches are keyed by these per call).
    __hash__ = object.__hash__

    @property
    def is_header(self) -> bool:
        return self is Framing.HEADER or self is Framing.FRAMED_HEADER


class Protocol(enum.Enum):
    """How a message is encoded. Never transcoded by the proxy."""

    BINARY = "binary"                      # strict binary (versioned head)
    BINARY_NONSTRICT = "binary_nonstrict"  # also accepts the old unversioned head
    COMPACT = "compact"

    __hash__ = object.__hash__  # as Framing's

    @property
    def header_id(self) -> int:
        """The protocol id THeader carries for this protocol."""
        return THEADER_PROTOCOL_COMPACT if self is Protocol.COMPACT else THEADER_PROTOCOL_BINARY


class MessageType(enum.IntEnum):
    CALL = 1
    REPLY = 2
    EXCEPTION = 3
    ONEWAY = 4


# Hot-path aliases. On Python 3.11 `MessageType.CALL` goes through enum's member descriptor
# (~95 ns a read, where a module global takes ~15): code that runs per call reads these instead.
# The objects are the enum members themselves.
M_CALL, M_REPLY, M_EXCEPTION, M_ONEWAY = MessageType.CALL, MessageType.REPLY, MessageType.EXCEPTION, MessageType.ONEWAY
F_FRAMED, F_BUFFERED, F_HEADER, F_FRAMED_HEADER = (Framing.FRAMED, Framing.BUFFERED, Framing.HEADER,
                                                   Framing.FRAMED_HEADER)
P_BINARY, P_BINARY_NONSTRICT, P_COMPACT = Protocol.BINARY, Protocol.BINARY_NONSTRICT, Protocol.COMPACT


class AppErrorType(enum.IntEnum):
    """TApplicationException types the proxy sends (Apache Thrift's numbering)."""

    UNKNOWN = 0
    UNKNOWN_METHOD = 1
    INVALID_MESSAGE_TYPE = 2
    WRONG_METHOD_NAME = 3
    BAD_SEQUENCE_ID = 4
    MISSING_RESULT = 5
    INTERNAL_ERROR = 6
    PROTOCOL_ERROR = 7
    INVALID_TRANSFORM = 8
    INVALID_PROTOCOL = 9
    UNSUPPORTED_CLIENT_TYPE = 10


# Binary protocol.
BINARY_VERSION_1 = 0x80010000
BINARY_VERSION_MASK = 0xFFFF0000

# Compact protocol.
COMPACT_PROTOCOL_ID = 0x82
COMPACT_VERSION = 1
COMPACT_VERSION_MASK = 0x1F
COMPACT_TYPE_SHIFT = 5

# THeader.
THEADER_MAGIC = 0x0FFF
THEADER_PROTOCOL_BINARY = 0
THEADER_PROTOCOL_COMPACT = 2
THEADER_TRANSFORM_ZLIB = 1
THEADER_INFO_PADDING = 0
THEADER_INFO_KEYVALUE = 1
THEADER_FIXED_SIZE = 10  # magic(2) flags(2) seqid(4) header-size(2), after the length prefix

# Apache Thrift's default maximum frame size.
DEFAULT_MAX_FRAME_SIZE = 16_384_000

# Binary protocol field types (TType).
T_STOP = 0
T_BOOL = 2
T_BYTE = 3
T_DOUBLE = 4
T_I16 = 6
T_I32 = 8
T_I64 = 10
T_STRING = 11
T_STRUCT = 12
T_MAP = 13
T_SET = 14
T_LIST = 15
T_UUID = 16

# Compact protocol field types.
C_STOP = 0
C_TRUE = 1
C_FALSE = 2
C_BYTE = 3
C_I16 = 4
C_I32 = 5
C_I64 = 6
C_DOUBLE = 7
C_BINARY = 8
C_LIST = 9
C_SET = 10
C_MAP = 11
C_STRUCT = 12
C_UUID = 13
