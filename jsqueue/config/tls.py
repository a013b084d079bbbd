"""The ``[outbound_tls]`` section: which published TLS policies outbound delivery honours
(MTA-STS, RFC 8461; DANE for SMTP, RFC 7672) and TLS reporting (RFC 8460)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from jsqueue.config.base import _Section
from jsqueue.config.sections import _ip


class TlsReportSettings(_Section):
    """Daily aggregate TLS reports (RFC 8460) to the ``rua`` of ``_smtp._tls.<domain>``."""

    enabled: bool = Field(False, description="build and send TLS reports (off by default)")
    organization: str = Field(
        "jsqueue", min_length=1, description="organization-name of the reports (RFC 8460 §4.4)"
    )
    contact: str = Field(
        "postmaster@localhost",
        min_length=3,
        description="contact-info of the reports and reverse-path of mailto: reports",
    )
    https_ca_file: Path | None = Field(
        None, description="CA bundle for https: report receivers; the system's when unset"
    )
    https_port: int | None = Field(
        None, ge=1, le=65535, description="port of https: receivers instead of the URI's (tests)"
    )
    interval_s: float = Field(
        3600.0, gt=0, description="how often the worker looks for a finished day to report"
    )


class OutboundTlsSettings(_Section):
    """Published TLS policies of destination domains (RFC 8461, RFC 7672, RFC 8460).

    DANE takes precedence over MTA-STS (RFC 8461 §2); a domain in ``worker.tls_policies``
    is ``manual`` and neither is looked up for it.
    """

    mta_sts: bool = Field(True, description="honour MTA-STS policies (RFC 8461)")
    mta_sts_port: int = Field(
        443, ge=1, le=65535, description="HTTPS port of mta-sts.<domain> (tests only change it)"
    )
    mta_sts_ca_file: Path | None = Field(
        None, description="CA bundle for policy hosts and MX certificates; the system's if unset"
    )
    mta_sts_timeout_s: float = Field(
        10.0, gt=0, description="policy fetch: connect and read, seconds (RFC 8461 §3.3)"
    )
    mta_sts_recheck_s: float = Field(
        60.0,
        ge=0,
        description="a worker reuses its last MTA-STS lookup of a domain this long before it "
        "asks for the TXT record again, seconds (0: every delivery)",
    )
    mta_sts_max_age_s: int = Field(
        31_557_600, ge=1, description="longest policy lifetime honoured, seconds (RFC 8461 §3.2)"
    )
    dane: bool = Field(
        False,
        description="honour DANE TLSA records (RFC 7672); needs a validating resolver",
    )
    dnssec_nameservers: list[str] = Field(
        default_factory=list,
        description="validating resolvers whose AD bit is trusted for DANE; "
        "empty = worker.nameservers",
    )
    dnssec_nameserver_port: int | None = Field(
        None, ge=1, le=65535, description="their port; worker.nameserver_port when unset"
    )
    report: TlsReportSettings = Field(default_factory=TlsReportSettings)

    @field_validator("dnssec_nameservers")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        """Each an IP address; the order kept, repeats dropped (each is asked in turn).

        Raises:
            ValueError: one is not an IP address (the resolver takes no host names).
        """
        return list(dict.fromkeys(str(_ip(v)) for v in value))
