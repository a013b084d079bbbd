"""jsqueue settings: environment (``JSQUEUE_…``, nested with ``__``) over a TOML file over
defaults. One entry point, :func:`load_settings`; secrets are ``SecretStr``.

Example: ``JSQUEUE_WORKER__MX_PORT=2526`` sets ``worker.mx_port``;
``JSQUEUE_NATS__URLS='["nats://a:4222","nats://b:4222"]'`` points at a cluster.
Durations are seconds (suffix ``_s``), sizes octets. A list setting also takes a bare,
comma-separated value (``JSQUEUE_SMTP__RELAY_NETWORKS=10.0.0.0/8,192.0.2.0/24``). A
``JSQUEUE_…`` variable that names no setting stops the start, as an unknown name in the
TOML file does: a misspelt variable is never silently ignored.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Mapping
from enum import StrEnum
from ipaddress import IPv4Network, IPv6Network, ip_address
from pathlib import Path
from typing import Annotated, Any, Literal

import tomli_w
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
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


class _Section(BaseModel):
    """A settings section: unknown keys are errors (a typo in a TOML file or a
    ``JSQUEUE_<SECTION>__<NAME>`` variable must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: object, info: ValidationInfo) -> object:
        """``true``/``false`` (TOML, JSON) is not a number; pydantic would read it as 1/0.

        Raises:
            ValueError: a boolean given for an int or float setting.
        """
        numeric = info.field_name is not None and cls.model_fields[info.field_name].annotation in (
            int,
            float,
        )
        if isinstance(value, bool) and numeric:
            raise ValueError("expected a number, not true/false")
        return value


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


class NatsSettings(_Section):
    """Where the queue lives."""

    urls: list[str] = Field(
        default_factory=list,
        description="NATS server URLs; empty = start the embedded nats-server",
    )
    store_dir: Path = Field(Path("data/nats"), description="embedded server's JetStream dir")
    config_file: Path | None = Field(None, description="embedded server config file")
    port: int = Field(4222, ge=0, le=65535, description="embedded server client port (0 = any)")
    prefix: str = Field("jsq", description="name prefix of every bucket, stream and subject")
    replicas: Replicas = Field(1, description="replica count of buckets and streams")
    ack_wait_s: float = Field(60.0, gt=0, description="work item ack wait, seconds")
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
    connect_timeout_s: float = Field(2.0, gt=0, description="NATS connect timeout, seconds")
    request_timeout_s: float = Field(5.0, gt=0, description="JetStream request timeout, seconds")
    user: str | None = Field(None, description="NATS user name (with nats.password)")
    password: SecretStr | None = Field(None, description="NATS password (secret)")
    creds_file: Path | None = Field(None, description="NATS credentials file (JWT and NKey)")


def _loopback_networks() -> list[IPv4Network | IPv6Network]:
    return [IPv4Network("127.0.0.0/8"), IPv6Network("::1/128")]


class SmtpSettings(_Section):
    """The SMTP front end."""

    host: Host = Field("127.0.0.1", description="listen address")
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
    bare_line_endings: BareLinePolicy = Field(
        BareLinePolicy.REJECT, description="bare CR or LF in DATA: reject with 550 or accept"
    )
    tls_cert: Path | None = Field(None, description="PEM certificate chain for STARTTLS")
    tls_key: Path | None = Field(None, description="PEM private key for STARTTLS")
    require_tls: bool = Field(False, description="refuse MAIL before STARTTLS")
    auth_file: Path | None = Field(None, description="user:hash lines; AUTH disabled when unset")
    dedupe_window_s: float = Field(120.0, ge=0, description="idempotent-ingest window, seconds")
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

    concurrency: int = Field(20, ge=1, description="deliveries in flight per worker")
    batch: int = Field(20, ge=1, description="work items fetched per request")
    ehlo_name: str = Field("localhost", description="EHLO name of outbound sessions")
    mx_port: int = Field(25, ge=1, le=65535, description="TCP port of remote MXes")
    max_mx_addresses: int = Field(5, ge=1, description="MX addresses tried per attempt")
    nameservers: list[str] = Field(default_factory=list, description="resolver IPs; empty=system")
    nameserver_port: int = Field(53, ge=1, le=65535, description="resolver port")
    dns_timeout_s: float = Field(5.0, gt=0, description="DNS lifetime per lookup, seconds")
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
        30.0,
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
    body_cache_bytes: int = Field(256 * 1024 * 1024, ge=0, description="local body cache size")
    body_cache_dir: Path | None = Field(None, description="cache dir; a temp dir when unset")
    smarthost: SmarthostSettings | None = Field(
        None, description="relay everything through this host instead of MX lookup"
    )


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
    interval_s: float = Field(60.0, gt=0, description="pause between passes, seconds")
    lost_trigger_after_s: float = Field(
        300.0, gt=0, description="an open recipient this overdue without a work item is re-queued"
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
        description="longest time between queue depth scans (they read every entry; the "
        "exporter of the queue-wide gauges scans again after 10 times a scan's duration, at "
        "least probe_interval_s), seconds; 0 = off",
    )


