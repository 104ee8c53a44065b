"""The background loop: tasks that can be cancelled and waited for."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cloudckpt.runtime.loop import start_task


def test_cancel_and_wait_returns_only_after_the_coroutine_stopped():
    started, writes, cleaned = threading.Event(), [], threading.Event()

    async def writer():
        started.set()
        try:
            while True:
                await asyncio.sleep(0.001)
                writes.append(time.monotonic())
        finally:
            await asyncio.sleep(0.05)  # cleanup that itself awaits
            cleaned.set()

    task = start_task(writer())
    assert started.wait(5)
    task.cancel_and_wait(timeout=5)
    assert cleaned.is_set()  # its finally block ran to the end before we got here
    count = len(writes)
    time.sleep(0.05)
    assert len(writes) == count  # and nothing happens after


def test_result_returns_value_or_raises():
    async def value():
        await asyncio.sleep(0)
        return 42

    async def boom():
        await asyncio.sleep(0)
        raise ValueError("nope")

    assert start_task(value()).result() == 42
    with pytest.raises(ValueError, match="nope"):
        start_task(boom()).result()
