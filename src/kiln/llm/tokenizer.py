"""Text <-> token ids with a Hugging Face ``tokenizer.json``, and the chat template.

The template comes from ``chat_template.jinja`` or ``tokenizer_config.json`` and is
rendered in Jinja's sandbox: it is code shipped with the model, not trusted code.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kiln.core.errors import KilnError, Status
from kiln.llm.config import TOKEN_TYPE_SHIFT

#: past this many characters a text is tokenized without holding the GIL
_LONG_TEXT = 4096


def _token_text(value: Any) -> str:
    # tokenizer_config.json writes special tokens as strings or as {"content": ...}
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as a printable character: printable Latin-1
    bytes stand for themselves, the others are shifted past 255. The inverse map gives a
    token's exact bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1)]
    printable += range(ord("\xae"), ord("\xff") + 1)
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return {c: b for b, c in chars.items()}


class Tokenizer:
    def __init__(self, folder: Path, chat_template: str = "") -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = folder / "tokenizer.json"
        if not path.is_file():
            if (folder / "tokenizer.model").is_file():
                raise KilnError(
                    f"llm backend: {folder} has a SentencePiece tokenizer.model but no "
                    "tokenizer.json, which kiln needs; write one with transformers (and "
                    'sentencepiece): python -c "from transformers import AutoTokenizer; '
                    f"AutoTokenizer.from_pretrained('{folder}').save_pretrained('{folder}')\"",
                    Status.INVALID_ARG,
                )
            raise KilnError(f"llm backend: no tokenizer.json in {folder}", Status.INVALID_ARG)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        decoder = json.loads(path.read_text()).get("decoder") or {}
        self._setup(
            HFTokenizer.from_file(str(path)),
            _token_text(config.get("bos_token")),
            _token_text(config.get("eos_token")),
            template_source(chat_template) or self._template(folder, config),
            decoder.get("type") == "ByteLevel",
        )
        #: tokenizer_config.json as the checkpoint has it (vLLM's ``/tokenizer_info``)
        self.config: dict[str, Any] = config if isinstance(config, dict) else {}

    def _setup(self, tok: Any, bos: str, eos: str, template: str | None, byte_level: bool) -> None:
        self._tok = tok
        self.bos_token = bos
        self.eos_token = eos
        self.chat_template = template
        self._byte_level = _byte_level_alphabet() if byte_level else None

    @staticmethod
    def _template(folder: Path, config: dict[str, Any]) -> str | None:
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return template if isinstance(template, str) else None

    def backend_json(self) -> str:
        """The ``tokenizers`` tokenizer serialized (tokenizer.json's content), for the
        structured-output grammar engine."""
        text: str = self._tok.to_str()
        return text

    @classmethod
    def load(cls, path: Path, chat_template: str = "") -> Tokenizer:
        """The tokenizer of a Hugging Face folder or of a ``.gguf`` file (built from its
        metadata); ``chat_template`` (a template, or a file holding one) replaces the
        checkpoint's."""
        if path.suffix != ".gguf" or not path.is_file():
            return cls(path, chat_template)
        from kiln.llm.gguf_file import gguf_tokenizer

        tok, bos, eos, template, byte_level = gguf_tokenizer(path)
        out = cls.__new__(cls)
        out._setup(tok, bos, eos, template_source(chat_template) or template, byte_level)
        out.config = {}  # a .gguf file's metadata holds no tokenizer_config.json
        return out

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens``: what the tokenizer's post-processor adds (BOS for Llama's),
        as vLLM does for completions and generate; a rendered chat template already holds
        its special tokens, so chat prompts are encoded without (vLLM's default too)."""
        if len(text) > _LONG_TEXT:
            # encode_batch releases the GIL while it works (encode holds it throughout: a
            # megabyte of text froze every thread, the event loop's too, for seconds)
            batch = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
            long_ids: list[int] = batch[0].ids
            return long_ids
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def encode_pair(self, first: str, second: str, token_types: bool = False) -> list[int]:
        """Two texts as one input, by the tokenizer's own pair template (its
        post-processor's ``pair``: a cross-encoder's query and document). ``token_types``
        (a BERT's): each id carries its segment (the template's type id) above
        ``TOKEN_TYPE_SHIFT``."""
        encoding = self._tok.encode(first, second, add_special_tokens=True)
        ids: list[int] = encoding.ids
        if not token_types:
            return ids
        return [t | (s << TOKEN_TYPE_SHIFT) for t, s in zip(ids, encoding.type_ids, strict=True)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def token_pieces(self, ids: list[int]) -> list[str]:
        """The vocabulary's own strings of ``ids`` (``Ġthe`` for a byte-level BPE), as
        vLLM's ``/tokenize`` returns them with ``return_token_strs``."""
        return [self._tok.id_to_token(t) or "" for t in ids]

    def bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of ``bad_words``: each word as written (leading spaces
        stripped) and, where a leading space makes a different first token of the same
        length, with one, so that it is banned at the start of the text and after a space."""
        out: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.encode(word.lstrip()))
            if not bare:
                continue
            out.append(bare)
            spaced = tuple(self.encode(" " + word.lstrip()))
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return tuple(out)

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text (its vocabulary entry) is ``text``, or None."""
        found: int | None = self._tok.token_to_id(text)
        return found

    def token_text(self, token_id: int) -> str:
        """One token alone as text (special tokens included), as logprobs show it."""
        text: str = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The token's exact bytes: part of a UTF-8 character for some byte-level tokens."""
        piece = self._tok.id_to_token(token_id)
        alphabet = self._byte_level
        if alphabet is not None and piece is not None and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return self.token_text(token_id).encode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> str:
        """The conversation as the model's template writes it. ``template_kwargs``: more
        variables for the template (vLLM's ``chat_template_kwargs``, e.g.
        ``enable_thinking``). ``continue_final_message``: the text ends with the last
        message's content, left open for the model to continue (``transformers``' rule).
        ``chat_template``: a request's own template instead of the model's (vLLM's, with
        ``--trust-request-chat-template``), rendered where repetition and powers are
        bounded too, in a worker process capped in memory and time
        (:mod:`kiln.llm.request_template`)."""
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise KilnError(
                "this model's tokenizer has no chat template: use /v1/completions",
                Status.INVALID_ARG,
            )
        from jinja2.exceptions import TemplateError

        try:
            variables = {
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
                "add_generation_prompt": add_generation_prompt,
                **(template_kwargs or {}),  # vLLM's order: the request's kwargs win
            }
            if chat_template is not None:
                # a request's own: in a worker process bounded in memory and time
                from kiln.llm.request_template import render

                text = render(source, messages, variables)
            else:
                text = _compiled(source, request=False).render(messages=messages, **variables)
        except (TemplateError, TypeError, ValueError, RecursionError, OverflowError) as exc:
            # the request's data the template cannot take (tojson of an undefined
            # field...): the request's error, not the server's
            raise KilnError(f"chat template: {exc}", Status.INVALID_ARG) from exc
        if continue_final_message:
            final = messages[-1].get("content") or ""
            if isinstance(final, list):  # text parts (--chat-template-content-format
                # openai): the last one is where the text goes on (transformers' rule)
                final = str(final[-1].get("text", "")) if final else ""
            text = _open_final_message(text, final)
        return text


#: compiled templates kept (the models' own and requests' ones): compiling is most of a
#: render's time (1.6 ms of 1.65 for SmolLM2's template)
_COMPILED_MAX = 32
_COMPILED: OrderedDict[tuple[str, bool], Any] = OrderedDict()
_COMPILED_LOCK = threading.Lock()


def _compiled(source: str, request: bool) -> Any:
    """The Jinja template of ``source``, compiled once (``request``: in the bounded
    environment of a request's own template)."""
    key = (source, request)
    with _COMPILED_LOCK:
        hit = _COMPILED.get(key)
        if hit is not None:
            _COMPILED.move_to_end(key)
            return hit
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    kind = _request_env() if request else ImmutableSandboxedEnvironment
    env = kind(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    # transformers' tojson: Jinja's escapes <, >, & and ' and sorts keys, which would
    # write a tool's JSON schema (tools=) differently from the model's training data
    env.filters["tojson"] = _tojson
    template = env.from_string(source)
    with _COMPILED_LOCK:
        _COMPILED[key] = template
        while len(_COMPILED) > _COMPILED_MAX:
            _COMPILED.popitem(last=False)
    return template


#: a request's template may build no string or list longer than this by ``*``, nor raise to
#: a power past ``MAX_POWER`` (the sandbox bounds ``range`` itself, to 100,000)
MAX_REPEAT = 1 << 20
MAX_POWER = 64


def _request_template_env() -> type:
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class RequestTemplateEnv(ImmutableSandboxedEnvironment):
        """The sandbox, with ``*`` and ``**`` checked before they allocate."""

        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_POWER:
                raise SecurityError(f"a power past {MAX_POWER} in a request's chat template")
            if operator == "*":
                count = right if isinstance(left, (str, list, tuple)) else left
                seq = left if isinstance(left, (str, list, tuple)) else right
                sized = isinstance(seq, (str, list, tuple)) and isinstance(count, int)
                if sized and len(seq) * count > MAX_REPEAT:
                    raise SecurityError(
                        f"a repetition past {MAX_REPEAT} items in a request's chat template"
                    )
            return super().call_binop(context, operator, left, right)

    return RequestTemplateEnv


_REQUEST_ENV: list[type] = []


def _request_env() -> type:
    """The request templates' environment class (jinja2 is imported when a template is
    first rendered, not with this module)."""
    if not _REQUEST_ENV:
        _REQUEST_ENV.append(_request_template_env())
    return _REQUEST_ENV[0]


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _open_final_message(text: str, final: str) -> str:
    """``text`` cut just after the last message's content (its end-of-turn tokens gone);
    trailing whitespace the template trimmed stays trimmed."""
    at = text.rfind(final.strip())
    if not final.strip() or at < 0:
        raise KilnError(
            "continue_final_message: the final message does not appear in the chat as the "
            "template renders it",
            Status.INVALID_ARG,
        )
    whole = final.lstrip()
    if text[at : at + len(whole)] == whole:
        return text[: at + len(whole)]
    return text[: at + len(final.strip())]


def template_source(value: str) -> str | None:
    """vLLM's ``--chat-template``: a file's path, or the template itself."""
    if not value:
        return None
    if "{" in value or "\n" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise KilnError(
            f"chat_template: '{value}' is neither a file nor a Jinja template",
            Status.INVALID_ARG,
        )
    return path.read_text()


#: vLLM's ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``: the prompt tokens a detokenizer's
#: window starts with, before the output's first token
SEED_OFFSET = 5
#: the prompt's last tokens read to seed it (two more, in case some are special tokens)
SEED_TOKENS = SEED_OFFSET + 2


def seed_window(prompt_ids: list[int]) -> tuple[list[int], int, int]:
    """vLLM's ``convert_prompt_ids_to_tokens``: the decoding window an output starts from
    (the prompt's last ``SEED_TOKENS`` ids), where it starts (``prefix``) and where the
    output begins (``read``). Decoded in the prompt's context, the first output token
    keeps what context gives it: a SentencePiece (Metaspace) token's leading space."""
    window = list(prompt_ids[-SEED_TOKENS:])
    return window, max(len(window) - SEED_OFFSET, 0), len(window)


class IncrementalDetokenizer:
    """Text for a growing list of token ids, released only when it is whole: a byte-level
    token can end in the middle of a UTF-8 character.

    Each call decodes a short window, not the whole sequence (which made streaming cost
    grow with the square of the output length): the ids from ``_prefix`` (a few tokens
    already released, kept so that a tokenizer's leading-space and merge rules see the
    same context) to the end, minus the text those prefix tokens make alone. The window
    starts in the prompt (``prompt_ids``' last few), as vLLM's detokenizer does."""

    __slots__ = ("_ids", "_prefix", "_read", "_skip", "_tok")

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # the window starts here; ids before ``_read`` are released as text (or prompt)
        self._ids, self._prefix, self._read = seed_window(list(prompt_ids))

    def add(self, ids: list[int], final: bool = False) -> str:
        self._ids.extend(ids)
        window = self._ids[self._prefix :]
        before = self._tok.decode(window[: self._read - self._prefix], self._skip)
        text = self._tok.decode(window, self._skip)
        if (text.endswith("\ufffd") and not final) or len(text) <= len(before):
            return ""  # an unfinished character, or nothing visible yet
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]
