"""DNSSEC for tests: :class:`SignedDnsServer`, an authoritative server for zones signed in
the test with dnspython's ``dns.dnssec.sign_zone`` (keys made in the test), answering with
RRSIG, DNSKEY and NSEC when the query has DO; and :class:`Unbound`, Debian's validating
resolver started with its own config on a loopback port, stub to that server, with the
signed zone's key as trust anchor. Nothing here talks to anything but loopback: unbound's
root is a stub to the test server too, which refuses every name outside its zones.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import dns.dnssec
import dns.flags
import dns.message
import dns.name
import dns.node
import dns.query
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rdtypes.ANY.RRSIG
import dns.rrset
import dns.zone
from cryptography.hazmat.primitives.asymmetric import ec

from support.dns import DnsServer

UNBOUND = shutil.which("unbound") or "/usr/sbin/unbound"

_SOA = "ns.{o} hostmaster.{o} 1 3600 600 86400 300"


def make_zone(origin: str, records: str) -> dns.zone.Zone:
    """A zone for ``origin`` from zone-file lines (relative or absolute names), with an SOA
    and NS added."""
    text = f"@ 300 IN SOA {_SOA.format(o=origin)}\n@ 300 IN NS ns.{origin}\n{records}"
    return dns.zone.from_text(text, origin=origin, relativize=False)


def sign(zone: dns.zone.Zone) -> dns.rrset.RRset:
    """Sign ``zone`` in place with a new ECDSA P-256 key (NSEC chain included); returns
    its DNSKEY RRset (the trust anchor)."""
    key = ec.generate_private_key(ec.SECP256R1())
    dnskey = dns.dnssec.make_dnskey(key.public_key(), dns.dnssec.Algorithm.ECDSAP256SHA256, 257)
    now = int(time.time())
    dns.dnssec.sign_zone(zone, keys=[(key, dnskey)], inception=now - 3600, lifetime=86400)
    rdataset = zone.get_rdataset(zone.origin, dns.rdatatype.DNSKEY)
    assert rdataset is not None
    return dns.rrset.from_rdata_list(zone.origin, rdataset.ttl, list(rdataset))


def break_signature(zone: dns.zone.Zone, name: str, rdtype: str) -> None:
    """Corrupt the RRSIG over ``name``/``rdtype`` so a validator finds it bogus."""
    owner = dns.name.from_text(name)
    covered = dns.rdatatype.from_text(rdtype)
    node = zone.find_node(owner)
    sigs = node.find_rdataset(dns.rdataclass.IN, dns.rdatatype.RRSIG, covered)
    broken = []
    for sig in sigs:
        assert isinstance(sig, dns.rdtypes.ANY.RRSIG.RRSIG)
        flipped = bytes([sig.signature[0] ^ 0xFF]) + sig.signature[1:]
        broken.append(sig.replace(signature=flipped))
    ttl = sigs.ttl
    sigs.clear()
    for sig in broken:
        sigs.add(sig, ttl)


class SignedDnsServer(DnsServer):
    """Authoritative for ``zones`` (signed or not), on loopback UDP and TCP; REFUSED for
    every other name. With DO in the query, answers carry their RRSIGs, and NODATA /
    NXDOMAIN answers the SOA and the NSEC records that prove them."""

    def __init__(self, zones: list[dns.zone.Zone], *, host: str = "127.0.0.1") -> None:
        super().__init__("", host=host)
        self.zones = zones

    def _respond(
        self, query: dns.message.Message, qname: str, qtype: int
    ) -> dns.message.Message | None:
        response = dns.message.make_response(query)
        name = dns.name.from_text(qname)
        zone = next((z for z in self.zones if name.is_subdomain(z.origin)), None)
        if zone is None:
            response.set_rcode(dns.rcode.REFUSED)
            return response
        response.flags |= dns.flags.AA
        do = bool(query.ednsflags & dns.flags.DO)
        node = zone.get_node(name)
        for _ in range(8):  # in-zone CNAME chains are followed, as authoritative servers do
            if node is None:
                break
            found = node.get_rdataset(dns.rdataclass.IN, qtype)
            if found is not None:
                response.answer.append(_rrset(name, found))
                if do:
                    self._add_sig(response.answer, node, name, qtype)
                return response
            alias = node.get_rdataset(dns.rdataclass.IN, dns.rdatatype.CNAME)
            if alias is None or qtype == dns.rdatatype.CNAME:
                self._negative(response, zone, do, [name])
                return response
            response.answer.append(_rrset(name, alias))
            if do:
                self._add_sig(response.answer, node, name, dns.rdatatype.CNAME)
            name = alias[0].target  # type: ignore[attr-defined]
            node = zone.get_node(name)
        if node is not None:
            return response
        response.set_rcode(dns.rcode.NXDOMAIN)
        wildcard = dns.name.from_text("*", zone.origin)
        self._negative(response, zone, do, [name, wildcard], covering=True)
        return response

    def _add_sig(
        self, section: list[dns.rrset.RRset], node: dns.node.Node, name: dns.name.Name, rdtype: int
    ) -> None:
        sigs = node.get_rdataset(dns.rdataclass.IN, dns.rdatatype.RRSIG, rdtype)
        if sigs is not None:
            section.append(_rrset(name, sigs))

    def _negative(
        self,
        response: dns.message.Message,
        zone: dns.zone.Zone,
        do: bool,
        names: list[dns.name.Name],
        covering: bool = False,
    ) -> None:
        apex = zone.find_node(zone.origin)
        soa = apex.get_rdataset(dns.rdataclass.IN, dns.rdatatype.SOA)
        assert soa is not None
        response.authority.append(_rrset(zone.origin, soa))
        if not do:
            return
        self._add_sig(response.authority, apex, zone.origin, dns.rdatatype.SOA)
        added: set[dns.name.Name] = set()
        for wanted in names:
            for owner, node in zone.items():
                nsec = node.get_rdataset(dns.rdataclass.IN, dns.rdatatype.NSEC)
                if nsec is None or owner in added:
                    continue
                nxt = nsec[0].next  # type: ignore[attr-defined]
                last = nxt == zone.origin
                covers = owner < wanted and (wanted < nxt or last)
                if (covering and covers) or (not covering and owner == wanted):
                    response.authority.append(_rrset(owner, nsec))
                    self._add_sig(response.authority, node, owner, dns.rdatatype.NSEC)
                    added.add(owner)


def _rrset(name: dns.name.Name, rdataset: dns.rdataset.Rdataset) -> dns.rrset.RRset:
    rrset = dns.rrset.RRset(name, rdataset.rdclass, rdataset.rdtype, rdataset.covers)
    rrset.update(rdataset)
    return rrset


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Unbound:
    """Debian's unbound as a validating resolver on ``host``: its own config in a temp dir,
    stub zones (the root included) to the test server, ``anchors`` as trust anchors.

    Args:
        upstream: the authoritative test server.
        anchors: DNSKEY RRsets to trust (the signed zones' keys).
        stubs: zone names served by ``upstream``.
    """

    def __init__(
        self,
        upstream: DnsServer,
        anchors: list[dns.rrset.RRset],
        stubs: list[str],
        host: str = "127.0.0.1",
    ) -> None:
        self.upstream = upstream
        self.anchors = anchors
        self.stubs = stubs
        self.host = host
        self.port = 0
        self._dir = Path(tempfile.mkdtemp(prefix="jsq-unbound-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> str:
        path = self._dir / "unbound.log"
        return path.read_text() if path.exists() else ""

    def start(self) -> Unbound:
        anchor_file = self._dir / "anchors.key"
        anchor_file.write_text("".join(a.to_text() + "\n" for a in self.anchors))
        up = f"{self.upstream.host}@{self.upstream.port}"
        stubs = "".join(
            f'stub-zone:\n  name: "{z}"\n  stub-addr: {up}\n' for z in [".", *self.stubs]
        )
        for _ in range(20):
            self.port = _free_port(self.host)
            conf = self._dir / "unbound.conf"
            conf.write_text(
                "server:\n"
                f"  interface: {self.host}@{self.port}\n"
                f"  port: {self.port}\n"
                '  username: ""\n  chroot: ""\n'
                f'  directory: "{self._dir}"\n  pidfile: "{self._dir}/unbound.pid"\n'
                f'  logfile: "{self._dir}/unbound.log"\n  use-syslog: no\n'
                "  verbosity: 1\n  val-log-level: 2\n  do-daemonize: no\n"
                "  do-ip6: no\n  do-not-query-localhost: no\n"
                "  access-control: 127.0.0.0/8 allow\n"
                '  local-zone: "test." nodefault\n'
                '  module-config: "validator iterator"\n'
                f'  trust-anchor-file: "{anchor_file}"\n'
                "  qname-minimisation: no\n  aggressive-nsec: no\n"
                "  harden-dnssec-stripped: yes\n  prefetch: no\n"
                '  target-fetch-policy: "0 0 0 0 0"\n'
                "  cache-max-ttl: 1\n  cache-max-negative-ttl: 1\n"
                "remote-control:\n  control-enable: no\n" + stubs
            )
            subprocess.run([UNBOUND + "-checkconf", str(conf)], check=True, capture_output=True)
            self._proc = subprocess.Popen([UNBOUND, "-d", "-c", str(conf)])
            if self._ready():
                return self
            self.stop()
        raise RuntimeError(f"unbound did not start: {self.log}")

    def _ready(self) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                return False
            query = dns.message.make_query(self.stubs[0], "SOA")
            try:
                dns.query.udp(query, self.host, timeout=0.5, port=self.port)
                return True
            except (OSError, dns.exception.Timeout):
                time.sleep(0.1)
        return False

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> Unbound:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
