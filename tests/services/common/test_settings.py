"""services.common.settings: a frozen dataclass is a command's flags and PDSERVE_* variables,
by one naming rule, with flag > environment > default and every bad value a usage error."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from services.common import settings
from services.common.settings import env_name, flag_name, setting
from services.decode.config import DecodeConfig
from services.gateway.config import GatewayConfig
from services.prefill.config import PrefillConfig
from services.scheduler.config import SchedulerConfig
from services.up import UpConfig


@dataclass(frozen=True)
class Inner:
    port: int = setting(50, "a port")
    ratio: float = setting(0.5, "a ratio")

    def __post_init__(self) -> None:
        if self.port > 65535:
            raise ValueError(f"port {self.port} is too big")


def _cores(text: str) -> frozenset[int]:
    return frozenset(int(c) for c in text.split(","))


@dataclass(frozen=True)
class Toy:
    drain_timeout_s: float = setting(1.5, "seconds to drain")
    name: str | None = setting(None, "a name")
    keys: tuple[str, ...] = setting((), "keys")
    fast: bool = setting(True, "go fast")
    level: str = setting("info", "level", parse=str.lower, choices=("info", "debug"))
    cores: frozenset[int] | None = setting(None, "cores", parse=_cores)
    ask: str | None = setting(None, "a question", const="why?")
    inner: Inner = field(default_factory=lambda: Inner(port=60))


def load(argv: list[str], env: dict[str, str] | None = None) -> Toy:
    return settings.load(Toy, "toy", argv, env or {}, prog="toy")


def test_names_follow_one_rule() -> None:
    assert flag_name("drain_timeout_s") == "--drain-timeout-s"
    assert env_name("gateway", "http_port") == "PDSERVE_GATEWAY_HTTP_PORT"
    text = settings.build_parser(Toy, "toy").format_help()
    for flag in ("--drain-timeout-s", "--fast, --no-fast", "--port", "--ratio", "--ask [ASK]"):
        assert flag in text
    assert "PDSERVE_TOY_<FLAG>" in text and "(default: 60)" in text  # the nested override


@pytest.mark.parametrize(
    "cls", [PrefillConfig, DecodeConfig, GatewayConfig, SchedulerConfig, UpConfig]
)
def test_every_service_has_a_flag_per_field_by_the_same_rule(cls: type) -> None:
    def leaves(c: type) -> list[dataclasses.Field]:
        out = []
        for f in dataclasses.fields(c):
            sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            out += leaves(type(sub)) if dataclasses.is_dataclass(sub) else [f]
        return out

    parser = settings.build_parser(cls, "x")
    flags = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    wanted = {flag_name(f.name) for f in leaves(cls) if not f.metadata.get("secret")}
    negated = {"--no-" + f.name.replace("_", "-") for f in leaves(cls) if f.type == "bool"}
    assert flags == wanted | negated
    assert all(f.metadata["help"] for f in leaves(cls))


@dataclass(frozen=True)
class Shared:
    token_file: str | None = setting(None, "a file", env="PDSERVE_SHARED_FILE")
    token: str | None = setting(None, "a secret", env="PDSERVE_SHARED_TOKEN", secret=True)


def test_a_shared_variable_and_a_secret() -> None:
    env = {"PDSERVE_SHARED_FILE": "/f", "PDSERVE_SHARED_TOKEN": "s3cret"}
    for service in ("gateway", "decode"):  # the same variable in every service
        assert settings.load(Shared, service, [], env) == Shared("/f", "s3cret")
    assert settings.load(Shared, "x", ["--token-file", "/g"], env).token_file == "/g"
    parser = settings.build_parser(Shared, "x")
    assert "--token" not in {s for a in parser._actions for s in a.option_strings}
    with pytest.raises(SystemExit):  # a secret is no flag
        settings.load(Shared, "x", ["--token", "s3cret"], {})
    assert "PDSERVE_SHARED_FILE" in parser.format_help()
    cfg = Shared("/f", "s3cret")
    assert "s3cret" not in repr(cfg) and settings.to_argv(cfg) == ["--token-file", "/f"]


def test_defaults_then_environment_then_flags() -> None:
    assert load([]) == Toy()
    assert load([]).inner == Inner(port=60)
    env = {"PDSERVE_TOY_PORT": "70", "PDSERVE_TOY_RATIO": "0.25", "UNRELATED": "x"}
    assert load([], env).inner == Inner(port=70, ratio=0.25)
    assert load(["--port", "80"], env).inner == Inner(port=80, ratio=0.25)


def test_types_come_from_the_annotations() -> None:
    cfg = load(["--keys", "a, b,", "--name", "n", "--no-fast", "--level", "DEBUG",
                "--cores", "0,2", "--ask"])  # fmt: skip
    assert (cfg.keys, cfg.name, cfg.fast, cfg.level) == (("a", "b"), "n", False, "debug")
    assert (cfg.cores, cfg.ask) == (frozenset({0, 2}), "why?")
    assert load(["--ask", "how?"]).ask == "how?"
    assert load(["--name", ""]).name is None  # an empty value is None
    for text, want in (("off", False), ("TRUE", True), ("0", False), ("yes", True)):
        assert load([], {"PDSERVE_TOY_FAST": text}).fast is want


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--port", "x"], {}, "argument --port: expected an integer, got 'x'"),
        (["--ratio", "fast"], {}, "argument --ratio: expected a number, got 'fast'"),
        ([], {"PDSERVE_TOY_RATIO": "x"}, "PDSERVE_TOY_RATIO='x': expected a number"),
        ([], {"PDSERVE_TOY_FAST": "maybe"}, "PDSERVE_TOY_FAST='maybe': expected a boolean"),
        (["--level", "loud"], {}, "'loud' is not one of info, debug"),
        ([], {"PDSERVE_TOY_LEVEL": "loud"}, "PDSERVE_TOY_LEVEL='loud'"),
        (["--port", "70000"], {}, "port 70000 is too big"),  # __post_init__: one place
        ([], {"PDSERVE_TOY_PORT": "70000"}, "port 70000 is too big"),
        (["--cores", "x"], {}, "argument --cores:"),
        (["--bogus"], {}, "unrecognized arguments: --bogus"),
    ],
)
def test_bad_values_are_usage_errors(
    argv: list[str], env: dict[str, str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        load(argv, env)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_to_argv_gives_back_the_config() -> None:
    assert settings.to_argv(Toy()) == []
    cfg = Toy(
        drain_timeout_s=2.0, name="n", keys=("a", "b"), fast=False, level="debug",
        cores=frozenset({3, 1}), ask="why not?", inner=Inner(port=1, ratio=0.5),
    )  # fmt: skip
    argv = settings.to_argv(cfg)
    assert "--no-fast" in argv and argv[argv.index("--cores") + 1] == "1,3"
    assert load(argv) == cfg


def test_a_name_used_twice_in_the_tree_is_refused() -> None:
    @dataclass(frozen=True)
    class Clash:
        port: int = setting(1, "a port")
        inner: Inner = field(default_factory=Inner)

    with pytest.raises(TypeError, match="two fields are called port"):
        settings.build_parser(Clash, "clash")
