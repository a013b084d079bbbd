"""Pacing of long background loops (jsqueue.pacing): the rest after a slice of work, the
pause after a run, and the pacer's bookkeeping. Pure arithmetic and a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from jsqueue.pacing import Pacer, cycle_rest, failure_backoff_s, rest_after
from support.queue import eventually


def test_rest_after_keeps_the_work_to_its_share() -> None:
    assert rest_after(1.0, 1.0) == 0.0
    assert rest_after(1.0, 0.5) == pytest.approx(1.0)
    assert rest_after(0.05, 0.1) == pytest.approx(0.45)
    worked = 2.0
    assert worked / (worked + rest_after(worked, 0.1)) == pytest.approx(0.1)


def test_cycle_rest_counts_the_rests_already_taken() -> None:
    assert cycle_rest(60.0, 1.0, 1.0, 0.1) == 60.0  # a short run: the interval
    assert cycle_rest(60.0, 100.0, 100.0, 0.1) == pytest.approx(900.0)  # unpaced
    assert cycle_rest(60.0, 100.0, 1000.0, 0.1) == 60.0  # paced while it ran


class FakeTime:
    """A clock moved by hand, and a sleep that moves it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.rests: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.rests.append(seconds)
        self.now += seconds


async def test_the_pacer_rests_only_after_a_slice_of_work() -> None:
    t = FakeTime()
    pacer = Pacer(0.1, slice_s=0.05, clock=t.clock, sleep=t.sleep)
    t.now += 0.01
    await pacer.step()
    assert t.rests == []  # less than a slice: a small queue never rests
    t.now += 0.05
    await pacer.step()
    assert t.rests == [pytest.approx(0.54)]  # 0.06 s worked, nine times that rested
    t.now += 0.02
    assert pacer.finish() == pytest.approx(0.08)
    assert pacer.finish() == pytest.approx(0.08)  # idempotent
    assert pacer.rested_s == pytest.approx(0.54)
    assert pacer.busy_s / (pacer.busy_s + pacer.rested_s) == pytest.approx(0.08 / 0.62)


async def test_the_pacer_bounds_each_rest_and_a_full_share_never_rests() -> None:
    t = FakeTime()
    bounded = Pacer(0.1, max_rest_s=2.0, clock=t.clock, sleep=t.sleep)
    t.now += 10.0  # one long step (a slow listing): ninety seconds would outlive a lock
    await bounded.step()
    assert t.rests == [2.0] and bounded.rested_s == 2.0
    full = Pacer(1.0, clock=t.clock, sleep=t.sleep)
    t.now += 10.0
    await full.step()
    assert t.rests == [2.0] and full.rested_s == 0.0


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_share_outside_the_unit_interval_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="share"):
        Pacer(share)
    with pytest.raises(ValueError, match="slice"):
        Pacer(0.5, slice_s=0.0)


async def test_hurry_ends_the_rest_under_way_and_the_rests_after_it() -> None:
    """A run wanted done soon (a recovery pass waits behind it) stops resting at once."""
    t = FakeTime()
    woke = asyncio.Event()

    async def long_sleep(seconds: float) -> None:
        t.rests.append(seconds)
        await woke.wait()  # a rest that would last until the test ends

    pacer = Pacer(0.001, clock=t.clock, sleep=long_sleep)
    t.now += 1.0
    step = asyncio.create_task(pacer.step())
    await eventually(lambda: pacer.resting, what="a rest of about 1 000 s under way")
    t.now += 0.5
    pacer.hurry()
    await asyncio.wait_for(step, 5)
    assert not pacer.resting and pacer.rested_s == pytest.approx(0.5)
    t.now += 10.0
    await asyncio.wait_for(pacer.step(), 5)  # no rest any more
    assert t.rests == [pytest.approx(999.0)]
    pacer.hurry()  # idempotent


def test_failure_backoff_grows_to_its_bound_with_jitter() -> None:
    """Doubling per failure in a row from the base, bounded, and a random half taken off."""
    assert failure_backoff_s(1, 1.0, 30.0, 0.0) == 0.5
    assert failure_backoff_s(1, 1.0, 30.0, 0.999999) == pytest.approx(1.0)
    assert failure_backoff_s(3, 1.0, 30.0, 1.0) == 4.0
    assert failure_backoff_s(10, 1.0, 30.0, 1.0) == 30.0
    assert failure_backoff_s(10_000, 1.0, 30.0, 0.5) == 22.5  # no overflow
