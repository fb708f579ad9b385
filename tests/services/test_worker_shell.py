"""The worker process shell's settings: the GIL switch interval, pinning, environment defaults."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from services.common.worker import apply_switch_interval
from services.decode.__main__ import build_parser as decode_parser
from services.prefill.__main__ import build_parser as prefill_parser


@pytest.fixture
def restore_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("parser", [decode_parser, prefill_parser])
def test_workers_default_to_a_short_switch_interval(parser, restore_interval: None) -> None:
    args = parser().parse_args([])
    assert args.switch_interval_ms == 0.5
    assert apply_switch_interval(args) == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    args = parser().parse_args(["--switch-interval-ms", "2"])
    assert apply_switch_interval(args) == pytest.approx(0.002)


@pytest.mark.parametrize("bad", ["0", "-1", "101", "fast"])
def test_switch_interval_out_of_range_is_a_usage_error(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        decode_parser().parse_args(["--switch-interval-ms", bad])
    assert exc.value.code == 2
    assert "--switch-interval-ms" in capsys.readouterr().err


def test_pin_plan_puts_decode_workers_first_and_away_from_the_control_plane() -> None:
    from services.up import pin_plan

    # two cores, control plane on 0: the decode worker gets the free core
    assert pin_plan(["prefill-0", "decode-0"], [0, 1], {0}) == {"decode-0": 1, "prefill-0": 0}
    assert pin_plan(["colocated-0"], [0, 1], {0}) == {"colocated-0": 1}
    # more workers than free cores: round-robin over free cores, then control cores
    assert pin_plan(["prefill-0", "prefill-1", "decode-0", "decode-1"], [0, 1, 2, 3], {0}) == {
        "decode-0": 1, "decode-1": 2, "prefill-0": 3, "prefill-1": 0,
    }  # fmt: skip
    # no control plane pinned: decode workers still come first
    assert pin_plan(["prefill-0", "decode-0"], [4, 5], None) == {"decode-0": 4, "prefill-0": 5}


def test_pinned_workers_keep_the_core_for_the_engine_thread_and_share_free_control_cores() -> None:
    from services.up import worker_placement

    # a control core no worker computes on: the process may also run there, the engine
    # thread only on its core
    assert worker_placement("colocated-0", {"colocated-0": 1}, {0}) == (
        {0, 1}, ["--engine-cpus", "1"],
    )  # fmt: skip
    plan = {"decode-0": 1, "decode-1": 2, "prefill-0": 3}
    assert worker_placement("decode-0", plan, {0}) == ({0, 1}, ["--engine-cpus", "1"])
    assert worker_placement("prefill-0", plan, {0, 1}) == ({0, 3}, ["--engine-cpus", "3"])
    # the only control core runs a prefill worker: nothing spare, whole process on its core
    two = {"decode-0": 1, "prefill-0": 0}
    assert worker_placement("decode-0", two, {0}) == ({1}, [])
    assert worker_placement("prefill-0", two, {0}) == ({0}, [])
    # no control cores named: the whole process on its core
    assert worker_placement("decode-0", {"decode-0": 1}, None) == ({1}, [])
    # not pinned at all
    assert worker_placement("decode-0", {}, {0}) == (None, [])
    # the flag it hands out is one both workers parse
    for parser in (decode_parser, prefill_parser):
        assert parser().parse_args(["--engine-cpus", "0"]).engine_cpus == {0}


@pytest.mark.parametrize("bad", ["", "x", "0,y", "-1", "100000"])
def test_engine_cpus_outside_the_process_cores_is_a_usage_error(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        decode_parser().parse_args(["--engine-cpus", bad])
    assert exc.value.code == 2
    assert "--engine-cpus" in capsys.readouterr().err


def test_kv_tcp_congestion_flows_from_pdserve_up_to_the_prefill_workers_tcp_transport(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse

    from services.prefill.__main__ import main as prefill_main
    from services.prefill.__main__ import transport_options
    from services.up import add_up_flags, prefill_flags

    up = argparse.ArgumentParser()
    add_up_flags(up)
    assert prefill_flags(up.parse_args([])) == []
    flags = prefill_flags(up.parse_args(["--kv-tcp-congestion", "reno"]))
    args = prefill_parser().parse_args(flags)
    assert transport_options(args, "tcp") == {"congestion": "reno"}
    assert transport_options(args, "shm") == {}
    assert transport_options(prefill_parser().parse_args([]), "tcp") == {}
    # A name the kernel refuses is a usage error at startup, before anything runs.
    with pytest.raises(SystemExit) as exc:
        prefill_main(["--kv-tcp-congestion", "no-such-cc"])
    assert exc.value.code == 2
    assert "cannot use TCP congestion control 'no-such-cc'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        up.parse_args(["--kv-tcp-congestion", "no-such-cc"])
    assert exc.value.code == 2
    assert "--kv-tcp-congestion: cannot use" in capsys.readouterr().err


def test_a_bad_environment_default_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PDSERVE_PREFILL_KV_TCP_CONGESTION", "no-such-cc")
    with pytest.raises(SystemExit) as exc:
        prefill_parser()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "PDSERVE_PREFILL_KV_TCP_CONGESTION='no-such-cc'" in err
    assert "cannot use TCP congestion control" in err
    monkeypatch.setenv("PDSERVE_PREFILL_KV_TCP_CONGESTION", "reno")
    assert prefill_parser().parse_args([]).kv_tcp_congestion == "reno"
    monkeypatch.setenv("PDSERVE_DECODE_PORT", "many")
    with pytest.raises(SystemExit) as exc:
        decode_parser()
    assert exc.value.code == 2
    assert "PDSERVE_DECODE_PORT='many'" in capsys.readouterr().err
