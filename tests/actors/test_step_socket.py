"""The step socket (actors/step_socket.py) without Ray: a StepServer on a thread of this process and
a StepChannel driving it, as a TP worker and its serving unit do. Plans and results round-trip
in order, a step that raises comes back as ChannelError with its message, a worker that goes away
fails the step at once (not at the step timeout), an abandoned step breaks the channel for good,
and any event loop may drive it."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from actors.step_socket import ChannelError, StepChannel, StepServer


class Worker:
    def __init__(self, delay: threading.Event | None = None) -> None:
        self.seen: list[Any] = []
        self.delay = delay

    def run_step(self, plan: Any) -> Any:
        if self.delay is not None:
            self.delay.wait(10)
        if plan == "boom":
            raise ValueError("step 7: blocks for unknown request x")
        self.seen.append(plan)
        return {"step": plan, "tokens": list(range(3))}


def test_plans_round_trip_in_order_from_any_loop() -> None:
    worker = Worker()
    server = StepServer(worker.run_step)
    channel = StepChannel([server.address])
    try:
        for _ in range(100):  # the socket file goes once the unit is connected
            if not os.path.exists(server.address):
                break
            time.sleep(0.01)
        assert not os.path.exists(server.address)

        async def steps(first: int) -> list[Any]:
            return [await channel.execute(i) for i in range(first, first + 3)]

        assert asyncio.run(steps(0)) == [[{"step": i, "tokens": [0, 1, 2]}] for i in range(3)]
        assert asyncio.run(steps(3))[-1] == [{"step": 5, "tokens": [0, 1, 2]}]  # another event loop
        big = list(range(200_000))  # a plan larger than the socket's buffers
        assert asyncio.run(channel.execute(big))[0]["step"] == big
        assert worker.seen[:6] == list(range(6))
    finally:
        channel.close()
        server.close()


def test_every_rank_answers_and_a_failed_step_names_its_error() -> None:
    workers = [Worker(), Worker()]
    servers = [StepServer(w.run_step) for w in workers]
    channel = StepChannel([s.address for s in servers])
    try:
        assert asyncio.run(channel.execute("plan")) == [{"step": "plan", "tokens": [0, 1, 2]}] * 2
        with pytest.raises(ChannelError, match="ValueError: step 7: blocks for unknown request x"):
            asyncio.run(channel.execute("boom"))
        with pytest.raises(ChannelError):  # the unit is rebuilt after a failed step: no step after it
            asyncio.run(channel.execute("plan"))
    finally:
        channel.close()
        for s in servers:
            s.close()


@pytest.fixture
def slow_worker() -> Iterator[tuple[threading.Event, StepServer, StepChannel]]:
    """A worker whose steps wait for `release` (set at the end in any case), and its channel."""
    release = threading.Event()
    server = StepServer(Worker(delay=release).run_step)
    channel = StepChannel([server.address])
    yield release, server, channel
    release.set()
    channel.close()
    server.close()


def test_a_worker_that_goes_away_fails_the_step_at_once(
        slow_worker: tuple[threading.Event, StepServer, StepChannel]) -> None:
    _, server, channel = slow_worker

    async def step() -> None:
        running = asyncio.ensure_future(channel.execute("plan"))
        await asyncio.sleep(0.05)
        server.close()  # its sockets close, as a dying worker process's do, while the step runs
        with pytest.raises(ChannelError, match="socket closed"):
            await running  # at once: the step has not answered and never will

    asyncio.run(step())
    with pytest.raises(ChannelError):
        asyncio.run(channel.execute("next"))


def test_a_worker_gone_before_the_step_fails_it_as_closed_whichever_side_notices(
        slow_worker: tuple[threading.Event, StepServer, StepChannel]) -> None:
    # Between steps the dead worker's socket is already closed: the send may fail (a broken pipe)
    # or, if it lands in the buffer first, the read sees the end. Either way the step says the
    # worker's socket closed, at once.
    release, server, channel = slow_worker
    release.set()
    assert asyncio.run(channel.execute("first"))[0]["step"] == "first"  # a live worker, then it dies
    server.close()
    time.sleep(0.05)
    with pytest.raises(ChannelError, match="rank 0's step socket closed"):
        asyncio.run(channel.execute("plan"))
    with pytest.raises(ChannelError, match="socket closed"):
        asyncio.run(channel.execute("next"))  # the channel stays broken with the same reason


def test_an_abandoned_step_breaks_the_channel(slow_worker: tuple[threading.Event, StepServer, StepChannel]) -> None:
    release, _, channel = slow_worker

    async def abandon() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await channel.execute("slow")

    asyncio.run(abandon())
    release.set()
    with pytest.raises(ChannelError, match="out of step"):
        asyncio.run(channel.execute("next"))  # its answer would be the abandoned step's


def test_connecting_to_nothing_raises() -> None:
    server = StepServer(Worker().run_step)
    server.close()
    with pytest.raises(OSError):
        StepChannel([server.address])
