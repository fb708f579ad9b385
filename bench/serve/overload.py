"""The ``overload`` workload: many more clients than the server can serve, and see that it
stays well-behaved.

Phases, one after the other:

1. quiet: ``streams`` clients in a closed loop (each sends a streaming request, reads it to
   the end, sends the next) for ``quiet_s``;
2. overload, for ``overload_s``: the same clients, plus ``flood`` more in a closed loop (a
   refused one waits ``retry_s`` and tries again), ``stalled`` clients that send a streaming
   request and never read a byte (held until the phase ends), and ``huge`` prompts of
   ``huge_mib`` MiB each (chat, one every second);
3. after: each of the ``streams`` clients sends one more request.

Verdict (``verdict``): PASS when nothing timed out; every request of the overload phase
completed or was refused (429 / 503) within ``REFUSE_WITHIN_S``; every huge prompt was
refused with a 4xx within ``REFUSE_WITHIN_S``; the admitted streams' ITL P99 in the overload
phase is within ``ITL_RATIO`` x the quiet phase's ITL P50; and every request after it
succeeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from bench.serve.client import ClientOptions, http_session, send_request
from bench.serve.metrics import itls, percentile
from bench.serve.result import RequestRecord
from bench.serve.runner import fetch_model, root_url
from bench.serve.workload import RequestSpec

REFUSE_WITHIN_S = 1.0
ITL_RATIO = 3.0
REFUSED = (429, 503)


@dataclass(frozen=True)
class OverloadConfig:
    streams: int = 16
    flood: int = 48
    stalled: int = 8
    huge: int = 3
    huge_mib: float = 3.0
    quiet_s: float = 20.0
    overload_s: float = 30.0
    retry_s: float = 1.0
    timeout_s: float = 120.0


@dataclass(frozen=True)
class Phase:
    """What one phase's requests did (``records`` tagged by client kind)."""

    name: str
    records: tuple[RequestRecord, ...]

    def admitted(self) -> list[RequestRecord]:
        return [r for r in self.records if r.status == 200 and r.tag != "huge"]

    def itl_ms(self) -> list[float]:
        return [g * 1000 for r in self.admitted() for g in itls(r)]


async def _closed_loop(
    session: aiohttp.ClientSession,
    root: str,
    specs: Sequence[RequestSpec],
    model: str,
    opts: ClientOptions,
    t0: float,
    until: float,
    tag: str,
    retry_s: float,
    out: list[RequestRecord],
) -> None:
    i = 0
    while time.perf_counter() < until:
        spec = specs[i % len(specs)]
        spec = RequestSpec(spec.prompt_ids, spec.prompt_text, spec.output_tokens, tag=tag)
        r = await send_request(session, root, spec, index=len(out), model=model, opts=opts, t0=t0)
        out.append(r)
        i += 1
        if r.status in REFUSED:
            await asyncio.sleep(retry_s)


async def _stalled(root: str, model: str, spec: RequestSpec, until: float) -> None:
    """Send a streaming request on a socket that is never read, and hold it until ``until``."""
    url = urlsplit(root)
    body = json.dumps({"model": model, "prompt": list(spec.prompt_ids), "stream": True,
                       "max_tokens": spec.output_tokens, "ignore_eos": True}).encode()  # fmt: skip
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, (url.hostname or "127.0.0.1", url.port or 80))
        await loop.sock_sendall(sock, head.encode() + body)
        await asyncio.sleep(max(0.0, until - time.perf_counter()))
    except OSError:
        pass  # refused or cut by the server: what it may do to a client that never reads
    finally:
        sock.close()


async def _huge(
    session: aiohttp.ClientSession, root: str, model: str, mib: float, index: int, t0: float
) -> RequestRecord:
    text = "lorem ipsum dolor sit amet " * int(mib * (1 << 20) / 27)
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
            "max_tokens": 16}  # fmt: skip
    send_s = time.perf_counter() - t0
    status, error = 0, None
    try:
        async with asyncio.timeout(60), session.post(root + "/v1/chat/completions", json=body) as r:
            status = r.status
            error = (await r.text())[:300] if status != 200 else None
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    end_s = time.perf_counter() - t0
    return RequestRecord(index, "huge", send_s, end_s, (), 0, 0, 16, status, error)


