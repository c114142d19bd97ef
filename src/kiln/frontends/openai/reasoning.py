"""vLLM's reasoning parsers (``--reasoning-parser``): a thinking model's answer split into
its reasoning (between ``<think>`` and ``</think>``) and its content, whole or streamed.

``deepseek_r1``: the chat template opens the thinking, so an answer without ``<think>`` is
reasoning until ``</think>`` (all of it when that never comes). ``qwen3``: the model opens
it itself; an answer that does not start with ``<think>`` is all content (the template's
``enable_thinking: false``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.llm.config import REASONING_PARSERS

START, END = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag`` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str

    def __post_init__(self) -> None:
        if self.name not in REASONING_PARSERS:
            raise ValueError(f"no reasoning parser {self.name!r}")

    def stream(self) -> ReasoningStream:
        return ReasoningStream(opened=self.name == "deepseek_r1")

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer's (reasoning, content); None for a part it does not have."""
        stream = self.stream()
        reasoning, content = stream.feed(text, final=True)
        return (reasoning if stream.reasoned else None), (content or None)


class ReasoningStream:
    """One choice's text in, (reasoning, content) pieces out; a piece that may begin a tag
    waits for the next one."""

    __slots__ = ("_opened", "_pending", "_state", "reasoned")

    def __init__(self, opened: bool) -> None:
        #: deepseek_r1: the template opened the thinking (no ``<think>`` expected)
        self._opened = opened
        self._pending = ""
        self._state = "start"  # start -> reasoning -> content
        #: the answer had a reasoning part (opened by the template or by ``<think>``)
        self.reasoned = False

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        text = self._pending + piece
        self._pending = ""
        reasoning = ""
        if self._state == "start":
            body = text.lstrip()
            if body.startswith(START):
                text, self._state = body[len(START) :], "reasoning"
            elif START.startswith(body) and not final:
                self._pending = text  # "", "<", "<thi": wait for more
                return "", ""
            else:
                self._state = "reasoning" if self._opened else "content"
            self.reasoned = self._state == "reasoning"
        if self._state == "reasoning":
            at = text.find(END)
            if at >= 0:
                reasoning, text = text[:at], text[at + len(END) :]
                self._state = "content"
            else:
                keep = 0 if final else _held(text, END)
                reasoning, self._pending = text[: len(text) - keep], text[len(text) - keep :]
                return reasoning, ""
        return reasoning, text
