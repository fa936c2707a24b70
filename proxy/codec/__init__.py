"""Sans-IO Thrift codec: framing, protocol heads, resumable scanning, encoding.

Public surface:
    Decoder(framing, protocol, max_frame_size).feed(data) / .next_message()
    Decoder.detach_unframed() -> (bytes so far, UnframedStream): a long unframed message passed
    on as it arrives (proxy.codec.stream), its end found read by read
    Message (head + untouched wire bytes), Head, ProtocolError
    reframe(msg, framing, headers), frame_payload(...), exception_reply(head, type, text)
    Framing, Protocol, MessageType, AppErrorType
    SCANNER_IMPL: "c" or "python", the unframed-message scanner in use (proxy.codec.scan:
    compiled from _scan.c when it was built, else pure Python; THRIFT_SIDECAR_PURE_SCANNER=1
    or THRIFT_SIDECAR_PURE_PYTHON=1, which also turns off the other compiled twins)

No sockets, loop, clock or logging in this package.
"""

from proxy.codec.decoder import Decoder
from proxy.codec.errors import Head, ProtocolError
from proxy.codec.frames import exception_reply, frame_payload, reframe
from proxy.codec.message import Message
from proxy.codec.scan import SCANNER_IMPL
from proxy.codec.theader import HeaderBlock
from proxy.codec.wire import DEFAULT_MAX_FRAME_SIZE, AppErrorType, Framing, MessageType, Protocol

__all__ = [
    "AppErrorType", "DEFAULT_MAX_FRAME_SIZE", "Decoder", "Framing", "Head", "HeaderBlock",
    "Message", "MessageType", "Protocol", "ProtocolError", "SCANNER_IMPL", "exception_reply",
    "frame_payload", "reframe",
]
