"""The PromQL subset kiln's alert rules are written in: parser and AST.

Enough of PromQL that the shipped rules read exactly like the ones in
``deploy/prometheus`` (thresholds, ``rate``/``increase`` over a window, ratios, ``sum by``,
``histogram_quantile``), so a rule moves between kiln and Prometheus unchanged. Anything
beyond the subset is refused with its position rather than half-understood.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.monitoring.snapshot import KNOWN_METRICS

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_UNITS["y"] = 365 * _UNITS["d"]
_DURATION = re.compile(r"^(?:\d+(?:ms|s|m|h|d|w|y))+$")
_DURATION_PART = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
# Prometheus keeps a duration in an int64 of milliseconds (about 292 million years): a
# longer one is "out of range" there too, and here it would overflow a float.
_MAX_DURATION_MS = 2**63 - 1


class ExprError(ValueError):
    def __init__(self, message: str, pos: int = 0) -> None:
        super().__init__(message)
        self.pos = pos


def parse_duration(text: str) -> float:
    """Prometheus durations: ``30s``, ``5m``, ``1h30m``, ``250ms``; seconds out."""
    if not _DURATION.match(text):
        raise ValueError(
            f"invalid duration '{text}' (expected e.g. 30s, 5m, 1h30m; units ms s m h d w y)"
        )
    total_ms = 0
    for n, u in _DURATION_PART.findall(text):
        # 19 digits already exceed the limit: never convert a longer string to an int
        total_ms += int(n) * round(_UNITS[u] * 1000) if len(n) <= 19 else _MAX_DURATION_MS + 1
        if total_ms > _MAX_DURATION_MS:
            raise ValueError(
                f"duration '{text[:40]}' is out of range (at most 2^63-1 milliseconds, "
                "as in Prometheus)"
            )
    return total_ms / 1000


# ---- AST -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Number:
    value: float


@dataclass(frozen=True, slots=True)
class Selector:
    metric: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, "=" | "!=", value)
    range_s: float | None = None


@dataclass(frozen=True, slots=True)
class Call:
    func: str
    args: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Aggregate:
    op: str
    expr: Expr
    grouping: tuple[str, ...] = ()
    without: bool = False


@dataclass(frozen=True, slots=True)
class Binary:
    op: str
    lhs: Expr
    rhs: Expr


Expr = Number | Selector | Call | Aggregate | Binary

RANGE_FUNCS = frozenset(
    {"rate", "increase", "delta", "avg_over_time", "max_over_time", "min_over_time"}
)
AGGREGATIONS = frozenset({"sum", "avg", "max", "min", "count"})
COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")
_PRECEDENCE = [("or",), ("and", "unless"), COMPARISONS, ("+", "-"), ("*", "/")]

_TOKEN = re.compile(
    r"""\s*(?:
    (?P<number>\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)
  | (?P<range>\[[^\]]*\])
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>==|!=|>=|<=|=~|!~|[-+*/<>(){},=])
)""",
    re.VERBOSE,
)


@dataclass(slots=True)
class _Tok:
    kind: str
    text: str
    pos: int


def _tokenize(text: str) -> list[_Tok]:
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None or m.lastgroup is None:
            start = pos + len(text[pos:]) - len(text[pos:].lstrip())
            raise ExprError(f"unexpected character '{text[start]}'", start)
        tokens.append(_Tok(m.lastgroup, m.group(m.lastgroup), m.start(m.lastgroup)))
        pos = m.end()
    tokens.append(_Tok("end", "", len(text)))
    return tokens


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = _tokenize(text)
        self.i = 0

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self, text: str | None = None) -> _Tok:
        tok = self.toks[self.i]
        if text is not None and tok.text != text:
            found = f"'{tok.text}'" if tok.text else "end of expression"
            raise ExprError(f"expected '{text}', found {found}", tok.pos)
        self.i += 1
        return tok

    def parse(self) -> Expr:
        expr = self.binary(0)
        if self.peek().kind != "end":
            raise ExprError(f"unexpected '{self.peek().text}'", self.peek().pos)
        return expr

    def binary(self, level: int) -> Expr:
        if level == len(_PRECEDENCE):
            return self.unary()
        lhs = self.binary(level + 1)
        while self.peek().text in _PRECEDENCE[level] and self.peek().kind in ("op", "name"):
            op = self.take().text
            if self.peek().text in ("on", "ignoring", "group_left", "group_right", "bool"):
                raise ExprError(f"'{self.peek().text}' is not supported", self.peek().pos)
            lhs = Binary(op, lhs, self.binary(level + 1))
        return lhs

    def unary(self) -> Expr:
        if self.peek().text == "-":
            self.take()
            return Binary("-", Number(0.0), self.unary())
        return self.primary()

    def primary(self) -> Expr:
        tok = self.peek()
        if tok.kind == "number":
            self.take()
            return Number(float(tok.text))
        if tok.text == "(":
            self.take()
            inner = self.binary(0)
            self.take(")")
            return inner
        if tok.kind != "name":
            found = f"'{tok.text}'" if tok.text else "end of expression"
            raise ExprError(f"expected a metric, number or function, found {found}", tok.pos)
        self.take()
        if tok.text in AGGREGATIONS:
            return self.aggregate(tok)
        if self.peek().text == "(":
            return self.call(tok)
        return self.selector(tok)

    def aggregate(self, tok: _Tok) -> Expr:
        grouping, without = self.grouping()
        self.take("(")
        inner = self.binary(0)
        self.take(")")
        if not grouping and not without:
            grouping, without = self.grouping()
        return Aggregate(tok.text, inner, grouping, without)

    def grouping(self) -> tuple[tuple[str, ...], bool]:
        if self.peek().text not in ("by", "without"):
            return (), False
        without = self.take().text == "without"
        self.take("(")
        labels: list[str] = []
        while self.peek().text != ")":
            labels.append(self.take().text)
            if self.peek().text == ",":
                self.take()
        self.take(")")
        return tuple(labels), without

    def call(self, tok: _Tok) -> Expr:
        if tok.text not in RANGE_FUNCS and tok.text != "histogram_quantile":
            known = ", ".join(sorted([*RANGE_FUNCS, "histogram_quantile"]))
            raise ExprError(f"unknown function '{tok.text}' (supported: {known})", tok.pos)
        self.take("(")
        args = [self.binary(0)]
        while self.peek().text == ",":
            self.take()
            args.append(self.binary(0))
        self.take(")")
        if tok.text == "histogram_quantile":
            if len(args) != 2 or not isinstance(args[0], Number):
                raise ExprError("histogram_quantile needs (quantile number, vector)", tok.pos)
        elif len(args) != 1 or not isinstance(args[0], Selector) or args[0].range_s is None:
            raise ExprError(f"{tok.text}() needs one range selector, e.g. metric[5m]", tok.pos)
        return Call(tok.text, tuple(args))

    def selector(self, tok: _Tok) -> Selector:
        if tok.text not in KNOWN_METRICS:
            raise ExprError(f"unknown metric '{tok.text}'", tok.pos)
        matchers: list[tuple[str, str, str]] = []
        if self.peek().text == "{":
            self.take()
            while self.peek().text != "}":
                label = self.take()
                op = self.take()
                if op.text not in ("=", "!="):
                    raise ExprError(f"label matcher '{op.text}' is not supported", op.pos)
                value = self.take()
                if value.kind != "string":
                    raise ExprError("a label value must be a quoted string", value.pos)
                matchers.append((label.text, op.text, value.text[1:-1]))
                if self.peek().text == ",":
                    self.take()
            self.take("}")
        range_s = None
        if self.peek().kind == "range":
            rng = self.take()
            try:
                range_s = parse_duration(rng.text[1:-1].strip())
            except ValueError as exc:
                raise ExprError(str(exc), rng.pos) from None
        return Selector(tok.text, tuple(matchers), range_s)


def parse(text: str) -> Expr:
    """The expression's AST; ``ExprError`` (with a character position) when it is not valid."""
    if not text.strip():
        raise ExprError("empty expression")
    return _Parser(text).parse()


def max_range(expr: Expr) -> float:
    """The longest window the expression looks back over (seconds)."""
    if isinstance(expr, Selector):
        return expr.range_s or 0.0
    if isinstance(expr, Call):
        return max(max_range(a) for a in expr.args)
    if isinstance(expr, Aggregate):
        return max_range(expr.expr)
    if isinstance(expr, Binary):
        return max(max_range(expr.lhs), max_range(expr.rhs))
    return 0.0


def is_vector(expr: Expr) -> bool:
    """An alert expression must yield a vector: each of its series is one alert."""
    if isinstance(expr, Number):
        return False
    if isinstance(expr, Binary):
        return is_vector(expr.lhs) or is_vector(expr.rhs)
    return True
