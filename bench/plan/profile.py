"""A measured performance profile of one worker, and its JSON file.

A ``Profile`` holds what the planner (``bench/plan/model.py``) needs to know about one
worker process (one engine on ``threads`` cores), as measured by ``bench/plan/measure.py``:

- prefill seconds of an uncached prompt of P tokens, at a few P;
- decode step seconds at a small grid of (batch size, context tokens per sequence);
- optionally the KV bytes per token, the number of layers, and the KV transfer rate in
  bytes/s of a transport (the prefill worker pushing a prompt's KV into a decode worker).

Lookups between and beyond the measured points (pure functions, documented here once):

- ``prefill_seconds(P)``: linear between neighbouring measured points; below the first
  point and above the last, proportional to P through that end point
  (``t(P) = t_end * P / P_end``). Proportional growth ignores attention's quadratic term, so
  a prompt far above the largest measured one is underestimated: measure up to the prompt
  lengths you plan for.
- ``decode_step_seconds(b, c)``: bilinear inside the grid, done separably: each measured
  batch row is looked up at context c, then the rows are looked up at batch b. Along each
  axis a value below the first grid point takes the first point's value (clamped: a smaller
  batch or shorter context never costs more), and a value above the last point extrapolates
  linearly with the last segment's slope, floored at zero (a bigger batch or longer context
  never costs less). An axis with one point is constant along it.

``Profile.to_dict`` / ``Profile.from_dict`` round-trip through JSON; ``save`` / ``load``
read and write the file. Every malformed input raises ``ProfileError`` naming the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

PROFILE_FORMAT = "pdserve-plan-profile/1"


class ProfileError(ValueError):
    """A profile is malformed, or its file is missing or unreadable."""


def interp_proportional(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Linear between points of increasing ``xs``; proportional to ``x`` beyond either end."""
    if x <= xs[0]:
        return ys[0] * x / xs[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    return _between(xs, ys, x)


def interp_clamped_linear(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Linear between points of increasing ``xs``; ``ys[0]`` below the first point; above the
    last, linear with the last segment's slope floored at zero. One point: constant."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + max(0.0, slope) * (x - xs[-1])
    return _between(xs, ys, x)


def _between(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    hi = next(i for i, v in enumerate(xs) if v >= x)
    lo = hi - 1
    w = (x - xs[lo]) / (xs[hi] - xs[lo])
    return ys[lo] + w * (ys[hi] - ys[lo])


@dataclass(frozen=True)
class Profile:
    """Measured figures of one worker; ``decode_step_s[i][j]`` is at ``decode_batches[i]``
    and ``decode_contexts[j]``. Axes strictly increase; every time is positive and finite."""

    prefill_tokens: tuple[int, ...]
    prefill_s: tuple[float, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_step_s: tuple[tuple[float, ...], ...]
    kv_bytes_per_token: int | None = None
    num_layers: int | None = None
    kv_transfer_bytes_per_s: float | None = None
    kv_transfer_transport: str | None = None
    threads: int = 1
    model: str = ""
    dtype: str = "float32"
    created: str = ""
    machine: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Lists are accepted and stored as tuples, so equal figures compare equal.
        for name in ("prefill_tokens", "prefill_s", "decode_batches", "decode_contexts"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.decode_step_s, list):
            rows = tuple(tuple(r) if isinstance(r, list) else r for r in self.decode_step_s)
            object.__setattr__(self, "decode_step_s", rows)
        _axis("prefill_tokens", self.prefill_tokens)
        _times("prefill_s", self.prefill_s, len(self.prefill_tokens))
        _axis("decode_batches", self.decode_batches)
        _axis("decode_contexts", self.decode_contexts)
        if not isinstance(self.decode_step_s, tuple) or len(self.decode_step_s) != len(
            self.decode_batches
        ):
            raise ProfileError(
                f"decode_step_s must have one row per decode batch ({len(self.decode_batches)})"
            )
        for i, row in enumerate(self.decode_step_s):
            _times(f"decode_step_s[{i}]", row, len(self.decode_contexts))
        for name in ("kv_bytes_per_token", "num_layers"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ProfileError(f"{name} must be an integer >= 1 or null, got {value!r}")
        rate = self.kv_transfer_bytes_per_s
        if rate is not None and not _positive(rate):
            raise ProfileError(f"kv_transfer_bytes_per_s must be > 0 or null, got {rate!r}")
        transport = self.kv_transfer_transport
        if transport is not None and not isinstance(transport, str):
            raise ProfileError(f"kv_transfer_transport must be a string or null, got {transport!r}")
        if not _is_int(self.threads) or self.threads < 1:
            raise ProfileError(f"threads must be an integer >= 1, got {self.threads!r}")

    # -- lookups ---------------------------------------------------------------------
    def prefill_seconds(self, tokens: float) -> float:
        """Seconds to prefill an uncached prompt of ``tokens`` tokens (see module doc)."""
        return interp_proportional(self.prefill_tokens, self.prefill_s, tokens)

    def decode_step_seconds(self, batch: float, context: float) -> float:
        """Seconds of one decode step of ``batch`` sequences holding ``context`` tokens each."""
        rows = [
            interp_clamped_linear(self.decode_contexts, row, context) for row in self.decode_step_s
        ]
        return interp_clamped_linear(self.decode_batches, rows, batch)

    def transfer_seconds(self, tokens: float) -> float | None:
        """Seconds to move ``tokens`` tokens of KV, or None without the two figures."""
        if self.kv_bytes_per_token is None or self.kv_transfer_bytes_per_s is None:
            return None
        return tokens * self.kv_bytes_per_token / self.kv_transfer_bytes_per_s

    # -- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "prefill": {"tokens": list(self.prefill_tokens), "seconds": list(self.prefill_s)},
            "decode": {
                "batches": list(self.decode_batches),
                "contexts": list(self.decode_contexts),
                "step_seconds": [list(row) for row in self.decode_step_s],
            },
            "kv": {
                "bytes_per_token": self.kv_bytes_per_token,
                "num_layers": self.num_layers,
                "transfer_bytes_per_s": self.kv_transfer_bytes_per_s,
                "transfer_transport": self.kv_transfer_transport,
            },
            "threads": self.threads,
            "model": self.model,
            "dtype": self.dtype,
            "created": self.created,
            "machine": dict(self.machine),
        }

    @classmethod
    def from_dict(cls, data: object) -> Profile:
        """Inverse of ``to_dict``; raises ``ProfileError`` naming the first bad field."""
        top = _section("profile", data)
        if top.get("format") != PROFILE_FORMAT:
            raise ProfileError(
                f"not a pdserve plan profile: format is {top.get('format')!r}, "
                f"expected {PROFILE_FORMAT!r}"
            )
        prefill = _section("prefill", top.get("prefill"))
        decode = _section("decode", top.get("decode"))
        kv = _section("kv", top.get("kv", {}))
        rows = _list("decode.step_seconds", decode.get("step_seconds"))
        machine = top.get("machine", {})
        if not isinstance(machine, Mapping):
            raise ProfileError("machine must be an object")
        try:
            return cls(
                prefill_tokens=tuple(_list("prefill.tokens", prefill.get("tokens"))),
                prefill_s=tuple(_list("prefill.seconds", prefill.get("seconds"))),
                decode_batches=tuple(_list("decode.batches", decode.get("batches"))),
                decode_contexts=tuple(_list("decode.contexts", decode.get("contexts"))),
                decode_step_s=tuple(
                    tuple(_list(f"decode.step_seconds[{i}]", row)) for i, row in enumerate(rows)
                ),
                kv_bytes_per_token=kv.get("bytes_per_token"),
                num_layers=kv.get("num_layers"),
                kv_transfer_bytes_per_s=kv.get("transfer_bytes_per_s"),
                kv_transfer_transport=kv.get("transfer_transport"),
                threads=top.get("threads", 1),
                model=str(top.get("model", "")),
                dtype=str(top.get("dtype", "float32")),
                created=str(top.get("created", "")),
                machine=dict(machine),
            )
        except TypeError as exc:  # a string where a number belongs, compared or divided
            raise ProfileError(f"profile has a value of the wrong type: {exc}") from exc

    def save(self, path: str | Path) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile file; a missing, unreadable or malformed file is a ``ProfileError``."""
        try:
            text = Path(path).read_text()
        except FileNotFoundError as exc:
            raise ProfileError(
                f"profile file {str(path)!r} not found "
                "(measure one with `pdserve plan profile --out FILE`)"
            ) from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise ProfileError(f"cannot read profile file {str(path)!r}: {exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile file {str(path)!r} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data)
        except ProfileError as exc:
            raise ProfileError(f"profile file {str(path)!r}: {exc}") from exc


# -- validation helpers -------------------------------------------------------------------
def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: object) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0  # type: ignore[arg-type]


def _axis(name: str, values: object) -> None:
    if not isinstance(values, tuple) or not values:
        raise ProfileError(f"{name} must be a non-empty list")
    if not all(_is_int(v) and v >= 1 for v in values):
        raise ProfileError(f"{name} must hold integers >= 1, got {list(values)}")
    if any(b <= a for a, b in pairwise(values)):
        raise ProfileError(f"{name} must strictly increase, got {list(values)}")


def _times(name: str, values: object, length: int) -> None:
    if not isinstance(values, tuple) or len(values) != length:
        raise ProfileError(f"{name} must hold {length} value(s)")
    if not all(_positive(v) for v in values):
        raise ProfileError(f"{name} must hold positive finite seconds, got {list(values)}")


def _section(name: str, value: object) -> Mapping[str, Any]:
    if value is None:
        raise ProfileError(f"the {name} section is missing")
    if not isinstance(value, Mapping):
        raise ProfileError(f"{name} must be an object, got {type(value).__name__}")
    return value


def _list(name: str, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise ProfileError(f"{name} must be a list, got {type(value).__name__}")
    return value
