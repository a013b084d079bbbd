"""jsqueue settings: environment (``JSQUEUE_…``, nested with ``__``) over a TOML file over
defaults. One entry point, :func:`load_settings`; secrets are ``SecretStr``.

Example: ``JSQUEUE_WORKER__MX_PORT=2526`` sets ``worker.mx_port``;
``JSQUEUE_NATS__URLS='["nats://a:4222","nats://b:4222"]'`` points at a cluster.
Durations are seconds (suffix ``_s``), sizes octets. A list setting also takes a bare,
comma-separated value (``JSQUEUE_SMTP__RELAY_NETWORKS=10.0.0.0/8,192.0.2.0/24``). A
``JSQUEUE_…`` variable that names no setting stops the start, as an unknown name in the
TOML file does: a misspelt variable is never silently ignored.
"""

from jsqueue.config.api import ApiSettings
from jsqueue.config.destinations import DestinationSettings, Rate, parse_rate
from jsqueue.config.loading import MASK, env_names, load_settings, toml_text
from jsqueue.config.reference import settings_reference
from jsqueue.config.sections import (
    CONFIG_ENV,
    BareLinePolicy,
    DsnSettings,
    HttpSettings,
    LogSettings,
    NatsSettings,
    ReconcilerSettings,
    RetrySettings,
    SmarthostSettings,
    SmtpSettings,
    TlsPolicy,
    WorkerSettings,
)
from jsqueue.config.settings import Settings, setting_paths
from jsqueue.config.tls import OutboundTlsSettings, TlsReportSettings
from jsqueue.config.ui import UiSettings

__all__ = [
    "CONFIG_ENV",
    "MASK",
    "ApiSettings",
    "BareLinePolicy",
    "DestinationSettings",
    "DsnSettings",
    "HttpSettings",
    "LogSettings",
    "NatsSettings",
    "OutboundTlsSettings",
    "Rate",
    "ReconcilerSettings",
    "RetrySettings",
    "Settings",
    "SmarthostSettings",
    "SmtpSettings",
    "TlsPolicy",
    "TlsReportSettings",
    "UiSettings",
    "WorkerSettings",
    "env_names",
    "load_settings",
    "parse_rate",
    "setting_paths",
    "settings_reference",
    "toml_text",
]