async def run_overload(
    base_url: str, specs: Sequence[RequestSpec], cfg: OverloadConfig, model: str | None = None
) -> list[Phase]:
    """Run the three phases against ``base_url``; ``specs``: the streams' requests."""
    root = root_url(base_url)
    opts = ClientOptions("completions", "ids", True, cfg.timeout_s)
    async with http_session() as session:
        model = model or await fetch_model(session, root, cfg.timeout_s)
        t0 = time.perf_counter()

        async def loops(n: int, tag: str, seconds: float, out: list[RequestRecord]) -> None:
            until = time.perf_counter() + seconds
            await asyncio.gather(*(
                _closed_loop(session, root, specs[i::n] or specs, model, opts, t0, until, tag,
                             cfg.retry_s, out)
                for i in range(n)
            ))  # fmt: skip

        quiet: list[RequestRecord] = []
        await loops(cfg.streams, "stream", cfg.quiet_s, quiet)

        busy: list[RequestRecord] = []
        until = time.perf_counter() + cfg.overload_s
        stalled = [asyncio.create_task(_stalled(root, model, specs[0], until))
                   for _ in range(cfg.stalled)]  # fmt: skip
        huge_tasks = []

        async def huge_later() -> None:
            for i in range(cfg.huge):
                await asyncio.sleep(1.0)
                huge_tasks.append(await _huge(session, root, model, cfg.huge_mib, i, t0))

        await asyncio.gather(
            loops(cfg.streams, "stream", cfg.overload_s, busy),
            loops(cfg.flood, "flood", cfg.overload_s, busy),
            huge_later(),
        )
        for task in stalled:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        busy.extend(huge_tasks)

        after = await asyncio.gather(*(
            send_request(session, root, specs[i % len(specs)], index=i, model=model, opts=opts,
                         t0=t0)
            for i in range(cfg.streams)
        ))  # fmt: skip
    return [Phase("quiet", tuple(quiet)), Phase("overload", tuple(busy)),
            Phase("after", tuple(after))]  # fmt: skip


def _count(records: Sequence[RequestRecord], pred: Any) -> int:
    return sum(1 for r in records if pred(r))


def verdict(phases: Sequence[Phase]) -> tuple[bool, list[str]]:
    """The PASS/FAIL rule of the module docstring, and one line per figure."""
    quiet, busy, after = phases
    lines, ok = [], True
    q = quiet.itl_ms()
    b = busy.itl_ms()
    q50 = percentile(q, 50.0) if q else float("nan")
    b99 = percentile(b, 99.0) if b else float("nan")
    ratio = b99 / q50 if q and b else float("inf")
    lines.append(f"quiet: {len(quiet.admitted())} requests served, ITL P50 {q50:.1f} ms, "
                 f"P99 {percentile(q, 99.0) if q else float('nan'):.1f} ms")  # fmt: skip
    served = busy.admitted()
    refused = [r for r in busy.records if r.status in REFUSED]
    slow_refusals = [r for r in refused if r.end_s - r.send_s > REFUSE_WITHIN_S]
    other = [r for r in busy.records if r.tag != "huge" and r.status not in (200, *REFUSED)]
    failed_served = [r for r in served if not r.ok]
    lines.append(
        f"overload: {len(served)} served ({len(failed_served)} failed mid-stream), "
        f"{len(refused)} refused (429/503), {len(slow_refusals)} of them after more than "
        f"{REFUSE_WITHIN_S:g} s, {len(other)} other outcomes"
    )
    refusal_s = [r.end_s - r.send_s for r in refused]
    if refusal_s:
        lines.append(f"  refusal time P50 {percentile(refusal_s, 50.0) * 1000:.1f} ms, "
                     f"max {max(refusal_s) * 1000:.1f} ms")  # fmt: skip
    lines.append(f"  admitted streams' ITL P99 {b99:.1f} ms = {ratio:.2f}x the quiet P50 "
                 f"(target <= {ITL_RATIO:g}x)")  # fmt: skip
    huge = [r for r in busy.records if r.tag == "huge"]
    huge_ok = all(400 <= r.status < 500 and r.end_s - r.send_s <= REFUSE_WITHIN_S for r in huge)
    times = ", ".join(f"{r.status} in {(r.end_s - r.send_s) * 1000:.0f} ms" for r in huge)
    lines.append(f"  huge prompts: {times or 'none'}")
    after_ok = all(r.ok for r in after.records)
    lines.append(f"after: {_count(after.records, lambda r: r.ok)}/{len(after.records)} served")
    ok = (
        not slow_refusals
        and not other
        and not failed_served
        and huge_ok
        and ratio <= ITL_RATIO
        and after_ok
    )
    lines.append("verdict: " + ("PASS" if ok else "FAIL"))
    return ok, lines
