"""Which TLS policy applies to each MX of a destination, and what it asks of the session
(:class:`TlsPlan`), decided by :class:`PolicyEngine` before an attempt:

1. ``manual``: the domain (or the smarthost) is in ``worker.tls_policies``, or a smarthost
   relays everything: the configured policy, nothing looked up.
2. ``dane`` (RFC 7672), when enabled and the MX RRset is DNSSEC-secure: a usable TLSA set
   at ``_25._tcp.<mx>`` makes TLS mandatory and authenticated by it; a TLSA set with no
   usable record makes TLS mandatory without authentication (RFC 7672 §2.2, as Postfix's
   ``encrypt`` fallback); a bogus answer defers the MX (never plaintext), and so does a
   bogus or unanswered MX RRset (the whole destination) or address RRset (that MX):
   RFC 7672 §2.1.1, delivery is delayed rather than the DNSSEC state guessed, also when
   the MX hosts were found through other, non-validating nameservers. DANE takes
   precedence over MTA-STS (RFC 8461 §2).
3. ``mta-sts enforce`` / ``mta-sts testing`` (RFC 8461 §5): enforce uses only MXes that
   match the policy, over TLS with a WebPKI-valid certificate for the MX name, else
   ``4.7.5``; testing delivers as opportunistic TLS would and notes what failed.
4. ``opportunistic`` (RFC 7435): STARTTLS when offered, any certificate, plaintext after
   a failed handshake.

Every session gets a :class:`~jsqueue.replies.TlsNote` saying which applied and why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from cryptography import x509

from jsqueue.config import OutboundTlsSettings, TlsPolicy, WorkerSettings
from jsqueue.delivery.policy.certs import Verdict, dane_verdict, load_store, webpki_verdict
from jsqueue.delivery.policy.dane import DnssecResolver, DnssecState
from jsqueue.delivery.policy.mta_sts import MtaSts, StsLookup, StsMode
from jsqueue.delivery.resolver import MxTarget, stub_resolver
from jsqueue.replies import TlsNote
from jsqueue.store.policies import MemoryPolicyCache, PolicyCache

__all__ = [
    "DANE",
    "MANUAL",
    "OPPORTUNISTIC",
    "STS_ENFORCE",
    "STS_TESTING",
    "PolicyEngine",
    "TlsPlan",
]

log = logging.getLogger(__name__)

DANE = "dane"
STS_ENFORCE = "mta-sts enforce"
STS_TESTING = "mta-sts testing"
OPPORTUNISTIC = "opportunistic"
MANUAL = "manual"

Check = Callable[[list[x509.Certificate]], Verdict]


@dataclass(frozen=True)
class TlsPlan:
    """What one session to one MX must do about TLS.

    Attributes:
        label: the policy (``dane``, ``mta-sts enforce``, ``mta-sts testing``,
            ``opportunistic``, ``manual``).
        required: no plaintext: STARTTLS missing or failing defers the MX with ``4.7.5``.
        check: run on the server's certificate chain after the handshake; None = none.
        enforce: a failed check defers the MX with ``4.7.5`` (else it is only noted).
        refuse: when set, this MX must not be used at all (MX outside an enforced
            MTA-STS policy, bogus TLSA answer); the note to record.
        detail: why this policy, in words.
        policy_id: MTA-STS policy id.
        policy_domain: the destination domain whose policy this is.
        prior: an RFC 8460 result type of the discovery (e.g. a failed policy fetch).
        sni: the name to send in the TLS SNI extension when it is not the MX host name:
            DANE's TLSA base domain, the CNAME-expanded MX host name when the TLSA RRset
            was found there (RFC 7672 §8.1, §2.2.2); None = the MX host name.
    """

    label: str
    required: bool = False
    check: Check | None = None
    enforce: bool = False
    refuse: TlsNote | None = None
    detail: str = ""
    policy_id: str | None = None
    policy_domain: str = ""
    prior: str | None = field(default=None)
    sni: str | None = None

    @property
    def session_policy(self) -> TlsPolicy:
        """The ``TlsPolicy`` the session runs under (also keys cached sessions)."""
        return TlsPolicy.REQUIRED if self.required else TlsPolicy.OPPORTUNISTIC

    def note(self, *, tls: bool, result: str, detail: str, mx: str | None) -> TlsNote:
        """The note of a session under this plan."""
        text = "; ".join(d for d in (self.detail, detail) if d)
        return TlsNote(
            policy=self.label, result=result, detail=text, tls=tls, mx=mx, policy_id=self.policy_id
        )


class PolicyEngine:
    """Decides the :class:`TlsPlan` of each MX of a destination (see the module docstring).

    Args:
        settings: the ``outbound_tls`` section.
        worker: the ``worker`` section (nameservers, manual ``tls_policies``, CA file).
        cache: the cluster-wide MTA-STS policy cache; a process-local one when None.
    """

    def __init__(
        self,
        settings: OutboundTlsSettings,
        worker: WorkerSettings,
        cache: PolicyCache | None = None,
    ) -> None:
        self.settings = settings
        self.worker = worker
        resolver = stub_resolver(worker)
        ca = settings.mta_sts_ca_file or worker.tls_ca_file
        self.sts = MtaSts(
            resolver,
            cache or MemoryPolicyCache(),
            port=settings.mta_sts_port,
            ca_file=str(ca) if ca else None,
            timeout_s=settings.mta_sts_timeout_s,
            max_age_s=settings.mta_sts_max_age_s,
            recheck_s=settings.mta_sts_recheck_s,
        )
        self.dnssec = DnssecResolver.from_settings(settings, worker)
        self._ca = ca
        self._roots: list[x509.Certificate] | None = None

    def _webpki(self, mx_host: str) -> Check:
        def check(chain: list[x509.Certificate]) -> Verdict:
            if self._roots is None:
                try:
                    self._roots = load_store(self._ca)
                except (OSError, ValueError) as e:
                    return Verdict("certificate-not-trusted", f"no trusted CAs: {e}")
            return webpki_verdict(chain, self._roots, mx_host)

        return check

    async def plans(self, domain: str, targets: Sequence[MxTarget]) -> dict[str, TlsPlan]:
        """A plan per MX host name of ``targets`` (see the module docstring). Never raises:
        DNS and HTTPS failures become plans (a bogus DANE answer refuses the MX, a failed
        MTA-STS fetch falls back to the cached policy or to opportunistic TLS). Not
        idempotent: it may fetch and cache an MTA-STS policy."""
        domain = domain.lower().rstrip(".")
        if not targets:
            return {}
        hosts = list(dict.fromkeys(t.host for t in targets))
        manual = self.worker.tls_policies
        if any(t.relay for t in targets) or domain in manual:
            policy = manual.get(hosts[0].lower() if targets[0].relay else domain, self.worker.tls)
            why = "smarthost" if targets and targets[0].relay else "worker.tls_policies"
            return {h: TlsPlan(MANUAL, detail=f"{policy.value} ({why})") for h in hosts}
        plans: dict[str, TlsPlan] = {}
        if self.settings.dane:
            plans.update(await self._dane(domain, targets))
        rest = [h for h in hosts if h not in plans]
        if rest and self.settings.mta_sts and not domain.startswith("["):
            found = await self.sts.lookup(domain)
            for h in rest:
                plans[h] = self._sts_plan(domain, h, found)
        for h in hosts:
            plans.setdefault(h, TlsPlan(OPPORTUNISTIC, policy_domain=domain))
        return plans

    def _sts_plan(self, domain: str, host: str, found: StsLookup) -> TlsPlan:
        policy = found.policy
        if policy is None:
            detail = f"no MTA-STS policy ({found.detail})" if found.failure else ""
            return TlsPlan(OPPORTUNISTIC, detail=detail, policy_domain=domain, prior=found.failure)
        enforce = policy.mode is StsMode.ENFORCE
        label = STS_ENFORCE if enforce else STS_TESTING
        why = f"MTA-STS policy {policy.id}" + ("" if enforce else " (testing)")
        if not policy.allows(host):
            why += f": {host} matches no mx pattern"
        plan = TlsPlan(
            label,
            check=self._webpki(host),
            detail=why,
            policy_id=policy.id,
            policy_domain=domain,
            prior=found.failure,
        )
        if not enforce:
            return plan
        if not policy.allows(host):
            note = TlsNote(
                policy=label, result="validation-failure", detail=why, mx=host, policy_id=policy.id
            )
            return replace(plan, check=None, refuse=note)
        return replace(plan, required=True, enforce=True)

    async def _dane(self, domain: str, targets: Sequence[MxTarget]) -> dict[str, TlsPlan]:
        """DANE plans for the hosts it applies to (RFC 7672 §2.2.1: only when the MX RRset
        is secure; §2.2.2: and the host's address RRset, whose CNAME-expanded name is asked
        for TLSA first; §2.1.1: bogus defers)."""
        implicit = all(t.preference is None for t in targets)
        rrset = "A" if implicit else "MX"
        mx_state = await self.dnssec.state(domain, rrset)
        if mx_state is DnssecState.BOGUS:
            why = f"{domain} {rrset}: DNSSEC validation failed or no validating resolver answered"
            log.warning("DANE %s; deferred", why)
            return {t.host: _bogus(domain, t.host, why) for t in targets}
        if mx_state is not DnssecState.SECURE:
            return {}
        plans: dict[str, TlsPlan] = {}
        for target in targets:
            host = target.host
            if host in plans:
                continue
            rdtype = "AAAA" if ":" in target.address else "A"
            state, expanded = await self.dnssec.address_state(host, rdtype)
            if state is DnssecState.BOGUS:
                why = (
                    f"{host} {rdtype}: DNSSEC validation failed or no validating resolver answered"
                )
                plans[host] = _bogus(domain, host, why)
                continue
            if state is not DnssecState.SECURE:
                continue
            found, base = await self.dnssec.tlsa_of(host, expanded)
            if found.state is DnssecState.BOGUS:
                why = f"{found.detail}: DNSSEC validation failed"
                note = TlsNote(policy=DANE, result="dnssec-invalid", detail=why, mx=host)
                plans[host] = TlsPlan(DANE, refuse=note, detail=why, policy_domain=domain)
            elif found.state is DnssecState.SECURE and found.usable:
                records = list(found.usable)
                names = list(dict.fromkeys([host, expanded, domain]))
                check = partial(dane_verdict, records=records, names=names)
                plans[host] = TlsPlan(
                    DANE,
                    required=True,
                    check=check,
                    enforce=True,
                    detail=f"{len(records)} usable TLSA record(s) at _25._tcp.{base}",
                    policy_domain=domain,
                    sni=base if base != host else None,
                )
            elif found.state is DnssecState.SECURE and found.records:
                why = f"TLSA at _25._tcp.{base} all unusable: encryption without authentication"
                sni = base if base != host else None
                plans[host] = TlsPlan(
                    DANE, required=True, detail=why, policy_domain=domain, sni=sni
                )
        return plans


def _bogus(domain: str, host: str, why: str) -> TlsPlan:
    """The plan of an MX that must not be used: a DNS answer on its way was bogus or
    indeterminate (RFC 7672 §2.1.1: delay, never guess the DNSSEC state)."""
    note = TlsNote(policy=DANE, result="dnssec-invalid", detail=why, mx=host)
    return TlsPlan(DANE, refuse=note, detail=why, policy_domain=domain)
