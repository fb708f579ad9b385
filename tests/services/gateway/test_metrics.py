"""The gateway's goodput counter: a request is good only when its TTFT and every one of its
inter-token gaps meet the SLO, and it finished by stop or length."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from services.gateway.backend import GenerateChunk
from services.gateway.config import load_config
from services.gateway.metrics import GatewayMetrics, LatencySlo

MODEL = "m"


def _chunk(token: int, finish: str | None = None) -> GenerateChunk:
    return GenerateChunk("x", (token,), (), finish, prompt_tokens=3, completion_tokens=token)


async def _stream(gaps_s: list[float], finish: str) -> AsyncIterator[GenerateChunk]:
    """One token now, then one after each gap; the last chunk carries ``finish``."""
    yield _chunk(1, finish if not gaps_s else None)
    for i, gap in enumerate(gaps_s, start=2):
        await asyncio.sleep(gap)
        yield _chunk(i, finish if i == len(gaps_s) + 1 else None)


def _good(slo: LatencySlo, *, waited_s: float, gaps_s: list[float], finish: str = "stop") -> int:
    metrics = GatewayMetrics(MODEL, slo)

    async def drive() -> None:
        async for _ in metrics.track(_stream(gaps_s, finish), time.monotonic() - waited_s, MODEL):
            pass

    asyncio.run(drive())
    assert metrics.request_success.labels(MODEL, finish)._value.get() == 1
    return int(metrics.goodput.labels(MODEL)._value.get())


def test_a_request_within_both_bounds_is_good() -> None:
    assert _good(LatencySlo(ttft_s=2.0, itl_s=1.0), waited_s=0.5, gaps_s=[0.01, 0.01]) == 1


def test_a_late_first_token_breaks_it() -> None:
    assert _good(LatencySlo(ttft_s=2.0, itl_s=1.0), waited_s=3.0, gaps_s=[0.01]) == 0


def test_one_slow_gap_among_fast_ones_breaks_it() -> None:
    # The mean gap is within the bound; the one stall is not.
    slo = LatencySlo(ttft_s=2.0, itl_s=0.05)
    assert _good(slo, waited_s=0.0, gaps_s=[0.0, 0.0, 0.0, 0.0, 0.12]) == 0


def test_unset_bounds_are_not_checked_but_failures_never_count() -> None:
    assert _good(LatencySlo(), waited_s=100.0, gaps_s=[0.06]) == 1
    assert _good(LatencySlo(itl_s=0.01), waited_s=100.0, gaps_s=[]) == 1  # no gap to break
    assert _good(LatencySlo(), waited_s=0.0, gaps_s=[0.0], finish="length") == 1
    assert _good(LatencySlo(), waited_s=0.0, gaps_s=[0.0], finish="abort") == 0
    assert _good(LatencySlo(), waited_s=0.0, gaps_s=[0.0], finish="error") == 0


def test_the_counter_is_exported_at_zero_and_configured_in_milliseconds() -> None:
    text = GatewayMetrics(MODEL).render().decode()
    assert f'pdserve:request_goodput_total{{model_name="{MODEL}"}} 0.0' in text
    # ... as are the finished requests it is compared with, so rate() sees their first one
    assert f'request_success_total{{finished_reason="stop",model_name="{MODEL}"}} 0.0' in text
    cfg = load_config(["--slo-ttft-ms", "500"], {"PDSERVE_GATEWAY_SLO_ITL_MS": "40"})
    assert LatencySlo.from_ms(cfg.slo_ttft_ms, cfg.slo_itl_ms) == LatencySlo(0.5, 0.04)
    assert LatencySlo.from_ms(None, None) == LatencySlo()
    with pytest.raises(SystemExit):
        load_config(["--slo-itl-ms", "0"], {})
