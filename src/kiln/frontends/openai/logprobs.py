"""Token logprobs in OpenAI's two shapes: the completions API's parallel lists and the chat
API's list of per-token objects."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importing the engine imports torch
    from kiln.llm.sampler import TokenLogprobs
    from kiln.llm.tokenizer import Tokenizer


def token_name(tok: Tokenizer, token_id: int, as_id: bool) -> str:
    """A token as logprobs name it: its text, or (vLLM's ``return_tokens_as_token_ids``)
    ``token_id:<id>``, which names a token whose bytes are no whole character too."""
    return f"token_id:{token_id}" if as_id else tok.token_text(token_id)


def chat_logprobs(
    tok: Tokenizer, entries: list[TokenLogprobs], as_ids: bool = False
) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or of one streamed chunk); ``bytes``
    are the token's own bytes either way."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": token_name(tok, token_id, as_ids),
            "logprob": logprob,
            "bytes": list(tok.token_bytes(token_id)),
        }

    content = [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def vllm_prompt_logprobs(
    tok: Tokenizer, entries: list[TokenLogprobs | None], count: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first, else the token and
    its ``count`` most likely alternatives, by token id: ``{logprob, rank, decoded_token}``."""

    def logprob(token_id: int, value: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": value, "rank": rank, "decoded_token": tok.token_text(token_id)}

    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        item = {str(entry.token_id): logprob(entry.token_id, entry.logprob, entry.rank)}
        for rank, (token_id, value) in enumerate(entry.top[:count], start=1):
            item.setdefault(str(token_id), logprob(token_id, value, rank))
        out.append(item)
    return out


class CompletionLogprobs:
    """``choices[i].logprobs`` of a text completion. ``text_offset`` counts characters from
    the start of the choice's text (after the prompt when it is echoed), across chunks."""

    __slots__ = ("_as_ids", "_offset", "_tok")

    def __init__(self, tok: Tokenizer, offset: int = 0, as_ids: bool = False) -> None:
        self._tok = tok
        self._offset = offset
        #: tokens named ``token_id:<id>``; ``text_offset`` still counts the text's characters
        self._as_ids = as_ids

    def _name(self, token_id: int, text: str) -> str:
        return f"token_id:{token_id}" if self._as_ids else text

    def __call__(
        self, entries: list[TokenLogprobs], first_token: int | None = None
    ) -> dict[str, Any]:
        """``first_token``: an echoed prompt's first token, which has no logprob (null,
        as in OpenAI's and vLLM's answers); ``entries`` then start with the prompt's next."""
        tokens: list[str] = []
        offsets: list[int] = []
        tops: list[dict[str, float] | None] = []
        logprobs: list[float | None] = []
        if first_token is not None:
            text = self._tok.token_text(first_token)
            tokens.append(self._name(first_token, text))
            offsets.append(self._offset)
            self._offset += len(text)
            tops.append(None)
            logprobs.append(None)
        for e in entries:
            text = self._tok.token_text(e.token_id)
            name = self._name(e.token_id, text)
            tokens.append(name)
            offsets.append(self._offset)
            self._offset += len(text)
            # as vLLM: the top alternatives, and the chosen token even when it is not one
            top = {token_name(self._tok, t, self._as_ids): lp for t, lp in e.top}
            top.setdefault(name, e.logprob)
            tops.append(top)
            logprobs.append(e.logprob)
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
