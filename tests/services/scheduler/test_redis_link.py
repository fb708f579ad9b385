"""The scheduler's Redis link: when to re-mirror (pure), and the probe loop against a real
redis-server that is killed and started again on its port."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from services.scheduler.redis_link import Link, connect, probe, watch
from tests.redis_server import RedisServer


@pytest.mark.parametrize(
    ("before", "seen", "after", "remirror"),
    [
        (Link(), "a", Link(up=True, run_id="a"), True),  # first answer after a failed start
        (Link(up=True), "a", Link(up=True, run_id="a"), False),  # restored: in step already
        (Link(up=True, run_id="a"), "a", Link(up=True, run_id="a"), False),
        (Link(up=True, run_id="a"), "b", Link(up=True, run_id="b"), True),  # restarted
        (Link(up=True, run_id="a"), None, Link(up=False, run_id="a"), False),
        (Link(up=False, run_id="a"), None, Link(up=False, run_id="a"), False),
        (Link(up=False, run_id="a"), "a", Link(up=True, run_id="a"), True),  # back
        (Link(up=False, run_id="a"), "b", Link(up=True, run_id="b"), True),
    ],
)
def test_redis_is_remirrored_when_it_comes_back_or_is_another_instance(
    before: Link, seen: str | None, after: Link, remirror: bool
) -> None:
    assert before.after_probe(seen) == (after, remirror)


async def test_the_probe_sees_a_restart_and_asks_again_until_the_mirror_is_accepted() -> None:
    with RedisServer.start() as server:
        client = connect(server.url, timeout_s=0.5)
        asks: list[float] = []
        links: list[Link] = []
        accept = [False]

        def remirror() -> bool:
            asks.append(time.monotonic())
            return accept[0]

        first = await probe(client, 0.5)
        assert first
        task = asyncio.create_task(
            watch(
                client,
                Link(up=True, run_id=first),
                interval_s=0.05,
                timeout_s=0.5,
                remirror=remirror,
                on_change=links.append,
            )
        )
        try:
            await asyncio.sleep(0.3)
            assert asks == [] and links[-1] == Link(up=True, run_id=first)
            server.kill()
            started = time.monotonic()
            while links[-1].up:
                assert time.monotonic() - started < 5, "the probe never saw Redis go"
                await asyncio.sleep(0.02)
            assert asks == []
            server.restart()
            while not asks:
                assert time.monotonic() - started < 10, "no re-mirror after the restart"
                await asyncio.sleep(0.02)
            assert links[-1].up and links[-1].run_id != first
            await asyncio.sleep(0.3)
            assert len(asks) > 1, "a refused re-mirror is asked for again"
            accept[0] = True
            await asyncio.sleep(0.2)
            count = len(asks)
            await asyncio.sleep(0.3)
            assert len(asks) == count, "an accepted re-mirror is not asked for again"
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.aclose()


async def test_a_probe_of_a_dead_redis_fails_within_its_deadline() -> None:
    with RedisServer.start() as server:
        client = connect(server.url, timeout_s=0.5)
        server.kill()
        started = time.monotonic()
        assert await probe(client, 0.5) is None
        assert time.monotonic() - started < 1.0
        await client.aclose()
