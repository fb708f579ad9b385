"""Stand-ins for llama.cpp's ``llama-batched-bench`` and ``llama-bench`` binaries.

Executable Python scripts installed where ``BuildLayout`` looks for the real ones. They read
the flags ``bench.peers.llama_bench`` passes and print output in the real tools' formats
(see ``fixtures/``), with made-up timings that follow a formula the tests know:

- batched-bench: ``t_tg = tg x (STEP_S + PER_SEQ_S x B)``; like the real tool it skips a
  batch whose KV (``B x (pp + tg)``) does not fit ``--ctx-size``;
- llama-bench: repetition ``i`` of a prompt of ``p`` tokens runs at ``p + i`` tokens/s.

``FAKE_LLAMA_SLEEP_S`` in the environment makes both sleep first (to test timeouts).
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.peers.llama_server import BuildLayout

STEP_S = 0.01
PER_SEQ_S = 0.002

_COMMON = """
import json, os, sys, time
time.sleep(float(os.environ.get("FAKE_LLAMA_SLEEP_S", "0")))
args = sys.argv[1:]
def flag(name):
    return args[args.index(name) + 1]
threads = int(flag("--threads"))
print("load_backend: loaded CPU backend", file=sys.stderr)
"""

_BATCHED_BENCH = (
    _COMMON
    + """
pp, tg, ctx = int(flag("-npp")), int(flag("-ntg")), int(flag("--ctx-size"))
print("main: n_kv_max = %d" % ctx, file=sys.stderr)
for pl in map(int, flag("-npl").split(",")):
    if pl * (pp + tg) > ctx:
        continue
    t_tg = tg * (STEP_S + PER_SEQ_S * pl)
    t_pp = pl * pp / 500.0
    print(json.dumps({
        "n_kv_max": ctx, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1,
        "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": threads,
        "n_threads_batch": int(flag("--threads-batch")), "pp": pp, "tg": tg, "pl": pl,
        "n_kv": pl * (pp + tg), "t_pp": t_pp, "speed_pp": pl * pp / t_pp, "t_tg": t_tg,
        "speed_tg": pl * tg / t_tg, "t": t_pp + t_tg,
        "speed": (pl * pp + pl * tg) / (t_pp + t_tg),
    }))
print("llama_perf_context_print: total time = 1 ms", file=sys.stderr)
"""
)

_LLAMA_BENCH = (
    _COMMON
    + """
reps = int(flag("--repetitions"))
assert flag("--output") == "json" and flag("--n-gen") == "0"
tests = []
for p in map(int, flag("--n-prompt").split(",")):
    ts = [float(p + i) for i in range(reps)]
    tests.append({
        "n_threads": threads, "n_prompt": p, "n_gen": 0, "n_depth": 0,
        "avg_ts": sum(ts) / reps, "samples_ns": [int(p / t * 1e9) for t in ts],
        "samples_ts": ts,
    })
print(json.dumps(tests, indent=2))
"""
)


def install(cache_dir: Path) -> BuildLayout:
    """Put fake ``llama-batched-bench`` and ``llama-bench`` (and an empty ``llama-server``)
    into ``cache_dir``'s build; return its layout."""
    layout = BuildLayout(cache_dir)
    scripts = {
        layout.batched_bench_binary: f"STEP_S, PER_SEQ_S = {STEP_S!r}, {PER_SEQ_S!r}\n"
        + _BATCHED_BENCH,
        layout.bench_binary: _LLAMA_BENCH,
        layout.binary: "raise SystemExit(1)\n",
    }
    for path, body in scripts.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    return layout
