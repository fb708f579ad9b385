"""GatewayConfig: flags over PDSERVE_GATEWAY_* variables over defaults, validated."""

from __future__ import annotations

import pytest

from services.gateway.config import GatewayConfig


def test_defaults() -> None:
    cfg = GatewayConfig.from_sources([], {})
    assert cfg == GatewayConfig()
    assert (cfg.http_port, cfg.grpc_port, cfg.max_body_bytes) == (8000, 50051, 4 << 20)
    assert cfg.api_keys == () and cfg.enable_prefix_caching


def test_flags_override_environment_override_defaults() -> None:
    env = {
        "PDSERVE_GATEWAY_HTTP_PORT": "9000",
        "PDSERVE_GATEWAY_GRPC_PORT": "9001",
        "PDSERVE_GATEWAY_API_KEYS": "a, b,",
        "PDSERVE_GATEWAY_ENABLE_PREFIX_CACHING": "false",
        "PDSERVE_GATEWAY_MAX_MODEL_LEN": "512",
        "UNRELATED": "x",
    }
    cfg = GatewayConfig.from_sources(["--http-port", "1234", "--drain-timeout-s", "2.5"], env)
    assert cfg.http_port == 1234  # flag wins
    assert cfg.grpc_port == 9001  # from the environment
    assert cfg.api_keys == ("a", "b")
    assert cfg.enable_prefix_caching is False
    assert cfg.max_model_len == 512
    assert cfg.drain_timeout_s == 2.5
    assert GatewayConfig.from_sources(["--enable-prefix-caching"], env).enable_prefix_caching


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--http-port", "70000"], {}, "http_port=70000 is not a port number"),
        (["--http-port", "eighty"], {}, "argument --http-port: expected an integer, got 'eighty'"),
        ([], {"PDSERVE_GATEWAY_GRPC_PORT": "x"}, "PDSERVE_GATEWAY_GRPC_PORT='x'"),
        ([], {"PDSERVE_GATEWAY_ENABLE_PREFIX_CACHING": "maybe"}, "expected a boolean"),
        (["--max-body-bytes", "0"], {}, "max_body_bytes=0 must be >= 1"),
        (["--backend", "remote"], {}, "invalid choice"),
    ],
)
def test_bad_values_exit_with_usage_error(argv, env, needle, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        GatewayConfig.from_sources(argv, env)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_engine_config_mapping() -> None:
    cfg = GatewayConfig(kv_cache_mib=64, chunked_prefill=128, max_num_seqs=8, threads=2)
    ec = cfg.engine_config()
    assert ec.kv_cache_bytes == 64 << 20
    assert ec.chunked_prefill and ec.max_num_batched_tokens == 128
    assert (ec.max_num_seqs, ec.num_threads, ec.enable_prefix_caching) == (8, 2, True)


def test_switch_interval_is_short_by_default_checked_and_applied(monkeypatch) -> None:
    import sys

    import services.gateway.__main__ as gateway_main

    assert GatewayConfig.from_sources([], {}).switch_interval_ms == 0.5
    assert GatewayConfig.from_sources(["--switch-interval-ms", "2"], {}).switch_interval_ms == 2
    for bad in ("0", "-1", "101"):
        with pytest.raises(SystemExit):
            GatewayConfig.from_sources(["--switch-interval-ms", bad], {})
    seen: list[float] = []

    async def serve(cfg: GatewayConfig) -> int:
        seen.append(sys.getswitchinterval())
        return 0

    before = sys.getswitchinterval()
    monkeypatch.setattr(gateway_main, "serve", serve)
    monkeypatch.setattr(gateway_main, "configure_logging", lambda level: None)
    try:
        assert gateway_main.main(["--switch-interval-ms", "0.25"]) == 0
    finally:
        sys.setswitchinterval(before)
    assert seen == [pytest.approx(0.00025)]
