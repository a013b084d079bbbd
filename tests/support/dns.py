"""A real authoritative DNS server for tests, on loopback UDP and TCP (same random port).

Fed with zone-file-style lines like the cases' ``dns.txt``::

    dest.example.test.      300 IN MX 10 mx.dest.example.test.
    mx.dest.example.test.   300 IN A  127.0.2.21
    alias.example.test.     300 IN CNAME real.example.test.
    nomail.example.test.    300 IN MX 0 .
    servfail.example.test.  MX   SERVFAIL     ; answer SERVFAIL to MX queries for the name
    nx.example.test.        NXDOMAIN          ; the name does not exist (any type)
    slow.example.test.      MX   TIMEOUT      ; drop MX queries (no answer at all)

Behaviours (SERVFAIL, NXDOMAIN, TIMEOUT, REFUSED) apply to one type when a type is given,
else to every type of the name. Names without any record are NXDOMAIN; a name with records
but none of the asked type is NOERROR/NODATA. CNAMEs are chased inside the data and the
whole chain is returned (as BIND does for in-zone targets), a loop stops at the first
repeated name; ``chase_cnames=False`` returns only the first CNAME so the client must chase.

The server runs in two daemon threads, so it works from sync and async tests alike::

    with DnsServer(zone_text) as dns:
        settings = WorkerSettings(nameservers=dns.nameservers, nameserver_port=dns.port)
        ...
        assert ("xn--bcher-kva.example.test", "MX") in dns.queried

``dns.queries`` logs every question (name without trailing dot, type, "udp"/"tcp").
"""

from __future__ import annotations

import socket
import socketserver
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.rrset

BEHAVIOURS = ("SERVFAIL", "NXDOMAIN", "TIMEOUT", "REFUSED")
_MAX_CHASE = 16


def _strip_comment(line: str) -> str:
    out = []
    quoted = False
    for ch in line:
        if ch == '"':
            quoted = not quoted
        elif ch == ";" and not quoted:
            break
        out.append(ch)
    return "".join(out).strip()


def _norm(name: str) -> str:
    return name.strip().rstrip(".").lower()


@dataclass
class Zone:
    """Records and behaviours by (name, type); names are lower case without trailing dot."""

    records: dict[tuple[str, int], list[tuple[int, dns.rdata.Rdata]]] = field(default_factory=dict)
    behaviours: dict[tuple[str, int | None], str] = field(default_factory=dict)

    def add_text(self, text: str) -> None:
        """Add zone-file-style lines (see the module docstring).

        Raises:
            ValueError: a line cannot be parsed.
        """
        for raw in text.splitlines():
            line = _strip_comment(raw)
            if not line:
                continue
            self._add_line(line, raw)

    def _add_line(self, line: str, raw: str) -> None:
        name, _, rest = line.partition(" ")
        owner = _norm(name)
        ttl = 300
        rdtype: int | None = None
        rest = rest.strip()
        while rest:
            token, _, tail = rest.partition(" ")
            upper = token.upper()
            if token.isdigit() and rdtype is None:
                ttl = int(token)
            elif upper == "IN" and rdtype is None:
                pass
            elif upper in BEHAVIOURS:
                self.behaviours[(owner, rdtype)] = upper
                return
            elif rdtype is None:
                try:
                    rdtype = dns.rdatatype.from_text(upper)
                except dns.rdatatype.UnknownRdatatype as e:
                    raise ValueError(f"cannot parse zone line {raw!r}") from e
                tail = tail.strip()
                if tail.upper() in BEHAVIOURS:
                    self.behaviours[(owner, rdtype)] = tail.upper()
                    return
                rdata = dns.rdata.from_text(
                    dns.rdataclass.IN, rdtype, tail, origin=dns.name.root, relativize=False
                )
                self.records.setdefault((owner, rdtype), []).append((ttl, rdata))
                return
            rest = tail.strip()
        raise ValueError(f"cannot parse zone line {raw!r}")

    def exists(self, name: str) -> bool:
        return any(owner == name for owner, _ in self.records)

    def behaviour(self, name: str, rdtype: int) -> str | None:
        return self.behaviours.get((name, rdtype)) or self.behaviours.get((name, None))


