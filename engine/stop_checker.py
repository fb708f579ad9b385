"""Find stop strings in streamed text without ever emitting any part of one."""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Scan detokenized text, delta by delta, for a request's stop strings.

    ``feed`` returns the text that is safe to emit: text that could still be the start of a
    stop string is held back until later text rules it in or out, so at most
    ``max(len(s) for s in stop) - 1`` characters are ever held. The stream stops at the first
    occurrence to *complete* (smallest end offset; among occurrences ending together, the one
    starting earliest), which is also the first any streaming check could see; the output is
    the text before that occurrence. This matches "earliest start" except when one stop string
    contains another strictly inside it. The result does not depend on how the text is
    chunked into deltas.

    ``include_stop``: the output runs to the end of the matched stop string instead (vLLM's
    ``include_stop_str_in_output``); which occurrence stops the stream is the same.

    Once ``feed`` has reported a stop, or ``flush`` has ended the stream, any further call
    raises ``RuntimeError``.
    """

    def __init__(self, stop: Sequence[str], *, include_stop: bool = False) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single str")
        for entry in stop:
            if not isinstance(entry, str) or not entry:
                raise ValueError(f"stop strings must be non-empty str, got {entry!r}")
        self._stop = tuple(dict.fromkeys(stop))
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1
        self._include_stop = include_stop
        self._held = ""
        self._finished = False
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has been seen."""
        return self._stopped

    @property
    def held(self) -> str:
        """Text received but not yet emitted because a stop string may start in it."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        """Take the next chunk; return ``(text safe to emit now, stopped)``.

        When ``stopped`` is True the returned text ends right before the stop string (right
        after it with ``include_stop``).
        """
        if self._finished:
            raise RuntimeError("StopChecker has already finished; feed() is no longer valid")
        if not self._stop:
            return delta, False
        text = self._held + delta
        match = self._first_stop(text)
        if match is not None:
            self._finished = self._stopped = True
            self._held = ""
            start, end = match
            return text[: end if self._include_stop else start], True
        keep = self._longest_pending_suffix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """End of stream without a stop: return whatever is still held back."""
        if self._finished:
            raise RuntimeError("StopChecker has already finished; flush() is no longer valid")
        self._finished = True
        held, self._held = self._held, ""
        return held

    def _first_stop(self, text: str) -> tuple[int, int] | None:
        # All earlier text was emitted only after it was proven not to start a stop string, so
        # every occurrence that has completed is inside ``text``; the earliest end wins.
        best_end: int | None = None
        best_start = 0
        for s in self._stop:
            start = text.find(s)
            if start < 0:
                continue
            end = start + len(s)
            if best_end is None or end < best_end or (end == best_end and start < best_start):
                best_end, best_start = end, start
        return None if best_end is None else (best_start, best_end)

    def _longest_pending_suffix(self, text: str) -> int:
        # Longest suffix of ``text`` that is a proper prefix of some stop string. Every shorter
        # potential start lies inside it, so holding it back is enough.
        for length in range(min(len(text), self._max_hold), 0, -1):
            tail = text[len(text) - length :]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0
