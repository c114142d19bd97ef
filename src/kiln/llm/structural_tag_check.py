"""xgrammar's structural tag ``format`` (what vLLM 0.32 passes to xgrammar, and what its tool
and reasoning parsers build): a tree of format nodes, checked and bounded before anything
is compiled. Each node is rebuilt with only the fields xgrammar defines (its defaults filled
in), so equal tags have equal canonical JSON, the compiled-grammar cache's key.

Every bound names the node's path in the request (``response_format.format.tags[3].end``).
:mod:`kiln.llm.structural_tag` translates the checked tree for llguidance.
"""

from __future__ import annotations

from typing import Any

from kiln.llm.params import InvalidField

#: the deepest nesting of format nodes (vLLM's tool and reasoning tags nest under 8)
MAX_FORMAT_DEPTH = 32
#: the most format nodes in one tag (two per tool for a tool-calling tag)
MAX_FORMAT_NODES = 2048
#: the most items in one list: tags, triggers, elements, rules, excludes, end strings
MAX_FORMAT_ITEMS = 256
#: the most token ids in one ``exclude_tokens`` / ``trigger_tokens`` list
MAX_FORMAT_TOKENS = 4096
#: the longest begin, end, trigger, separator, dispatch pattern or excluded string
#: (each one is compiled into the lexer's automata)
MAX_TAG_STRING = 1024
#: the longest const_string, regex or grammar
MAX_FORMAT_TEXT = 65536
#: the largest repeat count, any_text max_chars and any_tokens max_tokens
MAX_FORMAT_COUNT = 4096
#: the JSON styles kiln writes (xgrammar's XML styles are refused by name)
JSON_STYLES = ("json",)
#: xgrammar's node types
FORMAT_TYPES = (
    "const_string",
    "json_schema",
    "grammar",
    "regex",
    "any_text",
    "token",
    "exclude_token",
    "any_tokens",
    "sequence",
    "or",
    "optional",
    "plus",
    "star",
    "repeat",
    "tag",
    "triggered_tags",
    "token_triggered_tags",
    "tags_with_separator",
    "dispatch",
    "token_dispatch",
    "qwen_xml_parameter",
)
_MISSING = object()


