"""Mooncake's public trace format (FAST'25 traces): read and write it, nothing else.

One request per line, JSON: ``timestamp`` (ms since the trace started), ``input_length``
and ``output_length`` (tokens), ``hash_ids`` (the ids of the prompt's ``BLOCK_TOKENS``-token
prefix blocks, in order; the last block may be partial). Two requests whose ``hash_ids``
open with the same run share that much prompt prefix, so requests that share anything share
their first id: a multi-turn conversation (or every conversation over one system prompt)
appears as the requests with one first hash id. Other fields are ignored; blank lines are
skipped. A line that breaks the format raises ``TraceFormatError`` naming its file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 512


class TraceFormatError(ValueError):
    """A trace that cannot be read: the message names the file and the line."""


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace (lengths in the trace's tokens, before any scaling)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def group(self) -> int | None:
        """The first hash id: requests that share any prefix share it (``None``: no ids)."""
        return self.hash_ids[0] if self.hash_ids else None

    def to_json_line(self) -> str:
        ts = self.timestamp_ms
        return json.dumps({
            "timestamp": int(ts) if float(ts).is_integer() else ts,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        })  # fmt: skip


def _int(obj: dict[str, Any], key: str, low: int) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key!r} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{key!r} must be >= {low}, got {value}")
    return value


def parse_line(text: str) -> TraceRequest:
    """One non-blank line; ``ValueError`` saying what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not 0 <= ts < float("inf"):
        raise ValueError(f"'timestamp' must be a number of ms >= 0, got {ts!r}")
    ids = obj.get("hash_ids", [])
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise ValueError(f"'hash_ids' must be a list of integers, got {str(ids)[:80]}")
    return TraceRequest(
        timestamp_ms=float(ts),
        input_length=_int(obj, "input_length", 1),
        output_length=_int(obj, "output_length", 0),
        hash_ids=tuple(ids),
    )


def parse_trace(lines: Iterable[str | bytes], source: str = "trace") -> list[TraceRequest]:
    """The requests of ``lines``, in file order; ``TraceFormatError`` on the first bad line
    (``source:LINE: why``) or when there is no request at all."""
    out = []
    for number, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            if text.strip():
                out.append(parse_line(text))
        except (UnicodeDecodeError, ValueError) as exc:
            raise TraceFormatError(f"{source}:{number}: {exc}") from None
    if not out:
        raise TraceFormatError(f"{source}: no requests in the trace")
    return out


def read_trace(path: Path) -> list[TraceRequest]:
    """The requests of the JSONL file at ``path`` (see ``parse_trace``); an unreadable file
    is a ``TraceFormatError`` too."""
    try:
        with path.open("rb") as f:
            return parse_trace(f, str(path))
    except OSError as exc:
        raise TraceFormatError(f"cannot read the trace {path}: {exc.strerror or exc}") from None


def write_trace(path: Path, requests: Iterable[TraceRequest]) -> None:
    """Write ``requests`` to ``path`` as JSONL, one per line, in the order given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(r.to_json_line() + "\n" for r in requests))