class DnsServer:
    """Authoritative test DNS server on ``host`` (default 127.0.0.1), UDP and TCP.

    Args:
        zone: zone-file-style text (see the module docstring); more with :meth:`add`.
        host: loopback address to bind (127.0.0.0/8 or ::1).
        chase_cnames: include the whole in-zone CNAME chain in answers.

    Attributes:
        port: the UDP and TCP port (random, chosen at :meth:`start`).
        queries: every question received, as ``(name, type, transport)``.
    """

    def __init__(
        self, zone: str = "", *, host: str = "127.0.0.1", chase_cnames: bool = True
    ) -> None:
        self.zone = Zone()
        self.zone.add_text(zone)
        self.host = host
        self.chase_cnames = chase_cnames
        self.port = 0
        self.queries: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._servers: list[socketserver.BaseServer] = []
        self._threads: list[threading.Thread] = []

    @classmethod
    def from_file(
        cls, path: str | Path, *, host: str = "127.0.0.1", chase_cnames: bool = True
    ) -> DnsServer:
        """A server fed with a file such as a case's ``dns.txt``."""
        return cls(Path(path).read_text(), host=host, chase_cnames=chase_cnames)

    def add(self, text: str) -> None:
        """Add records or behaviours; takes effect for the next query."""
        with self._lock:
            self.zone.add_text(text)

    @property
    def nameservers(self) -> list[str]:
        """``[host]``, for ``WorkerSettings.nameservers``."""
        return [self.host]

    @property
    def queried(self) -> set[tuple[str, str]]:
        """The ``(name, type)`` pairs asked so far."""
        with self._lock:
            return {(n, t) for n, t, _ in self.queries}

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> DnsServer:
        """Bind UDP and TCP on one free port and serve in background threads."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        udp_cls = type("_Udp", (socketserver.ThreadingUDPServer,), {"address_family": family})
        tcp_cls = type(
            "_Tcp",
            (socketserver.ThreadingTCPServer,),
            {"address_family": family, "allow_reuse_address": True, "daemon_threads": True},
        )
        server = self
        udp_handler = type("_UdpHandler", (_UdpHandler,), {"dns": server})
        tcp_handler = type("_TcpHandler", (_TcpHandler,), {"dns": server})
        for _ in range(50):
            udp = udp_cls((self.host, 0), udp_handler)
            udp.daemon_threads = True
            port = udp.server_address[1]
            try:
                tcp = tcp_cls((self.host, port), tcp_handler)
            except OSError:
                udp.server_close()
                continue
            self.port = port
            self._servers = [udp, tcp]
            break
        else:
            raise OSError("no port free for both UDP and TCP")
        for srv in self._servers:
            thread = threading.Thread(
                target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop serving and close the sockets."""
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._servers = []
        self._threads = []

    def __enter__(self) -> DnsServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- answering -----------------------------------------------------------------------

    def answer(self, wire: bytes, transport: str, max_size: int = 65535) -> bytes | None:
        """The response to one query in wire format; None to drop it (TIMEOUT)."""
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None
        if not query.question:
            return None
        question = query.question[0]
        qname = _norm(question.name.to_text())
        qtype = question.rdtype
        with self._lock:
            self.queries.append((qname, dns.rdatatype.to_text(qtype), transport))
            response = self._respond(query, qname, qtype)
        if response is None:
            return None
        if transport == "udp":
            limit = max(512, query.payload) if query.edns >= 0 else 512
            try:
                return response.to_wire(max_size=limit)
            except dns.exception.TooBig:
                response.answer = []
                response.flags |= dns.flags.TC
                return response.to_wire()
        return response.to_wire(max_size=max_size)

    def _respond(
        self, query: dns.message.Message, qname: str, qtype: int
    ) -> dns.message.Message | None:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        name = qname
        seen: set[str] = set()
        for _ in range(_MAX_CHASE):
            behaviour = self.zone.behaviour(name, qtype)
            if behaviour == "TIMEOUT":
                return None
            if behaviour in ("SERVFAIL", "REFUSED", "NXDOMAIN"):
                response.set_rcode(dns.rcode.from_text(behaviour))
                return response
            data = self.zone.records.get((name, qtype))
            if data:
                response.answer.append(_rrset(name, qtype, data))
                return response
            cname = self.zone.records.get((name, dns.rdatatype.CNAME))
            if cname and qtype != dns.rdatatype.CNAME:
                response.answer.append(_rrset(name, dns.rdatatype.CNAME, cname))
                seen.add(name)
                target = _norm(cname[0][1].to_text())
                if not self.chase_cnames or target in seen:
                    return response
                name = target
                continue
            if not self.zone.exists(name):
                response.set_rcode(dns.rcode.NXDOMAIN)
            return response
        return response


def _rrset(name: str, rdtype: int, data: list[tuple[int, dns.rdata.Rdata]]) -> dns.rrset.RRset:
    rrset = dns.rrset.RRset(
        dns.name.from_text(name), dns.rdataclass.IN, dns.rdatatype.RdataType.make(rdtype)
    )
    for ttl, rdata in data:
        rrset.add(rdata, ttl)
    return rrset


class _UdpHandler(socketserver.BaseRequestHandler):
    dns: DnsServer

    def handle(self) -> None:
        data, sock = self.request
        reply = self.dns.answer(data, "udp")
        if reply is not None:
            sock.sendto(reply, self.client_address)


class _TcpHandler(socketserver.BaseRequestHandler):
    dns: DnsServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(5)
        try:
            while True:
                head = _recv_exact(sock, 2)
                if head is None:
                    return
                wire = _recv_exact(sock, int.from_bytes(head, "big"))
                if wire is None:
                    return
                reply = self.dns.answer(wire, "tcp")
                if reply is None:
                    continue
                sock.sendall(len(reply).to_bytes(2, "big") + reply)
        except OSError:
            return


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
