"""The HTTP API against its own OpenAPI 3.1 document: property-based requests
(schemathesis, valid and invalid input) to a real ``jsqueue smtp`` on loopback with a real
nats-server. No 500 for any input; every response matches the document; every operation
answers 401 without a token and 403 to a token without its role."""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from jsqueue.config import Settings
from jsqueue.events import NULL_OBSERVER
from jsqueue.http.app import api_routes
from jsqueue.http.auth import TokenFile
from jsqueue.http.context import ApiContext
from jsqueue.http.openapi import openapi_document
from jsqueue.store.memory import open_memory
from support.api_process import ApiProcess

# The events stream never ends unless asked to (until_end); it is tested on its own
# (tests/test_http_events.py), with requests that end.
STREAMING = "/api/v1/events"


def role_of(operation: Any) -> str | None:
    """The role an operation needs, read from the document (None: any token)."""
    text = operation.definition.raw.get("description", "")
    for role in ("read", "admin", "inject"):
        if f"role `{role}`" in text:
            return role
    return None


def local_document() -> dict[str, Any]:
    """The document generated from the route table here (no server needed to collect)."""
    stores = open_memory()
    ctx = ApiContext(Settings(), stores, [], NULL_OBSERVER, TokenFile(None))
    return openapi_document(api_routes(ctx))


OPERATIONS = [
    (path, method.upper())
    for path, ops in local_document()["paths"].items()
    for method in ops
    if path != STREAMING
]


@pytest.fixture(scope="module")
def api_schema(api_process: ApiProcess) -> Any:
    """The document as the running process serves it, loaded by schemathesis."""
    schema = schemathesis.openapi.from_url(
        api_process.url + "/api/openapi.json", headers=api_process.auth("read"), timeout=10
    )
    schema.config.update(base_url=api_process.url)
    # The tests send the Authorization header themselves (right, wrong or no token).
    schema.config.generation.update(with_security_parameters=False)
    return schema


def token_for(api_process: ApiProcess, role: str | None) -> dict[str, str]:
    return api_process.auth("inject" if role == "inject" else "admin")


def cases(schema: Any, path: str, method: str) -> Any:
    operation = schema[path][method]
    both = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(
        GenerationMode.NEGATIVE
    )
    return both


@pytest.mark.parametrize(("path", "method"), OPERATIONS)
def test_api_conforms_to_its_document(
    path: str, method: str, api_schema: Any, api_process: ApiProcess
) -> None:
    """Valid and invalid requests with the right token: no 500, responses match.

    Schema-valid requests may still be refused with 422 where the document cannot state
    the rule (a mailbox's grammar, RFC 3461 xtext, one of raw/raw_base64/message, a
    line's length): schemathesis's positive-data-acceptance check is off for that."""
    operation = api_schema[path][method]
    headers = token_for(api_process, role_of(operation))

    @given(case=cases(api_schema, path, method))
    @settings(deadline=None, max_examples=30, suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        case.call_and_validate(headers=headers, excluded_checks=[positive_data_acceptance])

    run()


@pytest.mark.parametrize(("path", "method"), OPERATIONS)
def test_every_operation_needs_a_token_and_its_role(
    path: str, method: str, api_schema: Any, api_process: ApiProcess
) -> None:
    """No token: 401 with a Bearer challenge; a token without the role: 403, whatever
    the input."""
    role = role_of(api_schema[path][method])

    @given(case=cases(api_schema, path, method))
    @settings(deadline=None, max_examples=3, suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        anonymous = case.call(headers={"Authorization": ""})
        assert anonymous.status_code == 401
        assert anonymous.headers["www-authenticate"][0].startswith("Bearer")
        assert case.call(headers={"Authorization": "Bearer jsq_not-a-token"}).status_code == 401
        if role is None:
            return
        for other in ("read", "admin", "inject"):
            allowed = other == role or (role == "read" and other == "admin")
            response = case.call(headers=api_process.auth(other))
            if allowed:
                assert response.status_code != 403
            else:
                assert response.status_code == 403, (other, response.text)
                assert response.json()["error"] == "forbidden"

    run()


def test_document_is_openapi_31_and_generated(api_process: ApiProcess) -> None:
    r = requests.get(
        api_process.url + "/api/openapi.json", headers=api_process.auth("inject"), timeout=10
    )
    doc = r.json()
    assert r.status_code == 200 and doc["openapi"] == "3.1.0"
    ops = {op["operationId"] for path in doc["paths"].values() for op in path.values()}
    for action in ("flush", "hold", "release", "delete", "bounce", "requeue"):
        assert {f"{action}_entry", f"{action}_bulk"} <= ops
    assert {"list_entries", "show_entry", "queue_stats", "events", "inject"} <= ops
    from jsqueue.http.models import InjectBody

    # the body schema is pydantic's, not a hand-written copy
    want = InjectBody.model_json_schema(ref_template="#/components/schemas/{model}")
    want.pop("$defs", None)
    assert json.dumps(doc["components"]["schemas"]["InjectBody"], sort_keys=True) == json.dumps(
        want, sort_keys=True
    )
