"""vLLM's reasoning parsers (``--reasoning-parser``): a thinking model's answer split into
its reasoning (between ``<think>`` and ``</think>``) and its content, whole or streamed.

``deepseek_r1``: the chat template opens the thinking, so an answer without ``<think>`` is
reasoning until ``</think>`` (all of it when that never comes). ``qwen3``: the model opens
it itself; an answer that does not start with ``<think>`` is all content (the template's
``enable_thinking: false``). ``mistral`` (Magistral): as ``qwen3``, between ``[THINK]`` and
``[/THINK]``, control tokens that the request's text then keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.llm.config import REASONING_PARSERS

START, END = "<think>", "</think>"
#: each parser's (start, end) markers
MARKERS = {"deepseek_r1": (START, END), "qwen3": (START, END), "mistral": ("[THINK]", "[/THINK]")}
#: parsers whose markers are special tokens (``skip_special_tokens`` would drop them)
SPECIAL_MARKERS = frozenset({"mistral"})


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

    @property
    def start(self) -> str:
        return MARKERS[self.name][0]

    @property
    def end(self) -> str:
        return MARKERS[self.name][1]

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.name == "deepseek_r1", self.start, self.end)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer's (reasoning, content); None for a part it does not have."""
        stream = self.stream()
        reasoning, content = stream.feed(text, final=True)
        return (reasoning if stream.reasoned else None), (content or None)


class ReasoningStream:
    """One choice's text in, (reasoning, content) pieces out; a piece that may begin a tag
    waits for the next one."""

    __slots__ = ("_end", "_opened", "_pending", "_start", "_state", "reasoned")

    def __init__(self, opened: bool, start: str = START, end: str = END) -> None:
        #: deepseek_r1: the template opened the thinking (no ``<think>`` expected)
        self._opened = opened
        self._start, self._end = start, end
        self._pending = ""
        self._state = "start"  # start -> reasoning -> content
        #: the answer had a reasoning part (opened by the template or by ``<think>``)
        self.reasoned = False

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        text = self._pending + piece
        self._pending = ""
        reasoning = ""
        start, end = self._start, self._end
        if self._state == "start":
            body = text.lstrip()
            if body.startswith(start):
                text, self._state = body[len(start) :], "reasoning"
            elif start.startswith(body) and not final:
                self._pending = text  # "", "<", "<thi": wait for more
                return "", ""
            else:
                self._state = "reasoning" if self._opened else "content"
            self.reasoned = self._state == "reasoning"
        if self._state == "reasoning":
            at = text.find(end)
            if at >= 0:
                reasoning, text = text[:at], text[at + len(end) :]
                self._state = "content"
            else:
                keep = 0 if final else _held(text, end)
                reasoning, self._pending = text[: len(text) - keep], text[len(text) - keep :]
                return reasoning, ""
        return reasoning, text
