"""Active health checks: call a configured Thrift method on each endpoint every `interval`.

A TApplicationException (logged with its type and message), a declared
exception, a reply that does not decode, a timeout or a connection failure
is a failed check; `unhealthy_threshold` failed checks in a row (default 1;
an answer that says it is not well, such as an exception, counts at once)
take the endpoint out (`ep.healthy = False`, so the balancer skips it like an
open breaker) and `healthy_threshold` passing ones bring it back. An endpoint
that joins the cluster (discovery, a reload, the start) is `pending` until its
first check answers, checked at once rather than at the next round: the
cluster uses it only when no checked endpoint may take a call (Envoy's new
hosts wait for their first check the same way). Needs the cluster's framing
and protocol (the config enforces it). Lifecycle work: one task per cluster,
its own connections (never the pool's), so checks never queue behind calls.
Whatever a check raises counts as that check's failure, and the task logs and
survives anything else: it never stops while its cluster lives. Checks never
touch the endpoint's breaker: `healthy` and the breaker are two separate
filters (`proxy.cluster.Cluster.pick`).
"""

from __future__ import annotations

import asyncio
import logging

from thrift.protocol.TBinaryProtocol import TBinaryProtocol
from thrift.protocol.TCompactProtocol import TCompactProtocol
from thrift.Thrift import TApplicationException
from thrift.transport.TTransport import TMemoryBuffer

from proxy.codec import Decoder, Framing, MessageType, Protocol, ProtocolError, frame_payload
from proxy.codec.heads import encode_head
from proxy.codec.wire import AppErrorType
from proxy.pool import describe_connect_error
from proxy.upstream import reply_terms

log = logging.getLogger(__name__)

# What `check_once` says when no answer came (a connect that failed, a timeout, a connection
# lost) or the check itself raised: these count toward `unhealthy_threshold`. An answer that says
# the endpoint is not well (a TApplicationException, a declared exception, a bad reply) takes it
# out at once, as an unexpected HTTP status does in Envoy's checks.
NO_ANSWER = ("connect failed", "no reply within", "connection closed before the reply", "check raised")


def describe_app_exception(reply) -> str:
    """'TApplicationException UNKNOWN_METHOD: <its message>' from an EXCEPTION reply, as far as it
    decodes."""
    try:
        prot_cls = TCompactProtocol if reply.protocol is Protocol.COMPACT else TBinaryProtocol
        prot = prot_cls(TMemoryBuffer(bytes(reply.payload())))
        prot.readMessageBegin()
        x = TApplicationException()
        x.read(prot)
    except Exception as e:  # noqa: BLE001 - any garbage in the body: say so, the check failed anyway
        return f"TApplicationException (body does not decode: {type(e).__name__})"
    try:
        kind = AppErrorType(x.type).name
    except ValueError:
        kind = f"type {x.type}"
    return f"TApplicationException {kind}: {x.message}" if x.message else f"TApplicationException {kind}"


def check_request(method: str, seqid: int, framing: Framing, protocol: Protocol) -> bytes:
    """A CALL of `method` with no arguments (an empty args struct)."""
    payload = bytes(encode_head(method, MessageType.CALL, seqid, protocol)) + b"\x00"
    return frame_payload(payload, framing, protocol, seqid)


async def check_once(host: str, port: int, method: str, framing: Framing, protocol: Protocol,
                     timeout: float, seqid: int = 1, ssl=None, server_hostname=None) -> str | None:
    """None when healthy, else why not."""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=ssl, server_hostname=server_hostname if ssl else None)
            writer.write(check_request(method, seqid, framing, protocol))
            dec = Decoder(framing, protocol)
            while True:
                data = await reader.read(65536)
                if not data:
                    return "connection closed before the reply"
                dec.feed(data)
                reply = dec.next_message()
                if reply is not None:
                    break
        if reply.type == MessageType.EXCEPTION:
            return describe_app_exception(reply)
        if reply.seqid != seqid:
            return f"reply seqid {reply.seqid} != {seqid}"
        if reply.type != MessageType.REPLY:
            return f"message type {reply.type} where a REPLY was due"
        field = reply.result_field()  # may raise ProtocolError (a truncated result struct)
    except TimeoutError:
        return f"no reply within {timeout * 1000:.0f}ms"
    except OSError as e:  # ssl.SSLError included
        return f"connect failed: {describe_connect_error(e, ssl is not None)}"
    except ProtocolError as e:
        return e.message if e.message.startswith("bad reply") else f"bad reply: {reply_terms(e.message)}"
    finally:
        if writer is not None:
            writer.close()
    if field:  # any id but 0 (a success) is a declared exception
        return f"declared exception (result field {field})"
    return None


