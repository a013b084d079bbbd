"""The settings sections (one pydantic model per TOML table), their enums and validators."""

from __future__ import annotations

import re
from enum import StrEnum
from ipaddress import IPv4Network, IPv6Address, IPv6Network, ip_address
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    BeforeValidator,
    Field,
    SecretStr,
    field_validator,
)

from jsqueue.config.base import _Section
from jsqueue.config.dkim import DkimSettings

CONFIG_ENV = "JSQUEUE_CONFIG"


class TlsPolicy(StrEnum):
    """Outbound STARTTLS policy (RFC 3207; RFC 7435 opportunistic security)."""

    NEVER = "never"
    OPPORTUNISTIC = "opportunistic"
    REQUIRED = "required"
    VERIFY = "required-with-verification"


class BareLinePolicy(StrEnum):
    """What the front end does with a bare CR or bare LF in DATA (RFC 5321 §2.3.8)."""

    REJECT = "reject"
    ACCEPT = "accept"


def _int_text(value: object) -> object:
    """Environment values arrive as text, and ``"3"`` is not ``Literal[1, 3]``."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


Replicas = Annotated[Literal[1, 3], BeforeValidator(_int_text)]

#: A host name label: letters, digits, hyphens (RFC 1123 §2.1), and the underscore some
#: private name services use (e.g. container names).
_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def _host(value: object) -> object:
    """A host name (RFC 1123 §2.1: LDH labels, not dotted-decimal) or an IP address without
    brackets; anything else (empty, ``host:port``, ``[addr]``, a URL) is refused here
    rather than found at the first connection or bind.

    Raises:
        ValueError: not a host name or IP address (empty, longer than 253 characters, all
            labels numeric, a label outside LDH, ``host:port``, ``[addr]`` or a URL).
    """
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        ip_address(text)
    except ValueError:
        pass
    else:
        return text
    labels = text.rstrip(".").split(".")
    numeric = all(label.isdigit() for label in labels)
    if not text or len(text) > 253 or numeric or not all(map(_LABEL.fullmatch, labels)):
        if "://" in text:
            hint = "; a host, not a URL"
        elif text.startswith("["):
            hint = "; an address without brackets" + (
                "; the port is a setting of its own" if "]:" in text else ""
            )
        elif ":" in text:
            hint = "; the port is a setting of its own"
        else:
            hint = "" if text else " (empty)"
        raise ValueError(f"not a host name or IP address: {value!r}{hint}")
    return text


Host = Annotated[str, BeforeValidator(_host)]

#: An RFC 5321 §4.1.2 sub-domain: Let-dig [Ldh-str], letters, digits and hyphens, neither
#: end a hyphen, at most 63 octets (RFC 1035 §2.3.4).
_SUB_DOMAIN = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _domain_problem(text: str) -> str | None:
    """Why ``text`` is not an RFC 5321 §4.1.2 ``Domain`` (dot-separated sub-domains, at most
    253 octets, not all numeric: RFC 1123 §2.1), or None when it is one."""
    if not text:
        return "empty"
    labels = text.split(".")
    if len(text) > 253 or not all(_SUB_DOMAIN.fullmatch(label) for label in labels):
        return (
            "dot-separated labels of letters, digits and hyphens "
            "(RFC 5321 §4.1.2; a U-label as its xn-- A-label)"
        )
    if all(label.isdigit() for label in labels):
        return "all numeric (RFC 1123 §2.1); an address is written as a literal, [192.0.2.1]"
    return None


def _smtp_domain(value: object) -> object:
    """A domain name as SMTP sends it (RFC 5321 §4.1.2 ``Domain``): the front end's name
    in its greeting, EHLO reply and Received: fields, where a CR LF or a space would start
    a line of its own.

    Raises:
        ValueError: not an RFC 5321 Domain (see :func:`_domain_problem`).
    """
    if not isinstance(value, str):
        return value
    problem = _domain_problem(value)
    if problem is not None:
        raise ValueError(f"not a domain name: {value!r}; {problem}")
    return value


def _address_literal_problem(text: str) -> str | None:
    """Why ``[...]`` text is not an RFC 5321 §4.1.3 address literal (``[192.0.2.1]`` or
    ``[IPv6:2001:db8::1]``), or None when it is one."""
    inner = text[1:-1] if text.startswith("[") and text.endswith("]") else None
    if inner is None:
        return "an address literal is [192.0.2.1] or [IPv6:2001:db8::1]"
    v6 = inner[:5].casefold() == "ipv6:"
    try:
        addr = ip_address(inner[5:] if v6 else inner)
    except ValueError:
        addr = None
    if addr is None or (addr.version == 6) != v6 or "%" in inner:
        return "an address literal is [192.0.2.1] or [IPv6:2001:db8::1] (RFC 5321 §4.1.3)"
    return None


def _ehlo_domain(value: object) -> object:
    """The argument of our EHLO (RFC 5321 §4.1.1.1): a ``Domain`` (§4.1.2) or an address
    literal (§4.1.3), nothing that could end the command line early.

    Raises:
        ValueError: neither a Domain nor an address literal.
    """
    if not isinstance(value, str):
        return value
    problem = _address_literal_problem(value) if value.startswith("[") else _domain_problem(value)
    if problem is not None:
        raise ValueError(f"not a domain name or address literal: {value!r}; {problem}")
    return value


#: The front end's name (``smtp.hostname``): an RFC 5321 Domain.
SmtpDomain = Annotated[str, BeforeValidator(_smtp_domain)]


def _mailbox(value: object) -> object:
    """An address of this system's own (``smtp.postmaster``): ``local@domain``, the domain
    an RFC 5321 §4.1.2 Domain; empty for the default. The local part's own syntax is the
    front end's to check.

    Raises:
        ValueError: no ``@``, an empty or spaced local part, or a bad domain.
    """
    if not isinstance(value, str) or value == "":
        return value
    local, at, domain = value.rpartition("@")
    problem = _domain_problem(domain) if at and local else "local@domain"
    if problem is None and any(c <= " " or c == "\x7f" for c in local):
        problem = "no spaces or control characters in the local part"
    if problem is not None:
        raise ValueError(f"not an address: {value!r}; {problem}")
    return value


Mailbox = Annotated[str, BeforeValidator(_mailbox)]
#: The worker's EHLO name (``worker.ehlo_name``): a Domain or an address literal.
EhloDomain = Annotated[str, BeforeValidator(_ehlo_domain)]

#: What :class:`jsqueue.names.Names` takes as a prefix (checked there again): it starts
#: every bucket, stream and subject name.
_PREFIX = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def _prefix(value: object) -> object:
    """A name prefix: 1-32 of ``[a-z0-9_-]``, starting with a letter (a dot would split a
    subject token, ``*``/``>`` are wildcards, a space ends a subject).

    Raises:
        ValueError: not such a prefix.
    """
    if isinstance(value, str) and not _PREFIX.fullmatch(value):
        raise ValueError(
            f"not a name prefix: {value!r}; 1-32 lower-case letters, digits, '_' or '-', "
            "starting with a letter"
        )
    return value


def _ip(value: object) -> object:
    """An IP address (a resolver to ask: dnspython takes no host names), stripped.

    Raises:
        ValueError: not an IP address (e.g. a host name, or ``addr:port``).
    """
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        ip_address(text)
    except ValueError:
        hint = "; the port is a setting of its own" if text.count(":") == 1 else ""
        raise ValueError(f"not an IP address: {value!r}{hint}") from None
    return text


def _nats_url(url: str) -> str:
    """``url`` when it is a NATS server URL as the client reads it (``nats://``,
    ``tls://``, ``ws://``, ``wss://``, or ``host[:port]`` for ``nats://``), with a host and
    a port from 1 to 65535 when one is given.

    Raises:
        ValueError: it is not, naming it and what is wrong.
    """
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    if parts.scheme not in ("nats", "tls", "ws", "wss"):
        raise ValueError(f"{url!r}: the scheme must be nats, tls, ws or wss")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0 or parts.netloc.endswith(":"):
        raise ValueError(f"{url!r}: the port must be a number from 1 to 65535")
    if not parts.hostname:
        raise ValueError(f"{url!r}: no host")
    return url


class NatsSettings(_Section):
    """Where the queue lives."""

    urls: list[str] = Field(
        default_factory=list,
        description="NATS server URLs; empty = start the embedded nats-server",
    )
    store_dir: Path = Field(Path("data/nats"), description="embedded server's JetStream dir")
    config_file: Path | None = Field(None, description="embedded server config file")
    port: int = Field(4222, ge=0, le=65535, description="embedded server client port (0 = any)")
    prefix: Annotated[str, BeforeValidator(_prefix)] = Field(
        "jsq", description="name prefix of every bucket, stream and subject"
    )
    replicas: Replicas = Field(1, description="replica count of buckets and streams")
    ack_wait_s: float = Field(
        10.0,
        gt=0,
        description="work item ack wait, seconds: a crashed worker's items come back after "
        "it (a worker acknowledges progress every third of it while it holds an item)",
    )
    max_ack_pending: int = Field(
        1_000_000, ge=1000, description="consumer limit; must exceed deferred backlog"
    )
    events_max_bytes: int = Field(
        1 << 30, ge=1 << 20, description="events stream size bound, octets (oldest dropped first)"
    )
    events_fsync: bool = Field(
        False,
        description="sync every event to disk like queue state (one replica; slower)",
    )
    work_fsync: bool = Field(
        False,
        description="sync every work item and ack to disk (one replica; slower); off, a "
        "trigger lost in a crash is put back by the reconciler's recovery pass",
    )
    connect_timeout_s: float = Field(2.0, gt=0, description="NATS connect timeout, seconds")
    request_timeout_s: float = Field(5.0, gt=0, description="JetStream request timeout, seconds")
    ping_interval_s: float = Field(
        1.0,
        gt=0,
        description="a PING to the connected NATS server this often, seconds; with "
        "max_outstanding_pings unanswered the server counts as silent (alive but paused, "
        "or cut off) and the client reconnects to another node of the cluster: noticed "
        "within ping_interval_s × (max_outstanding_pings + 1)",
    )
    max_outstanding_pings: int = Field(
        2, ge=1, description="PINGs left unanswered before the connection counts as stale"
    )
    user: str | None = Field(None, description="NATS user name (with nats.password)")
    password: SecretStr | None = Field(None, description="NATS password (secret)")
    creds_file: Path | None = Field(None, description="NATS credentials file (JWT and NKey)")

    @field_validator("urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        """Each a NATS URL (:func:`_nats_url`); websocket URLs only, or none (the client
        mixes no transports).

        Raises:
            ValueError: one is no NATS URL, or both kinds are given.
        """
        for url in urls:
            _nats_url(url)
        ws = {url.partition("://")[0] in ("ws", "wss") for url in urls}
        if len(ws) > 1:
            raise ValueError("websocket (ws://, wss://) and other URLs cannot be mixed")
        return urls


def _loopback_networks() -> list[IPv4Network | IPv6Network]:
    return [IPv4Network("127.0.0.0/8"), IPv6Network("::1/128")]


#: The longest ``smtp.dedupe_window_s``, seconds: a resend of a message delivered meanwhile
#: is known as a copy by its entry's delete marker, which lives this long (the entry store's
#: ``DELETE_MARKER_TTL_S``; a test holds the two equal).
DEDUPE_WINDOW_MAX_S = 900.0


class SmtpSettings(_Section):
    """The SMTP front end."""

    host: Host = Field("127.0.0.1", description="listen address")
    port: int = Field(2525, ge=0, le=65535, description="listen port")
    hostname: SmtpDomain = Field(
        "localhost",
        description="domain name in the greeting, EHLO reply and Received: (RFC 5321 §4.1.2)",
    )
    max_message_size: int = Field(50_000_000, ge=1024, description="SIZE limit, octets")
    max_recipients: int = Field(1000, ge=1, description="RCPT limit per message")
    postmaster: Mailbox = Field(
        "",
        description="the address RCPT TO:<Postmaster> (no domain) and "
        "postmaster@<smtp.hostname> are queued for, RFC 5321 §4.5.1; empty: dsn.postmaster; "
        "with neither, they are refused (this queue has no mailbox of its own)",
    )
    max_received: int = Field(
        100,
        ge=10,
        description="Received: header fields a message may arrive with; more is a mail loop, "
        "refused with 554 5.4.6 (RFC 5321 §6.3 recommends allowing at least 100)",
    )
    max_sessions: int = Field(200, ge=1, description="concurrent SMTP sessions")
    max_sessions_per_client: int = Field(
        50,
        ge=0,
        description="concurrent SMTP sessions of one client address outside relay_networks "
        "(more get 421 4.7.0 at the greeting, as Postfix's "
        "smtpd_client_connection_count_limit); 0: no limit",
    )
    max_junk_commands: int = Field(
        100,
        ge=0,
        description="commands that move no mail (NOOP, RSET, VRFY, EXPN, HELP, EHLO, HELO) a "
        "session may send between two messages; the next ends it with 421 4.7.0; 0: no limit",
    )
    soft_error_limit: int = Field(
        10,
        ge=0,
        description="errors (4xx/5xx replies) a session may make before each further error "
        "reply waits error_delay_s (counted from its last accepted message); 0: never waits",
    )
    hard_error_limit: int = Field(
        20,
        ge=0,
        description="errors a session may make; then it is ended with 421 4.7.0 (AUTH "
        "guessing, address harvesting); 0: no limit",
    )
    error_delay_s: float = Field(
        1.0, ge=0, description="wait before each error reply past soft_error_limit, seconds"
    )
    session_timeout_s: float = Field(300.0, gt=0, description="idle command timeout, seconds")
    relay_networks: list[IPv4Network | IPv6Network] = Field(
        default_factory=_loopback_networks,
        description="client networks allowed to relay without AUTH",
    )
    bare_line_endings: BareLinePolicy = Field(
        BareLinePolicy.REJECT, description="bare CR or LF in DATA: reject with 550 or accept"
    )
    tls_cert: Path | None = Field(None, description="PEM certificate chain for STARTTLS")
    tls_key: Path | None = Field(None, description="PEM private key for STARTTLS")
    require_tls: bool = Field(False, description="refuse MAIL before STARTTLS")
    auth_file: Path | None = Field(None, description="user:hash lines; AUTH disabled when unset")
    dedupe_window_s: float = Field(
        120.0,
        ge=0,
        le=DEDUPE_WINDOW_MAX_S,
        description="idempotent-ingest window, seconds; at most 900, the life of the delete "
        "marker that shows a resent message was stored and delivered",
    )
    store_timeout_s: float = Field(30.0, gt=0, description="max time to store before 451")
    inline_body_max: int = Field(
        0,
        ge=0,
        le=256 * 1024,
        description="messages up to this size, octets, are kept in their KV entry instead "
        "of the object store (0: never)",
    )


class SmarthostSettings(_Section):
    """Send everything through one relay instead of MX lookup."""

    host: Host = Field(description="relay host name or address (required)")
    port: int = Field(25, ge=1, le=65535, description="relay TCP port")
    username: str | None = Field(None, description="AUTH user name; no AUTH when unset")
    password: SecretStr | None = Field(None, description="AUTH password (secret)")


class WorkerSettings(_Section):
    """Delivery workers."""

    concurrency: int = Field(
        32,
        ge=1,
        description="deliveries in flight per worker; one site gets three quarters at most, "
        "the rest stays for other sites (keep it above the largest site's sessions)",
    )
    batch: int = Field(20, ge=1, description="work items fetched per request")
    ehlo_name: EhloDomain = Field(
        "localhost",
        description="EHLO name of outbound sessions: a domain name, or an address literal "
        "such as [192.0.2.1] (RFC 5321 §4.1.3)",
    )
    own_names: list[str] = Field(
        default_factory=list,
        description="more names this queue's SMTP services answer EHLO with (smtp.hostname "
        "is added): a next hop answering EHLO with one of them, or with ehlo_name, is this "
        "queue, and the mail loops back (554 5.4.6, RFC 5321 §5.1); names without a dot "
        "and localhost are never taken for ours",
    )
    own_addresses: list[str] = Field(
        default_factory=list,
        description="IP addresses at which this queue's SMTP front ends receive mail (public "
        "addresses, a load balancer's): an MX at one of them is this queue, and it and every "
        "MX of the same or a lower preference are dropped (RFC 5321 §5.1; 554 5.4.6 when it "
        "is the best MX); the smarthost is never matched",
    )
    mx_address_targets: bool = Field(
        False,
        description="use an MX record whose exchange is an IP address (MX 10 192.0.2.1.) as "
        "that address; off: such a record is unusable (RFC 1035 §3.3.9 and RFC 5321 §5.1 "
        "make it a host name; Postfix refuses it), the next MX is tried, and with none left "
        "the recipients bounce with 5.4.4 naming it",
    )
    mx_port: int = Field(25, ge=1, le=65535, description="TCP port of remote MXes")
    max_mx_addresses: int = Field(5, ge=1, description="MX addresses tried per attempt")
    nameservers: list[str] = Field(default_factory=list, description="resolver IPs; empty=system")
    nameserver_port: int = Field(53, ge=1, le=65535, description="resolver port")
    dns_timeout_s: float = Field(5.0, gt=0, description="DNS lifetime per lookup, seconds")
    dns_cache_size: int = Field(
        10_000,
        ge=0,
        description="DNS answers a worker process keeps, each for its TTL (negative answers: "
        "the SOA's, RFC 2308 §5; failures never); 0 = ask on every delivery",
    )
    dns_cache_max_ttl_s: float = Field(
        300.0,
        gt=0,
        le=86400,
        description="longest a worker keeps a DNS answer whatever its TTL, seconds: a record "
        "changed or flushed at the resolver is seen within it",
    )
    tls: TlsPolicy = Field(TlsPolicy.OPPORTUNISTIC, description="outbound STARTTLS policy")
    tls_policies: dict[str, TlsPolicy] = Field(
        default_factory=dict, description="per-destination-domain TLS policy overrides"
    )
    tls_ca_file: Path | None = Field(None, description="CA bundle for verified TLS")
    connect_timeout_s: float = Field(30.0, gt=0, description="TCP connect per MX, seconds")
    # RFC 5321 §4.5.3.2 minimum timeouts
    greeting_timeout_s: float = Field(300.0, gt=0, description="220 greeting, seconds")
    mail_timeout_s: float = Field(300.0, gt=0, description="MAIL reply, seconds")
    rcpt_timeout_s: float = Field(300.0, gt=0, description="RCPT reply, seconds")
    data_init_timeout_s: float = Field(120.0, gt=0, description="DATA 354 reply, seconds")
    data_block_timeout_s: float = Field(180.0, gt=0, description="each data block, seconds")
    data_final_timeout_s: float = Field(600.0, gt=0, description="reply to the dot, seconds")
    lease_s: float = Field(600.0, gt=0, description="claim lease per delivery, seconds")
    lease_owner: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="stable lease owner name (a restarted worker takes its leases back); "
        "the host name (the pod name in Kubernetes) when unset",
    )
    presence_grace_s: float = Field(
        15.0,
        ge=1,
        le=3600,
        description="a worker without a heartbeat for this long is dead and its leases are "
        "taken over, seconds (heartbeat every grace/3)",
    )
    drain_timeout_s: float = Field(20.0, gt=0, description="SIGTERM drain bound, seconds")
    connection_cache_s: float = Field(
        2.0, ge=0, description="idle outbound session kept for reuse, seconds; 0 = QUIT each"
    )
    connection_reuse_s: float = Field(
        300.0, gt=0, description="no reuse of an outbound session older than this, seconds"
    )
    pipelining: bool = Field(
        True,
        description="MAIL, every RCPT and DATA in one write when the server offers "
        "PIPELINING (RFC 2920); false = one command at a time",
    )
    body_cache_bytes: int = Field(256 * 1024 * 1024, ge=0, description="local body cache size")
    body_cache_dir: Path | None = Field(None, description="cache dir; a temp dir when unset")
    smarthost: SmarthostSettings | None = Field(
        None, description="relay everything through this host instead of MX lookup"
    )
    dkim: DkimSettings = Field(default_factory=DkimSettings, description="DKIM signing")

    @field_validator("own_names")
    @classmethod
    def _own_names(cls, names: list[str]) -> list[str]:
        for name in names:  # a name in an EHLO reply: a domain or an address literal
            _ehlo_domain(name.removesuffix("."))  # (matched with a final dot or without)
        return names

    @field_validator("own_addresses")
    @classmethod
    def _own_addresses(cls, value: list[str]) -> list[str]:
        """Each an IP address, in its normal form (``::ffff:192.0.2.1`` as ``192.0.2.1``).

        Raises:
            ValueError: one is not an IP address.
        """
        out = []
        for v in value:
            ip = ip_address(str(_ip(v)))
            mapped = ip.ipv4_mapped if isinstance(ip, IPv6Address) else None
            out.append(str(mapped or ip))
        return out

    @field_validator("nameservers")
    @classmethod
    def _nameservers(cls, value: list[str]) -> list[str]:
        """Each an IP address (the resolver takes no host names), stripped.

        Raises:
            ValueError: one is not an IP address.
        """
        return [str(_ip(v)) for v in value]


class RetrySettings(_Section):
    """Retry schedule (DESIGN.md §5; RFC 5321 §4.5.4.1)."""

    base_s: float = Field(300.0, gt=0, description="first retry delay, seconds")
    factor: float = Field(2.0, ge=1.0, description="delay multiplier per attempt")
    max_delay_s: float = Field(4 * 3600.0, gt=0, description="longest retry delay, seconds")
    max_age_s: float = Field(5 * 86400.0, gt=0, description="queue lifetime, seconds")
    bounce_max_age_s: float = Field(86400.0, gt=0, description="lifetime of DSNs, seconds")
    max_attempts: int | None = Field(None, ge=1, description="attempts before expiry; unlimited")
    jitter: float = Field(0.1, ge=0.0, le=0.5, description="± fraction of each delay")


class DsnSettings(_Section):
    """Delivery status notifications (RFC 3464)."""

    reporting_mta: str = Field("localhost", description="Reporting-MTA name")
    postmaster: str | None = Field(None, description="copy of double bounces goes here")
    max_returned_size: int = Field(1_000_000, ge=0, description="RET=FULL limit, octets")
    delay_warning_after_s: float | None = Field(None, gt=0, description="off when unset")
    delay_warning_interval_s: float = Field(
        86400.0, gt=0, description="between repeated delay warnings, seconds"
    )


class ReconcilerSettings(_Section):
    """The periodic consistency sweep (:mod:`jsqueue.reconciler`); one runs at a time."""

    enabled: bool = Field(True, description="run the reconciler in `up` and `worker`")
    interval_s: float = Field(
        60.0,
        gt=0,
        description="pause between passes, seconds (longer after a pass that worked more "
        "than a tenth of the time: passes rest as they read)",
    )
    lost_trigger_after_s: float = Field(
        300.0, gt=0, description="an open recipient this overdue without a work item is re-queued"
    )
    recovery_margin_s: float = Field(
        5.0,
        gt=0,
        description="in the recovery pass (at start and after every NATS reconnect) an open "
        "recipient this overdue without a work item is re-queued, seconds",
    )
    orphan_after_s: float = Field(
        3600.0, gt=0, description="a body (or entry) without its other half is removed after"
    )
    dsn_retention_s: float = Field(
        3 * 86400.0, gt=0, description="final DSN entries are kept this long, seconds"
    )
    full_scan_every: int = Field(
        10, ge=1, description="every n-th pass reads every entry, not only trigger-less ones"
    )
    lock_ttl_s: float = Field(
        120.0, ge=3, description="the reconciler lock expires this long after its last renewal"
    )
    failed_pass_pause_s: float = Field(
        1.0,
        gt=0,
        description="pause after a pass that failed (NATS unavailable: a leader election, "
        "a lost quorum), seconds; doubled after each further failure in a row, with jitter "
        "(the pause is between half and all of it), up to failed_pass_pause_max_s",
    )
    failed_pass_pause_max_s: float = Field(
        30.0, gt=0, description="longest pause after failed passes in a row, seconds"
    )


class HttpSettings(_Section):
    """Metrics and health endpoints."""

    host: Host = Field("127.0.0.1", description="listen address of /metrics, /healthz, /readyz")
    port: int = Field(9125, ge=0, le=65535, description="listen port (0 = any)")
    enabled: bool = Field(True, description="serve the HTTP endpoint")
    probe_interval_s: float = Field(
        5.0, gt=0, description="NATS probe (readiness, backlog gauge) interval, seconds"
    )
    queue_depth_interval_s: float = Field(
        300.0,
        ge=0,
        description="longest time between queue depth scans (they read every entry, resting "
        "as they read so as to work at most a tenth of the time; the exporter of the "
        "queue-wide gauges scans again after 10 times a scan's work, at least "
        "probe_interval_s, later than this when the scan worked more than a tenth of it), "
        "seconds; 0 = off",
    )


class LogSettings(_Section):
    """Logging."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    json_format: bool = Field(False, description="one JSON object per line instead of text")
