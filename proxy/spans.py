"""Span names and attribute keys: the one place they are spelled (trace viewer and `hops` read them).

Span tree of one call (DESIGN.md):

    SERVER "{service}/{method}"      first request byte read → the client has every reply byte (none left unsent)
     ├─ read_request                 first byte → whole request framed
     ├─ CLIENT "{service}/{method}"  one per upstream attempt
     │   ├─ acquire                  pool lease, including connect (one never got: until the attempt ended)
     │   ├─ write_upstream           request bytes written to the upstream socket
     │   ├─ service_time             last request byte written → first reply byte
     │   └─ read_response            first reply byte (after a hold: its turn) → whole reply framed
     ├─ backoff                      only between retries
     ├─ queued                       a finished reply waited for earlier pipelined replies; also a
     │                               large one held unread for its turn (from its first byte, as long as held)
     └─ write_response               first reply byte written → every byte left our send queue (SIOCOUTQNSD = 0)

Attribute keys follow the OpenTelemetry semantic conventions (pinned below)
for RPC, server and network; the proxy's own keys live under `sidecar.`.
"""

SEMCONV_VERSION = "1.26.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"
INSTRUMENTATION_SCOPE = "thrift-sidecar"

# Hop span names (exactly these).
READ_REQUEST = "read_request"
ACQUIRE = "acquire"
WRITE_UPSTREAM = "write_upstream"
SERVICE_TIME = "service_time"
READ_RESPONSE = "read_response"
BACKOFF = "backoff"
QUEUED = "queued"
WRITE_RESPONSE = "write_response"

CALL_HOPS = (READ_REQUEST, QUEUED, WRITE_RESPONSE, BACKOFF)          # children of SERVER
ATTEMPT_HOPS = (ACQUIRE, WRITE_UPSTREAM, SERVICE_TIME, READ_RESPONSE)  # children of CLIENT
HOPS = (READ_REQUEST, ACQUIRE, WRITE_UPSTREAM, SERVICE_TIME, READ_RESPONSE, BACKOFF, QUEUED,
        WRITE_RESPONSE)


def call_span_name(service: str, method: str) -> str:
    """Name of the SERVER and CLIENT spans: `{service}/{method}`."""
    return f"{service}/{method}"


# Semantic-convention attributes.
RPC_SYSTEM = "rpc.system"
RPC_SYSTEM_VALUE = "apache_thrift"
RPC_SERVICE = "rpc.service"
RPC_METHOD = "rpc.method"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
PEER_ADDRESS = "network.peer.address"
PEER_PORT = "network.peer.port"
ERROR_TYPE = "error.type"

# The proxy's own attributes.
LISTENER = "sidecar.listener"
SEQID = "sidecar.seqid"
REQUEST_SIZE = "sidecar.request_size"         # bytes, framing included
REPLY_SIZE = "sidecar.reply_size"             # bytes, framing included
OUTCOME = "sidecar.outcome"                   # success | declared_exception | app_exception | not_sent | may_have_run | timeout
ERROR_MESSAGE = "sidecar.error"               # the proxy's own error text, when it answered
ATTEMPT = "sidecar.attempt"                   # 1-based, on CLIENT spans
ATTEMPTS = "sidecar.attempts"                 # on the SERVER span
RETRY_REASON = "sidecar.retry_reason"         # why this attempt is a retry (the previous outcome)
BREAKER_STATE = "sidecar.breaker_state"       # the endpoint's breaker when the attempt was picked
ENDPOINT = "sidecar.endpoint"                 # host:port of the attempt's upstream
STREAMED = "sidecar.streamed"                 # the reply streamed (read_response overlaps write_response)
REQUEST_STREAMED = "sidecar.request_streamed" # the request streamed (read_request overlaps write_upstream)
UPLOAD_HELD_MS = "sidecar.upload_held_ms"     # time a streamed request's client was held back (upstream side)
CLIENT_PAUSED_MS = "sidecar.client_paused_ms" # time the client side held a streamed reply back
UPSTREAM_WAIT_MS = "sidecar.upstream_wait_ms" # time a streamed reply waited for upstream bytes
HANDED_MS = "sidecar.handed_ms"               # write_response: when the kernel took the last byte (ms after start)
CLIENT_NEVER_READ = "sidecar.client_never_read"  # write_response: the client never acknowledged within the cap
LOOP_LAG_MS = "sidecar.loop_lag_ms"           # the largest event-loop lag seen while the call ran
ONEWAY = "sidecar.oneway"
SAMPLED_BY = "sidecar.sampled_by"             # head | slow | failed
NEW_TRACE = "sidecar.new_trace"               # true when the client sent no trace context

# The error.type of a call whose only failure is that its client never read its reply (its outcome,
# the upstream's answer, may be a success); its write_response carries CLIENT_NEVER_READ.
ERROR_CLIENT_NEVER_READ = "client_never_read"

# Values of SAMPLED_BY: why a call's spans were exported (precedence: head, failed, slow).
SAMPLED_HEAD = "head"      # the head decision (the client's flag, else the sample ratio)
SAMPLED_FAILED = "failed"  # the proxy answered with its own error, or the outcome was not success/declared
SAMPLED_SLOW = "slow"      # slower than the route's slow_call
