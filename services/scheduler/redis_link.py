"""The scheduler's link to Redis: the client, whether Redis is up, and when to re-mirror.

Redis mirrors what the scheduler holds in memory (worker registry, prefix index) and keeps
the request records; the scheduler never waits on it to place. What this module owns:

* ``connect``: a client whose every call has a deadline and which retries a call once at
  once (a pooled connection to a Redis that restarted fails on first use; the retry dials
  again), never with a sleep of its own: the store decides how to back off.
* ``Link``: what the last probe saw (up, and which Redis instance: its ``run_id``).
  ``Link.after_probe`` is pure: a probe that answers after one that failed, or from another
  instance (Redis restarted, perhaps from its append-only file, perhaps empty), means Redis
  may have lost what it was sent, so the scheduler must write everything again (re-mirror).
* ``watch``: the probe loop: every ``interval_s`` ask ``INFO server`` (with a deadline) and
  call ``remirror`` when ``Link`` says so, until ``remirror`` accepts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

log = structlog.get_logger(__name__)

UNREACHABLE = (aioredis.ConnectionError, aioredis.TimeoutError, OSError, TimeoutError)
"""Errors that mean Redis cannot be reached now (as opposed to a refused command)."""


def connect(
    url: str, timeout_s: float, *, username: str | None = None, password: str | None = None
) -> aioredis.Redis:
    """A client for ``url`` that logs in as ``username`` with ``password`` (when given:
    they win over any in the URL); ``timeout_s`` bounds each connect and each reply; a call
    that fails to reach Redis is tried once more at once, then raises."""
    creds = {k: v for k, v in (("username", username), ("password", password)) if v}
    return aioredis.from_url(
        url,
        **creds,  # type: ignore[arg-type]
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
    )


@dataclass(frozen=True)
class Link:
    """What the scheduler last knew of Redis: reachable or not, and which instance."""

    up: bool = False
    run_id: str = ""
    """The ``run_id`` of the instance last seen; empty: not known yet."""

    def after_probe(self, run_id: str | None) -> tuple[Link, bool]:
        """The link after a probe that saw ``run_id`` (None: the probe failed), and whether
        Redis must be re-mirrored now.

        >>> Link(up=True, run_id="a").after_probe("a")
        (Link(up=True, run_id='a'), False)
        >>> Link(up=True, run_id="a").after_probe("b")[1]  # restarted between two probes
        True
        >>> Link(up=True, run_id="a").after_probe(None)
        (Link(up=False, run_id='a'), False)
        >>> Link(up=False, run_id="a").after_probe("a")[1]  # back after an outage
        True
        """
        if run_id is None:
            return Link(up=False, run_id=self.run_id), False
        restarted = bool(self.run_id) and run_id != self.run_id
        return Link(up=True, run_id=run_id), restarted or not self.up


async def probe(client: aioredis.Redis, timeout_s: float) -> str | None:
    """The ``run_id`` of the Redis behind ``client``, or None if it does not answer in time."""
    try:
        async with asyncio.timeout(timeout_s):
            info = await client.info("server")
    except (*UNREACHABLE, aioredis.RedisError) as exc:
        log.debug("redis_probe_failed", error=str(exc))
        return None
    return str(info.get("run_id", "")) or None


async def watch(
    client: aioredis.Redis,
    link: Link,
    *,
    interval_s: float,
    timeout_s: float,
    remirror: Callable[[], bool],
    on_change: Callable[[Link], None] = lambda _: None,
) -> None:
    """Probe Redis every ``interval_s`` from ``link`` on; call ``remirror`` when Redis may
    have lost what it was sent, and again on each probe until it returns True (accepted).
    ``on_change`` sees every new ``Link``. Runs until cancelled."""
    owed = False
    while True:
        seen, due = link.after_probe(await probe(client, timeout_s))
        if seen.up != link.up:
            log.warning("redis_up" if seen.up else "redis_down", run_id=seen.run_id)
        elif due:
            log.warning("redis_restarted", run_id=seen.run_id, was=link.run_id)
        link = seen
        on_change(link)
        owed = (owed or due) and link.up
        if owed:
            owed = not remirror()
        await asyncio.sleep(interval_s)
