"""The dashboard's login: the API's bearer token (:mod:`jsqueue.http.auth`) kept in a
cookie, and the CSRF token of its action forms.

* The login form posts the token; when it is a ``read`` or ``admin`` token the answer
  sets the cookie :data:`COOKIE` to it: ``HttpOnly`` (no script reads it),
  ``SameSite=Strict`` (no other site's page sends it, RFC 6265bis §8.8), ``Path=/ui/``,
  ``Secure`` on HTTPS (or always, ``ui.secure_cookie``), ``Max-Age`` of
  ``ui.session_max_age_s``. Every request checks the cookie's token against the tokens
  file again, so a token removed there logs its sessions out within about a second, on
  every process of the cluster, and no session state is kept anywhere.
* Every form that acts carries :func:`csrf_token`, an HMAC-SHA-256 of a fixed label under
  the token: only a page that was given the token can make it, and it is checked in
  constant time (:func:`csrf_ok`), along with the ``Origin`` header when the browser
  sends one (it must name this host). SameSite=Strict already keeps cross-site posts
  from carrying the cookie; the CSRF token covers browsers that do not honour it.
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web
from yarl import URL

from jsqueue.http.auth import Token, TokenFile

#: The cookie holding the token.
COOKIE = "jsqueue_ui"
#: Where the cookie is sent.
COOKIE_PATH = "/ui/"
_CSRF_LABEL = b"jsqueue-ui-csrf-v1"


def cookie_secret(request: web.Request) -> str | None:
    """The token in the request's login cookie, else None."""
    value = request.cookies.get(COOKIE)
    return value or None


def logged_in(request: web.Request, tokens: TokenFile) -> tuple[Token, str] | None:
    """(token, secret) of the request's login cookie when the tokens file still knows the
    token, else None. Never raises."""
    secret = cookie_secret(request)
    if secret is None:
        return None
    token = tokens.authenticate(secret)
    return (token, secret) if token is not None else None


def csrf_token(secret: str) -> str:
    """The CSRF token of the forms of a session whose token is ``secret``: 64 hex digits."""
    return hmac.new(
        secret.encode("utf-8", "surrogateescape"), _CSRF_LABEL, hashlib.sha256
    ).hexdigest()


def same_origin(request: web.Request) -> bool:
    """False when the request has an ``Origin`` (RFC 6454) naming another host than its
    ``Host`` header; True when it names this host or is absent."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    if origin == "null":
        return False
    try:
        return URL(origin).raw_authority == request.host
    except ValueError:
        return False


def csrf_ok(request: web.Request, secret: str, sent: str | None) -> bool:
    """Whether a form post carries this session's CSRF token and comes from this origin."""
    if not sent or not same_origin(request):
        return False
    return hmac.compare_digest(sent.encode(), csrf_token(secret).encode())


def set_login(response: web.StreamResponse, secret: str, *, secure: bool, max_age_s: int) -> None:
    """Set the login cookie on ``response`` (see the module docstring)."""
    response.set_cookie(
        COOKIE,
        secret,
        path=COOKIE_PATH,
        httponly=True,
        samesite="Strict",
        secure=secure,
        max_age=max_age_s,
    )


def clear_login(response: web.StreamResponse) -> None:
    """Remove the login cookie."""
    response.del_cookie(COOKIE, path=COOKIE_PATH)
