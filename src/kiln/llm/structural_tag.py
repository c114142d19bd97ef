"""xgrammar's structural tag ``format`` translated for llguidance: one Lark rule per format
node (the tree is checked and bounded first, by :mod:`kiln.llm.structural_tag_check`),
``%json`` for a JSON schema, a named sub-grammar for an EBNF / GBNF grammar, token ids for
token formats, which the model's tokenizer resolves.

Free text (``any_text``, and the text around ``triggered_tags`` and ``dispatch``) needs to
know where it stops. As in xgrammar, it stops at the enclosing tag's ``end``; kiln also lets
it stop at the string that follows it in a ``sequence`` (a ``const_string`` or a ``tag``'s
string ``begin``). There, the text and the string it stops at are one lazy lexeme, which ends
at the string's first occurrence. Free text with nothing to stop at but the end of the
output, or a special token, is greedy; free text followed by anything else is refused, as
is free text inside a repetition (``plus``, ``star``, ``repeat``), which has no end.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kiln.llm.params import InvalidField

#: kinds whose text runs until something stops it
_FREE = ("any_text", "triggered_tags", "dispatch")
#: an "anything" text regex (llguidance's, UTF-8 only)
_ANY = "(?s:.*)"

#: a follow: the strings the node must consume after itself; None when only the end of the
#: output or a special token follows (greedy text is fine); () when something else follows
Follow = tuple[str, ...] | None


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else ""


def _alt(follow: Follow) -> str:
    """The follow strings as one Lark item ("" for none)."""
    if not follow:
        return ""
    items = sorted({_lit(s) or '""' for s in follow})
    return items[0] if len(items) == 1 else "(" + " | ".join(items) + ")"


def _escape(text: str) -> str:
    """``text`` as a regex matching it exactly (every non-alphanumeric character as
    ``\\x{..}``: no character can end the ``/.../`` or mean anything)."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text)


def is_free(node: dict[str, Any]) -> bool:
    """Whether the node ends with text that runs until something stops it."""
    kind = node["type"]
    if kind == "triggered_tags":
        return not (node["at_least_one"] and node["stop_after_first"])
    if kind in _FREE:
        return True
    if kind == "sequence":
        return is_free(node["elements"][-1])
    if kind == "or":
        return any(is_free(e) for e in node["elements"])
    if kind == "optional":
        return is_free(node["content"])
    return False


