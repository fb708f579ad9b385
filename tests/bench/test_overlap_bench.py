"""``bench/overlap``: the pure parts, then a small real run (one prefill worker, a decode
worker per transport, real requests)."""

from __future__ import annotations

import pytest

from bench.overlap import Row, main, share, table


def test_share_is_the_mean_of_the_observations_between_two_readings() -> None:
    assert share((1.5, 2.0), (3.0, 4.0)) == 0.75
    with pytest.raises(ValueError, match="no observation"):
        share((1.0, 2.0), (1.0, 2.0))


def test_the_table_judges_each_row_against_the_target() -> None:
    rows = [Row("shm", 512, 3, 0.9, 0.2), Row("tcp", 512, 3, 0.5, 0.25)]
    lines = table(rows).splitlines()
    assert lines[2] == "| shm | 512 | 3 | 90% pass | 200 ms |"
    assert lines[3] == "| tcp | 512 | 3 | 50% FAIL | 250 ms |"


@pytest.mark.slow  # a bench's whole run (its parts are tested above); -m slow runs it
def test_a_small_run_reports_every_transport(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--transports", "shm,mooncake", "--lengths", "96", "--requests", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| shm |") or line.startswith("| mooncake |")]
    assert len(rows) == 2, out
    for line in rows:
        percent = int(line.split("|")[4].split("%")[0])
        assert 0 <= percent <= 100
