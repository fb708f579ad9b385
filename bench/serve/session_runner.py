"""Run conversations (``bench.serve.sessions``) against an OpenAI-compatible chat server.

Lifecycle of a session: waiting for one of ``concurrency`` slots (closed loop over sessions)
-> turn 0 sent -> its answer recorded -> turn 1 sent with that answer in its messages -> ...
-> done. Turns of one session go one at a time, in order; sessions run side by side. A turn
that fails ends its session: the turns after it cannot be built without its answer and are
not sent (``config["dropped"]`` counts them). Every request has the client's deadline, so
the run always ends.

``rounds``: turn-major order instead: every session's turn k is answered before any
session's turn k + 1 is sent (``concurrency`` requests at once within a round). That is
users who come back after a while: between two turns of one conversation every other
conversation takes a turn, so its KV has long left a small pool by then.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from bench.serve.arrival import Concurrency, describe
from bench.serve.client import ClientOptions, http_session, send_request
from bench.serve.result import BenchResult
from bench.serve.runner import Recorder, closed_loop, fetch_model, root_url
from bench.serve.sessions import Session, turn_request


async def run_sessions(
    base_url: str,
    sessions: Sequence[Session],
    *,
    model: str | None = None,
    concurrency: int = 4,
    timeout_s: float = 300.0,
    progress: bool = True,
    ignore_eos: bool = False,
    config: dict[str, Any] | None = None,
    rounds: bool = False,
) -> BenchResult:
    """Send every session's turns (see the module docstring); up to ``concurrency`` sessions
    at once. ``model``: the name to send (``None``: the first of ``/v1/models``).
    ``timeout_s``: each request's deadline. Records are ordered by session, then turn; a
    record's ``index`` is its place in that order whether or not the turns before it ran.
    """
    if timeout_s <= 0 or concurrency < 1:
        raise ValueError(f"need timeout_s > 0 and concurrency >= 1, got {timeout_s}, {concurrency}")
    opts = ClientOptions("chat", "ids", ignore_eos, timeout_s, keep_text=True)
    root = root_url(base_url)
    first_index = [0, *itertools.accumulate(s.turns for s in sessions)]
    total = first_index[-1]
    async with http_session() as http:
        if model is None:
            model = await fetch_model(http, root, timeout_s)
        rec = Recorder(total, progress)
        answers: list[list[str]] = [[] for _ in sessions]
        failed: set[int] = set()

        async def take_turn(i: int, turn: int) -> bool:
            """Session ``i``'s turn ``turn``; False when it failed (the session ends)."""
            session = sessions[i]
            record = await send_request(
                http,
                root,
                turn_request(session, turn, answers[i]),
                index=first_index[i] + turn,
                model=model,
                opts=opts,
                t0=rec.t0,
            )
            rec.add(record)
            if not record.ok:
                failed.add(i)
                rec.drop(session.turns - turn - 1)
                return False
            answers[i].append(record.output_text or "")
            return True

        async def converse(i: int) -> None:
            for turn in range(sessions[i].turns):
                if not await take_turn(i, turn):
                    return

        try:
            if rounds:
                await _in_rounds(sessions, failed, concurrency, take_turn)
            else:
                await closed_loop(len(sessions), concurrency, converse)
        finally:
            rec.bar.close()
    return rec.result(
        {
            "base_url": base_url,
            "model": model,
            "endpoint": "chat",
            "prompt_format": "text",
            "ignore_eos": ignore_eos,
            "timeout_s": timeout_s,
            "arrival": {**describe(Concurrency(concurrency)), "of": "sessions"},
            "turn_order": "rounds" if rounds else "sessions",
            "num_requests": total,
            "num_sessions": len(sessions),
            "dropped": rec.dropped,
            **(config or {}),
        }
    )


async def _in_rounds(
    sessions: Sequence[Session],
    failed: set[int],
    concurrency: int,
    take_turn: Callable[[int, int], Awaitable[bool]],
) -> None:
    """Every session's turn k before any session's turn k+1, up to ``concurrency`` at once;
    a session in ``failed`` takes no more turns."""
    for turn in range(max((s.turns for s in sessions), default=0)):
        due = [i for i, s in enumerate(sessions) if turn < s.turns and i not in failed]

        async def one(k: int, turn: int = turn, due: list[int] = due) -> None:
            await take_turn(due[k], turn)

        await closed_loop(len(due), concurrency, one)
