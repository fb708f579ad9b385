"""GatewayConfig: flags over PDSERVE_GATEWAY_* variables over defaults, validated."""

from __future__ import annotations

import pytest

from engine.engine_config import EngineConfig
from services.gateway.config import GatewayConfig, load_config


def test_defaults() -> None:
    cfg = load_config([], {})
    assert cfg == GatewayConfig()
    assert (cfg.http_port, cfg.grpc_port, cfg.max_body_bytes) == (8000, 50051, 4 << 20)
    assert cfg.api_keys == () and cfg.engine == EngineConfig()


def test_flags_override_environment_override_defaults() -> None:
    env = {
        "PDSERVE_GATEWAY_HTTP_PORT": "9000",
        "PDSERVE_GATEWAY_GRPC_PORT": "9001",
        "PDSERVE_GATEWAY_API_KEYS": "a, b,",
        "PDSERVE_GATEWAY_PREFIX_CACHING": "false",
        "PDSERVE_GATEWAY_MAX_MODEL_LEN": "512",
        "UNRELATED": "x",
    }
    cfg = load_config(["--http-port", "1234", "--drain-timeout-s", "2.5"], env)
    assert cfg.http_port == 1234  # flag wins
    assert cfg.grpc_port == 9001  # from the environment
    assert cfg.api_keys == ("a", "b")
    assert cfg.engine.prefix_caching is False
    assert cfg.engine.max_model_len == 512
    assert cfg.drain_timeout_s == 2.5
    assert load_config(["--prefix-caching"], env).engine.prefix_caching


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--http-port", "70000"], {}, "http_port=70000 is not a port number"),
        (["--http-port", "eighty"], {}, "argument --http-port: expected an integer, got 'eighty'"),
        ([], {"PDSERVE_GATEWAY_GRPC_PORT": "x"}, "PDSERVE_GATEWAY_GRPC_PORT='x'"),
        ([], {"PDSERVE_GATEWAY_PREFIX_CACHING": "maybe"}, "expected a boolean"),
        (["--max-body-bytes", "0"], {}, "max_body_bytes=0 must be >= 1"),
        (["--backend", "remote"], {}, "'remote' is not one of local, cluster"),
        (["--backend", "cluster"], {}, "backend=cluster needs --scheduler"),
        (["--kv-cache-mib", "0"], {}, "kv_cache_mib must be >= 1"),
        (["--served-model-name", " "], {}, "served_model_name must not be blank"),
        (["--worker-keepalive-s", "0"], {}, "worker_keepalive_s=0.0 must be > 0"),
        (["--max-concurrent-requests", "0"], {}, "max_concurrent_requests=0 must be >= 1"),
        (["--max-queued-requests", "-1"], {}, "max_queued_requests=-1 must be >= 0"),
        (["--write-timeout-s", "0"], {}, "write_timeout_s=0.0 must be > 0"),
        (["--max-connections", "0"], {}, "max_connections=0 must be >= 1"),
        (["--rate-limit-rps", "-1"], {}, "rate_limit_rps=-1.0 must be >= 0"),
    ],
)
def test_bad_values_exit_with_usage_error(argv, env, needle, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        load_config(argv, env)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_admission_defaults_follow_the_workers_batch() -> None:
    cfg = load_config([], {})
    # --max-num-seqs' default to start with, then the fleet's target batch (admission); the
    # queue keeps its bound
    assert (cfg.concurrency, cfg.queue_size, cfg.follows_fleet) == (64, 64, True)
    cfg = load_config(["--max-num-seqs", "16"], {})
    assert (cfg.concurrency, cfg.queue_size, cfg.follows_fleet) == (16, 16, True)
    env = {"PDSERVE_GATEWAY_MAX_CONCURRENT_REQUESTS": "8", "PDSERVE_GATEWAY_RATE_LIMIT_RPS": "2"}
    cfg = load_config(["--max-queued-requests", "0"], env)
    assert (cfg.concurrency, cfg.queue_size, cfg.rate_limit_rps) == (8, 0, 2.0)
    assert not cfg.follows_fleet
    assert (cfg.write_timeout_s, cfg.max_connections, cfg.rate_limit_burst) == (30.0, 512, 10)
