"""bench/grammar.py on llguidance (the engine's library; xgrammar is optional): a figure per
schema and batch, every step timed, the apply a part of the step."""

from __future__ import annotations

from bench.grammar import SCHEMAS, LLGuidance, main, measure


def test_a_figure_per_schema_and_batch() -> None:
    figures = measure([LLGuidance], batches=[1, 3], steps=6)
    assert [(f.schema, f.batch) for f in figures] == [(s, b) for s in SCHEMAS for b in (1, 3)]
    for f in figures:
        assert f.library == "llguidance" and f.compile_ms > 0
        assert 0 < f.apply_ms_median <= f.step_ms_median <= f.step_ms_p90


def test_the_command_prints_the_table(capsys) -> None:
    assert main(["--library", "llguidance", "--batch", "2", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "| llguidance | deep | 2 |" in out
