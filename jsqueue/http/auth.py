"""Bearer tokens of the HTTP API: roles, the hashed tokens file, minting a token.

A token is ``jsq_`` and 43 URL-safe base64 characters (256 random bits, :func:`new_token`).
The server never keeps it: the tokens file (``api.tokens_file``, a plain file or a
Kubernetes Secret mount) holds one line per token::

    name:role:sha256:<64 lower-case hex digits of SHA-256(token)>

``#`` starts a comment line; blank lines are ignored. A plain SHA-256 is enough because the
token is random and 256 bits long (nothing to guess from a dictionary, so no slow hash is
needed); the check is one hash per request and a dictionary lookup on the digest.

Roles (RFC 6750 bearer tokens, one role each):

* ``read`` - list, show, stats, the events stream, the OpenAPI document;
* ``admin`` - everything ``read`` may, and the actions (flush, hold, release, delete,
  bounce, requeue): an operator who acts must see what is acted on, so admin implies read;
* ``inject`` - only ``POST /api/v1/inject`` and the OpenAPI document: an application that
  sends mail sees nobody else's mail, and an operator token cannot inject.

The file is re-read when its modification time, size or inode changes (a Secret mount is
replaced by an atomic symlink swap), checked at most once a second. A file that cannot be
read or parsed after a change accepts no token at all (fail closed) and the error is
logged; at start it stops the process with a :class:`~jsqueue.errors.ConfigError`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from jsqueue.config.loading import not_utf8
from jsqueue.errors import ConfigError

log = logging.getLogger("jsqueue.http.auth")

#: Prefix of every token (recognisable in logs and secret scanners).
TOKEN_PREFIX = "jsq_"
#: Token names: what the events' ``source`` and the logs show (``api:<name>``).
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_LINE_RE = re.compile(r"^(?P<name>[^:]+):(?P<role>[^:]+):sha256:(?P<digest>[0-9a-f]{64})$")
#: Shortest pause between two looks at the tokens file, seconds.
RECHECK_S = 1.0


class Role(StrEnum):
    """What a token may do; see the module docstring."""

    READ = "read"
    ADMIN = "admin"
    INJECT = "inject"


#: The roles that satisfy a required role (admin implies read).
_GRANTS: dict[Role, frozenset[Role]] = {
    Role.READ: frozenset({Role.READ, Role.ADMIN}),
    Role.ADMIN: frozenset({Role.ADMIN}),
    Role.INJECT: frozenset({Role.INJECT}),
}


@dataclass(frozen=True)
class Token:
    """An authenticated caller: the token's name and role (never the token itself)."""

    name: str
    role: Role

    def allows(self, needed: Role) -> bool:
        """Whether this token may do what ``needed`` guards (admin implies read)."""
        return self.role in _GRANTS[needed]

    @property
    def source(self) -> str:
        """``api:<name>``: who acted, for the events' ``source`` and the logs."""
        return f"api:{self.name}"


def check_name(name: str) -> str:
    """Return ``name`` if it can name a token: 1-64 of letters, digits, ``_ . -``, starting
    with a letter or digit.

    Raises:
        ValueError: anything else.
    """
    if not _NAME_RE.match(name):
        raise ValueError(
            f"invalid token name {name!r}: 1-64 letters, digits, '_', '.', '-' "
            "(starting with a letter or digit)"
        )
    return name


def new_token() -> str:
    """A fresh token: ``jsq_`` and 256 random bits, URL-safe base64 (43 characters)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    """SHA-256 of the token's UTF-8 octets, 64 lower-case hex digits (never raises: a lone
    surrogate is hashed as its code unit, and matches no minted token)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def token_line(name: str, role: Role, token: str) -> str:
    """The tokens-file line for ``token`` (without the newline).

    Raises:
        ValueError: ``name`` is not a token name.
    """
    return f"{check_name(name)}:{Role(role).value}:sha256:{token_digest(token)}"


