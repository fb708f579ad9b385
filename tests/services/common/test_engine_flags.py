"""The engine's flags are ``EngineConfig``'s fields: every command that runs or starts an
engine reads the same flags with the same defaults (compose: tests/compose; the defaults and
checks themselves: tests/engine/test_engine_config.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.engine_config import EngineConfig
from pdserve.cli import build_parser as pdserve_parser
from services.common import settings
from services.decode.config import load_config as decode_config
from services.gateway.config import load_config as gateway_config
from services.prefill.config import load_config as prefill_config
from services.up import load_up_config


def _generate(argv: list[str]) -> EngineConfig:
    parser = pdserve_parser()
    args = parser.parse_args(["generate", "a prompt", *argv])
    return settings.from_namespace(EngineConfig, "generate", args, args.parser, environ={})


COMMANDS: dict[str, Callable[[list[str]], EngineConfig]] = {
    "python -m services.prefill": lambda argv: prefill_config(argv, {}).engine,
    "python -m services.decode": lambda argv: decode_config(argv, {}).engine,
    "python -m services.gateway": lambda argv: gateway_config(argv, {}).engine,
    "pdserve up": lambda argv: load_up_config(argv, {}).engine,
    "pdserve generate": _generate,
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_the_one_set_of_engine_defaults(command: str) -> None:
    assert COMMANDS[command]([]) == EngineConfig()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_reads_every_engine_flag(command: str) -> None:
    custom = EngineConfig(
        model="/models/x.gguf", dtype="float32", threads=3, block_size=32, kv_cache_mib=64,
        max_model_len=1024, max_num_seqs=8, chunked_prefill=256, prefix_caching=False,
        cpu_kernels=False, kv_cache_dtype="float32", num_kv_blocks=100,
        kv_staging=True, triton_kernels=True, batch_invariant=True, weights="quantized",
        device="cpu", itl_target_ms=50.0,
    )  # fmt: skip
    argv = settings.to_argv(custom)
    # every field differs but max_num_batched_tokens (chunked_prefill's alternative)
    flags = {
        a.removeprefix("--").removeprefix("no-").replace("-", "_") for a in argv if a[:2] == "--"
    }
    assert flags == set(EngineConfig.__dataclass_fields__) - {"max_num_batched_tokens"}
    assert COMMANDS[command](argv) == custom


def test_an_impossible_engine_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        decode_config(["--block-size", "12"], {})
    assert exit_.value.code == 2
    assert "block_size must be a power of two" in capsys.readouterr().err
