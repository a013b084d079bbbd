"""The API's route table and its request pipeline on aiohttp: authenticate the bearer token,
check the role, validate query and body with the route's pydantic models, call the
handler, render its model as JSON; every error is an :class:`~jsqueue.http.models.ErrorBody`.
JSON bodies are validated in pydantic's strict mode (``false`` is no number, ``"1"`` no
integer), as the document's JSON Schema says; query values arrive as text and are
converted.

One :class:`Route` per operation is the single description of the API: aiohttp serves it,
and :mod:`jsqueue.http.openapi` turns the same table into the OpenAPI 3.1 document, so the
document cannot drift from what is served.

Status codes (RFC 9110 §15, RFC 6750 §3.1): 401 no or unknown token (with
``WWW-Authenticate: Bearer``), 403 the token lacks the role, 404 no such route or entry,
405 wrong method, 413 request or message too large, 415 a body whose Content-Type is not
JSON (:func:`json_media_type`), 422 a query, path or body that does not validate, 503
NATS unreachable or failing (with ``Retry-After``), never 500 by design (an unexpected
error is logged with its traceback and answered 500).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from jsqueue.errors import EntryNotFound, InvalidName, RequestRejected, StoreError
from jsqueue.http.auth import Role, Token, TokenFile
from jsqueue.http.models import ErrorBody

log = logging.getLogger("jsqueue.http")

#: Where the API lives on the HTTP endpoint.
API_PREFIX = "/api/"
#: Seconds a client should wait before retrying after a 503.
RETRY_AFTER_S = 5

_TOKENS_KEY = web.AppKey("jsqueue_tokens", TokenFile)
#: The authenticated token of a request (set before the handler runs).
TOKEN_KEY = web.RequestKey("jsqueue_token", Token)


@dataclass
class Call:
    """One validated request, as a handler gets it.

    Attributes:
        request: the aiohttp request (headers, peer, streaming responses).
        token: the authenticated caller.
        path: the path parameters (already validated against the route's patterns).
        query: the validated query model, or None when the route takes none.
        body: the validated body model, or None when the route takes none (or none was sent
            and the body is optional).
    """

    request: web.Request
    token: Token
    path: dict[str, str]
    query: Any = None
    body: Any = None


Handler = Callable[[Call], Awaitable[BaseModel | web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    """One API operation: what aiohttp serves and what the OpenAPI document says.

    Attributes:
        method: ``GET`` or ``POST``.
        path: the aiohttp path, e.g. ``/api/v1/queue/{queue_id}``.
        operation_id: the OpenAPI operationId (unique).
        summary: one line for the document.
        role: the role the caller's token needs (:meth:`Token.allows`); None: any token.
        handler: the coroutine serving it.
        response: the model of the success body (None for a streaming route).
        status: the success status (200, 202).
        query: the query model (fields become query parameters), or None.
        body: the JSON body model, or None.
        body_required: whether a body must be sent.
        path_params: path parameter name → JSON Schema.
        errors: the error statuses the operation can answer (besides 401, 403, 422, 503).
        stream: the media type of a streaming success body (``text/event-stream``).
        description: more text for the document.
        tag: the document's group.
        headers: request header name → (JSON Schema, description) the route reads.
    """

    method: str
    path: str
    operation_id: str
    summary: str
    role: Role | None
    handler: Handler
    response: type[BaseModel] | None = None
    status: int = 200
    query: type[BaseModel] | None = None
    body: type[BaseModel] | None = None
    body_required: bool = True
    path_params: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    errors: tuple[int, ...] = ()
    stream: str | None = None
    description: str = ""
    tag: str = "queue"
    headers: Mapping[str, tuple[dict[str, Any], str]] = field(default_factory=dict)


def error_response(
    status: int, error: str, detail: str = "", headers: Mapping[str, str] | None = None
) -> web.Response:
    """An :class:`ErrorBody` JSON response."""
    body = ErrorBody(status=status, error=error, detail=detail[:2000])
    return web.Response(
        status=status,
        body=body.model_dump_json().encode(),
        content_type="application/json",
        headers=headers,
    )


def _unauthorized(detail: str) -> web.Response:
    # RFC 6750 §3: the challenge names the scheme; invalid_token when one was given.
    challenge = 'Bearer realm="jsqueue"'
    if detail != "no bearer token":
        challenge += ', error="invalid_token"'
    return error_response(401, "unauthorized", detail, {"WWW-Authenticate": challenge})


def bearer_token(request: web.Request) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (RFC 6750 §2.1), else None."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def authenticate(request: web.Request) -> Token | None:
    """The caller's :class:`Token` from the request's bearer token, else None. Never raises.

    For routes outside the API table (e.g. pages served by the same process): call it,
    then :meth:`Token.allows`.
    """
    secret = bearer_token(request)
    if secret is None:
        return None
    return request.app[_TOKENS_KEY].authenticate(secret)


#: The media type of every request body (RFC 8259 §11); ``+json`` types are JSON too (RFC
#: 6839 §3.1).
JSON_MEDIA_TYPE = "application/json"


def json_media_type(content_type: str | None) -> str | None:
    """Why a request body with this ``Content-Type`` is not JSON, or None when it is.

    No header at all is read as JSON (RFC 9110 §8.3 lets the recipient decide); a header
    naming another type (a form, as ``curl -d`` sends, text, XML, multipart), or a charset
    other than UTF-8 (RFC 8259 §8.1), is refused with 415 (RFC 9110 §15.5.16), even when
    the octets happen to parse as JSON: the client meant something else. Pure.

    Args:
        content_type: the request's ``Content-Type`` header value, or None when absent.

    Returns:
        None for JSON, else the 415's detail naming what was sent and what is expected.
    """
    if content_type is None:
        return None
    media, _, params = content_type.partition(";")
    media = media.strip().lower()
    expected = f"send the body as JSON with Content-Type: {JSON_MEDIA_TYPE}"
    if media != JSON_MEDIA_TYPE and not (
        media.startswith("application/") and media.endswith("+json")
    ):
        return f"Content-Type {media[:80]!r} is not JSON; {expected}"
    for param in params.split(";"):
        name, _, value = param.partition("=")
        charset = value.strip().strip('"').lower()
        if name.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            return f"charset {charset[:40]!r}: JSON is UTF-8 (RFC 8259 §8.1); {expected}"
    return None


def _query_values(request: web.Request, model: type[BaseModel]) -> dict[str, Any]:
    """The query as a dict for ``model``: repeatable (list) fields take every value."""
    out: dict[str, Any] = {}
    for name in request.query:
        if name in out:
            continue
        info = model.model_fields.get(name)
        many = info is not None and "list[" in str(info.annotation)
        out[name] = request.query.getall(name) if many else request.query[name]
    return out


def _validation_detail(e: ValidationError) -> str:
    parts = []
    for err in e.errors(include_url=False)[:5]:
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def _render(route: Route, result: BaseModel | web.StreamResponse) -> web.StreamResponse:
    if isinstance(result, web.StreamResponse):
        return result
    return web.Response(
        status=route.status,
        body=result.model_dump_json().encode(),
        content_type="application/json",
    )


def _serve(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def serve(request: web.Request) -> web.StreamResponse:
        secret = bearer_token(request)
        if secret is None:
            return _unauthorized("no bearer token")
        token = request.app[_TOKENS_KEY].authenticate(secret)
        if token is None:
            return _unauthorized("unknown token")
        request[TOKEN_KEY] = token
        if route.role is not None and not token.allows(route.role):
            return error_response(
                403, "forbidden", f"token {token.name!r} ({token.role}) lacks role {route.role}"
            )
        path = dict(request.match_info)
        try:
            for name, schema in route.path_params.items():
                _check_path(name, path.get(name, ""), schema)
            query = None
            if route.query is not None:
                query = route.query.model_validate(_query_values(request, route.query))
            elif request.query:
                return error_response(422, "invalid request", "this operation takes no query")
            body = None
            if route.body is not None:
                raw = await request.read()
                not_json = json_media_type(request.headers.get("Content-Type")) if raw else None
                if not_json is not None:
                    return error_response(
                        415, "unsupported media type", not_json, {"Accept": JSON_MEDIA_TYPE}
                    )
                if raw.strip():
                    body = route.body.model_validate_json(raw, strict=True)
                elif route.body_required:
                    return error_response(422, "invalid request", "a JSON body is required")
        except ValidationError as e:
            return error_response(422, "invalid request", _validation_detail(e))
        except _PathProblem as e:
            return error_response(422, "invalid request", str(e))
        try:
            result = await route.handler(Call(request, token, path, query, body))
        except EntryNotFound as e:
            return error_response(404, "not found", str(e))
        except RequestRejected as e:
            reason = "too large" if e.status == 413 else "invalid request"
            return error_response(e.status, reason, str(e))
        except (InvalidName, ValidationError) as e:
            detail = _validation_detail(e) if isinstance(e, ValidationError) else str(e)
            return error_response(422, "invalid request", detail)
        except StoreError as e:
            log.warning("%s %s: %s", request.method, request.path, e)
            return error_response(503, "unavailable", f"{e}", {"Retry-After": str(RETRY_AFTER_S)})
        return _render(route, result)

    return serve


class _PathProblem(ValueError):
    """A path parameter outside its schema (pattern or enum)."""


def _check_path(name: str, value: str, schema: Mapping[str, Any]) -> None:
    """Check a path parameter against its JSON Schema's ``pattern`` / ``enum``.

    Raises:
        _PathProblem: it does not match.
    """
    pattern = schema.get("pattern")
    if pattern is not None and not re.match(pattern, value):
        raise _PathProblem(f"path parameter {name}: {value[:40]!r} does not match {pattern}")
    enum = schema.get("enum")
    if enum is not None and value not in enum:
        raise _PathProblem(f"path parameter {name}: {value[:40]!r} is not one of {enum}")


@web.middleware
async def api_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Under ``/api/``: HTTP errors aiohttp raises (404 no route, 405, 413 too large) as
    :class:`ErrorBody` JSON; an unexpected exception logged and answered 500 (a bug);
    every request logged with its token's name and status.

    Raises:
        HTTPException: a status below 400 (a redirect), passed on as aiohttp raised it.
    """
    if not request.path.startswith(API_PREFIX):
        return await handler(request)
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        if e.status < 400:
            raise
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return error_response(e.status, e.reason.lower(), e.text or "", headers)
    except Exception:
        log.exception("%s %s failed unexpectedly", request.method, request.path)
        return error_response(500, "internal error", "see the server log")
    finally:
        token = request.get(TOKEN_KEY)
        log.info(
            "api %s %s token=%s status=%d",
            request.method,
            request.path,
            token.name if token is not None else "-",
            status,
            extra={"token": token.name if token is not None else None, "status": status},
        )


def mount(app: web.Application, tokens: TokenFile, routes: list[Route]) -> None:
    """Add ``routes`` and the API's error middleware to ``app`` (before it starts)."""
    app[_TOKENS_KEY] = tokens
    app.middlewares.append(api_errors)
    for route in routes:
        app.router.add_route(route.method, route.path, _serve(route))


def json_dumps(value: Any) -> str:
    """Compact JSON (for documents served as is)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
