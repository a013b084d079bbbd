"""Shared pytest fixtures. Keep this small: fixtures live in ``tests/support/*`` modules and
are registered here as plugins (see each module's docstring for what it provides)."""

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop

pytest_plugins = [
    "support.nats",
    "support.queue",
    "support.cluster",
    "support.api",
    "support.api_process",
    "support.ui",
]


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """In-process tests run on the loop the jsqueue processes use (jsqueue.cli): uvloop."""
    return {"uvloop": uvloop.new_event_loop}
