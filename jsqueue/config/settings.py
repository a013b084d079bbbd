"""The whole settings model (:class:`Settings`: every section, and its sources: init,
environment, TOML file) and the dotted paths of its settings."""

from __future__ import annotations

import os
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from jsqueue.config.api import ApiSettings
from jsqueue.config.destinations import DestinationSettings
from jsqueue.config.sections import (
    CONFIG_ENV,
    DsnSettings,
    HttpSettings,
    LogSettings,
    NatsSettings,
    ReconcilerSettings,
    RetrySettings,
    SmtpSettings,
    WorkerSettings,
)
from jsqueue.config.tls import OutboundTlsSettings
from jsqueue.config.ui import UiSettings


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
    api: ApiSettings = Field(default_factory=ApiSettings)
    ui: UiSettings = Field(default_factory=UiSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    outbound_tls: OutboundTlsSettings = Field(default_factory=OutboundTlsSettings)
    destinations: DestinationSettings = Field(default_factory=DestinationSettings)

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.smtp.tls_cert is None) != (self.smtp.tls_key is None):
            raise ValueError("smtp.tls_cert and smtp.tls_key must be set together")
        tls = self.outbound_tls
        if tls.dane and not (tls.dnssec_nameservers or self.worker.nameservers):
            # DANE trusts a resolver's AD bit (RFC 7672 §1.3); with none configured every
            # DNSSEC lookup is bogus and every MX deferred.
            raise ValueError(
                "outbound_tls.dane needs a validating resolver: set "
                "outbound_tls.dnssec_nameservers (or worker.nameservers)"
            )
        return self

    def front_end(self) -> SmtpSettings:
        """The ``smtp`` section as the front end runs it: ``smtp.postmaster`` falls back to
        ``dsn.postmaster`` (the one postmaster an operator may have set, RFC 5321 §4.5.1)."""
        postmaster = self.smtp.postmaster or self.dsn.postmaster or ""
        return self.smtp.model_copy(update={"postmaster": postmaster})

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


def model_of(info: FieldInfo) -> type[BaseModel] | None:
    args = getattr(info.annotation, "__args__", None) or (info.annotation,)
    for arg in args:
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def setting_paths(model: type[BaseModel] = Settings, prefix: str = "") -> list[str]:
    """Every setting's dotted path (``worker.smarthost.host`` ...), sections excluded."""
    paths: list[str] = []
    for name, info in model.model_fields.items():
        sub = model_of(info)
        if sub is not None:
            paths.extend(setting_paths(sub, f"{prefix}{name}."))
        else:
            paths.append(prefix + name)
    return paths
