"""The hub's background loop (:class:`gpupool.background.Periodic`): passes at start, every
period and on a kick; a failing pass does not end the loop; ``stop()`` returns once the task has
ended, also from inside a pass; a stopped loop starts again in another event loop."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gpupool.background import Periodic, stop_tasks

LOG = logging.getLogger("gpupool.tests.background")


class Passes:
    """A pass that counts itself and lets a test wait for the n-th."""

    def __init__(self) -> None:
        self.count = 0
        self.changed: asyncio.Event | None = None

    async def __call__(self) -> None:
        self.count += 1
        if self.changed is not None:
            self.changed.set()

    async def reach(self, n: int) -> None:
        self.changed = asyncio.Event()  # of the running event loop
        async with asyncio.timeout(10):
            while self.count < n:
                self.changed.clear()
                await self.changed.wait()


def test_a_pass_runs_at_once_then_every_period_and_stop_ends_the_task() -> None:
    passes = Passes()

    async def main() -> None:
        loop = Periodic("test pass", passes, lambda: 0.01, LOG)
        loop.start()
        loop.start()  # a running loop is left alone: one task
        task = loop.task
        await passes.reach(3)
        await loop.stop()
        assert task is not None and task.done() and not loop.running

    asyncio.run(main())


def test_without_at_once_the_first_pass_waits_for_a_kick() -> None:
    passes = Passes()

    async def main() -> None:
        loop = Periodic("test pass", passes, lambda: 3600, LOG, at_once=False)
        loop.start()
        for _ in range(5):
            await asyncio.sleep(0)  # the loop gets to run: it waits, no pass
        assert passes.count == 0
        loop.kick()
        await passes.reach(1)
        await loop.stop()

    asyncio.run(main())


def test_kicks_during_a_pass_make_one_more_pass() -> None:
    release = asyncio.Event()
    began: list[int] = []
    done = Passes()

    async def slow() -> None:
        began.append(1)
        if len(began) == 1:
            await release.wait()
        await done()

    async def main() -> None:
        loop = Periodic("test pass", slow, lambda: 3600, LOG)
        loop.start()
        while not began:
            await asyncio.sleep(0)
        for _ in range(3):
            loop.kick()
        release.set()
        await done.reach(2)
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(began) == 2
        await loop.stop()

    asyncio.run(main())


def test_a_failing_pass_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    passes = Passes()

    async def failing() -> None:
        await passes()
        raise RuntimeError("boom")

    async def main() -> None:
        loop = Periodic("test pass", failing, lambda: 0.01, LOG)
        loop.start()
        await passes.reach(2)
        await loop.stop()

    with caplog.at_level(logging.ERROR, logger=LOG.name):
        asyncio.run(main())
    failed = [r for r in caplog.records if r.getMessage() == "gpupool: test pass failed"]
    assert len(failed) >= 2 and "boom" in caplog.text


def test_first_is_awaited_before_the_first_pass() -> None:
    up = asyncio.Event()
    passes = Passes()

    async def main() -> None:
        loop = Periodic("test pass", passes, lambda: 3600, LOG, first=up.wait)
        loop.start()
        for _ in range(5):
            await asyncio.sleep(0)
        assert passes.count == 0
        up.set()
        await passes.reach(1)
        await loop.stop()

    asyncio.run(main())


def test_stop_cancels_a_pass_where_it_waits_and_returns_once_it_has_ended() -> None:
    ended: list[str] = []
    entered = asyncio.Event()

    async def stuck() -> None:
        try:
            entered.set()
            await asyncio.Event().wait()
        finally:
            ended.append("unwound")

    async def main() -> None:
        loop = Periodic("test pass", stuck, lambda: 3600, LOG)
        loop.start()
        await entered.wait()
        await loop.stop()
        assert ended == ["unwound"]

    asyncio.run(main())


def test_a_stopped_loop_starts_again_in_another_event_loop() -> None:
    passes = Passes()
    loop = Periodic("test pass", passes, lambda: 3600, LOG)

    async def once(n: int) -> None:
        loop.start()
        await passes.reach(n)
        await loop.stop()

    asyncio.run(once(1))
    asyncio.run(once(2))
    assert passes.count == 2


def test_stop_tasks_logs_a_task_that_had_failed(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise ValueError("broken")

    async def waits() -> None:
        await asyncio.Event().wait()

    async def main() -> None:
        failed = asyncio.create_task(fails(), name="failing task")
        waiting = asyncio.create_task(waits(), name="waiting task")
        await asyncio.wait([failed])
        await stop_tasks([failed, waiting], LOG)
        assert failed.done() and waiting.cancelled()

    with caplog.at_level(logging.ERROR, logger=LOG.name):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == [
        "gpupool: task failing task had failed: ValueError('broken')"
    ]
