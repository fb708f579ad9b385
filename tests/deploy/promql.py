"""A small PromQL reader for checking dashboards: which metrics an expression selects, with
their label matchers, and which of them sit inside ``histogram_quantile(...)``.

Not a parser: it tokenizes and tracks brackets, which is enough for the expressions a
dashboard holds. Grafana variables (``$role``, ``${datasource}``, ``$__rate_interval``) are
tokens of their own, never names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?:ms|[smhdwy])*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=,(){}\[\]@])
    """,
    re.VERBOSE,
)
# Words that are never metric names where they stand without a "(" after them.
KEYWORDS = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "offset", "bool", "atan2", "inf", "nan",
})  # fmt: skip
# Their "(...)" lists label names, not series.
_LABEL_LIST_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})


@dataclass(frozen=True)
class Selector:
    """One series selector: ``name{label op value, ...}``."""

    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value as written)
    in_quantile: bool  # inside the argument list of histogram_quantile(...)


def tokenize(expr: str) -> list[tuple[str, str]]:
    """``(kind, text)`` pairs, spaces dropped; ``ValueError`` at a character no token has."""
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read {expr[pos : pos + 20]!r} in {expr!r}")
        if m.lastgroup != "space":
            out.append((m.lastgroup or "", m.group()))
        pos = m.end()
    return out


def selectors(expr: str) -> list[Selector]:
    """Every series selector in ``expr``, in order (``name`` "" for one that names no
    metric: ``{__name__=...}``). ``ValueError`` for brackets that do not match or matchers
    it cannot read."""
    tokens = tokenize(expr)
    found: list[Selector] = []
    stack: list[str] = []  # open brackets; "q" marks histogram_quantile's "("
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1].lower() if i + 1 < len(tokens) else ""
        if text in ("(", "["):
            stack.append(text)
        elif text in (")", "]"):
            if not stack or {"(": ")", "q": ")", "[": "]"}[stack.pop()] != text:
                raise ValueError(f"unbalanced {text!r} in {expr!r}")
        elif text == "{":  # a selector without a name
            matchers, i = _matchers(tokens, i, expr)
            found.append(Selector("", matchers, "q" in stack))
        elif kind != "ident" or "[" in stack:  # numbers, strings, variables, durations
            pass
        elif text.lower() in _LABEL_LIST_WORDS and nxt == "(":
            i = _skip_group(tokens, i + 1, expr)
            continue
        elif nxt in ("(", "by", "without"):  # a function, or an aggregation: sum by (x) (...)
            j = _skip_group(tokens, i + 2, expr) if nxt != "(" else i + 1
            if j >= len(tokens) or tokens[j][1] != "(":
                raise ValueError(f"{text} without its arguments in {expr!r}")
            stack.append("q" if text == "histogram_quantile" else "(")
            i = j + 1
            continue
        elif text.lower() not in KEYWORDS:
            matchers = ()
            if nxt == "{":
                matchers, i = _matchers(tokens, i + 1, expr)
            found.append(Selector(text, matchers, "q" in stack))
        i += 1
    if stack:
        raise ValueError(f"unclosed {stack[-1]!r} in {expr!r}")
    return found


def _skip_group(tokens: list[tuple[str, str]], open_at: int, expr: str) -> int:
    """The index after the ``)`` closing the ``(`` at ``open_at`` (a label list)."""
    if open_at >= len(tokens) or tokens[open_at][1] != "(":
        raise ValueError(f"a label list without its '(' in {expr!r}")
    for j in range(open_at + 1, len(tokens)):
        if tokens[j][1] == ")":
            return j + 1
        if tokens[j][0] != "ident" and tokens[j][1] != ",":
            raise ValueError(f"label list holds {tokens[j][1]!r} in {expr!r}")
    raise ValueError(f"unclosed label list in {expr!r}")


def _matchers(
    tokens: list[tuple[str, str]], open_at: int, expr: str
) -> tuple[tuple[tuple[str, str, str], ...], int]:
    """The ``label op "value"`` triples of the ``{...}`` opening at ``open_at``, and the
    index of its ``}``."""
    out, j = [], open_at + 1
    while j < len(tokens) and tokens[j][1] != "}":
        if tokens[j][1] == ",":
            j += 1
            continue
        label, op, value = tokens[j : j + 3]
        if label[0] != "ident" or op[1] not in ("=", "!=", "=~", "!~") or value[0] != "string":
            raise ValueError(f"cannot read the matchers of {expr!r}")
        out.append((label[1], op[1], value[1]))
        j += 3
    if j >= len(tokens):
        raise ValueError(f"unclosed '{{' in {expr!r}")
    return tuple(out), j
