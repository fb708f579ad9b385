"""Run a workload against an OpenAI-compatible server: send on the arrival pattern, record.

Lifecycle of a request: waiting for its send time (open loop, schedule) or for a free slot
(closed loop) -> dropped if its ``while_tag`` has no unfinished request left -> in flight
(``client.send_request``, bounded by ``timeout_s``) -> recorded. The run ends when every
request is recorded or dropped; nothing waits without a deadline, so it always ends.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
from tqdm import tqdm

from bench.serve.arrival import (
    Arrival,
    Concurrency,
    FixedRate,
    Poisson,
    Schedule,
    describe,
    open_loop_offsets,
)
from bench.serve.client import (
    ClientOptions,
    Endpoint,
    PromptFormat,
    http_session,
    send_request,
)
from bench.serve.result import BenchResult, RequestRecord
from bench.serve.workload import RequestSpec


def root_url(base_url: str) -> str:
    """``http://host:port`` from ``http://host:port``, ``.../`` or ``.../v1``."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def fetch_model(session: aiohttp.ClientSession, root: str, timeout_s: float) -> str:
    """The first model ``GET /v1/models`` lists; raises ``RuntimeError`` when there is none."""
    async with asyncio.timeout(timeout_s), session.get(root + "/v1/models") as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET /v1/models: HTTP {resp.status}: {await resp.text()}")
        data = (await resp.json()).get("data") or []
    if not data:
        raise RuntimeError("GET /v1/models listed no model: pass the model name")
    return str(data[0]["id"])


class _Tags:
    """Unfinished requests per tag, and an event per tag set once none is left."""

    def __init__(self, requests: Sequence[RequestSpec]) -> None:
        self.left = Counter(r.tag for r in requests)
        self.done = {tag: asyncio.Event() for tag in self.left}

    def finished(self, tag: str) -> None:
        self.left[tag] -= 1
        if self.left[tag] == 0:
            self.done[tag].set()

    def over(self, tag: str | None) -> bool:
        return tag is not None and self.left[tag] == 0


async def run_benchmark(
    base_url: str,
    requests: Sequence[RequestSpec],
    *,
    model: str | None = None,
    arrival: Arrival | None = None,
    timeout_s: float = 300.0,
    progress: bool = True,
    endpoint: Endpoint = "completions",
    prompt_format: PromptFormat = "ids",
    ignore_eos: bool = True,
    config: dict[str, Any] | None = None,
) -> BenchResult:
    """Send ``requests`` to the server at ``base_url`` and record each one.

    ``arrival``: ``Poisson`` / ``FixedRate`` (open loop; these override the specs' start
    offsets), ``Concurrency`` (closed loop), or ``Schedule`` / ``None`` (each spec at its
    ``start_offset_s``, 0 when unset). ``model``: the name to send (``None``: the first of
    ``/v1/models``). ``timeout_s``: each request's deadline. ``progress``: a tqdm bar on
    stderr. ``config`` is merged into the result's config. Records are in request order;
    requests dropped by ``while_tag`` have no record (their count is ``config["dropped"]``).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    arrival = arrival or Schedule()
    opts = ClientOptions(endpoint, prompt_format, ignore_eos, timeout_s)
    root = root_url(base_url)
    async with http_session() as session:
        if model is None:
            model = await fetch_model(session, root, timeout_s)
        tags = _Tags(requests)
        rec = Recorder(len(requests), progress)

        async def one(index: int, scheduled: float | None) -> None:
            spec = requests[index]
            if tags.over(spec.while_tag):
                rec.drop(1)
            else:
                rec.add(
                    await send_request(
                        session,
                        root,
                        spec,
                        index=index,
                        model=model,
                        opts=opts,
                        t0=rec.t0,
                        scheduled_s=scheduled,
                    )
                )
            tags.finished(spec.tag)

        try:
            if isinstance(arrival, Concurrency):
                await closed_loop(len(requests), arrival.limit, lambda i: one(i, None))
            else:
                if isinstance(arrival, Poisson | FixedRate):
                    offsets = open_loop_offsets(arrival, len(requests))
                else:
                    offsets = [r.start_offset_s or 0.0 for r in requests]
                await _open_loop(requests, offsets, rec.t0, tags, one)
        finally:
            rec.bar.close()
    return rec.result(
        {
            "base_url": base_url,
            "model": model,
            "endpoint": endpoint,
            "prompt_format": prompt_format if endpoint == "completions" else "text",
            "ignore_eos": ignore_eos,
            "timeout_s": timeout_s,
            "arrival": describe(arrival),
            "num_requests": len(requests),
            "dropped": rec.dropped,
            **(config or {}),
        }
    )


class Recorder:
    """A run's records as they come, the requests it dropped, its progress bar on stderr
    (``progress``) and its clocks: ``started_at`` (wall) and ``t0`` (``perf_counter``, the
    zero of every record's times)."""

    def __init__(self, total: int, progress: bool) -> None:
        self.records: list[RequestRecord] = []
        self.dropped = 0
        self.bar = tqdm(
            total=total, disable=not progress, unit="req", file=sys.stderr, dynamic_ncols=True
        )
        self.started_at = time.time()
        self.t0 = time.perf_counter()

    def add(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.bar.update(1)

    def drop(self, n: int) -> None:
        """``n`` requests will not be sent: they are not progress."""
        self.dropped += n
        self.bar.total -= n
        self.bar.refresh()

    def result(self, config: dict[str, Any]) -> BenchResult:
        """The records in index order; the run lasted until the last one ended."""
        records = sorted(self.records, key=lambda r: r.index)
        duration = max((r.end_s for r in records), default=0.0)
        return BenchResult(tuple(records), duration, self.started_at, config)


async def closed_loop(n: int, limit: int, one: Callable[[int], Awaitable[None]]) -> None:
    """``one(0)`` ... ``one(n - 1)`` in order, at most ``limit`` running at once."""
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < n:
            index = next_index
            next_index += 1
            await one(index)

    await asyncio.gather(*(worker() for _ in range(min(limit, n))))


async def _open_loop(
    requests: Sequence[RequestSpec],
    offsets: Sequence[float],
    t0: float,
    tags: _Tags,
    one: Callable[[int, float | None], Awaitable[None]],
) -> None:
    tasks = []
    for index in sorted(range(len(requests)), key=lambda i: offsets[i]):
        delay = t0 + offsets[index] - time.perf_counter()
        while_tag = requests[index].while_tag
        if delay > 0 and not tags.over(while_tag):
            if while_tag is None:
                await asyncio.sleep(delay)
            else:  # stop waiting once the tag is over: the request will be dropped
                try:
                    async with asyncio.timeout(delay):
                        await tags.done[while_tag].wait()
                except TimeoutError:
                    pass
        tasks.append(asyncio.create_task(one(index, offsets[index])))
    await asyncio.gather(*tasks)