class LogSettings(_Section):
    """Logging."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    json_format: bool = Field(False, description="one JSON object per line instead of text")


def _is_list(info: FieldInfo | None) -> bool:
    annotation = info.annotation if info is not None else None
    return getattr(annotation, "__origin__", None) is list


class _EnvSource(EnvSettingsSource):
    """The environment, where a list setting may also be a bare comma-separated value."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        if isinstance(value, str) and _is_list(field) and not value.lstrip().startswith("["):
            return [part.strip() for part in value.split(",") if part.strip()]
        return super().decode_complex_value(field_name, field, value)


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
    reconciler: ReconcilerSettings = Field(default_factory=ReconcilerSettings)
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
        env = _EnvSource(
            settings_cls, env_prefix="JSQUEUE_", env_nested_delimiter="__", case_sensitive=False
        )
        sources: list[PydanticBaseSettingsSource] = [init_settings, env]
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
    elif os.environ.get(CONFIG_ENV) and not Path(os.environ[CONFIG_ENV]).is_file():
        raise ConfigError(f"config file {os.environ[CONFIG_ENV]} (${CONFIG_ENV}): not found")
    _check_environment(os.environ)
    try:
        return Settings(**overrides)
    except ValidationError as e:
        err = e.errors()[0]
        where = _location(err["loc"])
        raise ConfigError(_one_line(f"{where}: {err['msg']}{_from_env(where)}")) from None
    except SettingsError as e:
        raise ConfigError(_one_line(_env_error(e))) from None
    except (tomllib.TOMLDecodeError, OSError) as e:
        raise ConfigError(_one_line(f"config file {os.environ.get(CONFIG_ENV)}: {e}")) from None


_ENV_PREFIX = "JSQUEUE_"


def env_names() -> set[str]:
    """Every environment variable name jsqueue reads (upper case): ``JSQUEUE_CONFIG``, a
    whole section or table as JSON (``JSQUEUE_WORKER``, ``JSQUEUE_WORKER__SMARTHOST``) and
    each setting (``JSQUEUE_WORKER__MX_PORT``)."""
    names = {CONFIG_ENV}
    for path in setting_paths():
        parts = path.split(".")
        for end in range(1, len(parts) + 1):
            names.add(_ENV_PREFIX + "__".join(parts[:end]).upper())
    return names


def _check_environment(environ: os._Environ[str] | dict[str, str]) -> None:
    """Raise ConfigError for the first ``JSQUEUE_…`` variable that names no setting, with
    the closest real name as a hint.

    Raises:
        ConfigError: a ``JSQUEUE_…`` variable names no setting (the first in sorted order).
    """
    known = env_names()
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(_ENV_PREFIX) or upper in known:
            continue
        close = difflib.get_close_matches(upper, sorted(known), n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(
            f"{name}: no such setting{hint}; sections and names are joined with '__', "
            "see docs/configuration.md"
        )


def _location(loc: tuple[int | str, ...]) -> str:
    """``smtp.relay_networks[0]`` from pydantic's error location, without the names of
    its internal validators (``lax-or-strict[…]``, ``function-after[…]``)."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part):
            text += f".{part}" if text else part
    return text or "settings"


def _from_env(where: str) -> str:
    """`` (from JSQUEUE_SMTP__PORT)`` when the setting at ``where`` came from that variable."""
    path = re.sub(r"\[\d+\]", "", where).split(".")
    for end in range(len(path), 0, -1):
        name = _ENV_PREFIX + "__".join(path[:end]).upper()
        if any(k.upper() == name for k in os.environ):
            return f" (from {name})"
    return ""


#: How ``jsqueue config show`` prints a secret (and a password inside a URL).
MASK = "**********"


def _masked(value: Any) -> bool:
    """Whether ``value`` holds a masked secret (a password, or a URL with one)."""
    if isinstance(value, str):
        return MASK in value
    return isinstance(value, list) and any(isinstance(v, str) and MASK in v for v in value)


def toml_text(data: Mapping[str, Any]) -> str:
    """Settings data (``Settings.model_dump(mode="json")``, secrets masked) as TOML that
    ``--config`` reads back to the same settings: unset values (None) are left out, as
    TOML has no null and their default is unset; masked secrets are left out too, named in
    a comment (give them through the environment or the file, never through this output);
    so is a list holding a URL with a masked password.

    Args:
        data: section name -> settings of that section.

    Returns:
        the TOML document, one ``[section]`` table per section.
    """
    hidden: list[str] = []

    def clean(value: Any, path: str) -> Any:
        if isinstance(value, Mapping):
            kept = {}
            for k, v in value.items():
                where = f"{path}.{k}" if path else str(k)
                if v is None:
                    continue
                if _masked(v):
                    hidden.append(where)
                    continue
                kept[k] = clean(v, where)
            return kept
        return value

    body = tomli_w.dumps(clean(data, ""))
    if not hidden:
        return body
    return f"# not shown (secrets): {', '.join(hidden)}\n{body}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _env_error(e: SettingsError) -> str:
    """``nats (JSQUEUE_NATS__URLS): ...`` for a value pydantic-settings could not parse."""
    match = re.search(r'field "([^"]+)"', str(e))
    field = match[1] if match else "settings"
    prefix = f"JSQUEUE_{field.upper()}"
    names = sorted(
        k for k in os.environ if k.upper() == prefix or k.upper().startswith(prefix + "__")
    )
    cause = e.__cause__ or e.__context__
    if isinstance(cause, ValueError):
        reason = (
            f'not valid JSON ({cause}); write a list as \'["a", "b"]\' (or a,b), '
            'a table as \'{"key": "value"}\''
        )
    else:
        reason = str(e)
    return f"{field} ({', '.join(names) or 'environment'}): {reason}"


# --------------------------------------------------------------------------- reference


def _type_text(info: FieldInfo) -> str:
    text = str(info.annotation).replace("typing.", "").replace("pathlib.", "")
    text = re.sub(r"<(?:class|enum) '([^']+)'>", r"\1", text)
    text = re.sub(r"\b(?:[a-z_]\w*\.)+([A-Z]\w*)", r"\1", text)  # module paths of classes
    annotation = info.annotation
    if isinstance(annotation, type) and issubclass(annotation, StrEnum):
        return " / ".join(f"`{m.value}`" for m in annotation)
    return text.replace("NoneType", "None")


def _default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, StrEnum):
        return f"`{value.value}`"
    if isinstance(value, Path):
        return f"`{value}`"
    if isinstance(value, list):
        return "`" + json.dumps([str(v) for v in value]) + "`"
    return f"`{json.dumps(value)}`"


def _unit(name: str, description: str) -> str:
    if name.endswith("_s"):
        return "seconds"
    if "octets" in description or name.endswith("_bytes"):
        return "octets"
    return ""


def _model_of(info: FieldInfo) -> type[BaseModel] | None:
    args = getattr(info.annotation, "__args__", None) or (info.annotation,)
    for arg in args:
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def setting_paths(model: type[BaseModel] = Settings, prefix: str = "") -> list[str]:
    """Every setting's dotted path (``worker.smarthost.host`` ...), sections excluded."""
    paths: list[str] = []
    for name, info in model.model_fields.items():
        sub = _model_of(info)
        if sub is not None:
            paths.extend(setting_paths(sub, f"{prefix}{name}."))
        else:
            paths.append(prefix + name)
    return paths


def settings_reference() -> str:
    """The settings reference (Markdown) generated from :class:`Settings`: every setting's
    path, environment variable, type, default, unit and meaning. ``python -m jsqueue.config``
    prints it (``docs/configuration.md``)."""
    out = [
        "# Configuration",
        "",
        "<!-- generated by `python -m jsqueue.config > docs/configuration.md`; do not edit -->",
        "",
        "Settings come from, in order of precedence: the environment (`JSQUEUE_` + section +",
        "`__` + name, upper case, e.g. `JSQUEUE_WORKER__MX_PORT=2526`; lists and tables as",
        "JSON, e.g. `JSQUEUE_NATS__URLS='[\"nats://a:4222\"]'`), then a TOML file (`--config",
        "FILE` or `$JSQUEUE_CONFIG`, sections as tables: `[worker]` / `mx_port = 2526`), then",
        "the defaults below. Durations are seconds (names end in `_s`), sizes octets.",
        "Secrets (`SecretStr`) are never printed: `jsqueue config show` masks them.",
        "",
        "An invalid value stops every command with one line naming the setting and the",
        "reason, and exit code 2, e.g. `jsqueue: invalid configuration: worker.mx_port: Input",
        "should be less than or equal to 65535`.",
    ]

    def section(model: type[BaseModel], path: str) -> None:
        doc = (model.__doc__ or "").strip().split("\n")[0]
        out.extend(["", f"## `{path}`", "", doc, ""])
        out.append("| setting | environment | type | default | unit | meaning |")
        out.append("|---|---|---|---|---|---|")
        subs: list[tuple[type[BaseModel], str]] = []
        for name, info in model.model_fields.items():
            full = f"{path}.{name}"
            sub = _model_of(info)
            if sub is not None:
                subs.append((sub, full))
            env = "JSQUEUE_" + full.upper().replace(".", "__")
            desc = (info.description or "").replace("|", "\\|")
            if sub is not None:
                desc = f"{desc} (section `{full}` below)".strip()
            out.append(
                f"| `{full}` | `{env}` | {_type_text(info).replace('|', 'or')} | "
                f"{_default_text(info)} | {_unit(name, desc)} | {desc} |"
            )
        for sub, full in subs:
            section(sub, full)

    for name, info in Settings.model_fields.items():
        sub = _model_of(info)
        assert sub is not None
        section(sub, name)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(settings_reference(), end="")
