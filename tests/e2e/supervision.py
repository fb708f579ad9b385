"""``pdserve up``'s supervisor for e2e tests that kill processes of a launched stack."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.launcher import Stack
from services.up import supervise


@contextlib.asynccontextmanager
async def supervised(st: Stack, said: list[str]) -> AsyncIterator[None]:
    """``pdserve up``'s own supervisor (every process restartable), ticking in the
    background as ``pdserve up`` does; ``said`` collects what it reports. Fails if the
    supervisor gave up (a process restarted too often)."""
    supervisor = supervise(st, said.append)
    stopped: list[str] = []

    async def tick() -> None:
        while True:
            reason = supervisor.tick()
            if reason is not None:
                stopped.append(reason)
                return
            await asyncio.sleep(0.1)

    task = asyncio.create_task(tick())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert not stopped, stopped
