"""Tiny fake OpenAI-compatible servers: SSE helpers and an app with /v1/models."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MODEL = "fake-model"
Serve = Callable[..., Awaitable[str]]


def sse(obj: dict[str, Any] | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


def completion_chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text,
            "finish_reason": finish}]}  # fmt: skip


def usage_chunk(prompt: int, completion: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


async def start_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return resp


def make_app(completions: Handler | None, chat: Handler | None = None) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    if completions is not None:
        app.router.add_post("/v1/completions", completions)
    if chat is not None:
        app.router.add_post("/v1/chat/completions", chat)
    return app


async def start_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"
