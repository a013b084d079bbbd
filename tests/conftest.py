"""Shared pytest fixtures. Keep this small: fixtures live in ``tests/support/*`` modules and
are registered here as plugins (see each module's docstring for what it provides)."""

import asyncio
import io
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

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


#: The event loop of the test running in this process, for :func:`_dump_tasks`.
_loops: list[asyncio.AbstractEventLoop] = []


def _new_loop() -> asyncio.AbstractEventLoop:
    loop = uvloop.new_event_loop()
    _loops[:] = [loop]
    return loop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """In-process tests run on the loop the jsqueue processes use (jsqueue.cli): uvloop."""
    return {"uvloop": _new_loop}


def _dump_tasks() -> None:
    """Print every task of the running loop with its stack to the real stderr: a hung
    test is most often an await that never ends, which the threads' stacks the timeout
    prints do not show (the loop thread is idle in uvloop)."""
    out = io.StringIO()
    for task in asyncio.all_tasks():
        print(f"--- {task!r}", file=out)
        step: Any = task.get_coro()
        while step is not None:  # the whole chain of awaits, outermost first
            frame = getattr(step, "cr_frame", None) or getattr(step, "gi_frame", None)
            if frame is not None:
                code = frame.f_code
                print(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}", file=out)
            step = getattr(step, "cr_await", None) or getattr(step, "gi_yieldfrom", None)
    os.write(_STDERR, out.getvalue().encode(errors="replace"))


_STDERR = os.dup(2)  # before pytest captures fd 2


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    """Shortly before the test timeout (its ``timeout`` mark, else pyproject's), dump the
    asyncio tasks of a test still running."""
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker and marker.args else item.config.getini("timeout")
    timeout = float(limit or 0)  # 0: no timeout, nothing to dump before it
    timer = threading.Timer(max(1.0, timeout - 15), _dump_loop_tasks)
    timer.daemon = True
    if timeout > 0:
        timer.start()
    try:
        return (yield)
    finally:
        timer.cancel()


def _dump_loop_tasks() -> None:
    for loop in _loops:
        if loop.is_running():
            loop.call_soon_threadsafe(_dump_tasks)
