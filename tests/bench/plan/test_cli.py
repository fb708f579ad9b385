"""`pdserve plan` / `python -m bench.plan`: output, and bad input as exit 2 with a message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.plan.cli import main
from tests.bench.plan.synthetic import linear_profile

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    linear_profile().save(path)
    return path


def _args(profile: Path | str, **overrides: str) -> list[str]:
    flags = {
        "--profile": str(profile),
        "--rate": "2",
        "--prompt-tokens": "1000",
        "--output-tokens": "100",
        "--slo-ttft-ms": "1000",
        "--slo-itl-ms": "100",
    }
    flags.update(overrides)
    return [item for pair in flags.items() for item in pair]


def test_prints_the_recommendation(profile_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(profile_file)) == 0
    out = capsys.readouterr().out
    # The hand-checked case of test_model.py: 2 prefill : 1 decode, TTFT 750 ms.
    assert "Recommendation: disaggregated, 2 prefill : 1 decode workers (3 in all)" in out
    assert "up to 80 sequences per decode worker" in out
    assert "750.0 ms mean = prefill 500.0 ms + queueing 250.0 ms" in out
    assert "Colocated (6 worker(s))" in out


def test_json_output(profile_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_args(profile_file, **{"--rate": "0.2"}), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "colocated"
    assert out["colocated"]["workers"] == 1
    assert out["profile_file"] == str(profile_file)


def test_budget_shortfall_is_reported_not_an_error(
    profile_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_args(profile_file, **{"--max-workers": "2"})) == 0
    assert "does NOT serve 2 req/s" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"--rate": "-1"}, "rate must be a positive"),
        ({"--rate": "0"}, "rate must be a positive"),
        ({"--prompt-tokens": "0"}, "prompt tokens must be an integer >= 1"),
        ({"--output-tokens": "0"}, "output tokens must be an integer >= 1"),
        ({"--slo-ttft-ms": "0"}, "TTFT SLO must be a positive"),
        ({"--slo-itl-ms": "15"}, "even at batch 1"),
        ({"--slo-ttft-ms": "400"}, "TTFT SLO (400.0 ms) cannot be met"),
        ({"--max-workers": "0"}, "max workers"),
    ],
)
def test_bad_workloads_exit_2(
    profile_file: Path,
    capsys: pytest.CaptureFixture[str],
    overrides: dict[str, str],
    message: str,
) -> None:
    assert main(_args(profile_file, **overrides)) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve plan: error: ")
    assert message in err


def test_bad_profile_files_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(tmp_path / "absent.json")) == 2
    assert "not found" in capsys.readouterr().err
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    assert main(_args(corrupt)) == 2
    assert "not valid JSON" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "pdserve-plan-profile/1", "prefill": {}}))
    assert main(_args(other)) == 2
    assert "the decode section is missing" in capsys.readouterr().err


def test_missing_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "missing --profile, --rate" in capsys.readouterr().err


def test_unparseable_flags_exit_2(profile_file: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(_args(profile_file, **{"--rate": "fast"}))
    assert info.value.code == 2


def test_profile_subcommand_rejects_bad_grids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    assert main(["profile", "--out", str(out), "--decode-batches", "8", "1"]) == 2
    assert "strictly increase" in capsys.readouterr().err
    assert not out.exists()


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def test_registered_as_pdserve_plan(profile_file: Path, tmp_path: Path) -> None:
    ok = _run("-m", "pdserve.cli", "plan", *_args(profile_file))
    assert ok.returncode == 0, ok.stderr
    assert "Recommendation: disaggregated" in ok.stdout
    bad = _run("-m", "pdserve.cli", "plan", *_args(tmp_path / "absent.json"))
    assert bad.returncode == 2
    assert "not found" in bad.stderr
    assert "Traceback" not in bad.stderr
    helped = _run("-m", "bench.plan", "--help")
    assert helped.returncode == 0
    assert "pdserve plan profile --out" in helped.stdout
