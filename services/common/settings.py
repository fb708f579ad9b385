"""One config mechanism for every pdserve command: a frozen dataclass is its flags and its
``PDSERVE_<SERVICE>_*`` environment variables.

The rules, the same for every service:

- field ``drain_timeout_s`` is the flag ``--drain-timeout-s`` and the variable
  ``PDSERVE_<SERVICE>_DRAIN_TIMEOUT_S``. A field whose type is a dataclass (``engine:
  EngineConfig``) adds that dataclass's fields under their own names (flattened), so a name
  must be unique across the whole tree;
- the help text is the field's ``help`` (declare fields with ``setting``; a nested config
  is ``field(default_factory=...)``, whose instance may change the nested defaults for
  this service); the type is the annotation: ``int``, ``float``, ``str``, ``bool`` (``--x`` /
  ``--no-x``; in the environment true/false, 1/0, yes/no, on/off), ``T | None`` (an empty
  value is None) and ``tuple[str, ...]`` (a comma list); any other type names a ``parse``
  hook (text -> value, raising ``ValueError`` or ``argparse.ArgumentTypeError``);
- a field declared with ``env=`` reads that variable instead, the same name in every
  service (``PDSERVE_CLUSTER_TOKEN_FILE``: one cluster, one setting); one declared
  ``secret=True`` has no flag at all (a secret on a command line is visible to every user
  of the machine), is left out of ``repr`` and ``to_argv``, and is set through its
  variable only;
- precedence: flag > environment variable > the field's default;
- a value that does not parse, and whatever the dataclass's ``__post_init__`` refuses
  (``ValueError``: the one place a config is validated), is an argparse usage error
  (exit status 2) naming the flag or the variable.

The parse hooks several commands share are here too (``log_level``,
``cpu_list``; usable as argparse ``type=`` functions): each checks its value against this
machine while parsing, so a value that cannot work is a usage error (exit 2), not a failed
start.

The environment is read here and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from engine.threads import check_cpus, core_set

C = TypeVar("C")
C_co = TypeVar("C_co", covariant=True)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")


def setting(
    default: Any,
    help: str,
    *,
    parse: Callable[[str], Any] | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    const: Any = None,
    env: str | None = None,
    secret: bool = False,
) -> Any:
    """A config field: its default, help text and, for a type the annotation cannot read,
    ``parse``. ``choices``: the only values accepted. ``const``: the flag may be given
    without a value, meaning ``const``. ``env``: the variable's full name, shared by every
    service (default: ``PDSERVE_<SERVICE>_<FIELD>``). ``secret``: no flag, environment only,
    hidden from ``repr``."""
    meta = {"help": help, "parse": parse, "choices": choices, "metavar": metavar, "const": const,
            "env": env, "secret": secret}  # fmt: skip
    return dataclasses.field(default=default, metadata=meta, repr=not secret)


def flag_name(field_name: str) -> str:
    """``drain_timeout_s`` -> ``--drain-timeout-s``."""
    return "--" + field_name.replace("_", "-")


def env_name(service: str, field_name: str) -> str:
    """``("gateway", "http_port")`` -> ``PDSERVE_GATEWAY_HTTP_PORT``."""
    return f"PDSERVE_{service.upper()}_{field_name.upper()}"


@dataclasses.dataclass(frozen=True)
class _Flag:
    """One leaf field of a config tree, as a flag."""

    name: str
    type: Any  # the resolved annotation
    default: Any
    meta: Mapping[str, Any]

    @property
    def optional(self) -> bool:
        return _is_optional(self.type)

    @property
    def secret(self) -> bool:
        return bool(self.meta.get("secret"))

    def env(self, service: str) -> str:
        """The variable that sets this field in ``service``."""
        return self.meta.get("env") or env_name(service, self.name)

    @property
    def base(self) -> Any:
        """The annotation without ``| None``."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        return args[0] if self.optional else self.type

    def convert(self, text: str) -> Any:
        """The value of ``text``; ``ValueError`` with a reason when it is not one."""
        if self.optional and text == "":
            return None
        parse = self.meta.get("parse")
        base = self.base
        try:
            if parse is not None:
                value = parse(text)
            elif base is bool:
                value = _boolean(text)
            elif base is int:
                value = int(text)
            elif base is float:
                value = float(text)
            elif base is str:
                value = text
            elif typing.get_origin(base) is tuple:
                value = tuple(part.strip() for part in text.split(",") if part.strip())
            else:  # a programming error: the field needs a parse hook
                raise TypeError(f"field {self.name}: no parser for {base!r}")
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
        except ValueError as exc:
            kind = None if parse else {int: "an integer", float: "a number"}.get(base)
            raise ValueError(f"expected {kind}, got {text!r}" if kind else str(exc)) from None
        choices = self.meta.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return value


