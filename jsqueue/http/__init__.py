"""The HTTP API (``/api/``) on the process's HTTP endpoint: bearer tokens with roles
(:mod:`.auth`), the route table and request pipeline (:mod:`.routing`), the OpenAPI 3.1
document generated from it (:mod:`.openapi`), the queue, events and inject routes, and the
mount that :mod:`jsqueue.runtime` hands to :func:`jsqueue.health.telemetry` (:mod:`.app`).
"""
