"""``python -m bench.prefix``'s flags and the ``pdserve up`` command line of each policy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.prefix.cli import build_parser, config_from, main
from bench.prefix.config import PrefixConfig
from bench.prefix.stack import check_up_flags, up_argv

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_each_policy_gets_its_own_pdserve_up_command_line(tmp_path: Path) -> None:
    cfg = PrefixConfig(kv_cache_mib=128, kv_store_segment_mib=96)
    for policy in ("round-robin", "least-loaded", "cache-aware", "cache-aware+store"):
        argv = up_argv(cfg, policy, http_port=8001, grpc_port=8002, log_dir=tmp_path)
        store = "96" if policy == "cache-aware+store" else "0"  # the store only in "+store"
        assert argv == [
            "--prefill", "2", "--decode", "2", "--routing", policy.removesuffix("+store"),
            "--kv-store-segment-mib", store, "--kv-cache-mib", "128",
            "--http-port", "8001", "--grpc-port", "8002", "--log-dir", str(tmp_path),
        ]  # fmt: skip
        check_up_flags(argv)  # this checkout's pdserve up takes it
    local = PrefixConfig(local_prefill_max_tokens=0)
    argv = up_argv(local, "cache-aware", http_port=1, grpc_port=2, log_dir=tmp_path)
    assert argv[-2:] == ["--local-prefill-max-tokens", "0"]
    with pytest.raises(RuntimeError, match="pdserve up refuses"):
        check_up_flags(["--routing", "random"])


def test_flags_become_the_config() -> None:
    args = build_parser().parse_args([])
    assert config_from(args) == PrefixConfig()
    args = build_parser().parse_args(
        ["--policies", "cache-aware,round-robin", "--workloads", "multi-turn", "--sessions",
         "2", "--turns", "2", "--users", "3", "--timeout-s", "9", "--no-progress"]
    )  # fmt: skip
    cfg = config_from(args)
    assert cfg.policies == ("cache-aware", "round-robin") and cfg.workloads == ("multi-turn",)
    assert (cfg.mt_sessions, cfg.mt_turns, cfg.sp_users, cfg.timeout_s) == (2, 2, 3, 9.0)
    assert cfg.progress is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--policies", "random"])
    assert main(["--turns", "0"]) == 2
    with pytest.raises(ValueError, match="distinct"):
        PrefixConfig(policies=("cache-aware", "cache-aware"))


def test_help_states_the_targets() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.prefix", "--help"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "TTFT P50 <= 1/2" in out.stdout and "--local-prefill-max-tokens" in out.stdout
