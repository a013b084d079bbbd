"""jsqueue settings: environment (``JSQUEUE_…``, nested with ``__``) over a TOML file over
defaults. One entry point, :func:`load_settings`; secrets are ``SecretStr``.

Example: ``JSQUEUE_WORKER__MX_PORT=2526`` sets ``worker.mx_port``;
``JSQUEUE_NATS__URLS='["nats://a:4222","nats://b:4222"]'`` points at a cluster.
Durations are seconds (suffix ``_s``), sizes octets.
"""

from __future__ import annotations

import os
import tomllib
from enum import StrEnum
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from jsqueue.errors import ConfigError

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


class NatsSettings(BaseModel):
    """Where the queue lives."""

    urls: list[str] = Field(
        default_factory=list,
        description="NATS server URLs; empty = start the embedded nats-server",
    )
    store_dir: Path = Field(Path("data/nats"), description="embedded server's JetStream dir")
    config_file: Path | None = Field(None, description="embedded server config file")
    port: int = Field(4222, ge=0, le=65535, description="embedded server client port (0 = any)")
    prefix: str = Field("jsq", description="name prefix of every bucket, stream and subject")
    replicas: Literal[1, 3] = Field(1, description="replica count of buckets and streams")
    ack_wait_s: float = Field(60.0, gt=0, description="work item ack wait, seconds")
    max_ack_pending: int = Field(
        1_000_000, ge=1000, description="consumer limit; must exceed deferred backlog"
    )
    connect_timeout_s: float = Field(2.0, gt=0, description="NATS connect timeout, seconds")
    request_timeout_s: float = Field(5.0, gt=0, description="JetStream request timeout, seconds")
    user: str | None = None
    password: SecretStr | None = None
    creds_file: Path | None = None


def _loopback_networks() -> list[IPv4Network | IPv6Network]:
    return [IPv4Network("127.0.0.0/8"), IPv6Network("::1/128")]


class SmtpSettings(BaseModel):
    """The SMTP front end."""

    host: str = Field("127.0.0.1", description="listen address")
    port: int = Field(2525, ge=0, le=65535, description="listen port")
    hostname: str = Field("localhost", description="name in the greeting and Received:")
    max_message_size: int = Field(50_000_000, ge=1024, description="SIZE limit, octets")
    max_recipients: int = Field(1000, ge=1, description="RCPT limit per message")
    max_sessions: int = Field(200, ge=1, description="concurrent SMTP sessions")
    session_timeout_s: float = Field(300.0, gt=0, description="idle command timeout, seconds")
    relay_networks: list[IPv4Network | IPv6Network] = Field(
        default_factory=_loopback_networks,
        description="client networks allowed to relay without AUTH",
    )
    bare_line_endings: BareLinePolicy = Field(BareLinePolicy.REJECT)
    tls_cert: Path | None = Field(None, description="PEM certificate chain for STARTTLS")
    tls_key: Path | None = Field(None, description="PEM private key for STARTTLS")
    require_tls: bool = Field(False, description="refuse MAIL before STARTTLS")
    auth_file: Path | None = Field(None, description="user:hash lines; AUTH disabled when unset")
    dedupe_window_s: float = Field(120.0, ge=0, description="idempotent-ingest window, seconds")
    store_timeout_s: float = Field(30.0, gt=0, description="max time to store before 451")


class SmarthostSettings(BaseModel):
    """Send everything through one relay instead of MX lookup."""

    host: str
    port: int = Field(25, ge=1, le=65535)
    username: str | None = None
    password: SecretStr | None = None


