"""vLLM's ``--chat-template-content-format``: how a chat message's ``content`` reaches the
chat template.

``string``: one string (a list of text parts joined by newlines, as vLLM joins them);
``openai``: a list of ``{"type": "text", "text": ...}`` parts (a string is one part);
``auto``: ``openai`` when the template loops over a message's content (``{% for part in
message['content'] %}``), ``string`` otherwise. The template's syntax tree is read once
per template (a request's own template too) and the answer kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jinja2 import nodes

    from kiln.llm.engine_client import EngineClient

__all__ = ["content_text", "detect_content_format", "for_template", "template_content"]

#: detected formats kept, by template source (requests may bring their own templates)
_DETECTED_MAX = 32
_DETECTED: OrderedDict[str, str] = OrderedDict()
_DETECTED_LOCK = threading.Lock()


def content_text(content: str | list[dict[str, Any]]) -> str:
    """A message's content as text: its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    return "\n".join(str(part.get("text", "")) for part in content)


def template_content(messages: list[dict[str, Any]], fmt: str) -> list[dict[str, Any]]:
    """``messages`` (``chat_messages``: each content a string or a list of text parts)
    with each content in the format ``fmt`` (``string`` or ``openai``). A ``tool``
    message's text parts are one string in either format, as vLLM gives them (templates
    print a tool's answer as text)."""
    out = []
    for message in messages:
        content = message["content"]
        if fmt == "string" or message["role"] == "tool":
            content = content_text(content)
        elif isinstance(content, str):
            # vLLM's openai format: a string is one text part, an assistant's absent
            # content (it only called tools) none
            content = (
                [{"type": "text", "text": content}]
                if content or not message.get("tool_calls")
                else []
            )
        out.append({**message, "content": content})
    return out


def for_template(
    llm: EngineClient, messages: list[dict[str, Any]], template: dict[str, Any]
) -> list[dict[str, Any]]:
    """``messages`` as the model's (or the request's own, ``template["chat_template"]``)
    template takes them, by the server's ``--chat-template-content-format``."""
    fmt = llm.chat_template_content_format
    if fmt == "auto":
        fmt = detect_content_format(template.get("chat_template") or llm.tokenizer.chat_template)
    return template_content(messages, fmt)


def detect_content_format(source: str | None) -> str:
    """``openai`` when the template ``source`` iterates over a message's content,
    ``string`` otherwise (no template, or one Jinja cannot parse, included)."""
    if not source:
        return "string"
    with _DETECTED_LOCK:
        hit = _DETECTED.get(source)
        if hit is not None:
            _DETECTED.move_to_end(source)
            return hit
    found = _detect(source)
    with _DETECTED_LOCK:
        _DETECTED[source] = found
        while len(_DETECTED) > _DETECTED_MAX:
            _DETECTED.popitem(last=False)
    return found


def _detect(source: str) -> str:
    from jinja2 import Environment, TemplateSyntaxError, nodes

    try:
        tree = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except (TemplateSyntaxError, RecursionError, ValueError):
        return "string"
    # names bound to the messages: ``messages`` and what is set from it
    # (``{% set loop_messages = messages[1:] %}``), transitively
    lists = _bound_from(tree, {"messages"})
    # a message: a loop variable over one of those
    items = {
        loop.target.name
        for loop in tree.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and _base_name(loop.iter) in lists
    }
    # a message's content: ``message.content``, ``message['content']``, or a name set
    # from it (``{% set content = message['content'] %}``)
    contents = _bound_content(tree, items)
    macro_loops = {id(loop) for macro in tree.find_all(nodes.Macro) for loop in
                   macro.find_all(nodes.For)}  # fmt: skip
    content_params = _macro_content_params(tree, items, contents)
    for loop in tree.find_all(nodes.For):
        it = _unwrapped(loop.iter)
        if _is_content_of(it, items):
            return "openai"
        if isinstance(it, nodes.Name):
            in_macro = id(loop) in macro_loops
            if (
                it.name in contents
                or (in_macro and it.name in content_params)
                or (not in_macro and it.name == "content")
            ):
                return "openai"
    return "string"


def _unwrapped(node: nodes.Node) -> nodes.Node:
    """The value under filters, tests and slices (``messages[1:]``, ``x | list``)."""
    from jinja2 import nodes

    while True:
        if isinstance(node, nodes.Filter | nodes.Test) and node.node is not None:
            node = node.node
            continue
        if not (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
            return node
        node = node.node


def _base_name(node: nodes.Node) -> str | None:
    from jinja2 import nodes

    node = _unwrapped(node)
    return node.name if isinstance(node, nodes.Name) else None


def _is_content_of(node: nodes.Node, items: set[str]) -> bool:
    """``node`` is ``item.content`` or ``item['content']`` of a message ``item``."""
    from jinja2 import nodes

    node = _unwrapped(node)
    if isinstance(node, nodes.Getattr):
        return node.attr == "content" and _base_name(node.node) in items
    if isinstance(node, nodes.Getitem):
        key = node.arg
        return (
            isinstance(key, nodes.Const) and key.value == "content"
            and _base_name(node.node) in items
        )  # fmt: skip
    return False


def _bound_from(tree: nodes.Template, names: set[str]) -> set[str]:
    from jinja2 import nodes

    bound = set(names)
    grew = True
    while grew:
        grew = False
        for assign in tree.find_all(nodes.Assign):
            target = assign.target
            if not isinstance(target, nodes.Name) or target.name in bound:
                continue
            if _base_name(assign.node) in bound:
                bound.add(target.name)
                grew = True
    return bound


def _bound_content(tree: nodes.Template, items: set[str]) -> set[str]:
    from jinja2 import nodes

    return {
        assign.target.name
        for assign in tree.find_all(nodes.Assign)
        if isinstance(assign.target, nodes.Name) and _is_content_of(assign.node, items)
    }


def _macro_content_params(tree: nodes.Template, items: set[str], contents: set[str]) -> set[str]:
    """Parameters of macros that some call passes a message's content to."""
    from jinja2 import nodes

    def is_content(arg: nodes.Node) -> bool:
        return _is_content_of(arg, items) or _base_name(arg) in contents

    params: set[str] = set()
    macros = {m.name: m for m in tree.find_all(nodes.Macro)}
    for call in tree.find_all(nodes.Call):
        macro = macros.get(call.node.name) if isinstance(call.node, nodes.Name) else None
        if macro is None:
            continue
        names = [a.name for a in macro.args]
        for i, arg in enumerate(call.args):
            if i < len(names) and is_content(arg):
                params.add(names[i])
        for kw in call.kwargs:
            if kw.key in names and is_content(kw.value):
                params.add(kw.key)
    return params
