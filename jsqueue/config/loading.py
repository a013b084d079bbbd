"""Loading settings (:func:`load_settings`), the check for unknown ``JSQUEUE_`` variables,
and TOML output of the effective settings."""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import (
    ValidationError,
)
from pydantic_settings import (
    SettingsError,
)

from jsqueue.config.sections import CONFIG_ENV
from jsqueue.config.settings import Settings, setting_paths
from jsqueue.errors import ConfigError


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Load settings from the environment, a TOML file and defaults.

    Args:
        config_file: TOML file; else ``$JSQUEUE_CONFIG`` when set.
        overrides: top-level sections given directly (tests), e.g. ``worker={...}``.

    Returns:
        the validated settings.

    Raises:
        ConfigError: one line naming the first invalid setting and why, e.g.
            ``worker.mx_port: Input should be less than or equal to 65535``; or naming the
            config file when it cannot be read, is not UTF-8 or is not TOML.
    """
    if config_file is not None:
        if not config_file.is_file():
            raise ConfigError(f"config file {config_file}: {_not_a_file(config_file)}")
        os.environ[CONFIG_ENV] = str(config_file)
    elif os.environ.get(CONFIG_ENV) and not Path(os.environ[CONFIG_ENV]).is_file():
        named = Path(os.environ[CONFIG_ENV])
        raise ConfigError(f"config file {named} (${CONFIG_ENV}): {_not_a_file(named)}")
    _check_environment(os.environ)
    try:
        return Settings(**overrides)
    except ValidationError as e:
        errors = e.errors()  # a misspelt key first: a required setting missing follows from it
        err = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
        where = _location(err["loc"])
        msg = _no_such_setting(where) if err["type"] == "extra_forbidden" else err["msg"]
        raise ConfigError(_one_line(f"{where}: {msg}{_from_env(where)}")) from None
    except SettingsError as e:
        raise ConfigError(_one_line(_env_error(e))) from None
    except (tomllib.TOMLDecodeError, OSError) as e:
        raise ConfigError(_one_line(f"config file {os.environ.get(CONFIG_ENV)}: {e}")) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {os.environ.get(CONFIG_ENV)}: {not_utf8(e)} (TOML is UTF-8)"
        ) from None


def _not_a_file(path: Path) -> str:
    """Why ``path`` (no regular file) is no config file: ``not found`` or what it is."""
    if path.is_dir():
        return "is a directory, not a TOML file"
    return "not a regular file" if path.exists() else "not found"


def not_utf8(e: UnicodeDecodeError) -> str:
    """``not UTF-8 at line 2, column 14 (byte 0xe9)``: where a file's text stops decoding.

    Args:
        e: the error of decoding the whole file's octets as UTF-8.
    """
    before = bytes(e.object[: e.start])
    line = before.count(b"\n") + 1
    column = e.start - (before.rfind(b"\n") + 1) + 1
    return f"not UTF-8 at line {line}, column {column} (byte {e.object[e.start]:#04x})"


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


def _no_such_setting(where: str) -> str:
    """``no such setting (did you mean worker.mx_port?)`` for an unknown TOML key (or JSON
    key of a ``JSQUEUE_…`` table) at dotted path ``where``, with the closest real
    setting, section or table as a hint."""
    known = {p for path in setting_paths() for p in _prefixes(path)}
    bare = re.sub(r"\[\d+\]", "", where)
    close = difflib.get_close_matches(bare, sorted(known), n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"no such setting{hint}; see docs/configuration.md"


def _prefixes(path: str) -> list[str]:
    """``a``, ``a.b``, ``a.b.c`` for ``a.b.c``: a setting and the tables holding it."""
    parts = path.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts) + 1)]


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
    ``--config`` reads back to the same settings: unset values (None) are left out, in
    tables and in lists of tables alike, as TOML has no null and their default is unset;
    masked secrets are left out too, named in a comment (give them through the environment
    or the file, never through this output); so is a list holding a URL with a masked
    password.

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
        if isinstance(value, list):  # a list of tables ([[worker.dkim.keys]]) too
            return [clean(v, f"{path}[{i}]") for i, v in enumerate(value)]
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
