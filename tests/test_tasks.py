"""Ending background tasks (jsqueue.tasks): a cancellation ``asyncio.wait_for`` loses on
Python 3.11 (CPython gh-86296) does not leave a loop running. In the test loop (uvloop)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from jsqueue.tasks import cancel_and_wait


class Beats:
    """A heartbeat loop whose every beat is a request under ``asyncio.wait_for``, as each
    nats-py request is; :meth:`answer_and_cancel` makes the reply and the cancellation
    arrive in the same event-loop turn."""

    def __init__(self) -> None:
        self.beats = 0
        self.reply: asyncio.Future[None] | None = None
        self.waiting = asyncio.Event()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.reply = loop.create_future()
            self.waiting.set()
            await asyncio.wait_for(self.reply, 30)
            self.waiting.clear()
            self.beats += 1
            await asyncio.sleep(30)  # the pause until the next beat

    async def answer_and_cancel(self, task: asyncio.Task[None]) -> None:
        await self.waiting.wait()
        assert self.reply is not None
        self.reply.set_result(None)
        task.cancel()


async def test_one_cancel_can_be_lost_by_wait_for() -> None:
    """The fault itself, so that the test below is known to exercise it: on Python 3.11,
    after one ``cancel()`` that meets the reply the loop is still running at its next
    pause (from 3.12 it has ended)."""
    beats = Beats()
    task = asyncio.create_task(beats.run())
    await beats.answer_and_cancel(task)
    done, _ = await asyncio.wait({task}, timeout=0.5)
    lost = sys.version_info < (3, 12)
    assert (not done) is lost, "3.11 loses the cancellation, 3.12 keeps it"
    await cancel_and_wait(task)


async def test_cancel_and_wait_ends_a_loop_whose_cancellation_was_lost() -> None:
    beats = Beats()
    task = asyncio.create_task(beats.run())
    loop = asyncio.get_running_loop()
    await beats.answer_and_cancel(task)
    started = loop.time()
    await asyncio.wait_for(cancel_and_wait(task, again_s=0.05), 5)
    assert task.cancelled() and beats.beats <= 1
    assert loop.time() - started < 2


async def test_cancel_and_wait_leaves_ended_tasks_and_their_outcomes() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    failed = asyncio.create_task(fails())
    await asyncio.wait({failed})
    sleeping = asyncio.create_task(asyncio.sleep(30))
    await cancel_and_wait(failed, sleeping)
    await cancel_and_wait(failed, sleeping)  # idempotent
    assert sleeping.cancelled() and not failed.cancelled()
    with pytest.raises(ValueError, match="boom"):
        failed.result()
