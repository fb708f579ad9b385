"""The transfer benchmark: its pure helpers on known inputs, and real short runs."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.transfer import (
    BYTES_PER_TOKEN,
    MOONCAKE_FROM_TOKENS,
    MOONCAKE_KEEP,
    HopPath,
    HopResult,
    MethodResult,
    SizeResult,
    Summary,
    added,
    config_from_args,
    hop_table,
    latency_table,
    main,
    parse_args,
    pass_rounds,
    per_token_gaps,
    request_block_ids,
    shuffled_rounds,
    split_cores,
    tcp_retirement,
    throughput_table,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_request_block_ids_source_consecutive_destination_in_short_runs() -> None:
    src, dst = request_block_ids(40, src_pool=56, dst_pool=80, seed=3)
    assert len(src) == len(dst) == 40
    assert src == list(range(src[0], src[0] + 40)) and 0 <= src[0] <= 16
    assert len(set(dst)) == 40 and all(0 <= b < 80 for b in dst)
    runs, length = [], 1
    for a, b in itertools.pairwise(dst):
        if b == a + 1:
            length += 1
        else:
            runs.append(length)
            length = 1
    runs.append(length)
    assert len(runs) > 1 and sum(runs) == 40  # scattered, not one block range
    assert request_block_ids(40, 56, 80, seed=3) == (src, dst)
    assert request_block_ids(40, 56, 80, seed=4) != (src, dst)
    with pytest.raises(ValueError):
        request_block_ids(81, 100, 80, seed=0)


def test_each_round_runs_every_method_once_in_a_fresh_order() -> None:
    names = ["memcpy_bulk", "memcpy", "shm", "socket", "tcp"]
    rounds = shuffled_rounds(names, 50, seed=3)
    assert len(rounds) == 50 and all(sorted(r) == sorted(names) for r in rounds)
    # the order changes from round to round (a fixed order can phase-lock with a periodic
    # disturbance), and every method takes every slot somewhere
    assert len({tuple(r) for r in rounds}) > 10
    assert all({r[slot] for r in rounds} == set(names) for slot in range(len(names)))
    assert shuffled_rounds(names, 50, seed=3) == rounds  # a seed replays its run


def test_a_sizes_rounds_are_shared_out_over_its_passes() -> None:
    assert pass_rounds(100, 5) == [20] * 5
    assert pass_rounds(7, 3) == [3, 2, 2]
    assert pass_rounds(5, 1) == [5]
    assert sum(pass_rounds(101, 6)) == 101
    for repeats, passes in ((3, 4), (5, 0)):
        with pytest.raises(ValueError, match="cannot fill"):
            pass_rounds(repeats, passes)
    assert config_from_args(parse_args([])).passes == 5
    assert config_from_args(parse_args(["--quick"])).passes == 1
    assert config_from_args(parse_args(["--repeats", "3"])).passes == 3  # no more than rounds
    assert config_from_args(parse_args(["--repeats", "9", "--passes", "2"])).passes == 2


@pytest.mark.parametrize("argv", [["--passes", "9", "--repeats", "3"], ["--repeats", "0"],
                                  ["--passes", "0"]])  # fmt: skip
def test_values_that_cannot_run_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_per_token_gaps_skip_the_first_event_and_split_multi_token_events() -> None:
    arrivals = [(10.0, 1), (10.5, 0), (11.0, 1), (11.2, 1), (12.2, 2)]
    assert per_token_gaps(arrivals) == pytest.approx([1.0, 0.2, 0.5, 0.5])
    assert per_token_gaps([(1.0, 3)]) == []
    assert per_token_gaps([]) == []


def test_summary_and_added_latency() -> None:
    base = Summary.of([0.010] * 99 + [0.020])
    path = Summary.of([0.011] * 99 + [0.030])
    assert base.p50 == pytest.approx(0.010) and base.n == 100
    assert base.p99 == pytest.approx(0.010 + 0.01 * 0.01)  # 0.99 of the way from rank 98
    d50, d99 = added(path, base)
    assert d50 == pytest.approx(0.001)
    assert d99 == pytest.approx(path.p99 - base.p99)
    assert Summary.of([1.0, 3.0]).mean == 2.0
    with pytest.raises(ValueError):
        Summary.of([])


def _method(seconds: float, wait: float | None = None) -> MethodResult:
    waits = None if wait is None else (wait, wait, 2 * wait)
    return MethodResult((seconds, seconds, 2 * seconds), waits, True)


def _size(tokens: int, mooncake_s: float | None = None) -> SizeResult:
    """A size whose tcp takes 8 ms and mooncake ``mooncake_s`` (absent: not run)."""
    methods = {
        "memcpy_bulk": _method(0.001),
        "memcpy": _method(0.002),
        "shm": _method(0.0024, 0.002),  # 0.83 of memcpy: above the 0.80 target
        "socket": _method(0.004),
        "tcp": _method(0.008, 0.007),  # 0.50 of the socket
    }
    if mooncake_s is not None:
        methods["mooncake"] = _method(mooncake_s, mooncake_s - 0.0005)
    return SizeResult(
        tokens=tokens,
        nbytes=tokens * BYTES_PER_TOKEN,
        blocks=-(-tokens // 16),
        ranges=120,
        plan_s=0.001,
        methods=methods,
    )


def test_size_result_ratios_and_verdicts() -> None:
    res = _size(256, mooncake_s=0.016)  # mooncake: half tcp's throughput
    nbytes = 256 * BYTES_PER_TOKEN  # 11,796,480 bytes
    assert res.gb_per_s("memcpy") == pytest.approx(nbytes / 0.002 / 1e9)
    assert res.shm_ratio == pytest.approx(0.002 / 0.0024)
    assert res.tcp_ratio == pytest.approx(0.5)
    assert res.mooncake_ratio == pytest.approx(0.5)
    out = res.to_json()
    assert out["shm_passed"] is True and out["tcp_passed"] is False
    assert out["mooncake_vs_tcp"] == pytest.approx(0.5)
    assert out["methods"]["mooncake"]["wait_p50_s"] == pytest.approx(0.0155)
    row = throughput_table([res]).splitlines()[-1]
    assert "0.83 pass" in row and "0.50 FAIL" in row
    # below 512 tokens the rule does not judge: the ratio stands alone
    assert row.endswith(f"| {res.gb_per_s('mooncake'):.2f} | 0.50 |")


def test_mooncake_columns_compare_with_tcp_from_512_tokens_or_show_a_dash() -> None:
    at_512 = _size(512, mooncake_s=0.008 / 0.9)  # 0.90 of tcp
    at_1024 = _size(1024, mooncake_s=0.008 / 0.7)  # 0.70 of tcp
    missing = _size(2048)  # mooncake did not run
    assert missing.mooncake_ratio is None and missing.to_json()["mooncake_vs_tcp"] is None
    rows = throughput_table([at_512, at_1024, missing]).splitlines()[2:]
    assert rows[0].endswith("| 0.90 ≥ 0.80 |")
    assert rows[1].endswith("| 0.70 < 0.80 |")
    assert rows[2].endswith("| — | — |")
    lat = latency_table([at_512, missing]).splitlines()[2:]
    # mooncake's P50 / P99 (of 1, 1, 2 × its time) and its finish wait, then planning
    p50, p99 = 0.008 / 0.9 * 1e3, 0.008 / 0.9 * 1e3 * 1.98
    assert f"| {p50:.2f} / {p99:.2f} |" in lat[0]
    assert lat[1].endswith("| — | — | 1.00 |")


def test_tcp_retires_only_if_mooncake_keeps_up_at_every_size_from_512_tokens() -> None:
    low = MOONCAKE_KEEP - 0.01
    small = MOONCAKE_FROM_TOKENS // 2
    # a slow small size does not count; the large ones all reach the share
    retire, line = tcp_retirement([(small, 0.1), (512, MOONCAKE_KEEP), (4096, 1.3)])
    assert retire is True
    assert f"lowest {MOONCAKE_KEEP:.2f}× at 512" in line and "fence" in line
    # one large size under the share keeps tcp, and the line names it
    retire, line = tcp_retirement([(512, 0.95), (2048, low), (4096, 0.9)])
    assert retire is False and f"{low:.2f}× at 2048" in line and "tcp stays" in line
    # nothing to judge: no size from 512 tokens, or mooncake not run (the reason is given)
    assert tcp_retirement([(small, 2.0)])[0] is None
    assert tcp_retirement([(1024, None)])[0] is None
    retire, line = tcp_retirement([(1024, 2.0)], skipped="pip install it")
    assert retire is None and "did not run (pip install it)" in line


def test_hop_table_judges_the_measured_delivery_delay() -> None:
    base = HopPath("in-process", (0.050,) * 50, True)
    # ITL +0.5 ms; delivery delays 0.4 ms except one of 1.5 ms: P99 (rank 48.51 of 0..49)
    # = 0.4 + 0.51 * 1.1 = 0.961 ms -> pass
    near = HopPath("worker", (0.0505,) * 50, True, delays=(0.0004,) * 49 + (0.0015,))
    # ITL P99 +5.1 ms but delays all 1 ms: judged on delays -> pass; tokens differ is flagged
    noisy = HopPath("gateway", (0.050,) * 49 + (0.060,), False, delays=(0.001,) * 50)
    # ITL identical but 3 ms delivery delays: FAIL
    slow = HopPath("slow", (0.050,) * 50, True, delays=(0.003,) * 50)
    gone = HopPath("broken", (), False, "did not start")
    # a reference row is shown with its figures but judged by nobody
    ref = HopPath("whole", (0.050,) * 50, True, delays=(0.003,) * 50, reference=True)
    hop = HopResult(tokens=51, repeats=1, paths=(base, near, noisy, slow, gone, ref))
    lines = hop_table(hop).splitlines()
    assert "(baseline)" in lines[2]
    assert "+0.50" in lines[3] and "0.96" in lines[3] and "pass" in lines[3]
    assert "+5.10" in lines[4] and "pass" in lines[4] and "tokens differ" in lines[4]
    assert "3.00" in lines[5] and "FAIL" in lines[5]
    assert "not run: did not start" in lines[6]
    assert "3.00" in lines[7] and "(reference)" in lines[7] and "FAIL" not in lines[7]
    paths = hop.to_json()["paths"]
    assert [p.get("passed") for p in paths] == [None, True, True, False, None, None]
    assert [p["reference"] for p in paths] == [False] * 5 + [True]
    assert paths[1]["delay_p99_s"] == pytest.approx(0.000961)


def test_quick_skips_the_hop_unless_asked() -> None:
    cfg = config_from_args(parse_args(["--quick"]))
    assert cfg.sizes == (128, 256) and cfg.repeats == 5 and not cfg.hop
    assert config_from_args(parse_args(["--quick", "--hop"])).hop
    full = config_from_args(parse_args([]))
    assert full.sizes == (128, 256, 512, 1024, 2048, 4096) and full.hop
    assert not config_from_args(parse_args(["--skip-hop"])).hop
    assert config_from_args(parse_args(["--quick", "--repeats", "7"])).repeats == 7


def test_both_parts_pin_their_two_sides_to_two_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {5, 3, 9})
    assert split_cores(True) == ({3}, {5})
    assert split_cores(False) == (None, None)
    assert not config_from_args(parse_args(["--no-transfer-pin"])).transfer_pin
    assert config_from_args(parse_args([])).transfer_pin
    assert not config_from_args(parse_args(["--no-hop-pin"])).hop_pin
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {4})
    assert split_cores(True) == (None, None)  # one core: nothing to keep apart


def _run(tmp_path: Path, *args: str, timeout: float) -> dict:
    out = tmp_path / "transfer.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.transfer", *args, "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| tokens |" in proc.stdout
    return json.loads(out.read_text())


HAS_MOONCAKE = importlib.util.find_spec("mooncake") is not None


def test_quick_run_measures_every_method_at_every_size(tmp_path: Path) -> None:
    data = _run(tmp_path, "--quick", timeout=180)
    assert [r["tokens"] for r in data["transfer"]] == [128, 256]
    assert data["hop"] is None
    # Where Mooncake's Transfer Engine is installed its method must run, not be skipped.
    assert ("mooncake" in data["skipped"]) is not HAS_MOONCAKE
    transports = ["shm", "tcp"] + ["mooncake"] * HAS_MOONCAKE
    for res in data["transfer"]:
        # 128 / 256 tokens are whole blocks: the bytes are the tokens' KV exactly.
        assert res["bytes"] == res["tokens"] * BYTES_PER_TOKEN
        for name in ("memcpy_bulk", "memcpy", "socket", *transports):
            m = res["methods"][name]
            assert m["verified"] is True, name
            assert len(m["seconds"]) == 5
            figures = [m["gb_per_s"], m["p50_s"], m["p99_s"]]
            assert all(math.isfinite(f) and f > 0 for f in figures), (name, figures)
            assert m["p99_s"] >= m["p50_s"]
        for name in transports:
            assert 0 < res["methods"][name]["wait_p50_s"] <= res["methods"][name]["p50_s"]
        assert res["shm_vs_memcpy"] > 0 and res["tcp_vs_socket"] > 0
        assert (res["mooncake_vs_tcp"] is not None) is HAS_MOONCAKE
    # 128 and 256 tokens are under the sizes the retirement rule judges
    assert data["tcp_retirement"]["retire"] is None


def test_without_mooncake_its_method_is_skipped_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    hide = "import sys; sys.modules['mooncake'] = None; from bench.transfer import main; "
    proc = subprocess.run(
        [sys.executable, "-c", hide + "sys.exit(main(sys.argv[1:]))",
         "--sizes", "16", "--repeats", "1", "--skip-hop", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert "mooncake-transfer-engine" in data["skipped"]["mooncake"]  # names the package
    assert "mooncake" not in data["transfer"][0]["methods"]
    assert all(m["verified"] for m in data["transfer"][0]["methods"].values())
    assert data["tcp_retirement"]["retire"] is None
    assert "mooncake did not run (" in proc.stdout and "mooncake-transfer-engine" in proc.stdout


@pytest.mark.slow  # a bench's whole run (its parts are tested above); -m slow runs it
def test_rounds_in_several_passes_are_all_timed_and_every_destination_checked(
    tmp_path: Path,
) -> None:
    # Two sizes whose destination blocks overlap in the pool: each is checked after its
    # own last visit, before the other size writes there again.
    data = _run(tmp_path, "--sizes", "128", "256", "--repeats", "4", "--passes", "2",
                "--skip-hop", timeout=120)  # fmt: skip
    assert data["config"]["passes"] == 2
    for res in data["transfer"]:
        for m in res["methods"].values():
            assert m["verified"] is True and len(m["seconds"]) == 4


@pytest.mark.slow  # a bench's whole run (its parts are tested above); -m slow runs it
def test_tiny_hop_streams_the_same_tokens_on_both_paths(tmp_path: Path) -> None:
    data = _run(
        tmp_path,
        *("--sizes", "16", "--repeats", "1", "--hop", "--hop-tokens", "4"),
        *("--hop-repeats", "1", "--no-gateway", "--hop-whole-pin"),
        timeout=240,
    )
    paths = {p["name"]: p for p in data["hop"]["paths"]}
    inproc, worker = paths["in-process AsyncEngine"], paths["decode worker gRPC"]
    whole = paths["decode worker gRPC, whole process on the engine core"]
    assert whole["reference"] is True and "passed" not in whole
    if split_cores(True)[0] is None:  # one core: nothing pinned, so no such layout
        assert "skipped" in whole["error"]
    else:
        assert whole["error"] is None and whole["outputs_match"] is True
        assert len(whole["gaps_s"]) == 3 and 1 <= len(whole["delays_s"]) <= 4
    for p in (inproc, worker):
        assert p["error"] is None and len(p["gaps_s"]) == 3  # 4 tokens: 3 gaps
        assert all(0 < g < 10 for g in p["gaps_s"])
    assert worker["outputs_match"] is True
    assert "added_p99_s" in worker and "added_p99_s" not in inproc
    # 4 tokens in 1-4 events (a lagging reader gets them coalesced); each event carries the
    # worker's stamp, so each gives a delay >= 0 s
    assert 1 <= len(worker["delays_s"]) <= 4
    assert all(0 <= d < 10 for d in worker["delays_s"])
    assert "delays_s" not in inproc
    assert "skipped" in paths["gateway → decode gRPC"]["error"]