class HealthChecker:
    """Checks every endpoint of one cluster; logs and counts each change once."""

    def __init__(self, cluster, method: str, interval: float, timeout: float,
                 unhealthy_threshold: int = 1, healthy_threshold: int = 1) -> None:
        self.cluster = cluster
        self.method = method
        self.interval = interval
        self.timeout = timeout
        self.unhealthy_threshold = unhealthy_threshold
        self.healthy_threshold = healthy_threshold
        self.task: asyncio.Task | None = None
        self._first: set[asyncio.Task] = set()  # first checks of endpoints that joined (adopt)
        self._seqid = 0
        self.stats = {"checks": 0, "failures": 0, "taken_out": 0, "brought_back": 0}

    def start(self) -> None:
        """Check every endpoint now and every `interval`; endpoints the cluster adds from now on
        are `adopt`ed (pending, checked at once)."""
        self.cluster.checker = self
        self.task = asyncio.get_running_loop().create_task(self._run())

    def adopt(self, ep) -> None:
        """`ep` joins the cluster: out (`pending`) until a check answers, which starts now."""
        ep.pending, ep.healthy = True, False
        if self.task is None or self.task.done():
            return  # (not started: its first round checks it; closed: nothing will)
        task = asyncio.get_running_loop().create_task(self._check_first(ep))
        self._first.add(task)
        task.add_done_callback(self._first.discard)

    def close(self) -> asyncio.Task | None:
        """Stop checking. Returns the task, which ends at its next await: the server waits for
        it before the loop closes (else asyncio warns that a pending task was destroyed)."""
        if self.cluster.checker is self:
            self.cluster.checker = None
        for task in list(self._first):
            task.cancel()
        if self.task is not None:
            self.task.cancel()
        return self.task

    async def _run(self) -> None:
        """A round every `interval` from the start of the last (or at once after one that took
        longer: a check's timeout over the interval)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                start = loop.time()
                try:
                    await self._round()
                except Exception:  # a bug here must not end health checking for the cluster, silently
                    log.exception("health checks of cluster %s: round failed; next round in %gs",
                                  self.cluster.name, self.interval)
                await asyncio.sleep(max(0.0, start + self.interval - loop.time()))
        finally:  # (the server waits for this task only: first checks end with it)
            if self._first:
                await asyncio.gather(*self._first, return_exceptions=True)

    def _check(self, ep):
        self._seqid = self._seqid % 0x7FFFFFFF + 1  # (1 .. 2**31-1: an i32 on the wire, never 0)
        return check_once(ep.host, ep.port, self.method, self.cluster.framing, self.cluster.protocol,
                          self.timeout, self._seqid, self.cluster.ssl, self.cluster.tls_name(ep.host))

    async def _checked(self, ep):
        """One check's result for `_record`: None, a reason, or what the check raised (a bug in
        check_once: still this endpoint's failed check, the others' stand)."""
        try:
            return await self._check(ep)
        except Exception as e:  # noqa: BLE001 - _record logs it
            return e

    async def _check_first(self, ep) -> None:
        why = await self._checked(ep)
        if ep.pending and not ep.removed:  # (a round may have answered first)
            self._record(ep, why)

    async def _round(self) -> None:
        """Every endpoint checked at once, each result recorded as it comes: a hung endpoint's
        check (its whole timeout) holds back no other endpoint's (a passing first check lets its
        endpoint in at once, not when the slowest check of the round ends)."""
        await asyncio.gather(*(self._check_recorded(ep) for ep in list(self.cluster.endpoints)))

    async def _check_recorded(self, ep) -> None:
        self._record(ep, await self._checked(ep))

    def _record(self, ep, why) -> None:
        """One check's result: None (passed), a reason, or what the check raised."""
        if isinstance(why, BaseException):
            # check_once turns every failure it knows into a reason; anything else is a bug
            # there, and still a failed check of this endpoint (the others' results stand)
            log.error("health check %s() of %s in cluster %s raised", self.method, ep.label,
                      self.cluster.name, exc_info=why)
            why = f"check raised {type(why).__name__}: {why}"
        self.stats["checks"] += 1
        healthy = why is None
        if not healthy:
            self.stats["failures"] += 1
        if ep.pending:
            ep.pending, ep.healthy, ep.streak = False, healthy, 0
            if healthy:
                log.info("first health check of %s in cluster %s passes: in", ep.label, self.cluster.name)
            else:
                log.warning("health check %s() of %s in cluster %s failed: %s; kept out (its first check)",
                            self.method, ep.label, self.cluster.name, why)
        elif healthy == ep.healthy:
            ep.streak = 0
        else:
            ep.streak += 1
            need = (self.healthy_threshold if healthy else
                    self.unhealthy_threshold if why.startswith(NO_ANSWER) else 1)
            if ep.streak < need:
                log.info("health check %s() of %s in cluster %s %s (%d of %d in a row to %s)",
                         self.method, ep.label, self.cluster.name,
                         "passed" if healthy else f"failed: {why}", ep.streak, need,
                         "bring it back" if healthy else "take it out")
                return
            ep.healthy, ep.streak = healthy, 0
            in_a_row = f" ({need} in a row)" if need > 1 else ""
            if healthy:
                self.stats["brought_back"] += 1
                log.warning("health check of %s in cluster %s passes again%s: back in",
                            ep.label, self.cluster.name, in_a_row)
            else:
                self.stats["taken_out"] += 1
                log.warning("health check %s() of %s in cluster %s failed%s: %s; taken out",
                            self.method, ep.label, self.cluster.name, in_a_row, why)