class WorkerSettings(BaseModel):
    """Delivery workers."""

    concurrency: int = Field(20, ge=1, description="deliveries in flight per worker")
    batch: int = Field(20, ge=1, description="work items fetched per request")
    ehlo_name: str = Field("localhost", description="EHLO name of outbound sessions")
    mx_port: int = Field(25, ge=1, le=65535, description="TCP port of remote MXes")
    max_mx_addresses: int = Field(5, ge=1, description="MX addresses tried per attempt")
    nameservers: list[str] = Field(default_factory=list, description="resolver IPs; empty=system")
    nameserver_port: int = Field(53, ge=1, le=65535)
    dns_timeout_s: float = Field(5.0, gt=0, description="DNS lifetime per lookup, seconds")
    tls: TlsPolicy = TlsPolicy.OPPORTUNISTIC
    tls_policies: dict[str, TlsPolicy] = Field(
        default_factory=dict, description="per-destination-domain TLS policy overrides"
    )
    tls_ca_file: Path | None = Field(None, description="CA bundle for verified TLS")
    connect_timeout_s: float = Field(30.0, gt=0)
    # RFC 5321 §4.5.3.2 minimum timeouts
    greeting_timeout_s: float = Field(300.0, gt=0)
    mail_timeout_s: float = Field(300.0, gt=0)
    rcpt_timeout_s: float = Field(300.0, gt=0)
    data_init_timeout_s: float = Field(120.0, gt=0)
    data_block_timeout_s: float = Field(180.0, gt=0)
    data_final_timeout_s: float = Field(600.0, gt=0)
    lease_s: float = Field(600.0, gt=0, description="claim lease per delivery, seconds")
    drain_timeout_s: float = Field(20.0, gt=0, description="SIGTERM drain bound, seconds")
    body_cache_bytes: int = Field(256 * 1024 * 1024, ge=0, description="local body cache size")
    body_cache_dir: Path | None = Field(None, description="cache dir; a temp dir when unset")
    smarthost: SmarthostSettings | None = None


class RetrySettings(BaseModel):
    """Retry schedule (DESIGN.md §5; RFC 5321 §4.5.4.1)."""

    base_s: float = Field(300.0, gt=0, description="first retry delay, seconds")
    factor: float = Field(2.0, ge=1.0)
    max_delay_s: float = Field(4 * 3600.0, gt=0)
    max_age_s: float = Field(5 * 86400.0, gt=0, description="queue lifetime, seconds")
    bounce_max_age_s: float = Field(86400.0, gt=0, description="lifetime of DSNs, seconds")
    max_attempts: int | None = Field(None, ge=1)
    jitter: float = Field(0.1, ge=0.0, le=0.5, description="± fraction of each delay")


class DsnSettings(BaseModel):
    """Delivery status notifications (RFC 3464)."""

    reporting_mta: str = Field("localhost", description="Reporting-MTA name")
    postmaster: str | None = Field(None, description="copy of double bounces goes here")
    max_returned_size: int = Field(1_000_000, ge=0, description="RET=FULL limit, octets")
    delay_warning_after_s: float | None = Field(None, gt=0, description="off when unset")
    delay_warning_interval_s: float = Field(86400.0, gt=0)


class HttpSettings(BaseModel):
    """Metrics and health endpoints."""

    host: str = "127.0.0.1"
    port: int = Field(9125, ge=0, le=65535)
    enabled: bool = True


class LogSettings(BaseModel):
    """Logging."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    json_format: bool = False


class Settings(BaseSettings):
    """Every jsqueue setting. Load with :func:`load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix="JSQUEUE_", env_nested_delimiter="__", extra="forbid"
    )

    nats: NatsSettings = Field(default_factory=NatsSettings)
    smtp: SmtpSettings = Field(default_factory=SmtpSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    retry: RetrySettings = Field(default_factory=RetrySettings)
    dsn: DsnSettings = Field(default_factory=DsnSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    log: LogSettings = Field(default_factory=LogSettings)

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.smtp.tls_cert is None) != (self.smtp.tls_key is None):
            raise ValueError("smtp.tls_cert and smtp.tls_key must be set together")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_path = os.environ.get(CONFIG_ENV)
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_path:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Load settings from the environment, a TOML file and defaults.

    Args:
        config_file: TOML file; else ``$JSQUEUE_CONFIG`` when set.
        overrides: top-level sections given directly (tests), e.g. ``worker={...}``.

    Returns:
        the validated settings.

    Raises:
        ConfigError: one line naming the first invalid setting and why, e.g.
            ``worker.mx_port: Input should be less than or equal to 65535``.
    """
    if config_file is not None:
        if not config_file.is_file():
            raise ConfigError(f"config file {config_file}: not found")
        os.environ[CONFIG_ENV] = str(config_file)
    try:
        return Settings(**overrides)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "settings"
        raise ConfigError(f"{where}: {err['msg']}") from None
    except (tomllib.TOMLDecodeError, OSError) as e:
        raise ConfigError(f"config file {os.environ.get(CONFIG_ENV)}: {e}") from None
