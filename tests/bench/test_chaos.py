"""``bench/chaos``: the pure parts (plan, parsing, verdicts), then a small chaos run against
a real stack (decode workers over shm and tcp; over mooncake in the slow run): 32 greedy
requests through injected transfer faults and kill -9 of a prefill worker, a decode worker,
Redis and the KV store's master, the requests sharing a preamble the store serves, meeting
the whole acceptance."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.chaos import probes
from bench.chaos.client import Outcome
from bench.chaos.disruptions import Kill, plan
from bench.chaos.report import ChaosReport, acceptance, count_outcomes, mismatches, render
from bench.chaos.runner import ChaosConfig, run


def _outcome(i: int, *, text: str = "a", error: str | None = None, hung: bool = False) -> Outcome:
    return Outcome(i, "q", f"chatcmpl-{i}", text, "length", error, hung, 1.0)


def _report(**changes: object) -> ChaosReport:
    base = ChaosReport(
        config={}, date="", wall_s=1.0, phases_s={}, requests=100, completed=100, failed=0,
        hung=0, error_causes={}, hung_requests=[], migrations_by_cause={},
        migrated_requests={}, migrated_completed=0, mismatches=[],
        free_blocks_before={"decode-0": 9, "decode-1": 9},
        free_blocks_after={"decode-0": 7, "decode-1": 9}, free_blocks_wait_s=0.0,
        disrupted={"decode-0": "killed"}, shm_bytes_before=0, shm_bytes_after=0, shm_left={},
        shm_swept=[], kills=[], supervisor=[], supervisor_stopped=None, outcomes=[],
    )  # fmt: skip
    return replace(base, **changes)  # type: ignore[arg-type]


def test_the_plan_kills_in_order_and_only_what_was_asked() -> None:
    assert plan(40, kill_prefill=True, kill_decode=True, restart_redis=True) == (
        Kill("prefill-0", 13), Kill("decode-0", 20), Kill("redis", 26)
    )  # fmt: skip
    assert plan(40, kill_prefill=False, kill_decode=False, restart_redis=True) == (
        Kill("redis", 26),
    )
    assert plan(40, kill_prefill=True, kill_decode=False, restart_redis=False,
                restart_kv_store=True) == (Kill("prefill-0", 13), Kill("kv-store", 33))  # fmt: skip


def test_outcomes_are_counted_and_causes_grouped_without_ids() -> None:
    outs = [
        _outcome(0),
        _outcome(1, error="HTTP 503: no worker for chatcmpl-0123456789abcdef"),
        _outcome(2, error="HTTP 503: no worker for chatcmpl-fedcba9876543210"),
        _outcome(3, hung=True),
    ]
    assert count_outcomes(outs) == (1, 2, 1, {"HTTP 503: no worker for chatcmpl-…": 2})
    found = mismatches([_outcome(0, text="b"), _outcome(1)], {"q": "a"}, {"chatcmpl-0": ["x"]})
    assert [(m.index, m.migrated) for m in found] == [(0, True)]


def test_the_verdicts_follow_the_acceptance() -> None:
    assert all(acceptance(_report()).values())  # the killed worker's blocks do not count
    assert not acceptance(_report(hung=1))["0 hung"]
    assert not acceptance(_report(completed=98))[">= 99% completed"]
    assert not acceptance(_report(disrupted={}))["free KV blocks after = before (survivors)"]
    assert not acceptance(_report(shm_left={"pdserve-kv-x": 4096}))[
        "0 pdserve-kv-* bytes left after stop"
    ]
    assert "0 KV store blocks refused" not in acceptance(_report())  # no store, no verdict
    stored = _report(kv_store={"hit_blocks": 40.0, "refused_blocks": 0.0})
    assert acceptance(stored)["0 KV store blocks refused"]
    assert not acceptance(replace(stored, kv_store={"refused_blocks": 1.0}))[
        "0 KV store blocks refused"
    ]
    migrated = mismatches([_outcome(0, text="b")], {"q": "a"}, {"chatcmpl-0": ["decode_lost"]})
    assert not acceptance(_report(mismatches=migrated))["0 greedy mismatches among migrated"]
    assert render(_report(mismatches=migrated)).endswith("FAIL")


def test_metrics_and_the_gateway_log_are_read(tmp_path: Path) -> None:
    text = '# HELP x\npdserve:migrations_total{cause="decode_lost"} 3.0\nother 1\n'
    assert probes.samples(text, "pdserve:migrations_total") == [({"cause": "decode_lost"}, 3.0)]
    log = tmp_path / "gateway.log"
    log.write_text(
        json.dumps(
            {"event": "request_migrating", "request_id": "r1~0a1b2c3d", "cause": "prefill_lost"}
        )
        + "\nREADY gateway\n"
        + json.dumps({"event": "chat_completion_started", "request_id": "r2"})
        + "\n"
    )
    assert probes.migrated_requests(log) == {"r1": ["prefill_lost"]}  # the client's id


@pytest.mark.parametrize("transport", ["shm,tcp", pytest.param("mooncake", marks=pytest.mark.slow)])
def test_a_small_chaos_run_meets_the_acceptance(tmp_path: Path, transport: str) -> None:
    report = run(
        ChaosConfig(
            transport=transport,
            requests=32,
            concurrency=16,
            max_tokens=12,
            fault_rate=0.1,
            prefill_deadline_s=10.0,
            kill_prefill=True,
            kill_decode=True,
            restart_redis=True,
            restart_kv_store=True,
            context_words=160,
            kv_cache_mib=128,
            log_dir=str(tmp_path / "logs"),
        )
    )
    print(render(report))
    assert acceptance(report) == dict.fromkeys(acceptance(report), True), render(report)
    assert [k["target"] for k in report.kills] == ["prefill-0", "decode-0", "redis", "kv-store"]
    assert report.kv_store["stored_blocks"] > 0
    assert sum(report.migrations_by_cause.values()) > 0  # the faults and kills were felt
    assert report.migrated_completed > 0
    assert report.supervisor_stopped is None
