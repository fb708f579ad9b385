"""EngineArgs: the engine settings are declared once, and every command that runs or starts
an engine reads the same flags with the same defaults (compose: tests/compose)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdserve.cli import build_parser as pdserve_parser
from services.common import settings
from services.common.engine_args import EngineArgs
from services.decode.config import load_config as decode_config
from services.gateway.config import load_config as gateway_config
from services.prefill.config import load_config as prefill_config
from services.up import load_up_config


def _generate(argv: list[str]) -> EngineArgs:
    parser = pdserve_parser()
    args = parser.parse_args(["generate", "a prompt", *argv])
    return settings.from_namespace(EngineArgs, "generate", args, args.parser, environ={})


COMMANDS: dict[str, Callable[[list[str]], EngineArgs]] = {
    "python -m services.prefill": lambda argv: prefill_config(argv, {}).engine,
    "python -m services.decode": lambda argv: decode_config(argv, {}).engine,
    "python -m services.gateway": lambda argv: gateway_config(argv, {}).engine,
    "pdserve up": lambda argv: load_up_config(argv, {}).engine,
    "pdserve generate": _generate,
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_the_one_set_of_engine_defaults(command: str) -> None:
    assert COMMANDS[command]([]) == EngineArgs()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_reads_every_engine_flag(command: str) -> None:
    custom = EngineArgs(
        model="/models/x.gguf", dtype="float32", threads=3, block_size=32, kv_cache_mib=64,
        max_model_len=1024, max_num_seqs=8, chunked_prefill=256, prefix_caching=False,
        cpu_kernels=False, kv_cache_dtype="float32",
    )  # fmt: skip
    argv = settings.to_argv(custom)
    assert len(argv) > len(EngineArgs.__dataclass_fields__)  # every field differs
    assert COMMANDS[command](argv) == custom


def test_the_kv_pool_default_holds_a_whole_context() -> None:
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K, V) x 4 bytes a token, 8,192 tokens
    # even in float32 (the CPU default, float16, holds twice that)
    assert EngineArgs().kv_cache_mib << 20 >= 30 * 3 * 64 * 2 * 4 * 8192


def test_kv_dtype_auto_is_float16_on_the_cpu_and_the_dtype_elsewhere() -> None:
    auto = EngineArgs()
    assert auto.kv_dtype("cpu", "float32") == "float16"
    assert auto.kv_dtype("cuda", "bfloat16") == "bfloat16"
    assert auto.kv_dtype("cpu", "bfloat16") == "bfloat16"
    assert EngineArgs(kv_cache_dtype="float32").kv_dtype("cpu", "float32") == "float32"
    assert EngineArgs(device="cpu").engine_config().kv_cache_dtype == "float16"
    for bad in (
        {"kv_cache_dtype": "float16", "dtype": "bfloat16"},
        {"kv_cache_dtype": "float16", "device": "cuda"},
        {"kv_cache_dtype": "float32", "dtype": "float16"},
    ):
        with pytest.raises(ValueError, match="kv-cache-dtype"):
            EngineArgs(**bad)


def test_engine_config_mapping() -> None:
    ec = EngineArgs(kv_cache_mib=64, chunked_prefill=128, max_num_seqs=8, threads=2).engine_config()
    assert ec.kv_cache_bytes == 64 << 20
    assert ec.chunked_prefill and ec.max_num_batched_tokens == 128
    assert (ec.max_num_seqs, ec.num_threads, ec.enable_prefix_caching) == (8, 2, True)
    assert ec.cpu_kernels and not EngineArgs(cpu_kernels=False).engine_config().cpu_kernels
    assert not EngineArgs().engine_config().chunked_prefill


def test_weights_auto_picks_per_role() -> None:
    auto = EngineArgs()
    assert auto.weights == "auto"
    assert auto.engine_config(role="decode").weights == "quantized"
    assert auto.engine_config(role="colocated").weights == "quantized"
    assert auto.engine_config().weights == "quantized"  # generate, the gateway's local engine
    assert auto.engine_config(role="prefill").weights == "float32"
    for role in ("prefill", "decode", "colocated"):
        assert EngineArgs(weights="float32").engine_config(role=role).weights == "float32"
        assert EngineArgs(weights="quantized").engine_config(role=role).weights == "quantized"
        # packed weights compute in float32: another dtype keeps dense weights
        assert EngineArgs(dtype="bfloat16").engine_config(role=role).weights == "float32"
    with pytest.raises(ValueError, match="float32"):
        EngineArgs(weights="quantized", dtype="bfloat16")


def test_a_pinned_engine_gets_one_thread_per_core_unless_told() -> None:
    assert EngineArgs().engine_config().num_threads is None  # torch's choice
    assert EngineArgs().engine_config(frozenset({3})).num_threads == 1
    assert EngineArgs().engine_config(frozenset({1, 2})).num_threads == 2
    assert EngineArgs(threads=4).engine_config(frozenset({3})).num_threads == 4


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"block_size": 12}, "power of two"),
        ({"kv_cache_mib": 0}, "kv_cache_mib"),
        ({"threads": 0}, "threads"),
        ({"chunked_prefill": -1}, "chunked_prefill"),
        ({"max_model_len": 0}, "max_model_len"),
    ],
)
def test_impossible_settings_are_refused(kwargs: dict[str, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        EngineArgs(**kwargs)  # type: ignore[arg-type]


def test_batch_invariant_loads_packed_weights_in_every_role_on_the_cpu() -> None:
    args = EngineArgs(batch_invariant=True)
    assert {args.weight_format(role, "cpu", "float32") for role in AUTO_ROLES} == {"quantized"}
    assert args.engine_config(role="prefill").batch_invariant
    assert not EngineArgs().engine_config(role="prefill").batch_invariant
    for bad in ({"weights": "float32"}, {"device": "cuda"}, {"dtype": "bfloat16"}):
        with pytest.raises(ValueError, match="--batch-invariant runs packed quantized"):
            EngineArgs(batch_invariant=True, **bad)  # type: ignore[arg-type]


AUTO_ROLES = ("prefill", "decode", "colocated")
