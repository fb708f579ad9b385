"""bench.gpu.transfer on the CPU: the staged path into a peer process's shm and tcp regions,
every byte checked there; what needs a GPU is refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu import report as gpu_report
from bench.gpu import transfer as gpu_transfer


def test_it_moves_checks_and_times_each_transport(tmp_path: Path, capsys) -> None:
    out = tmp_path / "gpu-transfer.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--tokens", "20", "40", "--repeats", "1",
            "--transports", "shm", "tcp", "--json", str(out)]  # fmt: skip
    assert gpu_transfer.main(argv) == 0
    rows = json.loads(out.read_text())["transfers"]
    assert [(r["transport"], r["tokens"]) for r in rows] == [
        ("shm", 20), ("shm", 40), ("tcp", 20), ("tcp", 40)
    ]  # fmt: skip
    block = 16 * 3 * 64 * 4  # tokens x kv heads x head dim x float32
    for r in rows:
        assert r["bytes"] == -(-r["tokens"] // 16) * block * 2 * 30
        assert r["gbs"] > 0
    capsys.readouterr()
    assert gpu_report.main([str(tmp_path)]) == 0
    assert "| KV transfer, tcp, 40 tokens | " in capsys.readouterr().out


def test_cuda_ipc_without_a_gpu_is_refused(capsys) -> None:
    assert gpu_transfer.main(["--device", "cpu", "--transports", "cuda_ipc"]) == 2
    assert "needs --device cuda" in capsys.readouterr().err
