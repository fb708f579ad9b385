"""Tuning: the thread layout of an engine process, checked, applied once at start."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from services.common import process
from services.common.tuning import Tuning
from services.decode.config import load_config as decode_config
from services.gateway.config import load_config as gateway_config
from services.prefill.config import load_config as prefill_config

LOADERS = [decode_config, prefill_config, gateway_config]


@pytest.fixture
def restore_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("load", LOADERS)
def test_engine_processes_share_one_tuning_with_a_short_switch_interval(
    load, restore_interval: None
) -> None:
    tuning = load([], {}).tuning
    assert tuning == Tuning()
    assert tuning.apply() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert load(["--switch-interval-ms", "2"], {}).tuning.apply() == pytest.approx(0.002)


def test_engine_options_carry_pinning_and_the_delivery_wait() -> None:
    assert Tuning().engine_options() == {"cpus": None, "delivery_wait_s": 0.002}
    tuning = prefill_config(["--engine-cpus", "0", "--delivery-wait-ms", "0"], {}).tuning
    assert tuning.engine_options() == {"cpus": frozenset({0}), "delivery_wait_s": 0.0}


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--switch-interval-ms", "0"], "switch_interval_ms must be in (0, 100]"),
        (["--switch-interval-ms", "101"], "switch_interval_ms must be in (0, 100]"),
        (["--switch-interval-ms", "fast"], "argument --switch-interval-ms"),
        (["--delivery-wait-ms", "-1"], "delivery_wait_ms must be >= 0"),
        (["--engine-cpus", "x"], "argument --engine-cpus"),
        (["--engine-cpus", "0,y"], "argument --engine-cpus"),
        (["--engine-cpus", "-1"], "argument --engine-cpus"),
        (["--engine-cpus", "100000"], "argument --engine-cpus"),
    ],
)
def test_bad_tuning_is_a_usage_error(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        decode_config(argv, {})
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_the_shell_applies_tuning_once_before_the_service_runs(
    restore_interval: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(process, "configure_logging", lambda service, level: None)
    seen: list[float] = []

    async def main() -> int:
        seen.append(sys.getswitchinterval())
        return 0

    assert process.run("test", "info", main(), Tuning(switch_interval_ms=0.25)) == 0
    assert seen == [pytest.approx(0.00025)]