class _Lark:
    def __init__(
        self,
        param: str,
        resolve: Callable[[int | str], int | None],
        json_options: Callable[[dict[str, Any] | bool, int | None], Any],
    ) -> None:
        self.param = param
        self.resolve = resolve
        self.json_options = json_options
        self.rules: list[str] = []
        self.grammars: list[dict[str, Any]] = []
        self.count = 0

    def fail(self, path: str, message: str) -> InvalidField:
        return InvalidField(self.param, f"'{path}' {message}")

    def name(self) -> str:
        self.count += 1
        return f"n{self.count}"

    def rule(self, body: str, attrs: str = "") -> str:
        name = self.name()
        self.rules.append(f"{name}{attrs}: {body}")
        return name

    def text(self, excludes: list[str], max_chars: int | None = None) -> str:
        """A terminal: text holding none of ``excludes``, at most ``max_chars`` long."""
        name = f"T{self.name()[1:]}"
        base = _ANY if max_chars is None else f"(?s:.{{0,{max_chars}}})"
        body = f"/{base}/"
        if excludes:
            strings = "|".join(_escape(s) for s in sorted(set(excludes)))
            body += f" & ~/{_ANY}(?:{strings}){_ANY}/"
        self.rules.append(f"{name}: {body}")
        return name

    def free(self, text: str, follow: Follow, path: str) -> str:
        """A rule: ``text`` then the follow, as one lazy lexeme when there is one."""
        if follow is None:
            return self.rule(text)
        if not follow:
            raise self.fail(
                path,
                "is free text with nothing to stop it: follow it with a const_string or a "
                "tag with a string begin, or end its tag",
            )
        if "" in follow:
            raise self.fail(path, "is free text inside a tag whose end is empty: give the tag "
                            "a non-empty end")  # fmt: skip
        return self.rule(f"{text} {_alt(follow)}", "[lazy]")

    def token(self, token: int | str, path: str) -> int:
        found = self.resolve(token)
        if found is None:
            raise self.fail(path, f"is {token!r}, not a token of the model")
        return found

    def tokens(self, ids: list[int | str], path: str, negate: bool = False) -> str:
        resolved = sorted({self.token(t, f"{path}[{i}]") for i, t in enumerate(ids)})
        if negate and not resolved:
            return "<[*]>"
        return "<[" + ("^" if negate else "") + ",".join(map(str, resolved)) + "]>"

    def node(
        self,
        node: dict[str, Any],
        path: str,
        follow: Follow,
        drop: int = 0,
        ends: tuple[int, ...] = (),
    ) -> str:
        """The rule for ``node`` then one of ``follow``; ``drop`` leading characters of a
        const_string or tag begin were taken by the free text before it; ``ends`` are the
        enclosing tag's end token ids (excluded from free tokens, as xgrammar does)."""
        kind = node["type"]
        method: Callable[..., str] = getattr(self, f"_{kind}")
        if kind in ("const_string", "tag"):
            return method(node, path, follow, ends, drop)
        return method(node, path, follow, ends)

    def closed(self, body: str, follow: Follow) -> str:
        return self.rule(f"{body} {_alt(follow)}".strip() or '""')

    def _const_string(
        self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...], drop: int
    ) -> str:
        return self.closed(_lit(node["value"][drop:]), follow)

    def _json_schema(self, node: dict[str, Any], path: str, follow: Follow, ends: Any) -> str:
        schema = self.json_options(node["json_schema"], node["max_whitespace_cnt"])
        return self.closed("%json " + json.dumps(schema), follow)

    def _grammar(self, node: dict[str, Any], path: str, follow: Follow, ends: Any) -> str:
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(node["grammar"])
        except Exception as exc:  # the converter raises bare exceptions on bad GBNF
            raise self.fail(f"{path}.grammar", f"is not a valid grammar: {exc}") from None
        name = f"g{len(self.grammars) + 1}"
        self.grammars.append({"name": name, "lark_grammar": lark})
        return self.closed(f"@{name}", follow)

    def _regex(self, node: dict[str, Any], path: str, follow: Follow, ends: Any) -> str:
        from llguidance import regex_to_lark

        try:
            regex = regex_to_lark(node["pattern"], "")
        except ValueError as exc:
            raise self.fail(f"{path}.pattern", f"is not a valid regex: {exc}") from None
        return self.closed(f"/{regex}/", follow)

    def _any_text(self, node: dict[str, Any], path: str, follow: Follow, ends: Any) -> str:
        return self.free(self.text(node["excludes"], node["max_chars"]), follow, path)

    def _token(self, node: dict[str, Any], path: str, follow: Follow, ends: Any) -> str:
        return self.closed(f"<[{self.token(node['token'], f'{path}.token')}]>", follow)

    def _exclude_token(
        self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...]
    ) -> str:
        excluded = [*node["exclude_tokens"], *ends]
        return self.closed(self.tokens(excluded, f"{path}.exclude_tokens", True), follow)

    def _any_tokens(
        self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...]
    ) -> str:
        one = self.tokens([*node["exclude_tokens"], *ends], f"{path}.exclude_tokens", True)
        most = node["max_tokens"]
        return self.closed(f"{one}*" if most is None else f"{one}{{0,{most}}}", follow)

    def _sequence(
        self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...]
    ) -> str:
        elements = node["elements"]
        parts, drop = [], 0
        for i, element in enumerate(elements):
            where = f"{path}.elements[{i}]"
            if i == len(elements) - 1:
                parts.append(self.node(element, where, follow, drop, ends))
                break
            after: Follow = ()
            if is_free(element):
                lead = _leading(elements[i + 1])
                if lead:
                    after = (lead,)
            parts.append(self.node(element, where, after, drop, ends))
            drop = len(after[0]) if after else 0
        return self.rule(" ".join(parts))

    def _or(self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...]) -> str:
        return self.rule(" | ".join(self.node(e, f"{path}.elements[{i}]", follow, ends=ends)
                                    for i, e in enumerate(node["elements"])))  # fmt: skip

    def _optional(
        self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...]
    ) -> str:
        inner = self.node(node["content"], f"{path}.content", follow, ends=ends)
        if not follow:
            return self.rule(f"{inner}?")
        return self.rule(f"{inner} | {_alt(follow)}")

    def _repeated(
        self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...], op: str
    ) -> str:
        content = node["content"]
        if is_free(content):
            raise self.fail(f"{path}.content", f"is free text ({content['type']}) inside a "
                            f"{node['type']}, which has nothing to stop it")  # fmt: skip
        inner = self.node(content, f"{path}.content", None, ends=ends)
        return self.closed(f"{inner}{op}", follow)

    def _plus(self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...]) -> str:
        return self._repeated(node, path, follow, ends, "+")

    def _star(self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...]) -> str:
        return self._repeated(node, path, follow, ends, "*")

    def _repeat(
        self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...]
    ) -> str:
        low, high = node["min"], node["max"]
        op = f"{{{low},}}" if high == -1 else f"{{{low},{high}}}"
        return self._repeated(node, path, follow, ends, op)

    def _tag(
        self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...], drop: int = 0
    ) -> str:
        return self.closed(f"{self.begin(node, path, drop)} {self.tag_rest(node, path)}", follow)

    def begin(self, node: dict[str, Any], path: str, drop: int = 0) -> str:
        begin = node["begin"]
        if isinstance(begin, str):
            return _lit(begin[drop:])
        return f"<[{self.token(begin['token'], f'{path}.begin.token')}]>"

    def tag_rest(self, node: dict[str, Any], path: str) -> str:
        """A rule for a tag's content and end (its content stops at its end)."""
        end = node["end"]
        if isinstance(end, dict):
            token = self.token(end["token"], f"{path}.end.token")
            inner = self.node(node["content"], f"{path}.content", None, ends=(token,))
            return self.rule(f"{inner} <[{token}]>")
        strings = (end,) if isinstance(end, str) else tuple(end)
        return self.node(node["content"], f"{path}.content", strings)

    def _triggered_tags(
        self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...]
    ) -> str:
        triggers = node["triggers"]
        text = self.text([*node["excludes"], *triggers, *(follow or ())])
        anywhere, direct = [], []
        for i, tag in enumerate(node["tags"]):
            rest = self.tag_rest(tag, f"{path}.tags[{i}]")
            trigger = max((t for t in triggers if tag["begin"].startswith(t)), key=len)
            lead = self.rule(f"{text} {_lit(trigger)}", "[lazy]")
            anywhere.append(f"{lead} {_lit(tag['begin'][len(trigger) :])} {rest}")
            direct.append(f"{_lit(tag['begin'])} {rest}")
        end = self.free(text, follow, path) if _open_end(node) else ""
        return self._choices(node, follow, end, anywhere, direct)

    def _choices(
        self,
        node: dict[str, Any],
        follow: Follow,
        end: str,
        anywhere: list[str],
        direct: list[str],
    ) -> str:
        """Tags after free text (right away for the first when ``at_least_one``), then
        ``end`` (free text, then the follow); one tag only when ``stop_after_first``."""
        first = self.rule(" | ".join(direct))
        if node["at_least_one"] and node["stop_after_first"]:
            return self.closed(first, follow)
        one = self.rule(" | ".join(anywhere))
        if node["stop_after_first"]:
            return self.rule(f"{end} | {one} {_alt(follow)}")
        start = f"{first} " if node["at_least_one"] else ""
        return self.rule(f"{start}{one}* {end}")

    def _token_triggered_tags(
        self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...]
    ) -> str:
        excluded = [*node["trigger_tokens"], *node["exclude_tokens"], *ends]
        free = self.rule(self.tokens(excluded, f"{path}.exclude_tokens", True) + "*")
        triggers = {self.token(t, f"{path}.trigger_tokens") for t in node["trigger_tokens"]}
        direct = []
        for i, tag in enumerate(node["tags"]):
            where = f"{path}.tags[{i}]"
            if self.token(tag["begin"]["token"], f"{where}.begin.token") not in triggers:
                raise self.fail(f"{where}.begin", "is none of the trigger_tokens")
            direct.append(f"{self.begin(tag, where)} {self.tag_rest(tag, where)}")
        anywhere = [f"{free} {d}" for d in direct]
        return self._choices(node, follow, self.closed(free, follow), anywhere, direct)

    def _tags_with_separator(
        self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...]
    ) -> str:
        one = self.rule(" | ".join(self.node(t, f"{path}.tags[{i}]", None)
                                   for i, t in enumerate(node["tags"])))  # fmt: skip
        if node["stop_after_first"]:
            body = one if node["at_least_one"] else f"{one}?"
        else:
            body = f"{one} ({_lit(node['separator'])} {one})*".replace("( ", "(")
            body = body if node["at_least_one"] else f"({body})?"
        return self.closed(body, follow)

    def _dispatch(
        self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...]
    ) -> str:
        patterns = [rule[0] for rule in node["rules"]]
        text = self.text([*node["excludes"], *patterns, *(follow or ())])
        loop = node["loop"]
        arms = []
        for i, (pattern, inner) in enumerate(node["rules"]):
            lead = self.rule(f"{text} {_lit(pattern)}", "[lazy]")
            after = () if loop else follow
            arms.append(f"{lead} {self.node(inner, f'{path}.rules[{i}][1]', after, ends=ends)}")
        arm = self.rule(" | ".join(arms))
        end = self.free(text, follow, path)
        return self.rule(f"{arm}* {end}" if loop else f"{end} | {arm}")

    def _token_dispatch(
        self, node: dict[str, Any], path: str, follow: Follow, ends: tuple[int, ...]
    ) -> str:
        patterns = [rule[0] for rule in node["rules"]]
        excluded = [*patterns, *node["exclude_tokens"], *ends]
        free = self.rule(self.tokens(excluded, f"{path}.exclude_tokens", True) + "*")
        loop = node["loop"]
        arms = []
        for i, (pattern, inner) in enumerate(node["rules"]):
            head = f"<[{self.token(pattern, f'{path}.rules[{i}][0]')}]>"
            after = () if loop else follow
            arms.append(f"{free} {head} {self.node(inner, f'{path}.rules[{i}][1]', after)}")
        arm = self.rule(" | ".join(arms))
        if loop:
            return self.closed(f"{arm}* {free}", follow)
        return self.rule(f"{self.closed(free, follow)} | {arm}")


def _open_end(node: dict[str, Any]) -> bool:
    return not (node["at_least_one"] and node["stop_after_first"])


def _leading(node: dict[str, Any]) -> str:
    """The string a const_string or a string-begun tag starts with ("" for others)."""
    if node["type"] == "const_string":
        return str(node["value"])
    if node["type"] == "tag" and isinstance(node["begin"], str):
        return str(node["begin"])
    return ""


def to_grammar(
    tag: dict[str, Any],
    param: str,
    resolve: Callable[[int | str], int | None],
    json_options: Callable[[dict[str, Any] | bool, int | None], Any],
) -> str:
    """llguidance's grammar (its JSON, with sub-grammars) for a checked ``format`` tag.
    ``resolve`` turns a token id or text into the model's id (None for one it lacks);
    ``json_options`` applies the request's JSON options to each schema."""
    lark = _Lark(param, resolve, json_options)
    top = lark.node(tag["format"], f"{param}.format", None)
    text = "%llguidance {}\nstart: " + top + "\n" + "\n".join(lark.rules) + "\n"
    return json.dumps({"grammars": [{"name": "structural_tag", "lark_grammar": text},
                                    *lark.grammars]})  # fmt: skip
