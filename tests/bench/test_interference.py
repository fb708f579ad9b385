"""bench/interference.py: the table and the target checks from known runs; the modes' flags
parse with ``pdserve up``'s own parser."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import interference
from bench.serve.metrics import Slo
from bench.serve.result import BenchResult, RequestRecord
from services.up import load_up_config


def _stream(index: int, ttft: float, gaps: list[float]) -> RequestRecord:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(
        index=index, tag="stream", send_s=0.0, end_s=times[-1], token_times_s=tuple(times),
        prompt_tokens=32, completion_tokens=len(times), output_tokens_asked=len(times),
        status=200,
    )  # fmt: skip


def _long(index: int, send: float, ttft: float) -> RequestRecord:
    return RequestRecord(
        index=index, tag="long", send_s=send, end_s=send + ttft + 0.1,
        token_times_s=(send + ttft, send + ttft + 0.1), prompt_tokens=1024,
        completion_tokens=2, output_tokens_asked=2, status=200,
    )  # fmt: skip


def _run(name: str, gaps: list[float], long_ttft: float) -> interference.ModeRun:
    records = (_stream(0, 0.1, gaps), _stream(1, 0.1, gaps), _long(2, 1.0, long_ttft))
    result = BenchResult(records=records, duration_s=10.0)
    return interference.ModeRun(interference.Mode(name), result)


def test_rows_and_checks_from_known_runs() -> None:
    # colocated: 99 gaps of 50 ms and one 1 s stall per stream -> P50 50 ms; the P99 of 200
    # gaps (rank 197.01 of 0..199) interpolates 1% of the way from 50 ms to 1,000 ms.
    colocated = _run("colocated", [0.05] * 99 + [1.0], long_ttft=1.5)
    # disaggregated: flat 60 ms gaps, long prompt TTFT 2.0 s (slower: one core for prefill)
    disaggregated = _run("disaggregated", [0.06] * 100, long_ttft=2.0)
    runs = [colocated, disaggregated]
    interference.summarize_runs(runs, Slo(ttft_ms=1800.0, itl_ms=200.0))
    rows = {r["mode"]: r for r in interference.table_rows(runs)}
    col, dis = rows["colocated"], rows["disaggregated"]
    assert col["itl_p50"] == pytest.approx(50.0)
    assert col["itl_p99"] == pytest.approx(50.0 + 0.01 * 950.0)
    assert col["itl_max"] == pytest.approx(1000.0)
    assert dis["itl_ratio"] == pytest.approx(1.0)
    assert dis["long_ttft_p50"] == pytest.approx(2000.0)
    # goodput: colocated streams each have a 1 s gap (> 200 ms): only its long request is
    # good; disaggregated: both streams good, the long one's 2 s TTFT misses 1.8 s.
    assert col["goodput"] == pytest.approx(1 / 10.0)
    assert dis["goodput"] == pytest.approx(2 / 10.0)
    checks = {c.name: c for c in interference.check_targets(list(rows.values()))}
    assert checks["disaggregated P99/P50 ITL"].passed
    assert not checks["colocated P99/P50 ITL"].passed  # 59.5 / 50 = 1.19 < 5
    assert checks["disaggregated P99 TTFT ÷ colocated P99 TTFT"].passed is False
    table = interference.format_table(list(rows.values()))
    assert table.splitlines()[2].startswith("| colocated | 100 |")
    assert "MISS" in interference.format_checks(list(checks.values()))


def test_the_store_checks_compare_with_the_storeless_run_and_bound_the_largest_gap() -> None:
    # with the store: gaps of 60 ms and one of 160 ms; without: flat 60 ms
    stored = _run("disaggregated", [0.06] * 99 + [0.16], long_ttft=2.0)
    bare = _run(interference.NO_STORE, [0.06] * 100, long_ttft=2.0)
    runs = [stored, bare]
    interference.summarize_runs(runs, Slo(ttft_ms=1800.0, itl_ms=200.0))
    checks = {c.name: c for c in interference.check_targets(interference.table_rows(runs))}
    # P99 of 200 gaps: 1% of the way from 60 to 160 ms -> 61 ms, 1.02x the storeless 60
    tail = checks["disaggregated P99 ITL ÷ the same without the KV store"]
    assert tail.measured == "1.02" and tail.passed
    gap = checks["disaggregated max ITL ÷ its P50"]
    assert gap.measured == "2.67" and not gap.passed  # 160 / 60


def test_the_peer_check_compares_the_disaggregated_median_with_llama_cpps() -> None:
    disaggregated = _run("disaggregated", [0.06] * 100, long_ttft=2.0)
    peer = _run(interference.PEER, [0.05] * 99 + [5.0], long_ttft=6.0)
    runs = [disaggregated, peer]
    interference.summarize_runs(runs, Slo(ttft_ms=1800.0, itl_ms=200.0))
    checks = {c.name: c for c in interference.check_targets(interference.table_rows(runs))}
    median = checks["disaggregated ITL P50 ÷ llama.cpp ITL P50"]
    assert median.measured == "1.20" and not median.passed  # 60 ms against 50 ms
    # Without the peer there is nothing to compare with.
    alone = interference.check_targets(interference.table_rows([disaggregated]))
    assert all("llama.cpp" not in c.name for c in alone)


def test_long_prompts_sent_after_the_streams_ended_are_reported() -> None:
    # The streams end at 0.1 + 100 * 0.05 = 5.1 s; long prompts at 1 s and at 6 s.
    records = (
        _stream(0, 0.1, [0.05] * 100), _stream(1, 0.1, [0.05] * 100),
        _long(2, 1.0, 1.0), _long(3, 6.0, 1.0),
    )  # fmt: skip
    run = interference.ModeRun(
        interference.Mode("colocated"), BenchResult(records=records, duration_s=8.0)
    )
    assert interference.late_long_prompts(run) == (1, 2)
    note = interference.format_late_notes([run])
    assert "colocated: 1 of 2 long prompts came after every stream had ended" in note
    on_time = _run("disaggregated", [0.06] * 100, long_ttft=2.0)
    assert interference.late_long_prompts(on_time) == (0, 1)
    assert interference.format_late_notes([on_time]) == ""


def test_every_mode_parses_with_pdserve_up_flags() -> None:
    args = interference.build_parser().parse_args(["--peer"])
    modes = interference.modes_for(args)
    assert [m.name for m in modes] == [*interference.MODES, interference.PEER]
    for mode in modes:
        if mode.peer:
            continue
        up = load_up_config(list(mode.up_flags), {})
        assert up.colocated == mode.name.startswith("colocated")
        assert up.pin == mode.name.startswith("disaggregated")  # colocated threads float
        # the store on by default, off in the mode that measures its cost
        assert (up.kv_store_segment_mib == 0) == (mode.name == interference.NO_STORE)
    chunked = load_up_config(list(modes[1].up_flags), {})
    assert chunked.engine.chunked_prefill == args.chunk
    disagg = load_up_config(list(modes[2].up_flags), {})
    assert (disagg.prefill, disagg.decode, disagg.pin, disagg.engine.threads) == (1, 1, True, 1)
    # the control plane and the load generator share the prefill worker's core (the first)
    first = min(os.sched_getaffinity(0))
    assert disagg.control_cpus == {first} and modes[2].client_cpus == {first}
    assert modes[0].client_cpus is None and modes[1].client_cpus is None


def test_the_unpinned_reference_mode_runs_the_same_stack_without_pinning() -> None:
    args = interference.build_parser().parse_args(["--modes", interference.UNPINNED])
    (mode,) = interference.modes_for(args)
    up = load_up_config(list(mode.up_flags), {})
    assert (up.prefill, up.decode, up.pin, up.engine.threads) == (1, 1, False, 1)
    assert up.transport == ("shm",) and mode.client_cpus is None
    default = interference.build_parser().parse_args([])
    assert interference.UNPINNED not in default.modes


def test_gaps_are_split_by_what_the_long_requests_were_doing() -> None:
    # one long request: sent at 1.0 s, first token at 2.0 s, last token at 2.1 s
    longs = [_long(9, 1.0, 1.0)]
    assert interference.gap_phase(0.5, 0.9, longs) == "quiet"
    assert interference.gap_phase(0.9, 1.1, longs) == "prefill"  # overlaps the send
    assert interference.gap_phase(1.2, 1.9, longs) == "prefill"
    assert interference.gap_phase(1.95, 2.05, longs) == "prefill"  # still before the first
    assert interference.gap_phase(2.0, 2.05, longs) == "long-decode"
    assert interference.gap_phase(2.1, 2.2, longs) == "quiet"  # after its last token
    # 100 gaps of 0.1 s from t=0.1: 9 before the send (0.1..1.0), 10 overlapping the prefill
    # (the gap ending at 1.1 .. the one starting at 1.9), 1 in decode, the rest quiet.
    run = _run("disaggregated", [0.1] * 100, long_ttft=1.0)
    rows = {r["phase"]: r for r in interference.phase_rows([run])}
    assert [rows[p]["count"] for p in interference.PHASES] == [2 * 10, 2 * 1, 2 * 89]
    assert rows["prefill"]["p50"] == pytest.approx(100.0)
    table = interference.format_phase_table(list(rows.values()))
    assert "| disaggregated | prefill | 20 | 100 | 100 | 100 |" in table


def test_report_replays_a_saved_run(tmp_path: Path) -> None:
    import json

    colocated = _run("colocated", [0.05] * 99 + [1.0], long_ttft=1.5)
    disaggregated = _run("disaggregated", [0.06] * 100, long_ttft=2.0)
    doc = {
        "config": {"slo_ttft_ms": 1800.0, "slo_itl_ms": 200.0},
        "modes": {
            r.mode.name: {"describe": "", "result": r.result.to_dict()}
            for r in (colocated, disaggregated)
        },
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    lines: list[str] = []
    assert interference.main(["--report", str(path), "--plot-dir", str(tmp_path)],
                             out=lines.append) == 0  # fmt: skip
    text = "\n".join(lines)
    assert "| colocated | 100 |" in text and "| disaggregated | 100 |" in text
    assert "PASS  disaggregated P99/P50 ITL: 1.00" in text
    assert "MISS  colocated P99/P50 ITL: 1.19" in text
    assert (tmp_path / "interference-itl.png").stat().st_size > 0


def test_pinned_moves_this_thread_and_restores_it() -> None:
    from bench._common import pinned

    before = os.sched_getaffinity(0)
    first = min(before)
    with pinned(frozenset({first})):
        assert os.sched_getaffinity(0) == {first}
    assert os.sched_getaffinity(0) == before
    with pinned(None):
        assert os.sched_getaffinity(0) == before
