"""SMTP AUTH credentials for the front end: the ``smtp.auth_file`` password file (one
``user:$scrypt$…`` line per user, RFC 7914 scrypt in PHC format), hashing a new line
(``python -m jsqueue.frontend.auth USER``) and verifying a login off the event loop without
revealing which users exist (RFC 4954 §4); format and reasons: docs/architecture.md, "AUTH
credentials".
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import getpass
import hashlib
import hmac
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from jsqueue.errors import ConfigError
from jsqueue.replies import R501_BAD_PLAIN_CREDENTIALS, R535_AUTH_FAILED, Reply

#: Default cost: N = 2**15, r = 8, p = 1 (32 MiB, the OWASP-recommended scrypt minimum).
DEFAULT_LN = 15
_KEY_OCTETS = 32
_HASH_RE = re.compile(
    r"^\$scrypt\$ln=(?P<ln>\d{1,2}),r=(?P<r>\d{1,2}),p=(?P<p>\d{1,2})"
    r"\$(?P<salt>[A-Za-z0-9+/]{11,})\$(?P<key>[A-Za-z0-9+/]{43})$"
)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)


@dataclass(frozen=True)
class ScryptHash:
    """One parsed ``$scrypt$`` hash."""

    ln: int
    r: int
    p: int
    salt: bytes
    key: bytes

    @classmethod
    def parse(cls, text: str) -> ScryptHash:
        """Parse the PHC string.

        Raises:
            ValueError: not a ``$scrypt$`` hash, or parameters out of range
                (ln 10..20, r 1..32, p 1..16).
        """
        m = _HASH_RE.match(text)
        if m is None:
            raise ValueError("not a $scrypt$ln=..,r=..,p=..$salt$key hash")
        ln, r, p = int(m["ln"]), int(m["r"]), int(m["p"])
        if not (10 <= ln <= 20 and 1 <= r <= 32 and 1 <= p <= 16):
            raise ValueError("scrypt parameters out of range (ln 10..20, r 1..32, p 1..16)")
        try:
            return cls(ln, r, p, _unb64(m["salt"]), _unb64(m["key"]))
        except binascii.Error as e:
            raise ValueError(f"bad base64 in hash: {e}") from e

    def derive(self, password: bytes) -> bytes:
        """The scrypt key of ``password`` under this hash's salt and cost (RFC 7914).

        Blocking: tens of milliseconds of CPU at the default cost.

        Returns:
            32 octets.
        """
        n = 1 << self.ln
        return hashlib.scrypt(
            password,
            salt=self.salt,
            n=n,
            r=self.r,
            p=self.p,
            maxmem=2 * 128 * n * self.r * self.p + (1 << 20),
            dklen=_KEY_OCTETS,
        )

    def verify(self, password: bytes) -> bool:
        """Whether ``password`` matches (constant-time comparison). Blocking, like
        :meth:`derive`."""
        return hmac.compare_digest(self.derive(password), self.key)

    def __str__(self) -> str:
        return f"$scrypt$ln={self.ln},r={self.r},p={self.p}${_b64(self.salt)}${_b64(self.key)}"


def plain_credentials(message: bytes) -> tuple[str, bytes] | Reply:
    """The (user, password) of a SASL PLAIN message, ``authzid NUL authcid NUL passwd``
    (RFC 4616 §2), or the reply that refuses it: ``501 5.5.2`` when it does not split in
    three, ``535 5.7.8`` for a user name that is no UTF-8 or an authorization identity
    other than the user (acting as another user is not supported). Pure."""
    parts = message.split(b"\0")
    if len(parts) != 3:
        return R501_BAD_PLAIN_CREDENTIALS
    authz, authc, password = parts
    return login_credentials(authc, password) if not authz or authz == authc else R535_AUTH_FAILED


def login_credentials(user: bytes, password: bytes) -> tuple[str, bytes] | Reply:
    """(user, password) from the two answers of the LOGIN mechanism (or PLAIN's authcid
    and password), or ``535 5.7.8`` when the user name is no UTF-8. Pure."""
    try:
        return user.decode("utf-8"), password
    except UnicodeDecodeError:
        return R535_AUTH_FAILED


def hash_password(password: str | bytes, *, ln: int = DEFAULT_LN, r: int = 8, p: int = 1) -> str:
    """Hash a password for the auth file.

    Args:
        password: the password (str is UTF-8 encoded).
        ln: log2 of the scrypt CPU/memory cost N.
        r: scrypt block size.
        p: scrypt parallelism.

    Returns:
        the ``$scrypt$...`` string to put after ``user:``.
    """
    raw = password.encode() if isinstance(password, str) else password
    proto = ScryptHash(ln, r, p, os.urandom(16), b"")
    return str(ScryptHash(ln, r, p, proto.salt, proto.derive(raw)))


class UserDB:
    """The users allowed to authenticate, loaded from an auth file."""

    def __init__(self, users: dict[str, ScryptHash]) -> None:
        """Args:
        users: user name -> parsed hash.
        """
        self._users = users
        any_hash = next(iter(users.values()), None)
        ln = any_hash.ln if any_hash else DEFAULT_LN
        self._dummy = ScryptHash(ln, 8, 1, b"\0" * 16, b"\0" * _KEY_OCTETS)

    @classmethod
    def load(cls, path: Path) -> UserDB:
        """Read an auth file (format in the module docstring).

        Raises:
            ConfigError: the file cannot be read, or a line is malformed (the message names
                the line number, never the hash).
        """
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"smtp.auth_file {path}: {e}") from None
        users: dict[str, ScryptHash] = {}
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            user, colon, encoded = line.partition(":")
            if not colon or not user:
                raise ConfigError(f"smtp.auth_file {path}:{number}: expected user:hash")
            try:
                users[user] = ScryptHash.parse(encoded)
            except ValueError as e:
                raise ConfigError(f"smtp.auth_file {path}:{number}: {e}") from None
        return cls(users)

    def __len__(self) -> int:
        return len(self._users)

    def check(self, user: str, password: bytes) -> bool:
        """Verify credentials, spending the same time on unknown users (blocking).

        Args:
            user: the user name, exactly as in the auth file.
            password: the password octets as the client sent them.

        Returns:
            True if ``user`` exists and ``password`` matches its hash.
        """
        stored = self._users.get(user)
        ok = (stored or self._dummy).verify(password)
        return ok and stored is not None

    async def verify(self, user: str, password: bytes) -> bool:
        """Verify credentials in a worker thread (RFC 4954 §4: the server decides).

        Args:
            user: the user name, exactly as in the auth file.
            password: the password octets as the client sent them.

        Returns:
            True if ``user`` exists and ``password`` matches its hash.
        """
        return await asyncio.to_thread(self.check, user, password)


def main(argv: list[str] | None = None) -> int:
    """``python -m jsqueue.frontend.auth USER``: prompt for a password, print ``USER:hash``.

    Returns:
        the exit status: 0 (also for ``-h``/``--help``, which prompts for nothing), or 2
        for a missing or bad USER (an option is no USER).
    """
    args = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m jsqueue.frontend.auth USER   (USER without ':')"
    if args in (["-h"], ["--help"]):
        print(f"{usage}\nprompts for USER's password, prints the auth file line USER:hash")
        return 0
    if len(args) != 1 or ":" in args[0] or args[0].startswith("-"):
        print(usage, file=sys.stderr)
        return 2
    password = getpass.getpass("password: ")
    print(f"{args[0]}:{hash_password(password)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
