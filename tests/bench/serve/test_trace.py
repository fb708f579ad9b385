"""Mooncake's trace format: good lines, extra fields, and bad lines named by number."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serve.trace import TraceFormatError, TraceRequest, parse_trace, read_trace, write_trace

GOOD = [
    '{"timestamp": 0, "input_length": 655, "output_length": 52, "hash_ids": [46, 47]}',
    "",
    '{"timestamp": 27482.5, "input_length": 7, "output_length": 0, "hash_ids": [],'
    ' "session_id": "x", "tools": [{"a": 1}]}',
    '{"hash_ids": [1, 2, 3], "output_length": 3, "input_length": 1200, "timestamp": 9}',
    '{"timestamp": 10, "input_length": 3, "output_length": 1}',
]


def test_good_lines_parse_and_other_fields_are_ignored() -> None:
    assert parse_trace(GOOD) == [
        TraceRequest(0.0, 655, 52, (46, 47)),
        TraceRequest(27482.5, 7, 0, ()),
        TraceRequest(9.0, 1200, 3, (1, 2, 3)),
        TraceRequest(10.0, 3, 1, ()),
    ]
    assert parse_trace(GOOD)[0].group == 46 and parse_trace(GOOD)[1].group is None


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"input_length": 5, "output_length": 1, "hash_ids": []}', "'timestamp'"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "'timestamp'"),
        ('{"timestamp": true, "input_length": 5, "output_length": 1}', "'timestamp'"),
        ('{"timestamp": NaN, "input_length": 5, "output_length": 1}', "'timestamp'"),
        ('{"timestamp": 1, "output_length": 1}', "'input_length' must be an integer"),
        ('{"timestamp": 1, "input_length": 0, "output_length": 1}', "'input_length' must be >= 1"),
        ('{"timestamp": 1, "input_length": 2.5, "output_length": 1}', "'input_length'"),
        ('{"timestamp": 1, "input_length": 5, "output_length": -1}', "'output_length'"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}',
         "'hash_ids'"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": 7}', "'hash_ids'"),
    ],
)  # fmt: skip
def test_a_bad_line_is_named_by_file_and_number(line: str, why: str) -> None:
    with pytest.raises(TraceFormatError) as err:
        parse_trace([GOOD[0], GOOD[1], line, GOOD[3]], "t.jsonl")
    assert str(err.value).startswith("t.jsonl:3: ") and why in str(err.value)


def test_files_round_trip_and_unreadable_ones_are_format_errors(tmp_path: Path) -> None:
    requests = parse_trace(GOOD)
    path = tmp_path / "sub" / "t.jsonl"
    write_trace(path, requests)
    assert read_trace(path) == requests
    assert path.read_text().splitlines()[0] == (
        '{"timestamp": 0, "input_length": 655, "output_length": 52, "hash_ids": [46, 47]}'
    )
    path.write_bytes(path.read_bytes() + b'{"timestamp": 1, "input_length": 1\xff}\n')
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:5: "):
        read_trace(path)
    with pytest.raises(TraceFormatError, match="no requests"):
        parse_trace(["", "  "], "empty")
    with pytest.raises(TraceFormatError, match="cannot read the trace"):
        read_trace(tmp_path / "missing.jsonl")
