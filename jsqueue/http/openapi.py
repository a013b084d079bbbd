"""The OpenAPI 3.1 document of the HTTP API, generated from the route table
(:mod:`jsqueue.http.routing`) and the pydantic models it names; nothing is written by hand.

OpenAPI 3.1 uses JSON Schema 2020-12 as its schema dialect, which is what pydantic's
``model_json_schema`` emits, so every model goes into ``components/schemas`` as pydantic
renders it (request models in validation mode, responses in serialization mode). Query
models become one ``in: query`` parameter per field (repeatable lists as ``form`` /
``explode``), the ``null`` branch of optional fields dropped (a query parameter is absent,
never null). Pure: the same table gives the same document.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from jsqueue.http.models import ErrorBody
from jsqueue.http.routing import Route

_REF = "#/components/schemas/{model}"
#: Errors every authenticated operation can answer.
_COMMON_ERRORS = (401, 403, 422, 503)
_REASONS = {
    400: "bad request",
    401: "no bearer token, or an unknown one (RFC 6750 §3.1)",
    403: "the token lacks the role this operation needs",
    404: "no such entry",
    405: "method not allowed",
    409: "conflict",
    413: "request or message too large (smtp.max_message_size)",
    415: "the body's Content-Type is not application/json (or a +json type)",
    422: "the path, query or body does not validate",
    503: "NATS unreachable or failing: nothing was done or stored; retry after Retry-After",
}


def _strip_null(schema: dict[str, Any]) -> dict[str, Any]:
    """``anyOf: [X, {type: null}]`` → ``X`` (for query parameters, which are absent rather
    than null); the field's other keywords (default, description) are kept."""
    options = schema.get("anyOf")
    if not options:
        return schema
    rest = [o for o in options if o.get("type") != "null"]
    if len(rest) != 1:
        return schema
    out = {k: v for k, v in schema.items() if k not in ("anyOf", "default")}
    out.update(rest[0])
    if schema.get("default") is not None:
        out["default"] = schema["default"]
    return out


def _query_parameters(model: type[BaseModel], defs: dict[str, Any]) -> list[dict[str, Any]]:
    schema = model.model_json_schema(ref_template=_REF, mode="validation")
    defs.update(schema.pop("$defs", {}))
    required = set(schema.get("required", ()))
    params = []
    for name, prop in schema.get("properties", {}).items():
        prop = _strip_null(dict(prop))
        description = prop.pop("description", "")
        prop.pop("title", None)
        param: dict[str, Any] = {
            "name": name,
            "in": "query",
            "required": name in required,
            "schema": prop,
        }
        if description:
            param["description"] = description
        if prop.get("type") == "array":
            param["style"] = "form"
            param["explode"] = True
        params.append(param)
    return params


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}


def _needs(route: Route) -> str:
    if route.role is None:
        return "Needs a token of any role."
    also = " (or `admin`)" if route.role.value == "read" else ""
    return f"Needs a token with role `{route.role.value}`{also}."


def _operation(route: Route, defs: dict[str, Any]) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": route.operation_id,
        "summary": route.summary,
        "tags": [route.tag],
        "security": [{"bearer": []}],
        "description": (route.description + "\n\n" if route.description else "") + _needs(route),
    }
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": dict(schema)}
        for name, schema in route.path_params.items()
    ]
    for name, (schema, text) in route.headers.items():
        params.append(
            {"name": name, "in": "header", "required": False, "schema": schema, "description": text}
        )
    if route.query is not None:
        params += _query_parameters(route.query, defs)
    if params:
        op["parameters"] = params
    if route.body is not None:
        op["requestBody"] = {"required": route.body_required, "content": _json(route.body)}
    responses: dict[str, Any] = {}
    if route.stream is not None:
        responses[str(route.status)] = {
            "description": "a stream",
            "content": {
                route.stream: {
                    "schema": {"type": "object" if route.stream.endswith("json") else "string"}
                }
            },
        }
    elif route.response is not None:
        responses[str(route.status)] = {
            "description": route.response.__doc__.splitlines()[0]
            if route.response.__doc__
            else "success",
            "content": _json(route.response),
        }
    body_errors = (415,) if route.body is not None else ()
    for status in sorted({*_COMMON_ERRORS, *route.errors, *body_errors}):
        responses[str(status)] = {"description": _REASONS[status], "content": _json(ErrorBody)}
    responses["401"]["headers"] = {
        "WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer challenge"}
    }
    responses["503"]["headers"] = {
        "Retry-After": {"schema": {"type": "string"}, "description": "seconds"}
    }
    op["responses"] = responses
    return op


def openapi_document(
    routes: Sequence[Route], *, title: str = "jsqueue HTTP API", version: str = "1"
) -> dict[str, Any]:
    """The OpenAPI 3.1.0 document of ``routes`` as a JSON-ready dict. Pure."""
    modes: dict[type[BaseModel], JsonSchemaMode] = {ErrorBody: "serialization"}
    for r in routes:
        if r.body is not None:
            modes[r.body] = "validation"
        if r.response is not None:
            modes.setdefault(r.response, "serialization")
    pairs: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = list(
        modes.items()
    )
    keyed, top = models_json_schema(pairs, ref_template=_REF)
    defs: dict[str, Any] = dict(top.get("$defs", {}))
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        paths.setdefault(r.path, {})[r.method.lower()] = _operation(r, defs)
    # models_json_schema may name a model "-Input"/"-Output" when the modes differ; point
    # the operations' refs at the names it chose.
    renames = {
        model.__name__: ref["$ref"].rsplit("/", 1)[-1]
        for (model, _mode), ref in keyed.items()
        if ref["$ref"].rsplit("/", 1)[-1] != model.__name__
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": version,
            "description": "Queue operations and message injection of a jsqueue process. "
            "Every operation needs `Authorization: Bearer <token>`; roles: `read`, `admin` "
            "(implies read), `inject`.",
        },
        "paths": paths,
        "components": {
            "schemas": defs,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
    if renames:
        doc = _rename_refs(doc, renames)
    return doc


def _rename_refs(value: Any, renames: dict[str, str]) -> Any:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#/components/schemas/"):
                name = v.rsplit("/", 1)[-1]
                out[k] = _REF.format(model=renames.get(name, name))
            else:
                out[k] = _rename_refs(v, renames)
        return out
    if isinstance(value, list):
        return [_rename_refs(v, renames) for v in value]
    return value
