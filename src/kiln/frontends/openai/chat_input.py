"""A chat request's messages and its chat template's options (chat, ``/tokenize``,
chat embeddings and the Responses API)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.frontends.openai.protocol import OpenAIError, flag

if TYPE_CHECKING:
    from kiln.llm.engine_client import EngineClient

_ROLES = ("system", "user", "assistant", "tool", "developer")
#: the most messages one chat request may hold: far past any real conversation, and the
#: chat template renders each of them (a bound on that work, with the prompt's length)
MAX_MESSAGES = 4096
#: the longest chat template a request may bring (--trust-request-chat-template)
MAX_REQUEST_TEMPLATE_CHARS = 1 << 16
#: OpenAI's ``reasoning_effort`` values, and vLLM's ``max``
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise OpenAIError(
            f"'messages' holds {len(messages)} messages, more than {MAX_MESSAGES}",
            param="messages",
        )
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise OpenAIError(
                f"messages[{i}] must be an object with a 'role' in {list(_ROLES)}",
                param=f"messages[{i}].role",
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: kiln serves text only
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(texts) != len(content) or not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(t, str)
                for p, t in zip(content, texts, strict=True)
            ):
                raise OpenAIError(
                    f"messages[{i}].content: only text parts are supported",
                    param=f"messages[{i}].content",
                )
            # kept as parts: --chat-template-content-format decides how the template
            # gets them (content.template_content)
            content = [{"type": "text", "text": t} for t in texts]
        if content is None and m.get("role") == "assistant" and m.get("tool_calls"):
            content = ""  # OpenAI's: an assistant turn that only calls tools has none
        if not isinstance(content, str | list):
            raise OpenAIError(
                f"messages[{i}].content must be a string or a list of text parts",
                param=f"messages[{i}].content",
            )
        out.append({**m, "content": content})
    return out


def chat_template_options(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's template options of a chat or ``/tokenize`` request, as keyword arguments of
    ``Tokenizer.apply_chat_template``."""
    continue_final = flag(body, "continue_final_message", False)
    # transformers refuses both at once; vLLM too, when both are sent true. Asking to
    # continue the last message alone turns the generation prompt off.
    add_prompt = flag(body, "add_generation_prompt", not continue_final)
    if continue_final and add_prompt:
        raise OpenAIError(
            "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true",
            param="continue_final_message",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise OpenAIError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    if "messages" in kwargs:
        raise OpenAIError(
            "chat_template_kwargs may not set 'messages': send them in 'messages'",
            param="chat_template_kwargs",
        )
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise OpenAIError("'documents' must be a list of objects", param="documents")
        kwargs = {"documents": documents, **kwargs}
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise OpenAIError(
                f"'reasoning_effort' must be one of {list(REASONING_EFFORTS)}, got {effort!r}",
                param="reasoning_effort",
            )
        # vLLM's: the template reads it (gpt-oss's, Qwen's, ...), and a template that
        # thinks on request (enable_thinking) thinks unless the effort is "none" and the
        # client's chat_template_kwargs did not say
        thinking = {} if "enable_thinking" in kwargs else {"enable_thinking": effort != "none"}
        kwargs = {**kwargs, **thinking, "reasoning_effort": effort}
    template = body.get("chat_template")
    if template is not None and (not isinstance(template, str) or not template.strip()):
        raise OpenAIError("'chat_template' must be a non-empty string", param="chat_template")
    if template is not None and len(template) > MAX_REQUEST_TEMPLATE_CHARS:
        raise OpenAIError(
            f"'chat_template' holds {len(template)} characters, more than "
            f"{MAX_REQUEST_TEMPLATE_CHARS}",
            param="chat_template",
        )
    return {
        "add_generation_prompt": add_prompt,
        "continue_final_message": continue_final,
        "template_kwargs": kwargs,
        "chat_template": template,
    }


def with_server_kwargs(llm: EngineClient, template: dict[str, Any]) -> dict[str, Any]:
    """``template`` (``chat_template_options``) over the server's
    ``--default-chat-template-kwargs``: a request's own variables win, as in vLLM. A
    request's own ``chat_template`` only where the server trusts them
    (``--trust-request-chat-template``), as vLLM: else a 400."""
    if template.get("chat_template") is not None and not llm.trust_request_chat_template:
        raise OpenAIError(
            "Chat template is passed with request, but --trust-request-chat-template is not "
            "set. Refused request with untrusted chat template.",
            param="chat_template",
        )
    defaults = llm.default_chat_template_kwargs
    if not defaults:
        return template
    return {**template, "template_kwargs": {**defaults, **template["template_kwargs"]}}
