"""``EngineConfig``: the one place an engine's defaults and checks live, and how ``resolved``
makes each ``auto`` concrete (the flags that map onto it: tests/services/common)."""

from __future__ import annotations

import pytest

from engine.engine_config import EngineConfig

ROLES = ("prefill", "decode", "colocated")


def test_the_defaults_are_the_services() -> None:
    config = EngineConfig()
    assert (config.device, config.dtype, config.weights, config.kv_cache_dtype) == (
        "auto", "auto", "auto", "auto",
    )  # fmt: skip
    assert (config.kv_cache_mib, config.block_size, config.max_num_seqs) == (512, 16, 64)
    assert (config.chunked_prefill, config.prefix_caching, config.cpu_kernels) == (0, True, True)


def test_the_kv_pool_default_holds_a_whole_context() -> None:
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K, V) x 4 bytes a token, 8,192 tokens
    # even in float32 (the CPU default, float16, holds twice that)
    assert EngineConfig().kv_cache_mib << 20 >= 30 * 3 * 64 * 2 * 4 * 8192


def test_weights_auto_picks_per_role() -> None:
    auto = EngineConfig(device="cpu")
    assert auto.resolved(role="decode").weights == "quantized"
    assert auto.resolved(role="colocated").weights == "quantized"
    assert auto.resolved().weights == "quantized"  # generate, the gateway's local engine
    assert auto.resolved(role="prefill").weights == "float32"
    for role in ROLES:
        assert EngineConfig(weights="float32").resolved(role).weights == "float32"
        assert EngineConfig(weights="quantized").resolved(role).weights == "quantized"
        # packed weights compute in float32: another dtype keeps dense weights
        assert EngineConfig(device="cpu", dtype="bfloat16").resolved(role).weights == "float32"
    with pytest.raises(ValueError, match="computes in float32"):
        EngineConfig(weights="quantized", dtype="bfloat16")
    with pytest.raises(ValueError, match="runs on the CPU only"):
        EngineConfig(device="cuda", weights="quantized")


def test_batch_invariant_loads_packed_weights_in_every_role_on_the_cpu() -> None:
    config = EngineConfig(device="cpu", batch_invariant=True)
    assert {config.resolved(role).weights for role in ROLES} == {"quantized"}
    assert config.resolved(role="prefill").batch_invariant
    for bad in ({"weights": "float32"}, {"device": "cuda"}, {"dtype": "bfloat16"}):
        with pytest.raises(ValueError, match="batch_invariant runs packed quantized"):
            EngineConfig(batch_invariant=True, **bad)  # type: ignore[arg-type]


def test_a_pinned_engine_gets_one_thread_per_core_unless_told() -> None:
    assert EngineConfig().resolved().threads is None  # torch's choice
    assert EngineConfig().resolved(cpus=frozenset({3})).threads == 1
    assert EngineConfig().resolved(cpus=frozenset({1, 2})).threads == 2
    assert EngineConfig(threads=4).resolved(cpus=frozenset({3})).threads == 4


def test_resolving_twice_changes_nothing() -> None:
    once = EngineConfig(device="cpu", chunked_prefill=64).resolved("prefill", frozenset({0}))
    assert once.resolved() == once


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"block_size": 12}, "power of two"),
        ({"block_size": 0}, "block_size"),
        ({"kv_cache_mib": 0}, "kv_cache_mib"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"threads": 0}, "threads"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"chunked_prefill": -1}, "chunked_prefill"),
        ({"chunked_prefill": True}, "tokens of a chunk"),
        ({"chunked_prefill": 64, "max_num_batched_tokens": 64}, "leave max_num_batched_tokens"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"weights": "int8"}, "weights must be one of"),
    ],
)
def test_impossible_settings_are_refused(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        EngineConfig(**kwargs)  # type: ignore[arg-type]