def _is_optional(tp: Any) -> bool:
    is_union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return is_union and type(None) in typing.get_args(tp)


def _boolean(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _flat(config: Any) -> dict[str, Any]:
    """Every leaf value of a config instance by field name (nested configs flattened)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_flat(value))
        else:
            out[f.name] = value
    return out


def _flags(cls: type) -> list[tuple[str | None, _Flag]]:
    """Every leaf of ``cls``'s config tree as ``(group, flag)``: group None for ``cls``'s
    own fields, else the name of the nested field holding it. Defaults are those of
    ``cls()``, so what a nested field's ``default_factory`` changes counts."""
    defaults = _flat(cls())
    out: list[tuple[str | None, _Flag]] = []

    def walk(c: type, group: str | None) -> None:
        hints = typing.get_type_hints(c)
        for f in dataclasses.fields(c):
            if _is_config(hints[f.name]):
                walk(hints[f.name], group or f.name)
            elif any(flag.name == f.name for _, flag in out):
                raise TypeError(f"{cls.__name__}: two fields are called {f.name}")
            else:
                out.append((group, _Flag(f.name, hints[f.name], defaults[f.name], f.metadata)))

    walk(cls, None)
    return out


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> argparse.ArgumentParser:
    """Add one flag per leaf field of ``cls`` to ``parser``; returns ``parser``.

    A flag left out of the command line is absent from the parsed namespace, so
    ``from_namespace`` can tell it from one given with its default value.
    """
    groups: dict[str | None, Any] = {None: parser}
    for group, flag in _flags(cls):
        if flag.secret:
            continue  # environment only
        if group not in groups:
            groups[group] = parser.add_argument_group(group)
        _add_flag(groups[group], flag)
    return parser


def _add_flag(group: Any, flag: _Flag) -> None:
    meta = flag.meta
    help_text = meta["help"]
    if "default:" not in help_text:  # a help that explains its default keeps its words
        shown = _format(flag.default) if flag.default is not None else ""
        help_text += f" (default: {shown or 'none'})"
    if meta.get("env"):
        help_text += f" [variable: {meta['env']}, in every service]"
    help_text = help_text.replace("%", "%%")
    common: dict[str, Any] = {"dest": flag.name, "default": argparse.SUPPRESS, "help": help_text}
    if flag.base is bool and not flag.optional:
        group.add_argument(flag_name(flag.name), action=argparse.BooleanOptionalAction, **common)
        return

    def convert(text: str) -> Any:
        try:
            return flag.convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    choices = meta.get("choices")
    metavar = meta.get("metavar") or ("{" + ",".join(choices) + "}" if choices else None)
    const = meta.get("const")
    extra: dict[str, Any] = {"nargs": "?", "const": const} if const is not None else {}
    group.add_argument(flag_name(flag.name), type=convert, metavar=metavar, **extra, **common)


def from_namespace(
    cls: type[C],
    service: str,
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    environ: Mapping[str, str] | None = None,
) -> C:
    """The ``cls`` instance ``args`` (parsed by a parser ``add_arguments`` built) and the
    environment describe; a bad variable or an invalid config exits through
    ``parser.error`` (status 2)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for _, flag in _flags(cls):
        if hasattr(args, flag.name):
            values[flag.name] = getattr(args, flag.name)
            continue
        var = flag.env(service)
        raw = env.get(var)
        if raw is None:
            continue
        try:
            values[flag.name] = flag.convert(raw)
        except ValueError as exc:
            parser.error(f"{var}={raw!r}: {exc}")
    try:
        return _build(cls, values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _build(cls: type, values: Mapping[str, Any], base: Any = None) -> Any:
    """``cls`` with ``values`` (by leaf name) over the defaults of ``base`` (or ``cls()``);
    nested configs are built, and so validated, before the config holding them."""
    base = cls() if base is None else base
    kwargs = {}
    for f in dataclasses.fields(cls):
        current = getattr(base, f.name)
        if dataclasses.is_dataclass(current):
            kwargs[f.name] = _build(type(current), values, current)
        else:
            kwargs[f.name] = values.get(f.name, current)
    return cls(**kwargs)


def load(
    cls: type[C],
    service: str,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    prog: str | None = None,
    description: str | None = None,
) -> C:
    """Parse ``argv`` (default: ``sys.argv[1:]``) over the environment (default:
    ``os.environ``) over the defaults."""
    parser = build_parser(cls, service, prog=prog, description=description)
    return from_namespace(cls, service, parser.parse_args(argv), parser, environ)


class Loader(Protocol[C_co]):
    def __call__(
        self, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> C_co: ...


def loader(cls: type[C], service: str, prog: str, description: str | None = None) -> Loader[C]:
    """A command's ``load_config(argv=None, environ=None)``: ``load`` for ``cls``."""

    def load_config(
        argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> C:
        return load(cls, service, argv, environ, prog=prog, description=description)

    load_config.__doc__ = (
        f"{prog}'s flags over PDSERVE_{service.upper()}_* over defaults; exits 2 on a bad value."
    )
    return load_config


def build_parser(
    cls: type, service: str, *, prog: str | None = None, description: str | None = None
) -> argparse.ArgumentParser:
    """The argument parser of a command configured by ``cls``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=env_help(service),
        allow_abbrev=False,  # a prefix of a flag is no flag: renamed flags fail loudly
    )
    return add_arguments(parser, cls)


def env_help(service: str) -> str:
    """The line every command's ``--help`` ends with."""
    example = env_name(service, "log_level")
    return (
        f"Every flag can also be set as {env_name(service, '<FLAG>')} (the flag's name in "
        f"capitals, '-' as '_'; e.g. {example}=debug); a flag given wins."
    )


def to_argv(config: Any) -> list[str]:
    """The flags that give a command ``config``: one per leaf field whose value differs
    from its default, so the command's parser reads ``config`` back equal."""
    values = _flat(config)
    out: list[str] = []
    for _, flag in _flags(type(config)):
        value = values[flag.name]
        if value == flag.default or flag.secret:
            continue
        if flag.base is bool and not flag.optional:
            out.append(flag_name(flag.name) if value else "--no-" + flag.name.replace("_", "-"))
        else:
            out += [flag_name(flag.name), "" if value is None else _format(value)]
    return out


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, frozenset | set):
        return ",".join(str(v) for v in sorted(value))
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    return str(value)


def read_secret(path: str | None, what: str) -> str | None:
    """The secret in the file ``path`` (surrounding whitespace stripped; None: no path);
    ``ValueError`` naming ``what`` when the file cannot be read or holds nothing."""
    if not path:
        return None
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path}: {e.strerror}") from None
    if not text:
        raise ValueError(f"the {what} {path} is empty")
    return text


def log_level(text: str) -> str:
    """A log level in any case; the field's ``choices`` (``LOG_LEVELS``) check the name."""
    return text.strip().lower()


def machine_cpu_list(text: str) -> frozenset[int]:
    """A comma list of cores (``"0,2"``), each one of this machine's (this process may be
    pinned elsewhere: a thread it starts moves there)."""
    try:
        cores = core_set(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of core numbers: {text!r}") from None
    count = os.cpu_count() or 1
    if max(cores) >= count:
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has cores 0-{count - 1}")
    return cores


def cpu_list(text: str) -> frozenset[int]:
    """A comma list of cores (``"0,2"``), each one this process may run on."""
    try:
        cores = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of core numbers: {text!r}") from None
    try:
        return check_cpus(cores)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
