"""The GPU check's table: ``scripts/gpu_check.sh`` writes JSON files into one folder, and
this turns whichever of them exist into one markdown table (what did not run says so).

    python -m bench.gpu.report gpu-check/ > gpu-check/summary.md
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from bench._common import markdown_table


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _tests(path: Path) -> str:
    if not path.exists():
        return "not run"
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped"


def rows(folder: Path) -> list[list[str]]:
    out = [["gpu tests (`pytest -m gpu`)", _tests(folder / "gpu-tests.xml")]]
    kernels = _load(folder / "gpu-kernels.json")
    if kernels is None:
        out.append(["decode attention vs copy bandwidth", "not run"])
    else:
        out.append([
            "decode attention vs copy bandwidth",
            f"{kernels['attention_gbs']:.0f} / {kernels['copy_gbs']:.0f} GB/s = "
            f"{kernels['ratio']:.2f} (target {kernels['target']:.2f}), {kernels['device']}",
        ])  # fmt: skip
    engine = _load(folder / "gpu-engine.json")
    if engine is None:
        out.append(["engine step times", "not run"])
    else:
        where = f"{engine['device_name']}, {engine['dtype']}, context {engine['context']}"
        for row in engine["decode"]:
            out.append([
                f"decode step, batch {row['batch']}",
                f"{row['step_ms']:.2f} ms, {row['tokens_per_s']:.0f} tok/s ({where})",
            ])  # fmt: skip
        pre = engine["prefill"]
        out.append([f"prefill, {pre['tokens']} tokens",
                    f"{pre['ms']:.1f} ms, {pre['tokens_per_s']:.0f} tok/s ({where})"])  # fmt: skip
    transfer = _load(folder / "gpu-transfer.json")
    if transfer is None:
        out.append(["KV transfer from GPU memory", "not run"])
    else:
        for row in transfer["transfers"]:
            out.append([
                f"KV transfer, {row['transport']}, {row['tokens']} tokens",
                f"{row['gbs']:.2f} GB/s, {row['ms']:.2f} ms ({transfer['device']}, "
                f"{transfer['dtype']})",
            ])  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m bench.gpu.report FOLDER", file=sys.stderr)
        return 2
    print(markdown_table(["check", "result"], rows(Path(args[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
