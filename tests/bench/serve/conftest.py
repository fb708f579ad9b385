"""Fixtures for the serving benchmark: the default tokenizer and fake servers to talk to."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from aiohttp import web

from bench.serve.workload import default_tokenizer
from engine.tokenizer import Tokenizer
from tests.bench.serve.fake_server import Handler, Serve, make_app, start_app


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return default_tokenizer()


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """``await serve(completions_handler, chat_handler=None)`` -> the server's root URL."""
    runners: list[web.AppRunner] = []

    async def start(completions: Handler | None, chat: Handler | None = None) -> str:
        runner, url = await start_app(make_app(completions, chat))
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
def threaded_server() -> Iterator[Callable[[web.Application], str]]:
    """Serve an app from a background thread (for code that runs its own event loop)."""
    loops: list[tuple[asyncio.AbstractEventLoop, threading.Thread, web.AppRunner]] = []

    def start(app: web.Application) -> str:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        runner, url = asyncio.run_coroutine_threadsafe(start_app(app), loop).result(timeout=10)
        loops.append((loop, thread, runner))
        return url

    yield start
    for loop, thread, runner in loops:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