def read_tokens_file(path: Path) -> str:
    """The text of the tokens file at ``path`` (UTF-8).

    Raises:
        ConfigError: the file is not UTF-8 (naming it, the line and the column).
        OSError: the file cannot be read.
    """
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: {not_utf8(e)}") from None


def parse_tokens(text: str, where: str = "tokens file") -> dict[str, Token]:
    """Parse a tokens file: digest → :class:`Token`.

    Raises:
        ConfigError: a malformed line, an unknown role, a bad name, or a name or digest
            given twice (the message names ``where`` and the line number).
    """
    tokens: dict[str, Token] = {}
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE_RE.match(line)
        if m is None:
            raise ConfigError(f"{where}:{number}: expected 'name:role:sha256:<64 hex digits>'")
        try:
            name = check_name(m["name"])
            role = Role(m["role"])
        except ValueError as e:
            raise ConfigError(f"{where}:{number}: {e}") from e
        if name in names or m["digest"] in tokens:
            raise ConfigError(f"{where}:{number}: token {name!r} or its digest given twice")
        names.add(name)
        tokens[m["digest"]] = Token(name, role)
    return tokens


class TokenFile:
    """The tokens of ``api.tokens_file``, re-read when the file changes.

    Args:
        path: the tokens file; None accepts no token (every API request gets 401).

    Raises:
        ConfigError: the file cannot be read or parsed at start.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._tokens: dict[str, Token] = {}
        self._stamp: tuple[int, int, int] | None = None
        self._checked = -float("inf")
        if path is not None:
            self._load(strict=True)

    def _load(self, *, strict: bool) -> None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return
            tokens = parse_tokens(read_tokens_file(self.path), str(self.path))
        except (OSError, ConfigError) as e:
            if strict:
                raise ConfigError(f"api.tokens_file: {e}") from e
            if self._tokens or self._stamp is not None:
                log.error("api.tokens_file: %s; accepting no token until it is fixed", e)
            self._tokens, self._stamp = {}, None
            return
        if self._stamp is not None:
            log.info("api.tokens_file: re-read %s (%d tokens)", self.path, len(tokens))
        self._tokens, self._stamp = tokens, stamp

    def authenticate(self, token: str) -> Token | None:
        """The :class:`Token` whose digest matches ``token``, else None. Never raises.

        The file is looked at again when it was last looked at over :data:`RECHECK_S`
        ago, so a revoked token stops working within about a second.
        """
        if self.path is None:
            return None
        now = time.monotonic()
        if now - self._checked >= RECHECK_S:
            self._checked = now
            self._load(strict=False)
        # A lookup by digest: what timing could reveal is a digest prefix, not the token.
        return self._tokens.get(token_digest(token))

    def __len__(self) -> int:
        return len(self._tokens)


def add_token(path: Path, name: str, role: Role) -> str:
    """Mint a token named ``name`` with ``role``: append its hash line to ``path``
    (created with mode 0600 when missing) and return the token, which is shown once and
    stored nowhere.

    Raises:
        ValueError: ``name`` is not a token name, or the file already has a token of that
            name.
        ConfigError: the file exists and cannot be parsed.
        OSError: the file cannot be read or written.
    """
    check_name(name)
    existing = read_tokens_file(path) if path.exists() else ""
    if any(t.name == name for t in parse_tokens(existing, str(path)).values()):
        raise ValueError(f"{path} already has a token named {name!r} (remove it first)")
    token = new_token()
    line = token_line(name, role, token)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        if existing and not existing.endswith("\n"):
            f.write("\n")
        f.write(line + "\n")
    return token


def remove_token(path: Path, name: str) -> bool:
    """Remove the line of the token named ``name`` from ``path``; True when one was there.

    Raises:
        ConfigError: the file is not UTF-8.
        OSError: the file cannot be read or written.
    """
    lines = read_tokens_file(path).splitlines(keepends=True)
    kept = [ln for ln in lines if ln.split(":", 1)[0].strip() != name or ln.startswith("#")]
    if len(kept) == len(lines):
        return False
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return True