class _Checker:
    def __init__(self, param: str) -> None:
        self.param = param
        self.nodes = 0

    def fail(self, path: str, message: str) -> InvalidField:
        return InvalidField(self.param, f"'{path}' {message}")

    def field(self, node: dict[str, Any], key: str, path: str, default: Any = _MISSING) -> Any:
        value = node.get(key, default)
        if value is _MISSING:
            raise self.fail(path, f"({node['type']}) needs '{key}'")
        return value

    def string(self, value: Any, path: str, limit: int = MAX_TAG_STRING, empty: bool = True) -> str:
        if not isinstance(value, str):
            raise self.fail(path, "must be a string")
        if len(value) > limit:
            raise self.fail(path, f"is {len(value)} characters long, more than {limit}")
        if not empty and not value:
            raise self.fail(path, "must not be empty")
        return value

    def strings(self, value: Any, path: str, nonempty_list: bool = False) -> list[str]:
        if not isinstance(value, list):
            raise self.fail(path, "must be a list of strings")
        if len(value) > MAX_FORMAT_ITEMS:
            raise self.fail(path, f"lists {len(value)} strings, more than {MAX_FORMAT_ITEMS}")
        if nonempty_list and not value:
            raise self.fail(path, "must be a non-empty list of strings")
        return [self.string(s, f"{path}[{i}]", empty=False) for i, s in enumerate(value)]

    def flag(self, node: dict[str, Any], key: str, path: str, default: bool) -> bool:
        value = node.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(f"{path}.{key}", "must be a boolean")
        return value

    def count(self, value: Any, path: str, low: int = 0) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(path, "must be an integer")
        if not low <= value <= MAX_FORMAT_COUNT:
            raise self.fail(path, f"is {value}: must be between {low} and {MAX_FORMAT_COUNT}")
        return value

    def optional_count(self, node: dict[str, Any], key: str, path: str) -> int | None:
        value = node.get(key)
        return None if value is None else self.count(value, f"{path}.{key}")

    def token(self, value: Any, path: str) -> int | str:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise self.fail(path, "must be a token id or a token's text")
        if isinstance(value, int) and not 0 <= value < 2**31:
            raise self.fail(path, f"is {value}, not a token id")
        if isinstance(value, str):
            self.string(value, path, empty=False)
        return value

    def tokens(self, value: Any, path: str, nonempty_list: bool = False) -> list[int | str]:
        if not isinstance(value, list):
            raise self.fail(path, "must be a list of token ids or token texts")
        if len(value) > MAX_FORMAT_TOKENS:
            raise self.fail(path, f"lists {len(value)} tokens, more than {MAX_FORMAT_TOKENS}")
        if nonempty_list and not value:
            raise self.fail(path, "must be a non-empty list of tokens")
        return [self.token(t, f"{path}[{i}]") for i, t in enumerate(value)]

    def token_node(self, value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, dict) or value.get("type") != "token":
            raise self.fail(path, "must be a string or a token format ({'type': 'token', ...})")
        self.nodes += 1
        return {"type": "token", "token": self.token(value.get("token"), f"{path}.token")}

    def formats(self, value: Any, path: str, depth: int) -> list[dict[str, Any]]:
        if not isinstance(value, list) or not value:
            raise self.fail(path, "must be a non-empty list of formats")
        if len(value) > MAX_FORMAT_ITEMS:
            raise self.fail(path, f"lists {len(value)} formats, more than {MAX_FORMAT_ITEMS}")
        return [self.node(v, f"{path}[{i}]", depth) for i, v in enumerate(value)]

    def tags(self, value: Any, path: str, depth: int) -> list[dict[str, Any]]:
        tags = self.formats(value, path, depth)
        for i, tag in enumerate(tags):
            if tag["type"] != "tag":
                raise self.fail(f"{path}[{i}]", f"must be a tag, got {tag['type']!r}")
        return tags

    def node(self, value: Any, path: str, depth: int) -> dict[str, Any]:
        """The canonical node, its children checked depth-first."""
        if depth > MAX_FORMAT_DEPTH:
            raise self.fail(path, f"is nested more than {MAX_FORMAT_DEPTH} formats deep")
        self.nodes += 1
        if self.nodes > MAX_FORMAT_NODES:
            raise self.fail(path, f"is past the limit of {MAX_FORMAT_NODES} format nodes")
        if not isinstance(value, dict):
            raise self.fail(path, "must be a format (an object with a 'type')")
        kind = value.get("type")
        if kind not in FORMAT_TYPES:
            known = ", ".join(FORMAT_TYPES)
            raise self.fail(f"{path}.type", f"is {kind!r}, not one of xgrammar's: {known}")
        node = {"type": kind, **value}
        out = getattr(self, f"_{kind}")(node, path, depth + 1)
        return {"type": kind, **out}

    def _const_string(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        value = self.field(node, "value", path)
        return {"value": self.string(value, f"{path}.value", MAX_FORMAT_TEXT)}

    def _json_schema(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        schema = self.field(node, "json_schema", path)
        if not isinstance(schema, dict | bool):
            raise self.fail(f"{path}.json_schema", "must be a JSON Schema (an object)")
        style = node.get("style", "json")
        if style not in JSON_STYLES:
            raise self.fail(
                f"{path}.style",
                f"is {style!r}: kiln writes 'json' only (xgrammar's XML parameter styles "
                "are not supported)",
            )
        if self.flag(node, "any_order", path, False):
            raise self.fail(f"{path}.any_order", "is not supported by kiln: properties come in "
                            "their schema's order")  # fmt: skip
        if self.strings(node.get("excludes", []), f"{path}.excludes"):
            raise self.fail(f"{path}.excludes", "is not supported by kiln for json_schema")
        spaces = self.optional_count(node, "max_whitespace_cnt", path)
        return {"json_schema": schema, "max_whitespace_cnt": spaces}

    def _grammar(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        text = self.field(node, "grammar", path)
        return {"grammar": self.string(text, f"{path}.grammar", MAX_FORMAT_TEXT, empty=False)}

    def _regex(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        text = self.field(node, "pattern", path)
        return {"pattern": self.string(text, f"{path}.pattern", MAX_FORMAT_TEXT, empty=False)}

    def _any_text(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        if node.get("max_tokens") is not None:
            raise self.fail(f"{path}.max_tokens", "is not supported by kiln for any_text: bound "
                            "it with max_chars")  # fmt: skip
        return {
            "excludes": self.strings(node.get("excludes", []), f"{path}.excludes"),
            "max_chars": self.optional_count(node, "max_chars", path),
        }

    def _token(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        return {"token": self.token(self.field(node, "token", path), f"{path}.token")}

    def _exclude_token(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        return {"exclude_tokens": self.tokens(node.get("exclude_tokens", []),
                                              f"{path}.exclude_tokens")}  # fmt: skip

    def _any_tokens(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        return {
            "exclude_tokens": self.tokens(node.get("exclude_tokens", []), f"{path}.exclude_tokens"),
            "max_tokens": self.optional_count(node, "max_tokens", path),
        }

    def _sequence(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        return {"elements": self.formats(self.field(node, "elements", path),
                                         f"{path}.elements", depth)}  # fmt: skip

    _or = _sequence

    def _optional(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        return {"content": self.node(self.field(node, "content", path), f"{path}.content", depth)}

    _plus = _optional
    _star = _optional

    def _repeat(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        low = self.count(self.field(node, "min", path), f"{path}.min")
        high = self.field(node, "max", path)
        if high != -1:
            high = self.count(high, f"{path}.max", low=max(low, 1))
        content = self.node(self.field(node, "content", path), f"{path}.content", depth)
        return {"min": low, "max": high, "content": content}

    def _tag(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        begin = self.field(node, "begin", path)
        begin = (
            self.string(begin, f"{path}.begin")
            if isinstance(begin, str)
            else self.token_node(begin, f"{path}.begin")
        )
        content = self.node(self.field(node, "content", path), f"{path}.content", depth)
        end = self.field(node, "end", path)
        if isinstance(end, str):
            end = self.string(end, f"{path}.end")
        elif isinstance(end, list):
            if not end:
                raise self.fail(f"{path}.end", "must be a non-empty list of strings")
            end = self.strings(end, f"{path}.end")
        else:
            end = self.token_node(end, f"{path}.end")
        return {"begin": begin, "content": content, "end": end}

    def _triggered_tags(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        triggers = self.strings(self.field(node, "triggers", path), f"{path}.triggers", True)
        tags = self.tags(self.field(node, "tags", path), f"{path}.tags", depth)
        for i, tag in enumerate(tags):
            where = f"{path}.tags[{i}].begin"
            if not isinstance(tag["begin"], str):
                raise self.fail(where, "must be a string in triggered_tags")
            if not any(tag["begin"].startswith(t) for t in triggers):
                raise self.fail(where, "starts with none of the triggers")
        return {
            "triggers": triggers,
            "tags": tags,
            "at_least_one": self.flag(node, "at_least_one", path, False),
            "stop_after_first": self.flag(node, "stop_after_first", path, False),
            "excludes": self.strings(node.get("excludes", []), f"{path}.excludes"),
        }

    def _token_triggered_tags(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        triggers = self.tokens(self.field(node, "trigger_tokens", path),
                               f"{path}.trigger_tokens", True)  # fmt: skip
        tags = self.tags(self.field(node, "tags", path), f"{path}.tags", depth)
        for i, tag in enumerate(tags):
            begin = tag["begin"]
            if not isinstance(begin, dict):
                raise self.fail(f"{path}.tags[{i}].begin", "must be a token format (one of the "
                                "trigger_tokens)")  # fmt: skip
        return {
            "trigger_tokens": triggers,
            "tags": tags,
            "exclude_tokens": self.tokens(node.get("exclude_tokens", []), f"{path}.exclude_tokens"),
            "at_least_one": self.flag(node, "at_least_one", path, False),
            "stop_after_first": self.flag(node, "stop_after_first", path, False),
        }

    def _tags_with_separator(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        return {
            "tags": self.tags(self.field(node, "tags", path), f"{path}.tags", depth),
            "separator": self.string(self.field(node, "separator", path), f"{path}.separator"),
            "at_least_one": self.flag(node, "at_least_one", path, False),
            "stop_after_first": self.flag(node, "stop_after_first", path, False),
        }

    def _rules(self, node: dict[str, Any], path: str, depth: int, tokens: bool) -> list[Any]:
        rules = self.field(node, "rules", path)
        if not isinstance(rules, list) or not rules:
            raise self.fail(f"{path}.rules", "must be a non-empty list of [pattern, format]")
        if len(rules) > MAX_FORMAT_ITEMS:
            raise self.fail(f"{path}.rules", f"lists {len(rules)} rules, more than "
                            f"{MAX_FORMAT_ITEMS}")  # fmt: skip
        out = []
        for i, rule in enumerate(rules):
            where = f"{path}.rules[{i}]"
            if not isinstance(rule, list) or len(rule) != 2:
                raise self.fail(where, "must be a [pattern, format] pair")
            head = (
                self.token(rule[0], f"{where}[0]")
                if tokens
                else self.string(rule[0], f"{where}[0]", empty=False)
            )
            out.append([head, self.node(rule[1], f"{where}[1]", depth)])
        return out

    def _dispatch(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        return {
            "rules": self._rules(node, path, depth, tokens=False),
            "loop": self.flag(node, "loop", path, True),
            "excludes": self.strings(node.get("excludes", []), f"{path}.excludes"),
        }

    def _token_dispatch(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        return {
            "rules": self._rules(node, path, depth, tokens=True),
            "loop": self.flag(node, "loop", path, True),
            "exclude_tokens": self.tokens(node.get("exclude_tokens", []), f"{path}.exclude_tokens"),
        }

    def _qwen_xml_parameter(self, node: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        raise self.fail(
            f"{path}.type",
            "'qwen_xml_parameter' (xgrammar's deprecated Qwen XML parameters) is not supported "
            "by kiln: use a json_schema format",
        )


def check_format(value: Any, param: str, path: str) -> dict[str, Any]:
    """The canonical ``format`` tree at ``path`` of request field ``param``; a tree past any
    bound, or with a field of the wrong type, raises :class:`InvalidField` naming the node."""
    return _Checker(param).node(value, path, 1)
