"""``python -m bench.store_load``: a real run at one length loads the prefix another engine
computed and times both ways; the table says which is faster."""

from __future__ import annotations

import pytest

from bench.store_load import Row, main, render


def test_the_table_states_the_ratio() -> None:
    text = render([Row(1024, 64, 12.5, 2500.0)], "python -m bench.store_load", 1)
    assert "| 1,024 | 64 | 12.5 | 2500.0 | 0.005 |" in text


@pytest.mark.slow  # two engines of the real model: ~15 s; the figures are in docs/benchmarks.md
def test_a_real_run_loads_and_computes(capsys) -> None:
    assert main(["--lengths", "32", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 32 |"))
    load_ms, compute_ms = (float(x) for x in row.split("|")[3:5])
    assert load_ms > 0 and compute_ms > 0
